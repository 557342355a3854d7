"""`calls.EngineThread`: where the SGLang adapter's Engine calls run. Inside a running event
loop they go to one dedicated thread, and a new thread's current CUDA device is cuda:0 whatever the
caller's is, so that thread must start on the engine's device. CPU only: torch.cuda.set_device is
spied on (a torch.device("cuda", 1) is only a name here)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hybrid_rl.rollout.sglang.calls import EngineThread


def _calls_in_a_cell(calls: EngineThread) -> list[str]:
    """Two calls made from inside a running loop (a notebook cell): the thread each ran on."""

    async def cell():
        return [calls.run(lambda: threading.current_thread().name) for _ in range(2)]

    try:
        return asyncio.run(cell())
    finally:
        calls.close()


@pytest.mark.parametrize(
    "device,want", [(torch.device("cuda", 1), [torch.device("cuda", 1)]), (torch.device("cpu"), []), (None, [])]
)
def test_the_engine_thread_starts_on_the_engines_cuda_device(monkeypatch, device, want):
    set_on: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_on.append((threading.current_thread().name, d)))
    names = _calls_in_a_cell(EngineThread(device))
    assert names[0] == names[1] and names[0].startswith("sglang-engine")  # one dedicated thread
    assert [d for _, d in set_on] == want  # once, before the first call
    assert all(name == names[0] for name, _ in set_on)  # on that thread, not the caller's


def test_off_a_running_loop_calls_run_inline_and_set_nothing(monkeypatch):
    set_on: list = []
    monkeypatch.setattr(torch.cuda, "set_device", set_on.append)
    calls = EngineThread(torch.device("cuda", 1))
    assert calls.run(lambda: threading.current_thread()) is threading.current_thread()
    assert not calls.dedicated and set_on == []


def test_the_adapter_hands_its_models_device_to_the_engine_thread(monkeypatch):
    """SGLangEngine builds its EngineThread with the device of the policy's parameters."""
    import types

    from hybrid_rl.rollout.sglang import engine as adapter

    class Stub:
        def release_memory_occupation(self, tags):
            pass

        def shutdown(self):
            pass

    monkeypatch.setattr(adapter.SGLangEngine, "_start", lambda self, *a: Stub())
    monkeypatch.setattr(adapter.atexit, "register", lambda fn: None)
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(vocab_size=2)
    engine = adapter.SGLangEngine(model, "unused", pad_id=0, eos_id=1)
    assert engine._calls._device == torch.device("cpu")
