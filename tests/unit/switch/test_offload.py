"""Offload round trips are bit-exact, move the bytes they claim, and reuse their host buffers."""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.switch.offload import ModuleOffloader, OptimizerOffloader, optimizer_tensors
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.types import SamplingParams


def _train_steps(model_dir: str, steps: int, offload: bool) -> tuple[dict, list]:
    from hybrid_rl.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(model_dir)
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pm = PhaseManager(
        model,
        opt,
        NativeEngine(model, pad_id=0, eos_id=1),
        torch.device("cpu"),
        ref=ref,
        offload_optimizer=offload,
        offload_ref=offload,
        always_copy=True,
    )
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
    """Offloaded and resident runs of the same steps end bit-equal: what a round trip copies comes back. On CPU
    the numbers would be equal even if the optimizer stepped on its host copy (never onloaded); where the state
    is at the step is checked in tests/unit/switch/test_phases.py."""
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


def test_optimizer_offloader_moves_all_state_into_one_reused_host_buffer(tiny_model):
    """Catches: a host buffer per state tensor (each one a pinned block on CUDA, rounded up to a power of two and
    kept by torch's pinned allocator for good), and a buffer allocated anew at every offload."""
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    tiny_model(input_ids=torch.tensor([[4, 5, 6]])).logits.sum().backward()
    opt.step()
    n_params = sum(p.numel() for p in tiny_model.parameters())
    n_tensors = len(list(optimizer_tensors(opt)))
    off = OptimizerOffloader(opt, torch.device("cpu"), always_copy=True)
    before = [v.clone() for _, _, v in optimizer_tensors(opt)]
    assert off.offload() == 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32
    assert off.offload() == 0, "a second offload is a no-op"
    host = off._host
    assert isinstance(host, torch.Tensor) and host.dtype == torch.uint8 and host.dim() == 1
    offloaded = [v for _, _, v in optimizer_tensors(opt)]
    assert {v.untyped_storage().data_ptr() for v in offloaded} == {host.untyped_storage().data_ptr()}, (
        "every offloaded state tensor must live in the one flat host buffer"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, offloaded))
    assert 2 * 4 * n_params <= off.host_bytes() < 2 * 4 * n_params + off._ALIGN * n_tensors
    assert off.onload() == 2 * 4 * n_params
    after = [v for _, _, v in optimizer_tensors(opt)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # On device the state must not alias the host buffer (it is written again at the next offload).
    assert all(v.untyped_storage().data_ptr() != host.untyped_storage().data_ptr() for v in after)
    off.offload()
    assert off._host is host, "the host buffer must be reused, not reallocated"
    off.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, (v for _, _, v in optimizer_tensors(opt))))


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

    args = dict(device=torch.device("cpu"), world_size=1, mixed_precision=False, prompt_tokens=4)

    def cfg(**offload):
        return SimpleNamespace(
            offload=_offload_cfg(**offload),
            model=SimpleNamespace(path=tiny_model_dir),
            algorithm=SimpleNamespace(needs_ref_model=False),
            reward=SimpleNamespace(model_path=""),
        )

    with pytest.warns(UserWarning, match="no reward model"):
        d = decide_offload(cfg(reward_model=True), **args)
    assert (d.optimizer, d.ref, d.params) == (False, False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = decide_offload(cfg(optimizer=True), **args)
    assert d.optimizer and not d.ref
    d = decide_offload(cfg(auto=True, optimizer=True), **args)
    assert not d.optimizer and "CPU" in d.message


def test_module_offloader_frees_storage_reuses_its_host_buffer_and_round_trips(tiny_model, monkeypatch):
    """The code that runs on CUDA (no pinning here): every parameter's and buffer's storage is
    emptied into one host buffer that the next offload reuses, and comes back bit-exact into
    the same tensor objects. `module.to` is never called (it allocated host memory per step)."""
    model = copy.deepcopy(tiny_model)
    monkeypatch.setattr(model, "to", lambda *a, **k: pytest.fail("offload must not move the module with .to()"))
    tensors = dict(model.named_parameters()) | {f"buffer:{n}": b for n, b in model.named_buffers()}
    assert any(n.startswith("buffer:") for n in tensors), "the tiny model has buffers (rotary inv_freq)"
    before = {n: t.detach().clone() for n, t in tensors.items()}
    nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}.values())
    off = ModuleOffloader(model, torch.device("cpu"), always_copy=True, free_storage=True)  # the device's path
    host_ptrs = []
    for _ in range(2):
        n = off.offload()
        assert n == nbytes > 0
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values()), "offload must free each storage"
        assert off.host_bytes() >= n and not off._host.is_pinned()
        host_ptrs.append(off._host.data_ptr())
        with pytest.raises(RuntimeError, match="offloaded to host memory by the phase switch"):
            model(input_ids=torch.tensor([[4, 5]]))  # an offloaded module holds no data, and says so
        assert off.onload() == n
        now = dict(model.named_parameters()) | {f"buffer:{k}": b for k, b in model.named_buffers()}
        assert all(now[k] is tensors[k] for k in tensors), "the same tensor objects come back"
        for name, t in tensors.items():
            assert t.untyped_storage().nbytes() > 0 and torch.equal(t, before[name]), name
            assert not (
                t.untyped_storage().data_ptr()
                <= off._host.data_ptr()
                < t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()
            ), f"{name} must not alias the host buffer"
    assert host_ptrs[0] == host_ptrs[1], "the second offload must reuse the host buffer, not allocate another"
    assert torch.equal(
        model(input_ids=torch.tensor([[4, 5]])).logits, tiny_model(input_ids=torch.tensor([[4, 5]])).logits
    )
    # A module left offloaded by one offloader (a PhaseManager that is gone) comes back with the next one.
    ModuleOffloader(model, torch.device("cpu"), always_copy=True, free_storage=True).offload()
    again = ModuleOffloader(model, torch.device("cpu"), always_copy=True)
    assert again.on_device and all(t.untyped_storage().nbytes() > 0 for t in tensors.values()), "not brought back"
    assert all(torch.equal(t, before[n]) for n, t in tensors.items())


def test_sglang_kv_room_warns_when_the_optimizer_state_will_not_fit_beside_the_engine():
    """SGLang sizes its KV cache from the memory free at its start, before AdamW's state exists:
    a state that stays on the device must fit in free x (1 - mem_fraction)."""
    from hybrid_rl.switch.advice import sglang_kv_room_warning

    GiB = 1024**3
    opt, free = 14 * GiB, 70 * GiB  # 7B: 56 GiB of Adam state over 4 ranks; 70 GiB free at start-up
    assert sglang_kv_room_warning(opt, free, None, optimizer_offloaded=True) is None
    assert sglang_kv_room_warning(0, free, 0.9, optimizer_offloaded=False) is None
    auto = sglang_kv_room_warning(opt, free, None, optimizer_offloaded=False)
    assert "mem_fraction=null" in auto and "rollout.mem_fraction <= 0.78" in auto  # 1 - 1.1 * 14 / 70
    assert sglang_kv_room_warning(opt, free, 0.75, optimizer_offloaded=False) is None  # leaves 17.5 GiB
    high = sglang_kv_room_warning(opt, free, 0.85, optimizer_offloaded=False)  # leaves 10.5 GiB < 14
    assert "leaves 10.5 GiB" in high and "offload.optimizer=true" in high
