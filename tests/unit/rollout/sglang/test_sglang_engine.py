"""The SGLang adapter (hybrid_rl/rollout/sglang/engine.py) against the CPU stand-in of sglang 0.5.21.

One process, tp_size 1: the phase switch drives the adapter exactly as in training
(resume weights -> begin -> buckets -> end -> resume kv -> generate -> release), and the
stand-in's schedulers are real spawned processes that open the payloads through
shared memory. The checklist of sglang-api.md section 6, rule by rule, where it
concerns what the adapter sends.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.engine_helpers import PROMPTS
from tests.engine_helpers import perturbed as _perturbed
from tests.engine_helpers import rollout as _rollout

pytestmark = pytest.mark.usefixtures("torch_one_thread", "fake_sglang")


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """A policy, its optimizer, an SGLang engine and the phase switch over them."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager

    tok = load_tokenizer(tiny_model_dir)
    policy = _perturbed(load_causal_lm(tiny_model_dir), seed=1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=64 << 10)
    yield policy, engine, pm, tok
    engine.shutdown()


def test_engine_starts_released_and_the_first_sync_is_complete(setup):
    policy, engine, pm, _ = setup
    rank0 = engine.engine._debug_state()["ranks"][0]
    assert engine.released == {"weights", "kv_cache"} and set(rank0["offload_tags"]) >= {"weights", "kv_cache"}
    with pm.rollout() as e:
        ranks = engine.engine._debug_state()["ranks"]
        e.generate(PROMPTS, _greedy())
    with pm.train():
        pass
    assert all(r["all_params_loaded_since_release"] for r in ranks), "a sync after a release must cover every parameter"
    assert engine.engine._debug_state()["ranks"][0]["offload_tags"] == ["kv_cache", "weights"], "released after"
    n_params = sum(p.numel() * p.element_size() for p in policy.parameters())
    assert engine.sync_stats["bytes"] == n_params, "the flat buckets hold exactly the weights, once per TP rank"
    assert engine.sync_stats["payloads"] == ranks[0]["payloads_opened"] > 1, "several buckets, each opened once"


def _greedy(max_new_tokens: int = 8):
    from hybrid_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, greedy=True)


def test_greedy_output_equals_the_native_engine_on_the_same_weights(setup):
    from hybrid_rl.rollout.native.engine import NativeEngine

    policy, engine, pm, tok = setup
    got = _rollout(pm, PROMPTS, _greedy())
    want = NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
        PROMPTS, _greedy()
    )
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_stop_token_at_the_length_limit_finishes_as_stop(setup):
    """Real SGLang (and the stand-in, which copies Req.check_finished) reports 'length' when the last allowed
    token is a stop token; the engine maps it to 'stop', as the native engine decodes it, so rewards and the
    overlong filter see a finished answer. The stop token is a token of the greedy answer that did not occur
    before it (position k), and the limit k + 1."""
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok = setup
    free_all = _rollout(pm, PROMPTS, _greedy(8))
    found = [
        (p, c.token_ids, k)
        for p, c in zip(PROMPTS, free_all)
        for k in range(1, len(c.token_ids))
        if c.token_ids[k] not in c.token_ids[:k]
    ]
    assert found, "the check needs a greedy answer with a token new at position k >= 1"
    prompt, free_ids, k = found[0]
    at_limit = SamplingParams(max_new_tokens=k + 1, greedy=True, stop_token_ids=(free_ids[k],))
    raw, real_generate = [], engine.engine.generate
    engine.engine.generate = lambda **kw: raw.extend(real_generate(**kw)) or raw
    try:
        got = _rollout(pm, [prompt], at_limit)[0]
    finally:
        engine.engine.generate = real_generate
    assert raw[0]["meta_info"]["finish_reason"]["type"] == "length", "the stand-in checks the length first, as SGLang"
    want = NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
        [prompt], at_limit
    )[0]
    assert got.token_ids == want.token_ids == free_ids[: k + 1]
    assert got.finish_reason == want.finish_reason == "stop"


