"""Offload round trips are bit-exact, move the bytes they claim, and reuse their host buffers."""
from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.switch.offload import ModuleOffloader, OptimizerOffloader, optimizer_tensors
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.rollout.base import SamplingParams
from hybrid_rl.rollout.native import NativeEngine


def _train_steps(model_dir: str, steps: int, offload: bool) -> tuple[dict, list]:
    from hybrid_rl.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(model_dir)
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pm = PhaseManager(model, opt, NativeEngine(model, pad_id=0, eos_id=1), torch.device("cpu"), ref=ref,
                      offload_optimizer=offload, offload_ref=offload, always_copy=True)
    for step in range(steps):
        with pm.rollout() as engine:
            out = engine.generate([[4, 5, 6, 14], [7, 8, 14]], SamplingParams(max_new_tokens=3, seed=step))
        ids = torch.tensor([[4, 5, 6, 14] + out[0].token_ids[:2] + [0] * (2 - len(out[0].token_ids[:2]))])
        with pm.score() as r:
            target = r(input_ids=ids).logits.detach()
        with pm.train():
            (model(input_ids=ids).logits - target).square().mean().backward()
            opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = [v.clone() for _, _, v in optimizer_tensors(opt)]
    return params, state, pm


def test_offload_every_step_equals_never(tiny_model_dir):
    p_off, s_off, pm = _train_steps(tiny_model_dir, steps=4, offload=True)
    p_ref, s_ref, _ = _train_steps(tiny_model_dir, steps=4, offload=False)
    for n in p_ref:
        assert torch.equal(p_off[n], p_ref[n]), n
    assert len(s_off) == len(s_ref) > 0
    assert all(torch.equal(a, b) for a, b in zip(s_off, s_ref))
    # The ref really went through host buffers: its onload moved its full size.
    stats = pm.pop_stats()
    ref_bytes = sum(t.numel() * t.element_size() for t in [*pm.ref.parameters(), *pm.ref.buffers()])
    assert stats.bytes["onload_ref"] == 4 * ref_bytes  # 4 steps, fp32


def test_optimizer_offloader_moves_all_state_and_reuses_buffers(tiny_model):
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    tiny_model(input_ids=torch.tensor([[4, 5, 6]])).logits.sum().backward()
    opt.step()
    n_params = sum(p.numel() for p in tiny_model.parameters())
    off = OptimizerOffloader(opt, torch.device("cpu"), always_copy=True)
    before = [v.clone() for _, _, v in optimizer_tensors(opt)]
    assert off.offload() == 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32
    assert off.offload() == 0, "a second offload is a no-op"
    buffers = {k: v.data_ptr() for k, v in off._host.items()}
    assert off.onload() == 2 * 4 * n_params
    after = [v for _, _, v in optimizer_tensors(opt)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # On device the state must not alias the host buffers (they are reused next time).
    assert not {v.data_ptr() for v in after} & set(buffers.values())
    off.offload()
    assert {k: v.data_ptr() for k, v in off._host.items()} == buffers, "host buffers must be reused, not reallocated"
    assert off.host_bytes() == 2 * 4 * n_params


def test_module_offloader_round_trip_is_exact(tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    off = ModuleOffloader(tiny_model, torch.device("cpu"), always_copy=True)
    n = off.offload()
    assert n == sum(t.numel() * t.element_size() for t in [*tiny_model.parameters(), *tiny_model.buffers()])
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.zero_()  # whatever happens on device while offloaded is overwritten on onload
    assert off.onload() == n
    for name, p in tiny_model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_cpu_without_always_copy_moves_nothing(tiny_model):
    off = ModuleOffloader(tiny_model, torch.device("cpu"))
    assert off.offload() == 0 and off.onload() == 0


def _offload_cfg(**kw):
    base = dict(optimizer=False, ref=True, params=False, reward_model=False, auto=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_decide_offload_warns_for_missing_roles_and_auto_on_cpu(tiny_model_dir):
    from hybrid_rl.switch.advice import decide_offload

    args = dict(model_path=tiny_model_dir, device=torch.device("cpu"), world_size=1, mixed_precision=False,
                sequences=16, context=12, has_ref=False)
    with pytest.warns(UserWarning, match="no reward model"):
        d = decide_offload(_offload_cfg(reward_model=True), **args)
    assert (d.optimizer, d.ref, d.params) == (False, False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = decide_offload(_offload_cfg(optimizer=True), **args)
    assert d.optimizer and not d.ref
    d = decide_offload(_offload_cfg(auto=True, optimizer=True), **args)
    assert not d.optimizer and "CPU" in d.message


def test_module_offload_to_the_host_blocks_and_back_to_the_device_does_not(tiny_model, monkeypatch):
    """A non-blocking device-to-host `.to()` returns before the copy lands, and FSDP2 re-pads an
    uneven shard from the new host tensor right away (a host copy that does not wait for the
    device): offloading must block. Onloading may not: the re-pad runs on the copy's stream."""
    import hybrid_rl.switch.offload as offload_mod

    calls = []
    monkeypatch.setattr(tiny_model, "to", lambda target, non_blocking=False: calls.append((target.type, non_blocking)))
    monkeypatch.setattr(offload_mod, "_sync", lambda device: None)
    off = ModuleOffloader(tiny_model, torch.device("cuda"))  # only the device's type is read here
    off.offload()
    off.onload()
    assert calls == [("cpu", False), ("cuda", True)]


def test_sglang_kv_room_warns_when_the_optimizer_state_will_not_fit_beside_the_engine():
    """SGLang sizes its KV cache from the memory free at its start, before AdamW's state exists:
    a state that stays on the device must fit in free x (1 - mem_fraction)."""
    from hybrid_rl.switch.advice import sglang_kv_room_warning

    GiB = 1024 ** 3
    opt, free = 14 * GiB, 70 * GiB  # 7B: 56 GiB of Adam state over 4 ranks; 70 GiB free at start-up
    assert sglang_kv_room_warning(opt, free, None, optimizer_offloaded=True) is None
    assert sglang_kv_room_warning(0, free, 0.9, optimizer_offloaded=False) is None
    auto = sglang_kv_room_warning(opt, free, None, optimizer_offloaded=False)
    assert "mem_fraction=null" in auto and "rollout.mem_fraction <= 0.78" in auto  # 1 - 1.1 * 14 / 70
    assert sglang_kv_room_warning(opt, free, 0.75, optimizer_offloaded=False) is None  # leaves 17.5 GiB
    high = sglang_kv_room_warning(opt, free, 0.85, optimizer_offloaded=False)  # leaves 10.5 GiB < 14
    assert "leaves 10.5 GiB" in high and "offload.optimizer=true" in high
