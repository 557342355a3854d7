"""The phase switch on a CUDA device, as far as a CPU shows it: torch.cuda's allocator calls are recorded by spies
beside the engine's, so the order in which the switch gives the allocator's cache back and resumes an engine is
what is checked (the effect on device memory is tests/gpu/test_trainer_cuda.py's)."""

from __future__ import annotations

import gc

import pytest
import torch

from hybrid_rl.switch.phases import PhaseManager

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


class _OwnCopyEngine:
    """An engine with its own weights and memory (as SGLang and vLLM): records the switch's calls."""

    dtype = None

    def __init__(self, log: list[str]):
        self.log = log

    def resume(self, tags):
        self.log += [f"resume:{t}" for t in tags]

    def release(self, tags):
        self.log += [f"release:{t}" for t in tags]

    def begin_weight_update(self):
        self.log.append("begin")

    def update_weights(self, named_tensors):
        self.log.append("update")

    def end_weight_update(self):
        self.log.append("end")

    def memory_bytes(self):
        return {"engine_weights": 0, "kv_cache": 0}


@pytest.fixture
def allocator(monkeypatch):
    """torch.cuda's allocator as spies: empty_cache gives back 600 of 1000 reserved bytes, logged in order."""
    log: list[str] = []
    state = {"reserved": 1000}

    def empty_cache():
        log.append("empty_cache")
        state["reserved"] = 400

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 300)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 350)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 1200)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(gc, "collect", lambda *a: log.append("gc") or 0)
    return log, state


def _policy() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    policy = torch.nn.Linear(4, 4)
    return policy, torch.optim.AdamW(policy.parameters(), lr=1e-3)


def test_the_cache_goes_back_before_each_engine_resume_and_after_the_sync(allocator):
    """Catches: an engine with its own memory (SGLang's processes, vLLM's pool) resumed while torch's allocator
    here still caches the trainer's freed blocks (no release, or one after the resume), a sync's buckets left
    cached when the KV cache resumes, and the REWARD stage's resume of the KV cache without the release."""
    log, state = allocator
    policy, opt = _policy()
    pm = PhaseManager(policy, opt, _OwnCopyEngine(log), CUDA, reward_model=torch.nn.Linear(4, 1))
    with pm.rollout():
        with pm.reward():
            pass
    with pm.train():
        pass
    engine_calls = [e for e in log if e != "gc"]
    assert engine_calls == [
        "empty_cache",
        "resume:weights",
        "begin",
        "update",
        "end",
        "empty_cache",
        "resume:kv_cache",
        "release:kv_cache",
        "empty_cache",
        "resume:kv_cache",
        "release:kv_cache",
        "release:weights",
    ], engine_calls
    assert log[log.index("empty_cache") - 1] == "gc", "a reference cycle can hold a freed block: collect first"
    stats = pm.pop_stats()
    assert stats.bytes["empty_cache"] == 600, "the stage counts the bytes given back (the first release)"


def test_the_native_engine_on_the_policy_keeps_the_cache(allocator):
    """Catches: the cache given back for the native engine, which decodes with the policy and allocates its KV
    cache from this same allocator (each rollout would ask the driver for it again)."""
    from hybrid_rl.rollout.native.engine import NativeEngine

    log, _ = allocator
    policy, opt = _policy()
    pm = PhaseManager(policy, opt, NativeEngine(policy, pad_id=0, eos_id=1), CUDA)
    with pm.rollout():
        pass
    with pm.train():
        pass
    assert "empty_cache" not in log


def test_the_ledger_records_reserved_beside_allocated_per_phase(allocator):
    """Catches: the ledger reporting allocated bytes only, which cannot show the cache another process competes
    with."""
    log, state = allocator
    policy, opt = _policy()
    pm = PhaseManager(policy, opt, _OwnCopyEngine(log), CUDA)
    with pm.rollout():
        pass
    with pm.train():
        pass
    snaps = pm.ledger.rollout_snapshots(pm.rollouts)
    assert [s.label for s in snaps] == ["rollout:ready", "rollout:generated", "train:ready", "train:end"]
    assert all((s.allocated, s.reserved, s.reserved_peak) == (300, 400, 1200) for s in snaps)
    m = pm.ledger.rollout_metrics(pm.rollouts)
    assert (m["memory/cuda_allocated"], m["memory/cuda_reserved"], m["memory/cuda_reserved_peak"]) == (300, 400, 1200)
    table = pm.ledger.table(pm.rollouts)
    assert "reserved" in table.splitlines()[0] and "0.00" in table
