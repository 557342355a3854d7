"""Which way the native engine decodes (`rollout/native/decode_path.py`): CUDA graphs only over the lean
step, never over the Hugging Face forward; the forward's ready 4-D mask only for attention that
takes one (flash-attention gets the 2-D mask). The capture itself needs a GPU (tests/gpu).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from hybrid_rl.models.loading import load_causal_lm, model_config
from hybrid_rl.rollout.native.decode_graph import DecodeGraphs
from hybrid_rl.rollout.native.decode_path import choose_decode_path
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.native.kv_cache import StaticKVCache
from hybrid_rl.types import SamplingParams
from tests.unit.rollout.native.test_native_engine import ForceTokens

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
NO_LEAN = "model_type 'gemma' is not one of ('llama', 'mistral', 'qwen2', 'qwen3')"


@pytest.mark.parametrize(
    "device,graphs,lean_step,reason,want",
    [
        ("cuda", None, None, None, "cuda_graph"),  # the default on CUDA: the lean step, captured
        ("cuda", False, None, None, "lean"),
        ("cuda", None, False, None, "forward"),  # no lean step: no graphs (said once), the forward
        ("cuda", None, None, NO_LEAN, "forward"),
        ("cpu", None, None, None, "lean"),
        ("cpu", True, None, None, "lean"),  # asked for off CUDA: the engine warns, decodes eagerly
        ("cpu", None, None, NO_LEAN, "forward"),
    ],
)
def test_graphs_only_over_the_lean_step(device, graphs, lean_step, reason, want):
    path = choose_decode_path(device, graphs, lean_step, reason, True, "sdpa")
    assert path.name == want
    # The default on CUDA without a lean step gives the reason, for the engine to log once.
    assert (path.note is not None) == (device == "cuda" and want == "forward")
    if path.note:
        assert "lean" in path.note and "eagerly" in path.note


@pytest.mark.parametrize("lean_step,reason,word", [(False, None, "lean_step=False"), (None, NO_LEAN, "gemma")])
def test_graphs_asked_for_without_a_lean_step_is_an_error(lean_step, reason, word):
    with pytest.raises(ValueError, match=rf"cuda_graphs=True needs the lean decode step.*{word}"):
        choose_decode_path("cuda", True, lean_step, reason, True, "sdpa")


def test_engine_refuses_graphs_without_a_lean_step_at_construction(sharp_model):
    wrapped = ForceTokens(sharp_model, {})  # a wrapper: the lean step cannot see through it
    with pytest.raises(ValueError, match="cuda_graphs=True needs the lean decode step"):
        NativeEngine(wrapped, PAD, EOS, cuda_graphs=True)
    with pytest.raises(ValueError, match="lean_step=False"):
        NativeEngine(sharp_model, PAD, EOS, cuda_graphs=True, lean_step=False)
    NativeEngine(sharp_model, PAD, EOS, cuda_graphs=True)  # the lean step exists: fine


def test_decode_graphs_never_wrap_the_models_forward(sharp_model):
    with pytest.raises(ValueError, match="lean decode step only"):
        DecodeGraphs(sharp_model, StaticKVCache(2, 4), torch.device("cpu"), capture=False, lean=None)


@pytest.mark.parametrize(
    "impl,mask_4d",
    [
        ("sdpa", True),
        ("eager", True),
        ("flash_attention_2", False),
        ("flash_attention_3", False),
        ("hybrid_rl_shared_prefix+sdpa", True),
        ("hybrid_rl_shared_prefix+flash_attention_2", False),
    ],
)
def test_ready_4d_mask_only_where_the_attention_takes_it(impl, mask_4d):
    assert choose_decode_path("cuda", False, False, None, True, impl).mask_4d is mask_4d
    # A sliding window needs transformers' own mask builder whatever the implementation.
    assert choose_decode_path("cuda", False, False, None, False, impl).mask_4d is False


def _flash_stand_in(seen: list):
    """flash-attention's contract as transformers calls it: a 2-D padding mask (or None) and causal
    attention over the keys, never a 4-D mask. Computed with sdpa so the tokens can be compared."""

    def attend(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw):
        seen.append(None if attention_mask is None else attention_mask.dim())
        if attention_mask is not None and attention_mask.dim() != 2:
            raise RuntimeError(f"flash-attention takes a 2-D padding mask, got {attention_mask.dim()}-D")
        (_, H, Q, _), S = q.shape, k.shape[2]
        k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
        allow = torch.ones(Q, S, dtype=torch.bool, device=q.device).tril(S - Q)[None, None]
        if attention_mask is not None:
            allow = allow & attention_mask.bool()[:, None, None, :]
        allow = allow | ~allow.any(-1, keepdim=True)  # a pad query with no key: any finite output (unpadded away)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attend


def test_flash_attention_decodes_through_the_forward_with_a_2d_mask(tiny_model_dir, sharp_model, monkeypatch):
    """The forward path (no lean step) under flash_attention_2: transformers' flash mask builder and a
    flash stand-in that refuses 4-D masks, as the real kernel cannot take one. Same tokens as sdpa."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = load_causal_lm(tiny_model_dir, dtype=torch.float32).eval()
    model.load_state_dict(sharp_model.state_dict())
    seen: list = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", _flash_stand_in(seen))
    assert "flash_attention_2" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping  # transformers' own builder
    model_config(model)._attn_implementation = "flash_attention_2"
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward path off CUDA is said nowhere: nothing to warn about
        got = NativeEngine(model, PAD, EOS, lean_step=False).generate(PROMPTS, sp)
    ref = NativeEngine(sharp_model, PAD, EOS, lean_step=False).generate(PROMPTS, sp)
    assert seen and set(seen) <= {None, 2}, seen
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]


