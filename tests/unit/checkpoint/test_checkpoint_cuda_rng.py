"""CUDA random-number state in a checkpoint: this rank's device only, so a resume that sees
fewer GPUs (a smaller node, CUDA_VISIBLE_DEVICES narrowed to the rank's own GPU) still works.

No GPU here: torch.cuda's RNG functions are replaced by a fake with a given number of devices,
which refuses a device index it does not have, as the real one does."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.checkpoint import sharded as ckpt


class FakeCuda:
    """`n` devices, each with its own generator state (distinct bytes); records every get/set."""

    def __init__(self, n: int, current: int):
        self.n, self.current = n, current
        self.states = {i: torch.full((16,), 10 * (i + 1), dtype=torch.uint8) for i in range(n)}
        self.got: list[int] = []
        self.set: list[int] = []

    def _index(self, device) -> int:
        if device in ("cuda", None):
            idx = self.current
        elif isinstance(device, str):
            idx = int(device.split(":")[1])
        elif isinstance(device, torch.device):
            idx = self.current if device.index is None else device.index
        else:
            idx = int(device)
        if not 0 <= idx < self.n:
            raise RuntimeError(f"CUDA error: invalid device ordinal {idx} (this process sees {self.n})")
        return idx

    def get_rng_state(self, device="cuda"):
        idx = self._index(device)
        self.got.append(idx)
        return self.states[idx].clone()

    def set_rng_state(self, new_state, device="cuda"):
        idx = self._index(device)
        self.set.append(idx)
        self.states[idx] = new_state.clone()

    def get_rng_state_all(self):
        return [self.get_rng_state(i) for i in range(self.n)]

    def set_rng_state_all(self, new_states):
        for i, s in enumerate(new_states):
            self.set_rng_state(s, i)

    def install(self, mp: pytest.MonkeyPatch) -> "FakeCuda":
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: self.n)
        mp.setattr(torch.cuda, "current_device", lambda: self.current)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            mp.setattr(torch.cuda, name, getattr(self, name))
        return self


def test_resume_on_a_rank_that_sees_fewer_gpus(tmp_path):
    """Rank 1 of a 2-GPU node saves; after the restart it sees only its own GPU (as cuda:0)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.MonkeyPatch.context() as mp:
        saving = FakeCuda(n=2, current=1).install(mp)
        rank_state = {"rng": ckpt.rng_state()}
    saved = rank_state["rng"]["cuda"]
    assert isinstance(saved, torch.Tensor), f"one device's state is saved, not {type(saved).__name__}"
    assert torch.equal(saved, saving.states[1]) and saving.got == [1], "only this rank's device is read"
    path = ckpt.save(str(tmp_path), 3, model, opt, rank_state, {"model": {}, "config": {}}, lambda d: None)

    with pytest.MonkeyPatch.context() as mp:
        resuming = FakeCuda(n=1, current=0).install(mp)
        state = ckpt.load(path, model, opt)  # the rank file goes through torch.load(weights_only=True)
        ckpt.set_rng_state(state["rng"])
    assert resuming.set == [0], "only this rank's device is restored"
    assert torch.equal(resuming.states[0], saving.states[1]), "the rank's device continues the saved stream"


def test_old_checkpoints_with_a_state_per_visible_gpu_still_resume(monkeypatch):
    old = {
        **ckpt.rng_state(),
        "cuda": [torch.full((16,), 7, dtype=torch.uint8), torch.full((16,), 9, dtype=torch.uint8)],
    }
    fake = FakeCuda(n=1, current=0).install(monkeypatch)
    ckpt.set_rng_state(old)
    assert fake.set == [0] and torch.equal(fake.states[0], old["cuda"][0]), "this rank's entry, nothing else"
    fake = FakeCuda(n=2, current=1).install(monkeypatch)
    ckpt.set_rng_state(old)
    assert fake.set == [1] and torch.equal(fake.states[1], old["cuda"][1])

    fake = FakeCuda(n=4, current=2).install(monkeypatch)
    with pytest.raises(ckpt.CheckpointError, match=r"2 GPU\(s\).*cuda:2.*CUDA_VISIBLE_DEVICES"):
        ckpt.set_rng_state(old)
    assert fake.set == []


def test_a_cuda_state_resumed_without_a_gpu_is_ignored(monkeypatch):
    """Nothing draws from a CUDA generator on a CPU-only machine; the other generators still resume."""
    state = {**ckpt.rng_state(), "cuda": torch.full((16,), 7, dtype=torch.uint8)}
    expected = torch.rand(3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.rand(5)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
