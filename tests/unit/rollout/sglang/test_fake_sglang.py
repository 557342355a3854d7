"""The CPU stand-in for sglang 0.5.21 (tests/fake_sglang) against the rules it must enforce.

The stand-in runs real spawned scheduler processes that decode with transformers, so
these tests compare it with a plain Hugging Face model on the same weights. Weights
are the checkpoint plus seeded noise (`trainer_weights`): the engines start from
load_format="dummy", so only a complete sync can make them agree.

Engines are module-scoped; the test that crashes an engine is the last to use it.
Legend: P prompt tokens, T response tokens, V vocab.
"""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

FAKE = str(Path(__file__).resolve().parents[3] / "fake_sglang")
EOS = 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14]]

pytestmark = pytest.mark.usefixtures("torch_one_thread", "fake_sglang")


@pytest.fixture(scope="module")
def h():
    """The stand-in's test helpers (tests/fake_sglang/fake_sglang_helpers.py)."""
    import fake_sglang_helpers

    return fake_sglang_helpers


@pytest.fixture(scope="module")
def make_engine(tiny_model_dir):
    made = []

    def make(**kwargs):
        import sglang

        args = dict(model_path=tiny_model_dir, skip_tokenizer_init=True, random_seed=0, load_format="dummy")
        made.append(sglang.Engine(**{**args, **kwargs}))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine1(make_engine):
    return make_engine(tp_size=1)


@pytest.fixture(scope="module")
def engine2(make_engine):
    return make_engine(tp_size=2)