# ---------------------------------------------------------------------------- one step per rollout
class Watched:
    """A decode step, its calls counted and marked as running (`active`)."""

    def __init__(self, step, active: list):
        self.step, self.active, self.calls = step, active, 0

    def __getattr__(self, name):
        return getattr(self.step, name)

    def __call__(self, *args):
        self.calls += 1
        self.active.append(self)
        try:
            return self.step(*args)
        finally:
            self.active.pop()


@pytest.mark.parametrize("path", ["forward", "lean", "cuda_graph"])
def test_the_decode_step_is_chosen_once_per_rollout(sharp_model, path, monkeypatch):
    """Catches a decode path decided, or a step switched, inside the token loop: the path is chosen once
    per rollout (two batches here), one step is built per batch, and after the prefill every forward and
    lean-step call runs inside that step's own call, one call per decoded token."""
    from hybrid_rl.rollout.native.lean_step import LeanStep
    from tests.unit.rollout.native.test_native_engine_speedups import fixed_shape_engine

    make = fixed_shape_engine if path == "cuda_graph" else (lambda m, **kw: NativeEngine(m, PAD, EOS, **kw))
    eng = make(sharp_model, max_batch_size=2, lean_step=path != "forward")
    active, chosen, steps, outside = [], [], [], []
    real_path, real_step, real_lean = eng._decode_path, eng._decode_step, LeanStep.__call__
    eng._decode_path = lambda dev: chosen.append(real_path(dev)) or chosen[-1]
    eng._decode_step = lambda *a: steps.append(Watched(real_step(*a), active)) or steps[-1]

    def lean_call(lean, *args):
        outside.extend([] if active else ["lean"])
        return real_lean(lean, *args)

    def on_forward(module, args, kwargs):  # prompts of 2+ tokens: a 1-token input is a decode step
        outside.extend([] if active or kwargs["input_ids"].shape[1] > 1 else ["forward"])

    monkeypatch.setattr(LeanStep, "__call__", lean_call)
    handle = sharp_model.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        comps = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=2))
    finally:
        handle.remove()
    assert [p.name for p in chosen] == [path] and eng.last_decode_path == path
    assert len(steps) == 2, "one step per batch"
    assert outside == [], f"decode calls outside the rollout's step: {outside}"
    longest = [max(len(c.token_ids) for c in comps[i : i + 2]) for i in (0, 2)]
    assert [s.calls for s in steps] == [n - 1 for n in longest], "one step call per token after the first"
