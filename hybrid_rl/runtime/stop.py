"""Stopping a run on a signal: SIGTERM (a scheduler's preemption, torchrun forwarding it) or
SIGINT (Ctrl-C) sets a flag; `Trainer.fit` reads it between steps, writes a checkpoint and
raises `TrainingInterrupted`."""

from __future__ import annotations

import os
import signal
import threading

import torch

from hybrid_rl.runtime import distributed as D
from hybrid_rl.runtime.errors import UserError


class TrainingInterrupted(UserError):
    """A run stopped by a signal (Ctrl-C, SIGTERM) after writing a checkpoint: its message names the
    checkpoint and how to continue. An ordinary exception, not SystemExit, so that Ctrl-C in a notebook reads
    as what happened (not `SystemExit: 130`) and leaves the kernel's session as it was; a recipe's
    `command_line` exits with `exit_status` = 128 + signal, as a process stopped by that signal would.

    `announce` prints the message; `Trainer.fit` calls it after its own closing lines (the curve, the
    time split), so that it is the last thing the library prints: under torchrun, only torchrun's
    report of the signal comes after it."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        name = signal.Signals(signum).name
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_status = self.code = 128 + signum
        self.announced = False
        self.message = (
            f"interrupted by {name} after step {step}; checkpoint {checkpoint} written. To continue, run the same "
            "command again, or in Python build a new Trainer(cfg) and call fit() (trainer.resume=auto, the "
            "default, resumes from the newest checkpoint)"
        ) + under_torchrun_note()
        super().__init__(self.message)

    def announce(self) -> None:
        if D.is_main():
            print(self.message, flush=True)
        self.announced = True


def under_torchrun_note() -> str:
    """What torchrun prints after a clean stop, said before it does ('' outside torchrun).

    torchrun's agent (torch 2.13, torch/distributed/elastic/) handles SIGTERM, SIGINT, SIGHUP and SIGQUIT
    itself (TORCHELASTIC_SIGNALS_TO_HANDLE, read by the agent): its handler raises SignalException, the
    agent sends the same signal to the workers, waits for them (SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    30 s by default) and re-raises whatever they exit with, so its traceback always comes last and torchrun
    exits 1. No exit of ours can make it quiet or print after it. A signal sent to the workers alone is
    worse: the agent reports the first rank to exit non-zero as 'FAILED' (ChildFailedError), so the docs
    say to signal torchrun (or the whole job), not the workers (docs/checkpoints.md)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    return (
        ". torchrun got the signal too and will print 'SignalException: Process ... got signal' with a "
        "traceback after this: that is torchrun reporting the signal, not a failure; this checkpoint is "
        "complete (if a step and checkpoint take over 30 s, raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT or "
        "torchrun kills the workers first)"
    )


class StopSignal:
    """SIGTERM / SIGINT set a flag the loop reads between steps; all ranks agree on it there.

    The ranks agree (one all-reduce per step) because a signal may reach only some of them,
    and the checkpoint that follows is a collective. A second signal restores the default
    handlers' behaviour at once (a second Ctrl-C stops without a checkpoint)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum:  # the second one
            self.restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(
            f"rank {D.rank()}: {signal.Signals(signum).name} received; stopping after this step "
            "(a checkpoint follows; send it again to stop at once)",
            flush=True,
        )

    def agreed(self) -> int:
        """The signal any rank received since the run started (0 if none); a collective."""
        if not D.is_dist():
            return self.signum
        return int(D.all_reduce_max(torch.tensor([float(self.signum)])).item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
