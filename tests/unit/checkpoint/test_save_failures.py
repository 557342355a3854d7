"""A save that fails at any point (checkpoint/sharded.py `save`): one message naming the checkpoint, where it
failed, the bytes it needed when the disk is full, and what was kept; the partial directory removed; and
what a killed save leaves removed (or restored) at the next start, saying so.

Saves here are of a small torch module and its AdamW state, through the same `save` the Trainer calls
(the Trainer's own full-disk case: test_checkpoint.py).

Catches: a full disk surfacing as torch's `unexpected pos ... vs ...` or a bare OSError, a failure at one
stage leaving `.tmp-step_*` behind or an earlier checkpoint touched, a message without the bytes needed or
without what was kept, DCP's CheckpointException (a BaseException) escaping the agreement between ranks,
and a killed save's leftovers removed silently or the only copy of a re-saved step deleted.
"""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch

from hybrid_rl.checkpoint import manifest
from hybrid_rl.checkpoint import sharded as C


def _module():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


def _write_hf(d):
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("{}")


def _save(root, step, model, opt):
    return C.save(root, step, model, opt, {"step": step}, {"model": {}, "config": {}}, _write_hf)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint root holding a complete step 1."""
    model, opt = _module()
    root = str(tmp_path / "checkpoints")
    _save(root, 1, model, opt)
    return root, model, opt


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device", "/disk/full/file")


def _short_write(*a, **k):  # what torch's zip writer raises when a write comes up short
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4544 vs 4436")


class _Usage:
    def __init__(self, free):
        self.free, self.total, self.used = free, 10**9, 10**9 - free


class _Boom(Exception):
    pass


def _io_error(*a, **k):
    raise _Boom("Input/output error")


def _dcp_enospc(*a, **k):  # DCP gathers each rank's failure into a CheckpointException (a BaseException)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _enospc()
    except OSError as err:
        raise CheckpointException("write_data", {0: (err, None)}) from err


# (what fails, where it is patched, the stage named, the message part that says why)
POINTS = {
    "hf_files": ("write_hf", _enospc, "preparing", "the disk is full at /disk/full/file"),
    "rank_file": ("torch.save", _short_write, "writing", "the disk is full at"),
    "weights": ("dcp.save", _dcp_enospc, "writing", "the disk is full at"),
    "checksums": ("manifest.describe", _io_error, "checksumming", "_Boom: Input/output error"),
    "manifest": ("manifest.write", _enospc, "committing", "the disk is full at /disk/full/file"),
    "rename": ("_replace_dir", _io_error, "committing", "_Boom: Input/output error"),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_failed_save_says_where_what_it_needed_and_what_was_kept(saved, monkeypatch, point):
    root, model, opt = saved
    target, fail, stage, why = POINTS[point]
    describe = manifest.describe
    before = describe(C.step_dir(root, 1), manifest.listing(C.step_dir(root, 1)))
    if target == "write_hf":
        pass  # the function is save()'s argument: passed below
    elif target == "torch.save":
        monkeypatch.setattr(C.torch, "save", fail)
        monkeypatch.setattr(C.shutil, "disk_usage", lambda p: _Usage(free=1000))
    elif target == "dcp.save":
        monkeypatch.setattr("torch.distributed.checkpoint.save", fail)
    elif target.startswith("manifest."):  # (write_hf fails as the argument itself, below)
        monkeypatch.setattr(C.manifest, target.split(".")[1], fail)
    else:
        monkeypatch.setattr(C, target, fail)
    with pytest.raises(C.CheckpointError) as err:
        if target == "write_hf":
            C.save(root, 2, model, opt, {"step": 2}, {"model": {}, "config": {}}, fail)
        else:
            _save(root, 2, model, opt)
    msg = str(err.value)
    final, tmp = C.step_dir(root, 2), os.path.join(root, ".tmp-step_00000002")
    assert "\n" not in msg, msg
    assert msg.startswith(f"saving checkpoint {final!r} failed while {stage} on rank 0"), msg
    assert why in msg, msg
    assert f"Kept: the checkpoint of step 1 under {root}, untouched" in msg and "was removed" in msg, msg
    if "disk is full" in why:
        weights = sum(p.numel() * 4 for p in model.parameters())  # fp32 weights + Adam's two moments
        need = int(re.search(r"needs about [\d.]+ KB \((\d+) bytes of weights and optimizer\)", msg).group(1))
        assert 3 * weights <= need < 3 * weights + 100 and "Free space" in msg, msg
    assert sorted(os.listdir(root)) == ["step_00000001"], "no temporary left, no partial checkpoint"
    assert describe(C.step_dir(root, 1), manifest.listing(C.step_dir(root, 1))) == before
    monkeypatch.undo()
    assert _save(root, 2, model, opt) == final and not C.damage(final), "the next save works"
    assert not os.path.exists(tmp)


def test_a_short_write_with_room_left_is_not_called_a_full_disk(saved, monkeypatch):
    root, model, opt = saved
    monkeypatch.setattr(C.torch, "save", _short_write)
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: _Usage(free=10**12))
    with pytest.raises(C.CheckpointError, match=r"writing on rank 0: RuntimeError: .*unexpected pos") as err:
        _save(root, 2, model, opt)
    assert "disk is full" not in str(err.value)


def test_the_manifest_lists_every_file_and_is_written_last(saved):
    """Every other file of the checkpoint is in the manifest with its size and checksum (meta.json included);
    a file added after it was written would be outside it."""
    root, _, _ = saved
    path = C.step_dir(root, 1)
    files = manifest.read(path)
    assert sorted(files) == manifest.listing(path) and "meta.json" in files and "rank_00000.pt" in files
    assert files == manifest.describe(path, manifest.listing(path))
    assert os.path.getmtime(os.path.join(path, "manifest.json")) >= max(
        os.path.getmtime(os.path.join(path, f)) for f in files
    )
    assert not C.damage(path)


def test_a_killed_saves_leftovers_are_cleaned_at_the_next_start_saying_so(saved, capsys):
    root, model, opt = saved
    os.makedirs(os.path.join(root, ".tmp-step_00000003", "state"))
    _save(root, 2, model, opt)
    os.replace(C.step_dir(root, 2), C.step_dir(root, 2) + ".old")  # killed between a re-save's two renames
    said = C.remove_stale_temporaries(root)
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
    assert len(said) == 2 and said == capsys.readouterr().out.strip().splitlines()
    assert {line.split()[1] for line in said} == {"restored", "removed"} and ".tmp-step_00000003" in "".join(said)
    assert not C.damage(C.step_dir(root, 2))