def test_min_new_tokens_bans_eos_and_the_extra_stops_like_the_native_engine(setup, tiny_model_dir):
    """rollout.min_new_tokens goes to SGLang as min_new_tokens, which 0.5.21 serves only with its tokenizer
    (skip_tokenizer_init=True refuses it): the first greedy token of a prompt, made a stop id, ends that row at
    once without it and is skipped for the first 3 tokens with it, as the native engine's loop does. SGLang's
    penalizer adds -inf to the logits before its sampler, so logprobs are the masked distribution's, as native."""
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.types import SamplingParams

    policy, plain_engine, _, tok = setup
    with pytest.raises(ValueError, match="with_tokenizer=True"):
        plain_engine._sampling_dict(SamplingParams(max_new_tokens=8, greedy=True, min_new_tokens=3), 0)
    policy = copy.deepcopy(policy)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, with_tokenizer=True)
    try:
        pm = PhaseManager(
            policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, torch.device("cpu"), bucket_bytes=64 << 10
        )
        stop = _rollout(pm, PROMPTS, _greedy())[0].token_ids[0]
        plain = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(stop,))
        assert len(_rollout(pm, PROMPTS, plain)[0].token_ids) == 1
        sp = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(stop,), min_new_tokens=3)
        got = _rollout(pm, PROMPTS, sp)
        want = NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
            PROMPTS, sp
        )
    finally:
        engine.shutdown()
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert len(got[0].token_ids) > 3 and stop not in got[0].token_ids[:3]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_cpu_export_switches_the_sharing_strategy_for_itself_only():
    """CPU payloads travel as file_system shared memory (a scheduler is not a child of the exporting rank), but
    the strategy is process-wide: left switched, every later torch.multiprocessing payload of the caller (a
    DataLoader worker's, the stand-in tests' fd payloads) would travel differently."""
    from hybrid_rl.rollout.sglang.weight_transport import export_bucket

    before = torch.multiprocessing.get_sharing_strategy()
    assert before != "file_system", "the check needs the default strategy"
    export = export_bucket([("w", torch.ones(4))], None)
    assert b"rebuild_storage_filename" in export.payload, "the payload itself is a file_system handle"
    assert torch.multiprocessing.get_sharing_strategy() == before


def test_sampled_logprobs_equal_the_trainers_at_the_sampling_temperature(setup):
    from hybrid_rl.models.logprobs import build_sequences, response_logprobs
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok = setup
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    got = _rollout(pm, PROMPTS * 2, params)
    ids, attn, mask, P = build_sequences(PROMPTS * 2, [c.token_ids for c in got], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(policy, ids, attn, P, 0.7)
    for i, c in enumerate(got):
        assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids) >= 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id, "the stop token is part of the completion"
        torch.testing.assert_close(torch.tensor(c.logprobs), logp[i, : len(c.logprobs)], atol=1e-5, rtol=0)


def test_weights_follow_the_policy_after_a_training_step(setup):
    policy, engine, pm, _ = setup
    before = [c.token_ids for c in _rollout(pm, PROMPTS, _greedy())]
    _perturbed(policy, seed=2)  # what a training step does to the weights, in larger
    after = _rollout(pm, PROMPTS, _greedy())
    assert [c.token_ids for c in after] != before, "the engine must decode with the synced weights"
    test_greedy_output_equals_the_native_engine_on_the_same_weights(setup)


def test_calls_that_would_kill_sglang_raise_in_python_first(setup):
    """Each of these, sent to SGLang, kills the process that built the engine (note section 0)."""
    policy, engine, pm, _ = setup
    assert engine.released == {"weights", "kv_cache"}
    engine.resume(["weights"])
    with pytest.raises(RuntimeError, match="not released"):
        engine.resume(["weights"])
    engine.release(["weights"])
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, _greedy())
    engine.resume(["weights"])
    with pytest.raises(RuntimeError, match="outside a weight-update session"):
        engine.update_weights([("model.norm.weight", torch.ones(64))])
    engine.begin_weight_update()
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.ones(65))])
    with pytest.raises(KeyError, match="not in the policy"):
        engine.update_weights([("model.norm.wieght", torch.ones(64))])
    engine.update_weights([("model.norm.weight", policy.model.norm.weight.detach())])
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.end_weight_update()
    # Finish the sync properly so the engine is usable again.
    from hybrid_rl.models.weights import iter_weight_buckets

    for bucket in iter_weight_buckets(policy, 64 << 10):
        engine.update_weights(bucket)
    engine.end_weight_update()
    engine.resume(["kv_cache"])
    engine.release(["kv_cache", "weights"])
    assert engine.released == {"weights", "kv_cache"}


def test_a_dtensor_or_an_empty_bucket_never_reaches_the_engine():
    from hybrid_rl.rollout.sglang.weight_transport import export_bucket

    with pytest.raises(ValueError, match="empty"):
        export_bucket([], None)

    class FakeDTensor(torch.Tensor):
        def full_tensor(self):  # what a DTensor has
            return self

    with pytest.raises(TypeError, match="DTensor"):
        export_bucket([("w", torch.zeros(2).as_subclass(FakeDTensor))], None)


