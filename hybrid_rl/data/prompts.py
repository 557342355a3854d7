"""Prompt datasets, the validation split, and a rank-aware prompt loader.

A dataset is a list of rows: {"prompt": str, ...metadata}. Tasks (`data.task`):
  digits          generated (rewards.toy)
  gsm8k           GSM8K (data/gsm8k.py): train split to train, test split to validate
  jsonl, parquet  a local file; `data.prompt_key` names the prompt (a string, or a list of
                  chat messages as in TRL's conversational and verl's parquet format), and
                  `data.answer_key` (optional) the reference answer, given to rewards as
                  "answer"; both may be dotted to reach nested fields ("reward_model.ground_truth")
`data.instruction` is appended to every prompt (gsm8k has its own by default). The
validation rows come from `data.val_path`, the task's own split, or `data.val_split`
of the training file. Every row is checked when the dataset is built, so a bad row
fails before the first training step, named by file and row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from hybrid_rl.data.rows import DataError, read_rows


@dataclass
class Datasets:
    train: list[dict]
    val: list[dict]  # empty when the run has no validation set
    train_source: str  # where the rows came from, for messages
    val_source: str


def load_datasets(cfg) -> Datasets:
    """Training and validation rows for a `DataConfig`."""
    from hybrid_rl.data import gsm8k

    val, val_source = [], ""
    if cfg.task == "gsm8k":
        raw = gsm8k.load_splits(cfg.path)
        instruction = gsm8k.INSTRUCTION if cfg.instruction is None else cfg.instruction
        train = [gsm8k.make_row(r, i, instruction, raw.train_source) for i, r in enumerate(raw.train)]
        train_source = raw.train_source
        if raw.test is not None and not cfg.val_path:
            val = [gsm8k.make_row(r, i, instruction, raw.test_source) for i, r in enumerate(raw.test)]
            val_source = raw.test_source
    else:
        train = load_rows(
            cfg.task,
            cfg.path,
            cfg.prompt_key,
            None if cfg.task != "digits" else cfg.num_prompts,
            cfg.seed,
            cfg.answer_key,
            cfg.instruction,
        )
        train_source = cfg.path or cfg.task
    if cfg.val_path:
        raw_val = read_rows(cfg.val_path, key="data.val_path")
        if cfg.task == "gsm8k":
            val = [gsm8k.make_row(r, i, instruction, cfg.val_path) for i, r in enumerate(raw_val)]
        else:
            val = [
                _check_row(r, i, cfg.prompt_key, cfg.val_path, cfg.answer_key, cfg.instruction)
                for i, r in enumerate(raw_val)
            ]
        val_source = cfg.val_path
    elif not val and cfg.val_split > 0:
        train, val = split_rows(train, cfg.val_split, cfg.seed)
        val_source = f"{train_source} (held-out {cfg.val_split:g})"
    if cfg.num_prompts is not None and cfg.task != "digits":
        train = train[: cfg.num_prompts]
    return Datasets(train, val, train_source, val_source)  # data.val_size applies after long prompts are dropped


def split_rows(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) with round(fraction * len) held-out rows, chosen by `seed`; both keep file order."""
    n_val = round(fraction * len(rows))
    if n_val < 1 or n_val >= len(rows):
        raise DataError(
            f"data.val_split={fraction} of {len(rows)} rows leaves {n_val} to validate on and "
            f"{len(rows) - n_val} to train on; both need at least one"
        )
    held = set(random.Random(seed).sample(range(len(rows)), n_val))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def load_rows(
    task: str,
    path: str = "",
    prompt_key: str = "prompt",
    num_prompts: Optional[int] = None,
    seed: int = 0,
    answer_key: str = "",
    instruction: Optional[str] = None,
) -> list[dict]:
    """The checked rows of a generated task or a local file (no split)."""
    if task == "digits":
        from hybrid_rl.data.digits import digits_rows

        rows = digits_rows(num_prompts or 4096, seed)
    elif task in ("jsonl", "parquet"):
        rows = read_rows(path, task)
    else:
        raise ValueError(
            f"unknown data.task {task!r} for load_rows; valid: ['digits', 'jsonl', 'parquet'] (gsm8k: load_datasets)"
        )
    return [_check_row(r, i, prompt_key, path or task, answer_key, instruction) for i, r in enumerate(rows)]