def check_matches_hf(engine, model) -> None:
    from fake_sglang_helpers import hf_greedy, hf_logprobs

    greedy = engine.generate(
        input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 8}, return_logprob=True
    )
    for prompt, res in zip(PROMPTS, greedy):
        assert res["output_ids"] == hf_greedy(model, prompt, 8, EOS)
        lp = torch.tensor([x[0] for x in res["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(lp, hf_logprobs(model, prompt, res["output_ids"], 1.0), atol=1e-5, rtol=0)
    sampled = engine.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_new_tokens": 8},
        return_logprob=True,
    )
    for prompt, res in zip(PROMPTS, sampled):
        lp = torch.tensor([x[0] for x in res["meta_info"]["output_token_logprobs"]])  # before top-k/top-p
        torch.testing.assert_close(lp, hf_logprobs(model, prompt, res["output_ids"], 0.7), atol=1e-5, rtol=0)


def _dtensor_and_patch_probe(port: int, out_q) -> None:
    import torch.distributed as dist
    from sglang.srt.utils.common import MultiprocessingSerializer as S
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    result = {}
    dtensor = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
    try:
        S.deserialize(S.serialize(dtensor))
        result["dtensor"] = "loaded"
    except RuntimeError as err:
        result["dtensor"] = str(err)
    dist.destroy_process_group()
    monkey_patch_torch_reductions()
    monkey_patch_torch_reductions()  # idempotent
    try:
        S.serialize(torch.zeros(3))
        result["cpu_after_patch"] = "ok"
    except IndexError:
        result["cpu_after_patch"] = "IndexError"
    out_q.put(result)


@dataclass
class _Custom:
    x: int


# -- transport, no engine ---------------------------------------------------------------
def test_serializer_roundtrip_and_payload_normalisation():
    import binascii
    import pickle

    from sglang.srt.utils.common import MultiprocessingSerializer as S
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payload as norm

    t = torch.arange(6.0)
    raw = S.serialize([("w", t.clone()), ("shape", torch.Size([2, 3])), ("dtype", torch.bfloat16)])
    assert raw[:1] == b"\x80" and norm(raw) == raw and norm(bytearray(raw)) == raw
    b64 = S.serialize({"t": t.clone()}, output_str=True)
    assert isinstance(b64, str) and norm(b64) == norm(b64.encode()) == base64.b64decode(b64)
    assert torch.equal(S.deserialize(b64)["t"], t)
    name, got = S.deserialize(raw)[0]
    assert name == "w" and torch.equal(got, t)
    # 0.5.21 takes any protocol up to the highest, and keeps bytes that are not base64 as they are.
    proto1 = b"\x80\x01K\x05."  # PROTO 1, the int 5, STOP
    assert norm(proto1) == proto1 and S.deserialize(norm(proto1)) == 5
    for protocol in (0, 1):  # no PROTO header at all
        old = pickle.dumps(t, protocol=protocol)
        assert norm(old) == old and torch.equal(S.deserialize(norm(old)), t)
    with pytest.raises(binascii.Error):  # a str must be base64
        norm("not base64!")
    with pytest.raises(TypeError, match="got int"):
        norm(5)


def _global(module: str, name: str) -> bytes:
    """A pickle that only looks up module.name (GLOBAL opcode), so each allow-list pair is probed alone."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n."


def test_allow_list_is_0_5_21s_exact_list():
    """Each pair as 0.5.21 lists it: some the old stand-in refused are admitted, some it admitted are not."""
    import functools
    import types

    from sglang.srt.utils.common import MultiprocessingSerializer as S

    admitted = [
        ("torch", "device"),
        ("torch", "dtype"),
        ("functools", "partial"),
        ("copyreg", "__newobj_ex__"),
        ("types", "SimpleNamespace"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch", "FloatTensor"),
        ("torch.cuda", "BoolTensor"),
        ("torch.sparse", "LongTensor"),
        ("torch", "QUInt8Storage"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
        ("itertools", "repeat"),
        ("torch", "uint7"),
    ]
    for module, name in admitted:
        assert S.deserialize(_global(module, name)) is getattr(__import__(module, fromlist=[name]), name)
    refused = [
        ("torch.multiprocessing.reductions", "rebuild_event"),
        ("torch._utils", "_rebuild_xla_tensor"),
        ("torch._utils", "_rebuild_nested_tensor"),
        ("torch", "Storage"),
        ("torch", "TypedStorage"),
        ("torch._tensor", "Tensor"),
        ("torch.sparse", "BoolTensor"),
        ("torch.cuda", "QInt8Storage"),
        ("torch", "load"),
        ("builtins", "eval"),
        ("sglang.srt.utils.common", "MultiprocessingSerializer"),
    ]
    for module, name in refused:
        with pytest.raises(RuntimeError, match=re.escape(f"Blocked unsafe global ({module}.{name})")):
            S.deserialize(_global(module, name))
    # Whole objects that ride on the newly admitted names.
    assert S.deserialize(S.serialize(functools.partial(int, "5")))() == 5
    assert S.deserialize(S.serialize(types.SimpleNamespace(a=torch.device("cpu")))).a == torch.device("cpu")


def test_allow_list_blocks_numpy_custom_classes_and_the_old_path():
    import numpy as np
    from sglang.srt.utils.common import MultiprocessingSerializer as S

    for obj in (np.zeros(3), _Custom(1), {"ok": torch.zeros(1), "bad": _Custom(2)}):
        with pytest.raises(RuntimeError, match="Blocked unsafe global"):
            S.deserialize(S.serialize(obj))
    with pytest.raises(ImportError):
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor  # noqa: F401
    old_path = b"\x80\x04csglang.srt.model_executor.model_runner\nLocalSerializedTensor\n."
    with pytest.raises(AttributeError):  # allow-listed, but 0.5.21 no longer defines it there
        S.deserialize(old_path)


def test_flattened_bucket_is_one_uint8_copy_with_byte_offsets():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    a, b = torch.randn(2, 3), torch.arange(4, dtype=torch.bfloat16)
    bucket = FlattenedTensorBucket(named_tensors=[("a", a), ("b", b.t())])
    flat = bucket.get_flattened_tensor()
    assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == 6 * 4 + 4 * 2
    meta = bucket.get_metadata()
    assert [(m.start_idx, m.end_idx, m.numel) for m in meta] == [(0, 24, 24), (24, 32, 8)]
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=flat, metadata=meta).reconstruct_tensors())
    assert torch.equal(rebuilt["a"], a) and torch.equal(rebuilt["b"], b)
    assert rebuilt["a"].data_ptr() == flat.data_ptr()  # views, not copies
    flat.zero_()
    assert not a.eq(0).all()  # the bucket is a copy of its inputs
    with pytest.raises(ValueError):
        FlattenedTensorBucket(named_tensors=[])


@pytest.mark.slow
def test_dtensor_is_blocked_and_patched_reductions_break_cpu_tensors():
    from hybrid_rl.runtime.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_dtensor_and_patch_probe, args=(free_port(), q))
    proc.start()
    result = q.get(timeout=240)
    proc.join(timeout=30)
    assert "Blocked unsafe global" in result["dtensor"]
    assert result["cpu_after_patch"] == "IndexError"


@pytest.mark.slow
def test_fd_handles_from_an_unrelated_process_need_its_authkey(tiny_model_dir, h):
    """Default "file_descriptor" strategy: only a process sharing the producer's multiprocessing
    authkey (its spawn descendants) may claim the fd. A torchrun sibling gets AuthenticationError."""
    from multiprocessing import AuthenticationError

    from sglang.srt.utils.common import MultiprocessingSerializer as S

    proc, payloads = h.start_unrelated_producer("file_descriptor", tiny_model_dir)
    try:
        with pytest.raises(AuthenticationError):
            S.deserialize(payloads[0])
    finally:
        proc.communicate("\n", timeout=60)


def test_engine_argument_errors(tiny_model_dir):
    import sglang

    with pytest.raises(TypeError, match="Unexpected keyword argument 'bogus'"):
        sglang.Engine(model_path=tiny_model_dir, bogus=1)
    with pytest.raises(TypeError, match="model_path"):
        sglang.Engine(tp_size=1)
    with pytest.raises(RuntimeError, match="CUDA"):
        sglang.Engine(model_path=tiny_model_dir, enable_memory_saver=True)
    assert sglang.__version__ == "0.5.21"


# -- tp_size=1 ------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_output_format(engine1):
    one = engine1.generate(
        input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 3, "ignore_eos": True}, return_logprob=True
    )
    assert isinstance(one, dict) and "text" not in one and len(one["output_ids"]) == 3
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["output_token_logprobs_length"]) == (4, 3, 3)
    assert {"id", "cached_tokens", "weight_version", "e2e_latency", "input_token_logprobs"} <= set(meta)
    assert all(
        isinstance(lp, float) and tok == t and text is None
        for (lp, tok, text), t in zip(meta["output_token_logprobs"], one["output_ids"])
    )
    batch = engine1.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 2, "n": 3})
    assert isinstance(batch, list) and len(batch) == 9
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [4, 4, 4, 2, 2, 2, 7, 7, 7]  # prompt-major
    assert [r["meta_info"]["cached_tokens"] for r in batch[:3]] == [3, 3, 3]  # the prompt is prefilled once
    assert "output_token_logprobs" not in batch[0]["meta_info"]
    per_prompt = engine1.generate(input_ids=PROMPTS[:2], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert [len(r["output_ids"]) for r in per_prompt] == [1, 2]
    # Default max_new_tokens is 128; without ignore_eos, EOS (from config.json) stops and is kept.
    for res in engine1.generate(input_ids=PROMPTS, sampling_params={}):
        reason, ids = res["meta_info"]["finish_reason"], res["output_ids"]
        assert (
            reason == {"type": "stop", "matched": EOS}
            and ids[-1] == EOS
            and EOS not in ids[:-1]
            or reason == {"type": "length", "length": 128}
            and len(ids) == 128
            and EOS not in ids
        )
    assert len(engine1.generate(input_ids=[5], sampling_params={"ignore_eos": True})["output_ids"]) == 128
    with pytest.raises(ValueError, match="top_p"):
        engine1.generate(input_ids=[5], sampling_params={"top_p": 0.0})
    with pytest.raises(TypeError):
        engine1.generate(input_ids=[5], sampling_params={"max_tokens": 3})
    with pytest.raises(ValueError):
        engine1.generate(prompt="1 2 =")  # no tokenizer with skip_tokenizer_init
    with pytest.raises(ValueError, match="min_new_tokens=2 is unavailable when skip_tokenizer_init=True"):
        engine1.generate(input_ids=[5], sampling_params={"min_new_tokens": 2})  # 0.5.21's normalize
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        engine1.generate(input_ids=[5], sampling_params={"min_new_tokens": -1})


@pytest.mark.slow
def test_stop_token_is_included(engine1):
    free = engine1.generate(
        input_ids=PROMPTS[2], sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    )["output_ids"]
    stop = free[2]
    cut = engine1.generate(
        input_ids=PROMPTS[2], sampling_params={"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop]}
    )
    assert cut["output_ids"] == free[: free.index(stop) + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.slow
def test_prompt_plus_new_tokens_over_the_context_fails_the_whole_call(engine1):
    """SGLang's request check: input + max_new_tokens >= the context length is a ValueError for
    the whole generate call (the tiny model's context is 256 tokens)."""
    ok = [5] * 200
    with pytest.raises(ValueError, match="exceeds the model's maximum context length of 256 tokens"):
        engine1.generate(input_ids=[PROMPTS[0], ok], sampling_params={"max_new_tokens": 56})
    assert len(engine1.generate(input_ids=[PROMPTS[0], ok], sampling_params={"max_new_tokens": 55})) == 2


def test_weight_update_session_rules(engine1, tiny_model_dir, h):
    weights = h.trainer_weights(tiny_model_dir)
    payload = [h.bucket_payload(weights, ["model.norm.weight"])]
    ok, msg = engine1.update_weights_from_tensor(payload, load_format="flattened_bucket")
    assert not ok and "begin_weight_update() and end_weight_update()" in msg
    assert engine1._debug_state()["ranks"][0]["payloads_opened"] == 0  # nothing was opened
    assert not engine1.end_weight_update()[0]
    assert engine1.begin_weight_update()[0]
    assert not engine1.begin_weight_update()[0]
    # 0.5.21 does not count the payloads: rank 0 opens payloads[0], and an extra one is never opened.
    extra = h.bucket_payload(weights, ["model.norm.weight"])
    assert engine1.update_weights_from_tensor(payload + [extra], load_format="flattened_bucket")[0]
    assert engine1.end_weight_update()[0]
    assert engine1._debug_state()["ranks"][0]["payloads_opened"] == 1


@pytest.mark.slow
def test_full_sync_matches_hf_and_opens_each_payload_once(engine1, tiny_model_dir, h):
    from sglang.srt.utils.common import MultiprocessingSerializer as S

    weights = h.trainer_weights(tiny_model_dir)
    before = engine1._debug_state()["ranks"][0]
    names = sorted(weights)
    mixed = {**weights, names[0]: weights[names[0]].double()}  # mixed-dtype bucket; copy_ casts back
    mixed["not.a.param"] = torch.ones(2)
    buckets = [[h.bucket_payload(mixed, names[:10] + ["not.a.param"])], [h.bucket_payload(weights, names[10:])]]
    h.sync(engine1, buckets)
    state = engine1._debug_state()["ranks"][0]
    assert state["payloads_opened"] - before["payloads_opened"] == 2
    assert state["names_skipped"] - before["names_skipped"] == 1  # unknown names are skipped silently
    assert state["all_params_loaded_since_release"]  # every parameter came from the trainer
    assert torch.equal(engine1._debug_get_param(names[0]), weights[names[0]])
    check_matches_hf(engine1, h.hf_model(tiny_model_dir, weights))
    with pytest.raises(EOFError):  # the fd was claimed by the scheduler; a second open fails
        S.deserialize(buckets[0][0])
    assert engine1.get_weights_by_name("model.norm.weight") is None  # Qwen2 in 0.5.21


@pytest.mark.slow
def test_released_weights_need_a_full_resync(engine1, tiny_model_dir, h):
    from sglang.fake_errors import WeightsNotLoadedError

    weights = h.trainer_weights(tiny_model_dir, seed=2)
    assert engine1.release_memory_occupation() is None  # None: all three tags
    assert engine1._debug_state()["ranks"][0]["offload_tags"] == ["cuda_graph", "kv_cache", "weights"]
    assert engine1.resume_memory_occupation(["cuda_graph"]) is None
    engine1.resume_memory_occupation(["weights"])
    names = sorted(weights)
    h.sync(engine1, [[h.bucket_payload(weights, names[:-3])]])  # a partial sync
    engine1.resume_memory_occupation(["kv_cache"])
    with pytest.raises(WeightsNotLoadedError, match="model.norm.weight"):
        engine1.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})
    state = engine1._debug_state()["ranks"][0]
    assert not state["all_params_loaded_since_release"] and len(state["params_not_loaded_since_release"]) == 3
    engine1._debug_pending_requests(1)
    assert engine1.flush_cache().success is False  # requests pending
    engine1._debug_pending_requests(0)
    assert engine1.flush_cache().success is True
    h.sync(engine1, [[h.bucket_payload(weights, names[-3:])]])
    assert engine1._debug_state()["ranks"][0]["all_params_loaded_since_release"]
    check_matches_hf(engine1, h.hf_model(tiny_model_dir, weights))


@pytest.mark.slow
def test_sync_from_a_sibling_process(engine1, tiny_model_dir, h):
    """Payloads serialized in another process spawned by this one (as tests/distributed ranks are)."""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    weights = h.trainer_weights(tiny_model_dir)
    proc = ctx.Process(target=h.sibling_producer, args=(tiny_model_dir, h.chunks(sorted(weights)), 1, q, done))
    proc.start()
    try:
        engine1.release_memory_occupation(["weights", "kv_cache"])
        engine1.resume_memory_occupation(["weights"])
        h.sync(engine1, q.get(timeout=240))
        engine1.resume_memory_occupation(["kv_cache"])
    finally:
        done.set()
        proc.join(timeout=60)
    check_matches_hf(engine1, h.hf_model(tiny_model_dir, weights))


@pytest.mark.slow
def test_sync_from_an_unrelated_process_with_file_system_strategy(engine1, tiny_model_dir, h):
    engine1.release_memory_occupation(["weights", "kv_cache"])
    engine1.resume_memory_occupation(["weights"])
    proc, payloads = h.start_unrelated_producer("file_system", tiny_model_dir)
    try:
        h.sync(engine1, [[p] for p in payloads])  # base64 text payloads
    finally:
        proc.communicate("\n", timeout=60)
    engine1.resume_memory_occupation(["kv_cache"])
    check_matches_hf(engine1, h.hf_model(tiny_model_dir, h.trainer_weights(tiny_model_dir)))


# -- event loops ----------------------------------------------------------------------------
def test_ensure_event_loop_takes_the_running_loop_as_0_5_21_and_0_5_17_do():
    """Engine construction keeps the loop every synchronous call later runs: inside a running loop,
    that loop, which then cannot run_until_complete ("already running")."""
    import asyncio

    from sglang.srt.entrypoints.engine import Engine, Engine0517

    async def cell():
        running = asyncio.get_running_loop()
        assert Engine._ensure_event_loop() is running and Engine0517._ensure_event_loop() is running
        pending = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="This event loop is already running"):
            running.run_until_complete(pending)
        pending.close()

    asyncio.run(cell())
    outside = Engine._ensure_event_loop()
    assert not outside.is_running() and Engine._ensure_event_loop() is outside  # this thread's loop, kept