def test_sglang_output_maps_to_completions_like_the_native_engine():
    from hybrid_rl.rollout.sglang.engine import to_completion

    out = {
        "output_ids": [5, 6, 1],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 1},
            "output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None), (-2.0, 1, None)],
        },
    }
    c = to_completion(out, 0)
    assert c.token_ids == [5, 6, 1] and c.logprobs == [-0.5, -1.0, -2.0] and c.finish_reason == "stop"
    out["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert to_completion(out, 0).finish_reason == "length"
    # SGLang tests the length limit first: a stop token as the last allowed token says "length"; it stopped.
    assert to_completion(out, 0, stop_ids=[1]).finish_reason == "stop"
    assert to_completion(out, 0, stop_ids=[2]).finish_reason == "length"
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory"}
    with pytest.raises(RuntimeError, match="out of memory"):
        to_completion(out, 0)
    out["meta_info"]["finish_reason"] = {"type": "stop", "matched": 1}
    out["meta_info"]["output_token_logprobs"][1] = (-1.0, 7, None)
    with pytest.raises(RuntimeError, match="do not follow"):
        to_completion(out, 0)


def test_config_rejects_bad_engine_settings(tiny_trainer_overrides, monkeypatch):
    import importlib.util

    from hybrid_rl import Trainer, load_config

    with pytest.raises(ValueError, match="rollout.tp_size"):
        load_config(None, ["rollout.tp_size=2"])  # tensor parallel needs sglang
    with pytest.raises(ValueError, match="rollout.tp_size"):
        load_config(None, ["rollout.engine=sglang", "rollout.tp_size=3"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ValueError, match="sglang is not importable"):
        Trainer(load_config(None, [*tiny_trainer_overrides, "rollout.engine=sglang"]))


def test_export_copies_the_weights_and_flushes_once_per_sync(setup, monkeypatch):
    """Serializing a CPU tensor moves its storage into shared memory in place: the policy's own
    parameters must never be exported (a fresh flat copy is). A stale prefix cache degrades
    rewards, so the cache is flushed once per sync, after the last bucket."""
    policy, engine, pm, _ = setup
    calls = []
    real_flush = engine.engine.flush_cache
    monkeypatch.setattr(engine.engine, "flush_cache", lambda: calls.append("flush") or real_flush())
    real_update = engine.engine.update_weights_from_tensor

    def update(**kwargs):
        calls.append("bucket")
        assert kwargs["load_format"] == "flattened_bucket" and len(kwargs["named_tensors"]) == engine.tp_size
        return real_update(**kwargs)

    monkeypatch.setattr(engine.engine, "update_weights_from_tensor", update)
    _rollout(pm, PROMPTS, _greedy())
    assert calls.count("flush") == 1 and calls[-1] == "flush" and calls.count("bucket") > 1
    assert not any(p.is_shared() for p in policy.parameters()), "a policy parameter was moved into shared memory"


def test_session_and_tag_rules_are_checked_before_sglang_sees_them(setup):
    """An empty tag list means ALL tags to SGLang (cuda_graph too, never paired here); a second
    begin, or resuming the KV cache or releasing inside a session, breaks the sync protocol."""
    policy, engine, pm, _ = setup
    with pytest.raises(ValueError, match="every tag"):
        engine.release([])
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.resume(["cuda_graph"])
    engine.resume(["weights"])
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="twice"):
        engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="inside a weight-update session"):
        engine.resume(["kv_cache"])
    with pytest.raises(RuntimeError, match="inside a weight-update session"):
        engine.release(["weights"])
    from hybrid_rl.models.weights import iter_weight_buckets

    for bucket in iter_weight_buckets(policy, 64 << 10):
        engine.update_weights(bucket)
    engine.end_weight_update()
    engine.resume(["kv_cache"])
    engine.release(["kv_cache", "weights"])
    assert not engine.engine._debug_state()["session_active"]


def test_a_cuda_export_runs_without_expandable_segments_and_restores_the_settings(setup, monkeypatch):
    """CUDA IPC cannot export expandable segments: a session switches them off in the trainer's
    allocator and gives it its whole settings string back at the end, or at an abort. The device
    is played (only a CUDA engine switches); tests/gpu/test_sglang_cuda.py checks torch's side."""
    from hybrid_rl.models.weights import iter_weight_buckets
    from hybrid_rl.rollout.sglang import alloc_conf

    policy, engine, pm, _ = setup
    settings, applied = ["max_split_size_mb:64,expandable_segments:True"], []
    monkeypatch.setattr(alloc_conf, "current_settings", lambda: settings[0])
    monkeypatch.setattr(alloc_conf, "apply_settings", applied.append)
    engine.resume(["weights"])
    monkeypatch.setattr(engine, "device", torch.device("cuda"))
    off = "max_split_size_mb:64,expandable_segments:False"
    engine.begin_weight_update()
    assert applied == [off]
    engine.abort_weight_update()
    assert applied == [off, settings[0]]
    engine.begin_weight_update()
    for bucket in iter_weight_buckets(policy, 64 << 10):
        engine.update_weights(bucket)
    engine.end_weight_update()
    assert applied == [off, settings[0], off, settings[0]]
    settings[0] = "max_split_size_mb:64"  # nothing to switch
    engine.begin_weight_update()
    engine.abort_weight_update()
    assert len(applied) == 4
    monkeypatch.setattr(engine, "device", torch.device("cpu"))
    engine.release(["weights"])


