"""Where the phase switch (hybrid_rl/switch/phases.py) keeps the optimizer state when the optimizer steps.

On CPU the device is the host: an optimizer that steps on its offloaded state (the host copy) computes the
same numbers as one that steps on onloaded state, so value comparisons (offload vs none) cannot see a missing
onload, and the byte counters only say that a copy ran. This test reads the state's placement instead: at the
moment `optimizer.step()` runs, no state tensor may live in the memory that held it while it was offloaded.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.switch.offload import optimizer_tensors
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.types import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _storages(opt: torch.optim.Optimizer) -> set[int]:
    """The storages the optimizer's state tensors live in, right now."""
    return {v.untyped_storage().data_ptr() for _, _, v in optimizer_tensors(opt)}


def test_the_optimizer_steps_on_onloaded_state_not_on_its_host_copy(tiny_model):
    """Catches: the TRAIN phase not onloading the optimizer state before the step (or an onload that only flips
    its flag): on CPU the step then updates the host copy in place, and every number stays the same."""
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    pm = PhaseManager(
        tiny_model,
        opt,
        NativeEngine(tiny_model, pad_id=0, eos_id=1),
        torch.device("cpu"),
        offload_optimizer=True,
        always_copy=True,  # CPU: the offload copies really run, into host memory and back
    )
    at_step = []
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: at_step.append(_storages(optimizer)))
    ids = torch.tensor([[4, 5, 6, 14, 7, 8]])
    offloaded, after_step = [], []
    for step in range(3):
        with pm.rollout() as engine:
            engine.generate([[4, 5, 6, 14]], SamplingParams(max_new_tokens=2, seed=step))
            offloaded.append(_storages(opt))  # the host copy (none before the first step makes the state)
        with pm.train() as optimizer:
            tiny_model(input_ids=ids).logits.square().mean().backward()
            optimizer.step()
            after_step.append(_storages(opt))
    assert len(at_step) == 3 and not offloaded[0] and after_step[0]
    for step in (1, 2):
        assert offloaded[step] and offloaded[step].isdisjoint(after_step[step - 1]), (
            "the state was not offloaded (or, never onloaded, the switch took it for offloaded still)"
        )
        assert at_step[step].isdisjoint(offloaded[step]), f"step {step}: the optimizer stepped on its host copy"
    stats = pm.pop_stats()
    assert stats.bytes["onload_optimizer"] == stats.bytes["offload_optimizer"] > 0