def test_sync_calls_run_on_the_engines_own_loop(engine1):
    """An Engine built outside a loop fails inside another running loop, and works from a thread
    that runs none (where the adapter puts its calls inside a notebook cell)."""
    import asyncio
    import threading

    async def cell():
        return engine1.flush_cache()

    with pytest.raises(RuntimeError, match="Cannot run the event loop while another loop is running"):
        asyncio.run(cell())
    got = []
    thread = threading.Thread(target=lambda: got.append(engine1.flush_cache().success))
    thread.start()
    thread.join(timeout=120)
    assert got == [True]


@pytest.mark.slow
def test_resume_of_a_resident_tag_kills_the_engine(engine1):
    from sglang.fake_errors import EngineCrashed

    with pytest.raises(EngineCrashed, match="KeyError"):
        engine1.resume_memory_occupation(["kv_cache"])  # never released
    with pytest.raises(EngineCrashed):
        engine1.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})
    with pytest.raises(EngineCrashed):
        engine1.flush_cache()
    engine1.shutdown()
    engine1.shutdown()  # idempotent


# -- tp_size=2 ------------------------------------------------------------------------------
@pytest.mark.slow
def test_tp2_each_rank_gets_its_own_payload(engine2, tiny_model_dir, h):
    from sglang.fake_errors import RankMismatchError

    weights = h.trainer_weights(tiny_model_dir)
    h.full_sync(engine2, weights, tp=2)
    ranks = engine2._debug_state()["ranks"]
    assert [r["payloads_opened"] for r in ranks] == [2, 2]
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
    check_matches_hf(engine2, h.hf_model(tiny_model_dir, weights))
    # Rank 1 gets a different tensor: its outputs no longer agree with rank 0's.
    other = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] * 1.5})
    norm = ["model.norm.weight"]
    h.sync(engine2, [[h.bucket_payload(weights, norm), h.bucket_payload(other, norm)]])
    with pytest.raises(RankMismatchError):
        engine2.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 4})


