"""Prompt datasets and a rank-aware prompt loader.

A dataset is a list of rows: {"prompt": str, ...metadata}. Built-in generated
tasks come from `rewards.toy`; `jsonl` reads a local file. Every row is checked
when the dataset is built, so a bad row fails before the first training step.
"""
from __future__ import annotations

import json
import os
import random
from typing import Optional


def load_rows(task: str, path: str = "", prompt_key: str = "prompt", num_prompts: int = 4096, seed: int = 0) -> list[dict]:
    if task == "digits":
        from hybrid_rl.rewards.toy import digits_rows

        rows = digits_rows(num_prompts, seed)
    elif task == "jsonl":
        rows = _read_jsonl(path)
    else:
        raise ValueError(f"unknown data.task {task!r}; valid: ['digits', 'jsonl']")
    return [_check_row(r, i, prompt_key, path or task) for i, r in enumerate(rows)]


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.path {path!r} does not exist")
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
    if not rows:
        raise ValueError(f"data.path {path!r} holds no rows")
    return rows


def _check_row(row: dict, i: int, key: str, source: str) -> dict:
    if not isinstance(row, dict) or not isinstance(row.get(key), str) or not row[key].strip():
        raise ValueError(f"{source}: row {i} has no non-empty string under {key!r} (config key 'data.prompt_key'); "
                         f"row: {str(row)[:120]}")
    out = dict(row)
    out["prompt"] = row[key]
    return out


class PromptLoader:
    """Endless shuffled batches of rows; each rank takes its own slice of each global batch.

    Its position (epoch, cursor, seed) is a plain, JSON-safe dict via state_dict /
    load_state_dict, and restoring it replays the same batches. Nothing saves it yet:
    checkpoint/resume of a run is not built.
    """

    def __init__(self, rows: list[dict], batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if batch_size % world_size:
            raise ValueError(f"data.batch_size={batch_size} does not divide over {world_size} ranks")
        if len(rows) < batch_size:
            raise ValueError(f"dataset has {len(rows)} prompts, fewer than data.batch_size={batch_size}")
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
        idx = self._perm()[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        per = self.batch_size // self.world
        return [self.rows[i] for i in idx[self.rank * per:(self.rank + 1) * per]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.seed, self._order = state["epoch"], state["cursor"], state["seed"], None
