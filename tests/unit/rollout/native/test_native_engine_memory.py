"""The native engine's memory cap: the decode batch and the prefill chunk come from the free memory
(`rollout_memory.native_budget`, the planner's arithmetic), and a capped rollout gives the tokens of
one big batch. On CPU the free memory is injected (`free_memory=`); on CUDA it is measured.

Legend: N sequences, P prompt tokens, T new tokens, S = P + T - 1 cache slots.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_rl.models.loading import model_config
from hybrid_rl.plan.memory import ModelArch, builtin_arch
from hybrid_rl.plan.rollout_memory import (
    RolloutShape,
    budget_for,
    decode_row_bytes,
    kv_row_bytes,
    native_budget,
    prefill_prompt_bytes,
)
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import SamplingParams
from tests.unit.rollout.native.test_native_engine_speedups import MANY, PROMPTS, Recorder, assert_logprobs_match_trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
QWEN7B = RolloutShape.of(builtin_arch("Qwen2.5-7B"))  # h 3584, I 18944, 28 layers, 28 heads, 4 kv, d 128, V 152064


# ---------------------------------------------------------------------------- the arithmetic, by hand
def test_bill_of_a_7b_rollout_by_hand():
    """Qwen2.5-7B, bf16, P = 512, T = 1024 (S = 1535): every part against the docstring's formula."""
    b, P, T, S = 2, 512, 1024, 1535
    assert kv_row_bytes(QWEN7B, b, S) == 2 * 28 * 4 * 128 * 2 * 1535 == 88_023_040
    # prefill, per token: 2 * (3 * 18944 + 6 * 3584 + (28 + 8) * 128) + 8 * 3584 = 194,560; + the first logits row.
    assert prefill_prompt_bytes(QWEN7B, b, P) == 512 * 194_560 + 152_064 * 2 == 99_918_848
    # eager attention adds the full fp32 score matrix: 28 heads x 512 x 512 x (8 + 4)
    assert prefill_prompt_bytes(QWEN7B, b, P, eager_attention=True) == 99_918_848 + 28 * 512 * 512 * 12
    row = decode_row_bytes(QWEN7B, b, S, T, top_p=False, graphs=True)
    assert row["sampling"] == 152_064 * (2 + 8) == 1_520_640
    assert decode_row_bytes(QWEN7B, b, S, T, top_p=True, graphs=True)["sampling"] == 152_064 * 34
    assert row["decode_step"] == 28 * 1535 * 14 + 152_064 * 2 + 8 * 3584 + 2 * (3 * 18944 + 6 * 3584 + 36 * 128)
    assert row["graph_pools"] == 2 * 152_064 * 2
    assert decode_row_bytes(QWEN7B, b, S, T, top_p=False, graphs=False)["graph_pools"] == 0
    assert row["bookkeeping"] == 4 * 1535 * 128 * 2 + 12 * 1024 + 1535
    bud = budget_for(QWEN7B, "bf16", 320, 64, P, T, top_p=False, graphs=True)
    assert bud.kv_cache == 320 * 88_023_040 and bud.prefill == 64 * 99_918_848
    assert bud.sampling == 320 * 1_520_640
    assert bud.working == max(bud.prefill, bud.sampling + bud.decode_step + bud.graph_pools + bud.bookkeeping)
    assert bud.peak == bud.kv_cache + bud.working