@pytest.mark.slow
def test_tp2_local_serialized_tensors_and_plain_tensors(engine2, tiny_model_dir, h):
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils.common import MultiprocessingSerializer as S

    weights = h.trainer_weights(tiny_model_dir, seed=3)
    first, second = h.chunks(sorted(weights))
    named = [(n, LocalSerializedTensor(values=[S.serialize(weights[n].clone()) for _ in range(2)])) for n in first]
    named += [(n, weights[n].clone()) for n in second]  # the engine serializes these once per rank
    assert engine2.begin_weight_update()[0]
    assert engine2.update_weights_from_tensor(named, flush_cache=False)[0]
    assert engine2.end_weight_update()[0]
    ranks = engine2._debug_state()["ranks"]
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
    check_matches_hf(engine2, h.hf_model(tiny_model_dir, weights))
    # No flush after the update: the prompts hit prefixes cached under the old weights.
    assert engine2._debug_state()["ranks"][0]["stale_cache_hits"] > 0


@pytest.mark.slow
def test_tp2_payload_sent_twice_kills_the_engine(engine2, tiny_model_dir, h):
    from sglang.fake_errors import EngineCrashed

    weights = h.trainer_weights(tiny_model_dir)
    payloads = [h.bucket_payload(weights, ["model.norm.weight"]) for _ in range(2)]
    h.sync(engine2, [payloads])
    assert engine2.begin_weight_update()[0]
    with pytest.raises(EngineCrashed, match="opened"):
        engine2.update_weights_from_tensor(payloads, load_format="flattened_bucket")
    with pytest.raises(EngineCrashed):
        engine2.end_weight_update()


