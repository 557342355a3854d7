"""Damaged checkpoints on resume (checkpoint/manifest.py, sharded.damage, loop/run_state.find_resume).

One run writes checkpoints at steps 2 and 4 (module fixture); each test damages a copy of it the way a full
disk, a cut copy or a stray edit would, then resumes. Resume is decided by `find_resume` (what `Trainer`
calls before it builds anything), so most tests build no model; one builds the Trainer end to end.

Catches: a damaged file loaded anyway (torch's or json's error from deep inside, or a silently different
run), a damage reported without the file and what is wrong, `trainer.resume=auto` refusing instead of
falling back to the newest intact checkpoint (or falling back silently), a damaged or later checkpoint
deleted instead of set aside, an explicit resume of an older checkpoint refused because newer ones exist,
and a refusal that does not say which command recovers.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.checkpoint_helpers import ROOT, overrides

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _cfg(model_dir: str, out: str, *extra: str):
    from hybrid_rl import load_config

    return load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out, *extra))


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, tmp_path_factory):
    """A run directory with intact checkpoints at steps 2 and 4 (treat as read-only: copy it)."""
    from hybrid_rl import Trainer

    out = str(tmp_path_factory.mktemp("saved") / "run")
    Trainer(_cfg(tiny_model_dir, out, "trainer.total_steps=4", "trainer.save_every=2")).fit()
    return out


@pytest.fixture
def run(saved_run, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(saved_run, out)
    return out


def _resume(model_dir: str, out: str, *extra: str):
    from hybrid_rl.loop.run_state import find_resume

    cfg = _cfg(model_dir, out, "trainer.total_steps=6", *extra)
    with open(os.path.join(model_dir, "config.json")) as f:
        return find_resume(cfg, json.load(f))


def _ckpt(out: str, step: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{step:08d}")


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _distcp(path: str) -> str:
    return "state/" + next(n for n in sorted(os.listdir(os.path.join(path, "state"))) if n.endswith(".distcp"))


def _garble(path: str) -> None:
    with open(path, "w") as f:
        f.write('{"format": 1, "step": ')


DAMAGES = {
    "rank_file_truncated": (lambda c: _truncate(os.path.join(c, "rank_00000.pt")), "rank_00000.pt", "truncated"),
    "shard_truncated": (lambda c: _truncate(os.path.join(c, _distcp(c))), ".distcp", "truncated"),
    "shard_changed": (lambda c: _flip_a_byte(os.path.join(c, _distcp(c))), ".distcp", "SHA-256"),
    "rank_file_missing": (lambda c: os.remove(os.path.join(c, "rank_00000.pt")), "rank_00000.pt", "is missing"),
    "hf_config_missing": (lambda c: os.remove(os.path.join(c, "hf", "config.json")), "hf/config.json", "missing"),
    "meta_does_not_parse": (lambda c: _garble(os.path.join(c, "meta.json")), "meta.json", "does not parse"),
    "manifest_does_not_parse": (lambda c: _garble(os.path.join(c, "manifest.json")), "manifest.json", "not parse"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_auto_falls_back_to_the_newest_intact_checkpoint_saying_why(run, tiny_model_dir, capsys, damage):
    """Each damage of the newest checkpoint: auto resumes from step 2, names the damaged file and what is wrong,
    and moves step 4 to set_aside/ (kept, not deleted)."""
    plant, file, what = DAMAGES[damage]
    plant(_ckpt(run, 4))
    path, meta = _resume(tiny_model_dir, run)
    assert path == _ckpt(run, 2) and meta["step"] == 2
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if "step_00000004 is damaged" in x)
    assert file in line and what in line, said
    aside = os.path.join(run, "checkpoints", "set_aside", "step_00000004-damaged")
    assert os.path.isdir(aside) and not os.path.exists(_ckpt(run, 4)) and "kept, not deleted" in line
    assert f"resuming from {_ckpt(run, 2)}, the newest intact checkpoint" in said


@pytest.mark.parametrize("damage", ["shard_truncated", "meta_does_not_parse", "rank_file_missing"])
def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file_and_the_fix(run, tiny_model_dir, damage):
    from hybrid_rl.checkpoint.sharded import CheckpointError

    plant, file, what = DAMAGES[damage]
    plant(_ckpt(run, 4))
    with pytest.raises(CheckpointError) as err:
        _resume(tiny_model_dir, run, f"trainer.resume={_ckpt(run, 4)}")
    msg = str(err.value)
    assert "\n" not in msg and _ckpt(run, 4) in msg and file in msg and what in msg
    assert msg.endswith(f"To recover, resume from the newest intact one before it: trainer.resume={_ckpt(run, 2)}")
    assert os.path.isdir(_ckpt(run, 4)), "a refusal moves nothing"


def test_no_intact_checkpoint_is_refused_and_nothing_moves(run, tiny_model_dir):
    from hybrid_rl.checkpoint.sharded import CheckpointError

    _truncate(os.path.join(_ckpt(run, 4), "rank_00000.pt"))
    os.remove(os.path.join(_ckpt(run, 2), "manifest.json"))
    os.remove(os.path.join(_ckpt(run, 2), "state", ".metadata"))  # without a manifest: the files every one has
    with pytest.raises(
        CheckpointError,
        match=r"no intact checkpoint.*step_00000004: rank_00000\.pt.*step_00000002: "
        r"state/\.metadata is missing.*Nothing was moved.*trainer\.resume=none",
    ):
        _resume(tiny_model_dir, run)
    assert os.path.isdir(_ckpt(run, 4)) and os.path.isdir(_ckpt(run, 2))


def test_an_older_checkpoint_resumes_and_the_later_ones_are_set_aside(run, tiny_model_dir, capsys):
    path, meta = _resume(tiny_model_dir, run, f"trainer.resume={_ckpt(run, 2)}")
    assert path == _ckpt(run, 2) and meta["step"] == 2
    aside = os.path.join(run, "checkpoints", "set_aside", "step_00000004-after-step-2")
    assert os.path.isfile(os.path.join(aside, "manifest.json")), "moved whole, not deleted"
    said = capsys.readouterr().out
    assert f"step_00000004 comes after step 2, which this run resumes from; moved to {aside}" in said
    assert "the 1 later checkpoint(s) are kept in" in said


def test_the_trainer_resumes_past_a_damaged_checkpoint_and_keeps_training(run, tiny_model_dir, capsys):
    """End to end: the damaged step 4 is set aside, the Trainer loads step 2 and trains to step 4 again, writing
    a new step 4 beside the one set aside; a second damaged save of the same name gets a free name."""
    from hybrid_rl import Trainer

    _flip_a_byte(os.path.join(_ckpt(run, 4), _distcp(_ckpt(run, 4))))
    tr = Trainer(_cfg(tiny_model_dir, run, "trainer.total_steps=4", "trainer.save_every=2"))
    assert tr.step_idx == 2
    tr.fit()
    assert os.path.isfile(os.path.join(_ckpt(run, 4), "manifest.json"))
    _truncate(os.path.join(_ckpt(run, 4), "rank_00000.pt"))
    assert Trainer(_cfg(tiny_model_dir, run, "trainer.total_steps=4")).step_idx == 2
    aside = sorted(os.listdir(os.path.join(run, "checkpoints", "set_aside")))
    assert aside == ["step_00000004-damaged", "step_00000004-damaged.2"]


def test_a_checkpoint_without_manifest_that_fails_to_load_is_named(run, tiny_model_dir):
    """Written before manifests (nothing to verify against): torch's error on load is wrapped, naming the
    checkpoint, the part and what to do."""
    from hybrid_rl import Trainer
    from hybrid_rl.checkpoint.sharded import CheckpointError

    ckpt = _ckpt(run, 4)
    os.remove(os.path.join(ckpt, "manifest.json"))
    _truncate(os.path.join(ckpt, _distcp(ckpt)))
    with pytest.raises(CheckpointError, match=r"step_00000004' is damaged: reading state/ .*failed.*older one"):
        Trainer(_cfg(tiny_model_dir, run, "trainer.total_steps=6"))


def test_the_export_cli_skips_a_damaged_newest_checkpoint(run, tmp_path, capsys):
    from hybrid_rl.checkpoint.export import main

    _truncate(os.path.join(_ckpt(run, 4), "rank_00000.pt"))
    assert main([os.path.join(run, "checkpoints"), str(tmp_path / "hf")]) == 0
    assert "export: skipping damaged" in capsys.readouterr().err
    assert main([_ckpt(run, 4), str(tmp_path / "hf2")]) == 2
    assert "rank_00000.pt has" in capsys.readouterr().err