def test_batch_cap_is_the_most_rows_the_free_memory_holds():
    b, P, T, S = 2, 512, 1024, 1535
    kv = kv_row_bytes(QWEN7B, b, S)
    dec = sum(decode_row_bytes(QWEN7B, b, S, T, top_p=False, graphs=True).values())
    one = prefill_prompt_bytes(QWEN7B, b, P)
    # 600 rows' worth of memory for 640 wanted: two balanced batches of 320, not 600 + 40.
    free = 600 * (kv + dec) + 123
    bud = native_budget(QWEN7B, "bf16", free, 640, P, T, top_p=False, graphs=True, samples_per_prompt=5)
    assert bud.rows == 320
    # The prefill gets what the 320 rows' cache leaves, but never more than their 64 distinct prompts.
    assert bud.prefill_rows == min(64, (free - 320 * kv) // one) == 64
    assert bud.peak <= free
    # 30 GB: 30e9 // (kv + dec) = 323 rows (the prefill bound, (30e9 - one) // kv = 339, is looser): two
    # batches of 320, and their cache leaves (30e9 - 320 kv) // one = 18 prompts per prefill chunk.
    assert dec == 4_814_967 and one == 99_918_848
    bud = native_budget(QWEN7B, "bf16", 30 * 10**9, 640, P, T, top_p=False, graphs=True, samples_per_prompt=5)
    assert (bud.rows, bud.prefill_rows) == (320, 18) and bud.peak <= 30 * 10**9
    # 10 rows' cache and one prompt's prefill: 10 rows; one byte less and the prefill binds: 9 rows.
    assert native_budget(QWEN7B, "bf16", 10 * kv + one, 640, P, T, top_p=False).rows == 10
    bud = native_budget(QWEN7B, "bf16", 10 * kv + one - 1, 640, P, T, top_p=False)
    assert (bud.rows, bud.prefill_rows) == (9, 1)
    # Everything fits: one batch, the whole wanted rows.
    assert native_budget(QWEN7B, "bf16", 10**15, 640, P, T).rows == 640
    # Not one row with its prefill: rows 0, which the engine turns into an error.
    assert native_budget(QWEN7B, "bf16", kv + one - 1, 640, P, T).rows == 0
    # More free memory never means fewer rows.
    caps = [native_budget(QWEN7B, "bf16", g * 10**9, 640, P, T).rows for g in range(1, 80, 3)]
    assert caps == sorted(caps) and caps[0] < caps[-1] == 640


# ---------------------------------------------------------------------------- the engine, capped
def _per_row(model, P: int, T: int, top_p: bool = False) -> tuple[int, int, int]:
    shape = RolloutShape.of(ModelArch.from_hf_config(model_config(model).to_dict()))
    S, b = P + T - 1, 4
    return (
        kv_row_bytes(shape, b, S),
        sum(decode_row_bytes(shape, b, S, T, top_p, graphs=False).values()),
        prefill_prompt_bytes(shape, b, P),
    )


@pytest.mark.parametrize("greedy", [True, False])
def test_engine_decodes_in_batches_of_at_most_the_cap_with_the_same_tokens(sharp_model, greedy):
    T = 8
    sp = SamplingParams(max_new_tokens=T, greedy=greedy, seed=11, temperature=0.9)
    whole = NativeEngine(sharp_model, PAD, EOS).generate(MANY, sp)
    kv, dec, one = _per_row(sharp_model, max(map(len, PROMPTS)), T)
    free = 5 * (kv + dec) + 7  # room for 5 rows of 16: four balanced batches of 4
    assert free - one >= 5 * kv
    eng = NativeEngine(sharp_model, PAD, EOS, free_memory=lambda dev: free)
    with Recorder(sharp_model) as rec:
        capped = eng.generate(MANY, sp)
    assert eng.last_batch_rows == 4
    assert max(s[0] for s in rec.shapes) <= 4 and len(rec.shapes) > T  # several batches ran
    # A sequence samples with its own uniforms whichever batch it lands in: the same tokens as one batch.
    assert [c.token_ids for c in capped] == [c.token_ids for c in whole]
    for a, b in zip(capped, whole):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert_logprobs_match_trainer(sharp_model, MANY, capped, sp.temperature)


def test_prefill_runs_in_chunks_of_prompts_that_fit(sharp_model):
    prompts = [
        [5, 6, 7, 14],
        [8, 14],
        [11, 12, 13, 4, 5, 6, 14],
        [9, 9, 14],
        [4, 14],
        [6, 6, 6, 14],
        [12, 14],
        [13, 5, 14],
    ]  # 8 distinct prompts
    T = 6
    sp = SamplingParams(max_new_tokens=T, seed=2)
    kv, dec, one = _per_row(sharp_model, 7, T)
    free = 8 * kv + max(3 * one, 8 * dec)  # all 8 rows, and 3 prompts' prefill beside their cache
    assert free - 8 * kv < 4 * one and free >= 8 * (kv + dec)
    eng = NativeEngine(sharp_model, PAD, EOS, free_memory=lambda dev: free, stop_check_every=T)  # no row dropped
    with Recorder(sharp_model) as rec:
        got = eng.generate(prompts, sp)
    assert (eng.last_batch_rows, eng.last_prefill_rows) == (8, 3)
    k = eng.last_prefill_forwards  # the prefill: chunks of at most 3 prompts (in length buckets)
    assert k >= 3 and all(s[0] <= 3 for s in rec.shapes[:k]) and sum(s[0] for s in rec.shapes[:k]) == 8
    assert rec.shapes[k:] == [(8, 1)] * (T - 1)  # then one decode batch of all 8 rows
    ref = NativeEngine(sharp_model, PAD, EOS).generate(prompts, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert_logprobs_match_trainer(sharp_model, prompts, got, 1.0)


def test_a_batch_kv_cache_is_freed_before_the_next_batch_without_the_cyclic_collector(sharp_model, monkeypatch):
    """Catches: the cache and its layers referring to each other. In a reference cycle the buffers outlive their
    batch until Python's cyclic collector happens to run, so the next batch's cache (and prefill) is allocated
    beside the last one, which the rollout bill does not count: on an H200 a 96-prompt rollout capped at two
    batches of 48 measured the bill plus one batch's cache (67.2 MiB against 63.0). Collector off, each batch's
    cache must already be gone when the next one is made, and the last when generate returns."""
    import gc
    import weakref

    from hybrid_rl.rollout.native.kv_cache import StaticKVCache

    made, alive_at_new = [], []
    real_init = StaticKVCache.__init__

    def init(self, *a, **k):
        alive_at_new.append(sum(r() is not None for r in made))
        real_init(self, *a, **k)
        made.append(weakref.ref(self))

    monkeypatch.setattr(StaticKVCache, "__init__", init)
    eng = NativeEngine(sharp_model, PAD, EOS, max_batch_size=4)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        eng.generate(MANY, SamplingParams(max_new_tokens=4, seed=3))
        left = sum(r() is not None for r in made)
    finally:
        if was_enabled:
            gc.enable()
    assert len(made) == 4 and alive_at_new == [0, 0, 0, 0] and left == 0


def test_max_batch_size_still_caps_below_the_memory(sharp_model):
    eng = NativeEngine(sharp_model, PAD, EOS, max_batch_size=3, free_memory=lambda dev: 10**12)
    eng.generate(MANY, SamplingParams(max_new_tokens=3, greedy=True))
    # 16 rows, at most 3: balanced into ceil(16 / 3) = 6 batches of ceil(16 / 6) = 3
    assert eng.last_batch_rows == 3


def test_no_room_for_one_sequence_says_what_to_change(sharp_model):
    eng = NativeEngine(sharp_model, PAD, EOS, free_memory=lambda dev: 1000)
    with pytest.raises(RuntimeError, match=r"not even one sequence.*offload.optimizer=true.*max_new_tokens"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=4))


def test_off_cuda_nothing_is_capped_by_default(sharp_model):
    eng = NativeEngine(sharp_model, PAD, EOS)
    eng.generate(MANY, SamplingParams(max_new_tokens=2))
    assert (eng.last_batch_rows, eng.last_prefill_rows) == (len(MANY), len(MANY))
    assert math.isclose(eng.act_bytes, torch.float32.itemsize)


def test_measured_free_memory_leaves_out_the_free_pieces_of_used_segments(monkeypatch):
    """On CUDA the cap plans with the device's free bytes plus the cached segments wholly unused: the
    free pieces of a segment that still holds a live block (inactive_split_bytes) hold no KV cache."""
    from hybrid_rl.plan.rollout_memory import HEADROOM
    from hybrid_rl.rollout.native import decode_path

    GiB = 2**30
    stats = {
        "reserved_bytes.all.current": 10 * GiB,
        "allocated_bytes.all.current": 4 * GiB,
        "inactive_split_bytes.all.current": 5 * GiB,
    }  # 1 GiB in wholly free segments
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)

    class Cuda:
        type = "cuda"

    assert decode_path.device_free_bytes(Cuda()) == 21 * GiB - int(HEADROOM * 80 * GiB)
    assert decode_path.plannable_bytes(1 * GiB, 80 * GiB, stats, 0.5) == 0  # never negative
    assert decode_path.plannable_bytes(3 * GiB, 8 * GiB, {}, 0.0) == 3 * GiB  # allocator not started yet
