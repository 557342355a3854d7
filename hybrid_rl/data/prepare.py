"""A dataset's rows made ready for training or validation, before any model loads: vetted by the
reward (`check_rows`), tokenized once (`PromptEncoder`), and without the prompts too long for
data.max_prompt_tokens or for the model's context with rollout.max_new_tokens (dropped, counted
and reported on rank 0)."""

from __future__ import annotations

from typing import Callable, Optional

from hybrid_rl.config.schema import Config
from hybrid_rl.data.chat import PromptEncoder, drop_long_prompts, prompt_limit
from hybrid_rl.data.rows import DataError
from hybrid_rl.runtime import distributed as D


def prepare_rows(
    rows: list[dict],
    source: str,
    what: str,
    cfg: Config,
    encode: PromptEncoder,
    check_rows: Optional[Callable[[list[dict], str], None]],
    max_positions: Optional[int],
) -> list[dict]:
    """The rows of `source` ("train" or "validation" rows: `what`) the run keeps.

    check_rows: the reward's row check (raises on a bad row), or None; max_positions: the model's
    max_position_embeddings, or None. Raises when no prompt is short enough, saying what to change."""
    if check_rows is not None:
        check_rows(rows, source)
    # With an environment the episodes' prompts are what its reset() returns (envs/episodes.py), not these texts.
    lengths = encode.encode_all(rows, source, check=not cfg.env.enabled)
    limit, limit_why, fix = prompt_limit(cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, max_positions)
    kept, dropped = drop_long_prompts(rows, lengths, limit)
    if not kept:
        raise DataError(
            f"every {what} prompt of {source} is longer than {limit_why} "
            f"(the shortest has {min(lengths)} tokens); {fix}"
        )
    if D.is_main():
        note = f", dropped {dropped} longer than {limit_why}" if dropped else ""
        print(
            f"data: {len(kept)} {what} prompts from {source}{note} (longest kept "
            f"{max(n for n in lengths if not limit or n <= limit)} tokens; chat template "
            f"{'on' if encode.chat_template else 'off'})"
        )
    return kept