ROLES = ("system", "user", "assistant")


def lookup(row: dict, key: str):
    """row[key], where a dotted key reaches into nested dicts (verl's "reward_model.ground_truth"); None if absent."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _check_messages(messages: list, where: str) -> None:
    """A conversation to prompt with: chat messages ({"role", "content": str}) ending in a user turn."""
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: message {j} is not a chat message with a role in {ROLES} and a string "
                f"content: {str(m)[:120]}"
            )
    if messages[-1]["role"] != "user":
        raise DataError(
            f"{where}: the last message is a {messages[-1]['role']!r} turn; a prompt ends with the user "
            "turn the model answers"
        )


def _check_row(
    row: dict, i: int, key: str, source: str, answer_key: str = "", instruction: Optional[str] = None
) -> dict:
    """The row with "prompt" (text: what rewards and logs see), "messages" when the prompt is a conversation
    (then "prompt" is its last user turn), and "answer" when answer_key names one. Keys may be dotted."""
    value = lookup(row, key) if isinstance(row, dict) else None
    if isinstance(value, list) and value:
        _check_messages(value, f"{source}: row {i} ({key!r}, config key 'data.prompt_key')")
    elif not isinstance(value, str) or not value.strip():
        raise DataError(
            f"{source}: row {i} has neither a non-empty string nor a list of chat messages under {key!r} "
            f"(config key 'data.prompt_key'); row: {str(row)[:120]}"
        )
    answer = lookup(row, answer_key) if answer_key else None
    if answer_key and answer in (None, ""):
        raise DataError(
            f"{source}: row {i} has no {answer_key!r} (config key 'data.answer_key'); row: {str(row)[:120]}"
        )
    out = dict(row)
    if isinstance(value, list):
        messages = [dict(m) for m in value]
        if instruction:  # the instruction goes with the question: after the last user turn's text
            messages[-1]["content"] = f"{messages[-1]['content']} {instruction}"
        out["messages"], out["prompt"] = messages, messages[-1]["content"]
    else:
        out["prompt"] = f"{value} {instruction}" if instruction else value
    if answer_key:
        out["answer"] = answer
    return out


class PromptLoader:
    """Endless shuffled batches of rows; each rank takes its own slice of each global batch.

    Its position (epoch, cursor, seed) is a plain, JSON-safe dict via state_dict /
    load_state_dict, and restoring it replays the same batches: a checkpoint saves it with the
    run's other state (loop/run_state.py), so a resumed run draws the batches it would have drawn.
    """

    def __init__(self, rows: list[dict], batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if batch_size % world_size:
            raise DataError(f"data.batch_size={batch_size} does not divide over {world_size} ranks")
        if len(rows) < batch_size:
            raise DataError(f"dataset has {len(rows)} prompts, fewer than data.batch_size={batch_size}")
        self.rows, self.batch_size, self.rank, self.world = rows, batch_size, rank, world_size
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self._order: Optional[list[int]] = None

    def _perm(self) -> list[int]:
        if self._order is None:
            self._order = list(range(len(self.rows)))
            random.Random(self.seed + self.epoch).shuffle(self._order)
        return self._order

    def next_batch(self) -> list[dict]:
        """This rank's rows of the next global batch (the tail of an epoch that cannot fill a batch is skipped)."""
        if self.cursor + self.batch_size > len(self.rows):
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
        idx = self._perm()[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        per = self.batch_size // self.world
        return [self.rows[i] for i in idx[self.rank * per : (self.rank + 1) * per]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.seed, self._order = state["epoch"], state["cursor"], state["seed"], None
