"""Loggers (hybrid_rl/observability/loggers.py): jsonl always, console one line per log_every steps, TensorBoard and
W&B under the same metric names, a clear error when a logger's package is missing, and no
progress bar in a non-interactive log."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.observability.loggers import ConsoleLogger, JsonlLogger, build_loggers, check_loggers, interactive
from hybrid_rl.observability.metrics import format_val_line

pytestmark = pytest.mark.usefixtures("torch_one_thread")

STEP = {
    "step": 3,
    "reward/mean": 0.25,
    "reward/accuracy": 0.5,
    "time/step": 1.5,
    "bottleneck": "rollout-bound",
    "actor/grad_norm": 0.1,
}


def test_jsonl_logger_starts_empty_and_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("stale\n")
    log = JsonlLogger(str(path))
    log.log(STEP, 3)
    log.log({**STEP, "step": 4}, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [3, 4]


def test_console_logger_every_n_steps_and_validation_lines():
    lines = []
    log = ConsoleLogger(every=2, write=lines.append)
    for step in (1, 2, 3, 4):
        log.log({**STEP, "step": step}, step)
    assert [line.split()[0] for line in lines] == ["step=2", "step=4"]
    assert "time=1.50s" in lines[0] and "reward=0.250" in lines[0]
    log.log({"step": 0, "val/pass@1": 0.125, "val/mean@4": 0.5}, 0)  # a validation before training: one val line
    assert lines[-1] == "val step=0  pass@1=0.125  mean@4=0.500"
    assert len(lines) == 3
    silent = ConsoleLogger(every=0, write=lines.append)
    silent.log({**STEP, "step": 2}, 2)
    assert len(lines) == 3


def test_format_val_line_puts_pass_at_1_first():
    assert (
        format_val_line({"step": 5, "val/truncated": 1.0, "val/pass@1": 0.25, "val/mean@2": 0.5, "val/prompts": 32.0})
        == "val step=5  pass@1=0.250  mean@2=0.500  prompts=32  truncated=1.000"
    )  # a count prints as one


def test_missing_optional_logger_packages_are_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a)
    )
    check_loggers(["console", "jsonl"])
    for name in ("tensorboard", "wandb"):
        with pytest.raises(ImportError, match=rf"trainer.loggers.*{name}.*pip install {name}"):
            check_loggers(["console", name])


def test_trainer_refuses_a_missing_logger_before_building_anything(tiny_trainer_overrides, monkeypatch):
    from hybrid_rl.trainer import Trainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.setattr("hybrid_rl.trainer.load_tokenizer", lambda *a: pytest.fail("built before the check"))
    with pytest.raises(ImportError, match="pip install wandb"):
        Trainer(load_config(None, [*tiny_trainer_overrides, "trainer.loggers=[console,wandb]"]))


def test_interactive_only_on_a_terminal(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert not interactive()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert interactive()


def _tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_logger_writes_every_number_under_its_name(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = load_config(None, [f"trainer.out_dir={tmp_path}", "trainer.loggers=[tensorboard]"])
    loggers = build_loggers(cfg)
    assert [type(x).__name__ for x in loggers] == ["JsonlLogger", "TensorBoardLogger"]
    for step in (1, 2):
        for x in loggers:
            x.log({**STEP, "step": step, "reward/mean": 0.5 * step}, step)
    for x in loggers:
        x.close()
    scalars = _tensorboard_scalars(str(tmp_path / "tensorboard"))
    assert set(scalars) == {"reward/mean", "reward/accuracy", "time/step", "actor/grad_norm"}  # numbers only
    assert scalars["reward/mean"] == [(1, pytest.approx(0.5)), (2, pytest.approx(1.0))]


def test_wandb_offline_run_gets_the_same_names(tmp_path):
    pytest.importorskip("wandb")
    cfg = load_config(None, [f"trainer.out_dir={tmp_path}", "trainer.loggers=[wandb]", "trainer.wandb_mode=offline"])
    loggers = build_loggers(cfg)
    run = loggers[1].run
    loggers[1].log({**STEP, "step": 1}, 1)
    assert set(run.summary.keys()) >= {"reward/mean", "reward/accuracy", "time/step", "actor/grad_norm"}
    loggers[1].close()
    assert any(name.startswith("offline-run") for name in os.listdir(tmp_path / "wandb"))


def test_a_training_run_logs_the_same_names_to_every_logger(tiny_trainer_overrides, tmp_path, capsys):
    """Two steps with the progress bar asked for: not a terminal, so no bar; one console line per step."""
    pytest.importorskip("tensorboard")
    from hybrid_rl.trainer import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *tiny_trainer_overrides,
            "trainer.total_steps=2",
            "trainer.progress_bar=true",
            "trainer.loggers=[console,tensorboard]",
        ],
    )
    tr = Trainer(cfg)
    capsys.readouterr()
    tr.fit()
    tr.close()
    out, err = capsys.readouterr()
    assert "\r" not in out and "\r" not in err, "a progress bar was drawn into a non-interactive log"
    assert [line.split()[0] for line in out.splitlines() if line.startswith("step=")] == ["step=1", "step=2"]
    with open(run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    numeric = {k for r in records for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    scalars = _tensorboard_scalars(str(run / "tensorboard"))
    assert set(scalars) == numeric
    assert [v for _, v in scalars["reward/mean"]] == pytest.approx([r["reward/mean"] for r in records])


def test_val_samples_restart_with_the_run(tmp_path):
    """val_samples.jsonl is per step like metrics.jsonl: a new run starts without it (no empty file left by a
    run that writes none), a resumed run keeps the samples up to its checkpoint (not those the stopped run
    wrote after it, nor an older run's)."""
    path = tmp_path / "val_samples.jsonl"
    path.write_text("".join(json.dumps({"step": s, "prompt": "p"}) + "\n" for s in (0, 2, 4)))
    cfg = load_config(None, [f"trainer.out_dir={tmp_path}", "trainer.loggers=[]"])
    build_loggers(cfg, resume_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]
    build_loggers(cfg)
    assert not path.exists()


def test_wandb_resume_continues_the_same_run(tmp_path, monkeypatch):
    """A resumed run passes W&B the id its first run got (kept in out_dir) with resume="allow"; a new run
    gets a new id. A stand-in module records what wandb.init receives."""
    import sys
    import types

    inits, ids = [], iter(["run-a", "run-b"])
    fake = types.ModuleType("wandb")
    fake.util = types.SimpleNamespace(generate_id=lambda: next(ids))
    fake.init = lambda **kw: inits.append(kw) or types.SimpleNamespace(log=None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(None, [f"trainer.out_dir={tmp_path}", "trainer.loggers=[wandb]", "trainer.wandb_mode=offline"])
    build_loggers(cfg)
    build_loggers(cfg, resume_step=5)
    build_loggers(cfg)
    assert [(kw["id"], kw["resume"]) for kw in inits] == [("run-a", "allow"), ("run-a", "allow"), ("run-b", "allow")]
    assert (tmp_path / "wandb_run_id").read_text().strip() == "run-b"


def test_rollout_log_writes_the_trained_completions(tiny_trainer_overrides):
    """trainer.log_rollouts=N: the first N completions the step trains on (rank 0), with the reward the
    reward function gave that very text, in order, grouped by prompt; a new run starts the file empty."""
    from hybrid_rl.rewards.toy import digits_reward
    from hybrid_rl.trainer import Trainer

    texts = []

    def reward(prompts, completions, metadata):
        out = digits_reward(prompts, completions, metadata)
        texts.extend(zip(prompts, completions, out))
        return out

    cfg = load_config(None, [*tiny_trainer_overrides, "trainer.log_rollouts=3", "trainer.total_steps=2"])
    tr = Trainer(cfg, reward_fn=reward)
    for _ in range(2):
        texts.clear()
        tr.step()
        step_texts = list(texts)
    path = os.path.join(cfg.trainer.out_dir, "rollouts.jsonl")
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 1, 1, 2, 2, 2] and [r["group"] for r in recs[3:]] == [0, 0, 1]
    assert [(r["prompt"], r["completion"], r["reward"]) for r in recs[3:]] == step_texts[:3]
    assert all(r["finish_reason"] in ("stop", "length") and "answer" in r for r in recs)
    Trainer(load_config(None, [*tiny_trainer_overrides, "trainer.log_rollouts=3", "trainer.resume=none"]))
    assert not os.path.exists(path)  # a new run in the same out_dir starts without the old run's lines