@pytest.mark.slow
def test_tp2_same_bytes_for_both_ranks_load_and_too_few_payloads_kill_the_engine(make_engine, tiny_model_dir, h):
    """0.5.21 checks neither: with file_system handles both ranks open one payload (as the real
    engine does on CPU; on a GPU it miscounts the CUDA-IPC refcount), and with one payload for two
    ranks, rank 1's deserialize_own_rank is an IndexError in its scheduler, which is fatal."""
    from sglang.fake_errors import EngineCrashed
    from sglang.srt.utils.common import MultiprocessingSerializer as S
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    engine = make_engine(tp_size=2)
    weights = h.trainer_weights(tiny_model_dir, seed=4)
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        # The producer keeps its buffers until the update returns, as the adapter does: each open
        # drops one reference the serialization added, so a second open needs the producer's.
        buckets = [
            FlattenedTensorBucket(named_tensors=[(n, weights[n].clone()) for n in names])
            for names in h.chunks(sorted(weights))
        ]
        payloads = [
            S.serialize({"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}) for b in buckets
        ]
        h.sync(engine, [[p, p] for p in payloads])  # the same bytes for both ranks
        ranks = engine._debug_state()["ranks"]
        assert [r["payloads_opened"] for r in ranks] == [2, 2]
        assert all(r["all_params_loaded_since_release"] for r in ranks)
        assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
        check_matches_hf(engine, h.hf_model(tiny_model_dir, weights))
        assert engine.begin_weight_update()[0]
        with pytest.raises(EngineCrashed, match="IndexError"):
            engine.update_weights_from_tensor(
                [h.bucket_payload(weights, ["model.norm.weight"])], load_format="flattened_bucket"
            )
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


# -- real weights, then a fatal generate ---------------------------------------------------------
@pytest.mark.slow
def test_checkpoint_weights_then_generate_after_release_crashes(make_engine, tiny_model_dir, h):
    from safetensors.torch import load_file
    from sglang.fake_errors import EngineCrashed

    engine = make_engine(tp_size=1, load_format="auto")
    check_matches_hf(engine, h.hf_model(tiny_model_dir, load_file(os.path.join(tiny_model_dir, "model.safetensors"))))
    engine.release_memory_occupation(["weights"])
    with pytest.raises(EngineCrashed, match="illegal memory access"):
        engine.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})
    engine.shutdown()


