"""The memory ledger: per-role bytes at each boundary, bounded history, table and timeline PNG."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.switch.memory import ROLES, MemoryLedger, grad_bytes, module_bytes, optimizer_bytes


def test_role_names_are_the_planners_one_definition():
    from hybrid_rl.plan import memory as memory_plan

    assert ROLES is memory_plan.ROLES, "the ledger must use the planner's ROLES, not a copy that can drift"


def test_counts_come_from_the_tensors(tiny_model):
    dev = torch.device("cpu")
    n = sum(p.numel() for p in tiny_model.parameters())
    assert module_bytes(tiny_model, dev) == 4 * n
    assert grad_bytes(tiny_model, dev) == 0
    opt = torch.optim.AdamW(tiny_model.parameters())
    tiny_model(input_ids=torch.tensor([[4, 5]])).logits.sum().backward()
    assert grad_bytes(tiny_model, dev) == 4 * n
    opt.step()
    assert optimizer_bytes(opt, dev) == 8 * n
    assert module_bytes(tiny_model, torch.device("meta")) == 0, "tensors elsewhere are not resident here"


def test_ledger_keeps_recent_rollouts_and_rejects_unknown_roles(tmp_path):
    led = MemoryLedger(torch.device("cpu"), keep_rollouts=2)
    for rollout in range(1, 6):
        led.record("rollout:ready", rollout, {"policy_weights": 10 * rollout, "kv_cache": 3})
        led.record("train:end", rollout, {"policy_weights": 10 * rollout, "grads": 7})
    assert {s.rollout for s in led.snapshots} == {4, 5}, "old rollouts are dropped so a long run does not grow"
    m = led.rollout_metrics(5)
    assert m["memory/policy_weights_peak"] == 50 and m["memory/grads_peak"] == 7
    assert m["memory/total_peak"] == 57
    assert "rollout:ready" in led.table(5)
    led.plot(5, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 2000
    with pytest.raises(ValueError, match="unknown memory roles"):
        led.record("x", 6, {"activations_typo": 1})
    with pytest.raises(ValueError, match="no memory snapshots"):
        led.plot(99, str(tmp_path / "none.png"))
