"""What a newcomer's first runs print (issue 30 parts 2 and 4): the demo's console says what accuracy
counts and shows the share that never stops; a resumed or finished run's summary and curve cover the
whole run (metrics.jsonl); the tiny recipe says when it makes a random model; no shard-writing bar or
DCP single-process warning; a reward module beside the command imports; a stop under torchrun says
what torchrun prints next."""

import json
import os
import sys
import warnings

import pytest

from hybrid_rl.observability.loggers import ConsoleLogger
from hybrid_rl.observability.metrics import format_line, reward_summary, run_history

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEP = {"step": 1, "reward/mean": 0.8, "reward/accuracy": 0.0, "response/truncated": 1.0, "time/step": 0.5}


def test_console_explains_accuracy_once_and_shows_truncated():
    """Catches: accuracy=0.00 with nothing saying why (full marks only; the demo's samples never stop)."""
    lines = []
    log = ConsoleLogger(every=1, write=lines.append, legend="columns: ...")
    log.log(STEP, 1)
    log.log({**STEP, "step": 2}, 2)
    assert lines[0] == "columns: ..." and len(lines) == 3  # the legend once, before the first step line
    assert "accuracy=0.00  truncated=1.00" in format_line(STEP)
    from hybrid_rl.observability.metrics import console_legend

    assert "reward.success_threshold = 0.9" in console_legend(0.9) and "full marks only" in console_legend(None)


def _jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_summary_and_curve_cover_the_whole_run(tmp_path):
    """Catches: the summary of a resumed run over its resumed steps only, and 'over 0 steps' for a finished one."""
    records = [{"step": 0, "val/pass@1": 0.1}] + [{"step": s, "reward/mean": s / 10} for s in range(1, 11)]
    _jsonl(tmp_path / "metrics.jsonl", records + [{"step": 10, "reward/mean": 0.95}, "not json"[:3]])
    this_time = [{"step": 10, "reward/mean": 0.95}]
    whole = run_history(str(tmp_path), this_time)
    assert [r["step"] for r in whole] == list(range(1, 11)) and whole[-1]["reward/mean"] == 0.95  # last record wins
    summary, line = reward_summary(whole, len(this_time))
    assert summary["steps"] == 10 and summary["reward_first10"] == 0.1
    assert line == (
        "reward: first 10% 0.100 -> last 10% 0.950 over 10 steps "
        "(1 of them in this process; the rest from metrics.jsonl)"
    )
    assert run_history(str(tmp_path / "none"), this_time) == this_time
    assert reward_summary([], 0)[1] == "reward: no training steps recorded yet"


def _fake_trainer(history):
    class Fake:
        def __init__(self, cfg):
            pass

        def fit(self):
            return history

        def save_pretrained(self, path):
            pass

        def close(self):
            pass

    return Fake


def test_tiny_recipe_says_when_it_makes_a_random_model_and_summarises_a_finished_run(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import grpo_tiny

    monkeypatch.setattr(grpo_tiny, "Trainer", _fake_trainer([]))  # a finished run started again: no steps
    out = tmp_path / "run"
    out.mkdir()
    _jsonl(out / "metrics.jsonl", [{"step": s, "reward/mean": 0.5, "time/step": 1.0} for s in (1, 2)])
    args = [f"model.path={tmp_path / 'model'}", f"trainer.out_dir={out}", "trainer.device=cpu"]
    # A model.path given on the command line that holds no model is a typo until the user says otherwise.
    with pytest.raises(ValueError, match=r"config key 'model\.path': .*holds no model.*--create-model"):
        grpo_tiny.main(args)
    assert not (tmp_path / "model").exists()
    summary = grpo_tiny.main(["--create-model", *args])
    printed = capsys.readouterr().out
    assert "NOTE: creating a RANDOM-weight tiny Qwen2 at model.path=" in printed
    assert "over 2 steps (0 of them in this process" in printed and summary["steps"] == 2
    grpo_tiny.main(args)
    assert "RANDOM-weight" not in capsys.readouterr().out  # the directory exists now: used as it is


def test_saving_prints_no_shard_bar_and_export_no_dcp_warning(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    from hybrid_rl.models.tiny import build_tiny_model_dir

    hf_logging.enable_progress_bar()
    build_tiny_model_dir(str(tmp_path / "m"), ["a", "b"], hidden_size=16, num_layers=1)
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # put back as it was
    from hybrid_rl.checkpoint import sharded as ckpt

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ckpt.quiet_single_process():
            warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming ...", UserWarning)
    assert not seen


def test_a_reward_module_beside_the_command_imports(tmp_path, monkeypatch):
    """Catches: `python recipes/x.py reward.fn=my_reward:fn` failing unless PYTHONPATH=. (the script's
    directory, not the working one, is on sys.path)."""
    from hybrid_rl.rewards.base import load_reward_fn

    (tmp_path / "my_reward_beside.py").write_text("def fn(prompts, completions, metadata):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_reward_fn("my_reward_beside:fn")([], [], []) == [1.0]
    with pytest.raises(ValueError, match="PYTHONPATH=/its/dir") as err:
        load_reward_fn("no_such_reward_module:fn")
    assert str(tmp_path) in str(err.value)


def test_a_stop_under_torchrun_says_what_torchrun_prints_next(monkeypatch, capsys):
    from hybrid_rl.runtime.stop import TrainingInterrupted

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert "torchrun" not in TrainingInterrupted(15, 3, "/c").message
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    stop = TrainingInterrupted(15, 3, "/c")
    assert stop.code == 143 and "SignalException" in stop.message and "not a failure" in stop.message
    stop.announce()
    assert stop.message in capsys.readouterr().out