@pytest.mark.slow
def test_wrong_shape_kills_the_engine(make_engine, h):
    from sglang.fake_errors import EngineCrashed

    engine = make_engine(tp_size=1)
    assert engine.begin_weight_update()[0]
    payload = h.bucket_payload({"model.norm.weight": torch.ones(3)}, ["model.norm.weight"])
    with pytest.raises(EngineCrashed, match="does not match"):
        engine.update_weights_from_tensor([payload], load_format="flattened_bucket")
    with pytest.raises(EngineCrashed):
        engine.end_weight_update()


# -- LoRA (note section 9) --------------------------------------------------------------------
LORA_ARGS = dict(
    enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"], enable_weights_cpu_backup=True
)
LORA_CFG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}  # scaling 2
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def check_adapted(engine, model, lora_path, prompts=PROMPTS) -> list:
    """Greedy output and logprobs of `engine` under `lora_path` equal the HF `model`'s; returns the tokens."""
    from fake_sglang_helpers import hf_greedy, hf_logprobs

    out = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=lora_path, return_logprob=True)
    models = model if isinstance(model, list) else [model] * len(prompts)
    for prompt, res, m in zip(prompts, out, models):
        assert res["output_ids"] == hf_greedy(m, prompt, 8, EOS)
        lp = torch.tensor([x[0] for x in res["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(lp, hf_logprobs(m, prompt, res["output_ids"], 1.0), atol=1e-5, rtol=0)
    return [res["output_ids"] for res in out]


def test_lora_server_argument_errors(tiny_model_dir):
    import sglang

    with pytest.raises(AssertionError, match="both --max-lora-rank and --lora-target-modules"):
        sglang.Engine(model_path=tiny_model_dir, enable_lora=True, max_lora_rank=8)
    with pytest.raises(AssertionError, match="only module"):
        sglang.Engine(
            model_path=tiny_model_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["all", "q_proj"]
        )
    with pytest.raises(AssertionError, match="max_loras_per_batch"):
        sglang.Engine(model_path=tiny_model_dir, max_loras_per_batch=0)


@pytest.fixture(scope="module")
def lora_engine(make_engine, tiny_model_dir, h):
    engine = make_engine(tp_size=1, **LORA_ARGS)
    weights = h.trainer_weights(tiny_model_dir, seed=3)
    h.full_sync(engine, weights, tp=1)
    return engine, weights


@pytest.mark.slow
def test_lora_adapter_applies_to_its_requests_only(lora_engine, tiny_model_dir, h):
    engine, weights = lora_engine
    lora = h.lora_tensors(weights, rank=4, targets=("q_proj", "v_proj"))
    res = engine.load_lora_adapter_from_tensors("a1", {n: t.clone() for n, t in lora.items()}, LORA_CFG)
    assert res.success and res.loaded_adapters == {"a1": "__tensor__"}, res
    base, adapted = (
        h.hf_model(tiny_model_dir, weights),
        h.hf_model(tiny_model_dir, h.merged_weights(weights, lora, 2.0)),
    )
    mixed = check_adapted(engine, [adapted, base, adapted], ["a1", None, "a1"])
    plain = check_adapted(engine, base, None)
    assert mixed[0] != plain[0] and mixed[2] != plain[2], "the adapter must change the greedy tokens"
    # The trainer's route: one flattened payload per TP rank, a new name each time, then the old one unloaded.
    assert engine.load_lora_adapter_from_tensors(
        "a2", [h.bucket_payload(lora, sorted(lora))], LORA_CFG, load_format="flattened_bucket"
    ).success
    assert engine.unload_lora_adapter("a1").success
    check_adapted(engine, adapted, "a2")
    with pytest.raises(ValueError, match="__tensor__"):  # its implicit reload reads the placeholder path
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a1")
    with pytest.raises(ValueError, match="never been loaded"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=["a2", "zz", None])
    assert engine.unload_lora_adapter("a2").success


@pytest.mark.slow
def test_lora_loads_refused_as_0_5_21_refuses_them(lora_engine, make_engine, h):
    engine, weights = lora_engine
    lora = h.lora_tensors(weights, rank=4, targets=("q_proj", "v_proj"))
    fresh = lambda: {n: t.clone() for n, t in lora.items()}  # noqa: E731 - serializing moves a tensor into shm
    assert engine.load_lora_adapter_from_tensors("r1", fresh(), LORA_CFG).success
    cases = [
        ("r1", LORA_CFG, "already loaded"),
        ("r2", {**LORA_CFG, "r": 16}, "incompatible"),
        ("r3", {**LORA_CFG, "target_modules": ["q_proj", "o_proj"]}, "incompatible"),
        ("r4", {"r": 4, "target_modules": ["q_proj"]}, "lora_alpha"),
        ("r5", {**LORA_CFG, "use_dora": True}, "DoRA"),
    ]
    for name, cfg, msg in cases:
        res = engine.load_lora_adapter_from_tensors(name, fresh(), cfg)
        assert not res.success and msg in res.error_message, (name, res)
    assert not engine.unload_lora_adapter("r9").success
    assert engine.unload_lora_adapter("r1").success
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]  # still alive
    plain = make_engine(tp_size=1)  # LoRA off (engine1 is dead by now: its crash test ran)
    off = plain.load_lora_adapter_from_tensors("x", fresh(), LORA_CFG)
    assert not off.success and "not enabled" in off.error_message
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="x")
    plain.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("backup", [True, False])
def test_adapters_survive_release_the_base_only_with_cpu_backup(make_engine, tiny_model_dir, h, backup):
    from sglang.fake_errors import WeightsNotLoadedError

    engine = make_engine(tp_size=1, **{**LORA_ARGS, "enable_weights_cpu_backup": backup})
    weights = h.trainer_weights(tiny_model_dir, seed=4)
    h.full_sync(engine, weights, tp=1)
    lora = h.lora_tensors(weights, rank=4, targets=("q_proj", "v_proj"), seed=1)
    assert engine.load_lora_adapter_from_tensors("p", lora, LORA_CFG).success
    engine.release_memory_occupation(["kv_cache", "weights"])
    engine.resume_memory_occupation(["weights"])
    engine.resume_memory_occupation(["kv_cache"])
    adapted = h.hf_model(tiny_model_dir, h.merged_weights(weights, lora, 2.0))
    if not backup:
        with pytest.raises(WeightsNotLoadedError):  # the base is gone ...
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="p")
        h.full_sync(engine, weights, tp=1)  # ... and only the base comes back: the adapter never left
    check_adapted(engine, adapted, "p")
    engine.shutdown()