def test_schedulers_inherit_no_agent_store_and_no_expandable_segments(tiny_model_dir, monkeypatch):
    """What SGLang's scheduler processes inherit from the trainer's environment, while it keeps its own.

    torchrun sets TORCHELASTIC_USE_AGENT_STORE=True for its workers. The schedulers rendezvous at
    their own tcp:// port through torch, which under that variable only connects to a store that
    nobody serves there (the stand-in's schedulers rendezvous through torch as the real ones do).
    Expandable segments, under either name torch reads (PYTORCH_ALLOC_CONF wins over
    PYTORCH_CUDA_ALLOC_CONF), are refused by torch_memory_saver in every scheduler; every other
    allocator setting stays, and a set variable stays set so that the same name wins there."""
    import os

    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("FAKE_SGLANG_RENDEZVOUS_TIMEOUT_S", "15")
    trainer_conf = {
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    for name, value in trainer_conf.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PYTORCH_HIP_ALLOC_CONF", raising=False)
    tok = load_tokenizer(tiny_model_dir)
    engine = SGLangEngine(
        load_causal_lm(tiny_model_dir), tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1
    )
    try:
        assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True", "the trainer's own environment is restored"
        assert {n: os.environ[n] for n in trainer_conf} == trainer_conf
        ranks = engine.engine._debug_state()["ranks"]
        assert engine.released == {"weights", "kv_cache"} and len(ranks) == 1
        assert ranks[0]["alloc_conf_env"] == {
            "PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "PYTORCH_HIP_ALLOC_CONF": None,
        }
    finally:
        engine.shutdown()


def test_the_payload_list_is_checked_against_tp_size_before_sglang_sees_it(setup, monkeypatch):
    """SGLang 0.5.21 checks nothing: TP rank i opens payloads[i], so too few kills its scheduler (and
    this process), extras are dropped, and one payload for two ranks opens one handle twice."""
    from hybrid_rl.models.weights import iter_weight_buckets
    from hybrid_rl.rollout.sglang.engine import check_payloads
    from hybrid_rl.runtime import distributed as D

    check_payloads([b"a", "b"], 2)
    for bad, why in (
        ([b"a"], "1 weight payloads for tp_size=2"),
        ([b"a", b"b", b"c"], "3 weight payloads"),
        ([b"a", b"a"], "same bytes"),
    ):
        with pytest.raises(ValueError, match=why):
            check_payloads(bad, 2)
    policy, engine, pm, _ = setup
    opened = engine.engine._debug_state()["ranks"][0]["payloads_opened"]
    real_gather = D.gather_object_to
    monkeypatch.setattr(D, "gather_object_to", lambda obj, dst, group: real_gather(obj, dst, group) * 2)
    engine.resume(["weights"])
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="2 weight payloads for tp_size=1"):
        engine.update_weights(next(iter_weight_buckets(policy, 64 << 10)))
    monkeypatch.setattr(D, "gather_object_to", real_gather)
    assert engine.engine._debug_state()["ranks"][0]["payloads_opened"] == opened, "nothing reached SGLang"
    engine.abort_weight_update()
    engine.release(["weights"])
    _rollout(pm, PROMPTS, _greedy())  # the engine is still usable


def test_sglang_0_5_17_without_a_weight_update_session(tiny_model_dir, monkeypatch):
    """0.5.17, the SGLang the lent GPU machines can run, has no begin/end_weight_update: the
    adapter syncs without a session, and greedy output still equals the native engine's."""
    import sglang

    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager

    monkeypatch.setenv("FAKE_SGLANG_VERSION", "0.5.17")
    tok = load_tokenizer(tiny_model_dir)
    policy = _perturbed(load_causal_lm(tiny_model_dir), seed=2)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    try:
        assert sglang.__version__ == "0.5.17" and not hasattr(engine.engine, "begin_weight_update")
        pm = PhaseManager(
            policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, torch.device("cpu"), bucket_bytes=64 << 10
        )
        got = _rollout(pm, PROMPTS, _greedy())
        want = NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
            PROMPTS, _greedy()
        )
        # The engine starts on dummy weights: equal output means the session-less sync loaded them.
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
    finally:
        engine.shutdown()
