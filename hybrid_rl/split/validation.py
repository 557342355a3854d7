"""Validation in the split placement: which versions a fit() validates, and what the rollout ranks' Validator
enters instead of the phase switch.

The learners hold no engine, so the rollout ranks validate (loop/validation.Validator, the colocated code, with
the rollout pool as its world: each rollout rank an interleaved slice of every validation batch, the metrics
reduced over the pool). What is validated at step s is version s, the weights colocated validates after step s:
the rollout ranks validate it as soon as they hold it (version s arrives before batch s + k, so the batches keep
the versions the schedule fixes), and each rollout rank sends learner rank 0 a JSON message (the step, the
version held, the val/* metrics, its sample records), which logs them at step s through its loggers and writes
the first rollout rank's samples (val_samples.jsonl, as global rank 0 writes its slice's in colocated). A
version no batch of this fit() is made with (s + k > the fit's last batch: the last step always, at k > 0 the
last k) is sent for the validation alone, after step s (`validation_syncs`).

Both pools compute the schedule from the start message's batches and the config, so it is deterministic: no
message says when to validate. The learners wait for the result at step s (the colocated history keeps its
shape: step s's metrics hold its val/*); at k > 0 that stalls the pipeline for the validation's length.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator


def validation_steps(first_batch: int, last_batch: int, val_every: int, before_train: bool) -> list[int]:
    """The steps whose version a fit() making batches first_batch..last_batch validates, as colocated fit() does:
    step 0 when trainer.val_before_train and the fit starts the run, every trainer.val_every-th step, and the fit's
    last step (step s trains batch s - 1; a fit of n batches runs steps first_batch + 1 .. last_batch + 1)."""
    steps = [0] if before_train and first_batch == 0 else []
    if val_every:
        last_step = last_batch + 1
        steps += [s for s in range(first_batch + 1, last_step + 1) if s % val_every == 0 or s == last_step]
    return steps


def validation_syncs(steps: list[int], last_batch: int, k: int) -> list[int]:
    """The versions sent for validation alone: a validated version s > 0 that no batch of the fit is made with
    (batch b is made with version b - k, so version s is synced anyway when s + k <= last_batch)."""
    return [s for s in steps if s > 0 and s + k > last_batch]


class ResidentEngine:
    """What the rollout ranks' Validator enters instead of the phase switch: the engine is always resident there
    (nothing switches, nothing is moved or timed), so `rollout()` yields it and `train()` is empty."""

    def __init__(self, engine):
        self.engine = engine

    @contextlib.contextmanager
    def rollout(self) -> Iterator[object]:
        yield self.engine

    @contextlib.contextmanager
    def train(self) -> Iterator[None]:
        yield None

    @contextlib.contextmanager
    def recovering(self) -> Iterator[None]:
        yield None

    def pop_stats(self) -> SimpleNamespace:
        """No switch ran: no seconds (val/switch_s is 0)."""
        return SimpleNamespace(seconds={})
