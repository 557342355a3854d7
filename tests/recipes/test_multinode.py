"""Multi-node launch: the tiny recipe under two `torchrun --nnodes=2` launchers on this machine (node
ranks 0 and 1, one process each, static rendezvous on localhost), as README's multi-node command.

Both launchers must exit 0, the run directory must hold one metrics line per step, the config,
the final model and the checkpoints, and no file may be written by two processes: every worker
runs under tests/recipes/audited_run.py, which logs the files it writes under the run and model
directories, and the two logs must not share a path. Rank 1 writes only its own checkpoint shards.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed.torchrun_jobs import SMALL, Job

pytestmark = pytest.mark.slow

AUDIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "audited_run.py")


def _writes(path: str) -> set[str]:
    """Paths one rank wrote (audited_run.py's log; renames count at both ends)."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {line.rstrip("\n").split("\t", 1)[1] for line in f if "\t" in line}


def test_two_launchers_one_process_each(tmp_path):
    run, model, logs = tmp_path / "run", tmp_path / "model", tmp_path / "writes"
    logs.mkdir()
    env = {"WRITE_AUDIT_DIRS": os.pathsep.join([str(run), str(model)]), "WRITE_AUDIT_LOG": str(logs / "rank{rank}.tsv")}
    overrides = [
        "--create-model",
        f"model.path={model}",
        f"trainer.out_dir={run}",
        "trainer.total_steps=3",
        "trainer.save_every=2",
        "trainer.dist_timeout_s=60",
        *SMALL,
    ]
    with Job(tmp_path, env=env) as job:
        job.multi_node(2, overrides, prefix=[AUDIT])
        rcs = job.wait(240)
        tails = job.tails()
        out0 = job.output(0)
    assert rcs == [0, 0], tails
    assert "reward: first 10%" in out0, "node 0 hosts global rank 0, which prints the summary"

    # The run directory, written once.
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    assert (run / "config.yaml").read_text().count("total_steps: 3") == 1
    assert (run / "final_model" / "config.json").is_file()
    assert any(name.endswith(".safetensors") for name in os.listdir(run / "final_model"))

    # Checkpoints: every save_every steps and after the last one, complete ones only.
    from hybrid_rl.checkpoint import sharded as ckpt

    root = str(run / "checkpoints")
    latest = ckpt.latest(root)
    assert latest is not None and os.path.basename(latest) == "step_00000003", os.listdir(root)
    assert os.path.isfile(os.path.join(latest, "meta.json"))

    # One writer per file: the two ranks' write logs share no path.
    w0, w1 = _writes(str(logs / "rank0.tsv")), _writes(str(logs / "rank1.tsv"))
    assert w0, "the audit hook saw no writes on rank 0: is audited_run.py wrapping the recipe?"
    assert not (w0 & w1), f"written by both ranks: {sorted(w0 & w1)}"
    for name in ["config.yaml", "metrics.jsonl", "final_model"]:
        assert str(run / name) in w0, f"rank 0 did not write {name}"
    assert str(model) in w0, "rank 0 builds the model directory (and renames it into place)"
    # Rank 1 (node 1) writes its own checkpoint shards and nothing else.
    strays = sorted(p for p in w1 if not p.startswith(root + os.sep))
    assert not strays, f"rank 1 wrote outside {root}: {strays}"

    # The same command with one more step resumes on both nodes from the newest checkpoint.
    overrides = [o if not o.startswith("trainer.total_steps=") else "trainer.total_steps=4" for o in overrides]
    with Job(tmp_path, env={}) as job:
        job.multi_node(2, overrides)
        rcs = job.wait(240)
        tails = job.tails()
        out0 = job.output(0)
    assert rcs == [0, 0], tails
    assert f"resumed from {latest} at step 3" in out0
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
