"""A run stopped by Ctrl-C or SIGTERM (runtime/stop.py `TrainingInterrupted`): in a notebook an ordinary exception
whose message names the checkpoint and how to continue (not `SystemExit: 130`, which IPython reports as an attempt
to quit); from a recipe's command line the exit status of the signal, without the message printed twice.

Catches: TrainingInterrupted made a SystemExit again (a notebook's Ctrl-C reads as a crash of the kernel's
session), a message without the checkpoint or the way to continue, and a recipe exiting 2 (a user error) or 0
after a clean stop.
"""

from __future__ import annotations

import signal

import pytest

from hybrid_rl.config.checks import command_line
from hybrid_rl.runtime.stop import TrainingInterrupted


def test_it_is_an_exception_that_says_the_checkpoint_and_how_to_continue(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    stop = TrainingInterrupted(signal.SIGINT, 7, "runs/x/checkpoints/step_00000007")
    assert isinstance(stop, Exception) and not isinstance(stop, SystemExit)
    assert str(stop) == stop.message
    assert "interrupted by SIGINT after step 7; checkpoint runs/x/checkpoints/step_00000007 written" in str(stop)
    assert "Trainer(cfg)" in str(stop) and "fit()" in str(stop) and "run the same command again" in str(stop)
    assert stop.exit_status == 130


def test_a_recipe_exits_with_the_signals_status_and_prints_it_once(capsys):
    def main(argv):
        stop = TrainingInterrupted(signal.SIGTERM, 3, "/c/step_00000003")
        stop.announce()  # what fit() does last
        raise stop

    assert command_line(main, []) == 128 + signal.SIGTERM
    out, err = capsys.readouterr()
    assert out.count("interrupted by SIGTERM after step 3") == 1 and err == ""


def test_a_notebook_gets_the_exception_from_fit(tiny_trainer_overrides, monkeypatch):
    """fit() under Ctrl-C: the step finishes, the checkpoint is written, TrainingInterrupted (an Exception) comes out
    of fit() and nothing exits the interpreter."""
    from hybrid_rl import Trainer, load_config

    tr = Trainer(load_config(None, [*tiny_trainer_overrides, "trainer.total_steps=3"]))
    real_step = tr.step

    def step_then_ctrl_c():
        m = real_step()
        signal.raise_signal(signal.SIGINT)
        return m

    monkeypatch.setattr(tr, "step", step_then_ctrl_c)
    with pytest.raises(Exception) as err:
        tr.fit()
    assert type(err.value) is TrainingInterrupted and err.value.step == 1
    assert err.value.checkpoint.endswith("step_00000001") and err.value.checkpoint in str(err.value)