@pytest.mark.slow
def test_wrong_adapter_shape_loads_and_kills_the_engine_at_first_use(make_engine, tiny_model_dir, h):
    from sglang.fake_errors import EngineCrashed

    engine = make_engine(tp_size=1, **LORA_ARGS)
    lora = h.lora_tensors(h.trainer_weights(tiny_model_dir), rank=4, targets=("q_proj",))
    name = next(n for n in sorted(lora) if ".lora_A." in n)
    lora[name] = lora[name][:, :-1]  # one input column short
    assert engine.load_lora_adapter_from_tensors("bad", lora, LORA_CFG).success  # shapes are not checked here
    with pytest.raises(EngineCrashed, match="shape"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="bad")
    engine.shutdown()


# -- streaming and aborts (note section 10) ---------------------------------------------------------
LONG_GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def stream_engine(make_engine, tiny_model_dir, h):
    """A synced engine of its own (engine1 is crashed by then); its last test crashes it too."""
    engine = make_engine(tp_size=1)
    h.full_sync(engine, h.trainer_weights(tiny_model_dir), tp=1)
    return engine


def _final(items: list) -> dict:
    """index -> the last item of each request in a streamed batch (the one with its finish_reason)."""
    return {it["index"]: it for it in items if it["meta_info"]["finish_reason"] is not None}


