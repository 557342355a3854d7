"""Saving never leaves a half-written directory."""

import os

import pytest

from hybrid_rl.models.saving import atomic_dir


def test_failed_write_leaves_the_previous_directory(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(str(target)) as tmp:
            (open(os.path.join(tmp, "config.json"), "w")).write("half")
            raise RuntimeError("disk full")
    assert (target / "config.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["model"], "the temporary directory is cleaned up"
    with atomic_dir(str(target)) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("new")
    assert (target / "config.json").read_text() == "new"