def test_a_streamed_batch_yields_items_as_0_5_21_does(stream_engine):
    """generate(stream=True): nothing is sent before the first item; an item per request every stream_interval tokens
    (at output length % k == 1 for k > 1, every token for the server's default 1) and at its finish, "index" its
    place in the batch, finish_reason None until the last, whose output equals the unstreamed call's; rids as given
    (a str: "<rid>_<i>"), refused when duplicated or not one per prompt."""
    engine = stream_engine
    params = [{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "stream_interval": k} for k in (4, None)]
    whole = engine.generate(input_ids=PROMPTS[:2], sampling_params=params, return_logprob=True)
    lazy = engine.generate(input_ids=PROMPTS[:2], sampling_params=params, stream=True, rid=["a", "b"])
    assert engine.tokenizer_manager.rid_to_state == {} and engine.flush_cache().success, "nothing sent yet"
    items = list(
        engine.generate(input_ids=PROMPTS[:2], sampling_params=params, return_logprob=True, stream=True, rid="r")
    )
    del lazy
    lengths = {i: [len(it["output_ids"]) for it in items if it["index"] == i] for i in (0, 1)}
    assert lengths == {0: [1, 5, 6], 1: [1, 2, 3, 4, 5, 6]}
    assert all(it["meta_info"]["finish_reason"] is None for it in items if len(it["output_ids"]) < 6)
    final = _final(items)
    for i in (0, 1):
        assert final[i]["meta_info"]["id"] == f"r_{i}" and final[i]["meta_info"]["finish_reason"]["type"] == "length"
        assert final[i]["output_ids"] == whole[i]["output_ids"]
        assert final[i]["meta_info"]["output_token_logprobs"] == whole[i]["meta_info"]["output_token_logprobs"]
        assert "e2e_latency" in final[i]["meta_info"]
    assert engine.tokenizer_manager.rid_to_state == {}
    with pytest.raises(ValueError, match="Duplicate request IDs"):
        next(engine.generate(input_ids=PROMPTS[:2], sampling_params=params, stream=True, rid=["x", "x"]))
    with pytest.raises(ValueError, match="rids length mismatch"):
        next(engine.generate(input_ids=PROMPTS[:2], sampling_params=params, stream=True, rid=["x"]))


def test_an_aborted_running_request_keeps_its_tokens_and_one_more(stream_engine):
    """tokenizer_manager.abort_request(rid): a running request samples one more token after the abort reaches the
    scheduler and finishes FINISH_ABORT().to_json() with every token (the uninterrupted greedy prefix) and its
    log-probs; the scheduler matches rids by prefix ("r_1" aborts "r_10" too); an empty or unknown rid does nothing.
    The engine is idle afterwards."""
    engine = stream_engine
    prompts = [PROMPTS[i % 3] for i in range(11)]
    whole = engine.generate(input_ids=prompts, sampling_params=LONG_GREEDY, return_logprob=True)
    engine._debug_step_delay(0.05)
    try:
        engine.tokenizer_manager.abort_request(rid="")
        engine.tokenizer_manager.abort_request(rid="r_3")  # not in flight: dropped
        seen = {}
        stream = engine.generate(
            input_ids=prompts,
            sampling_params={**LONG_GREEDY, "stream_interval": 1},
            return_logprob=True,
            stream=True,
            rid="r",
        )
        items = []
        for it in stream:
            items.append(it)
            seen[it["index"]] = len(it["output_ids"])
            if it["index"] == 1 and len(it["output_ids"]) == 2:
                engine.tokenizer_manager.abort_request(rid="r_1")
    finally:
        engine._debug_step_delay(0.0)
    final = _final(items)
    aborted = {i for i, it in final.items() if it["meta_info"]["finish_reason"]["type"] == "abort"}
    assert aborted == {1, 10}
    assert final[1]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    for i, it in final.items():
        n = len(it["output_ids"])
        assert n == 40 if i not in aborted else 3 <= n < 40
        assert it["output_ids"] == whole[i]["output_ids"][:n]
        assert it["meta_info"]["output_token_logprobs"] == whole[i]["meta_info"]["output_token_logprobs"][:n]
    assert engine.tokenizer_manager.rid_to_state == {} and engine.flush_cache().success


def test_a_release_while_a_streams_requests_run_kills_the_engine(stream_engine):
    """A stream left unread keeps its requests running in the scheduler: flush_cache refuses, and a release fails
    the scheduler's idle assertion, which kills the caller on SGLang (EngineCrashed here). Kills stream_engine."""
    from sglang.fake_errors import EngineCrashed

    engine = stream_engine
    engine._debug_step_delay(0.05)
    stream = engine.generate(input_ids=PROMPTS, sampling_params=LONG_GREEDY, stream=True)
    assert next(stream)["meta_info"]["finish_reason"] is None
    refused = engine.flush_cache()
    assert not refused.success and "3 requests are running" in refused.message
    with pytest.raises(EngineCrashed, match="fully idle"):
        engine.release_memory_occupation(["kv_cache"])
