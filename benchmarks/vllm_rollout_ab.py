"""What the vLLM adapter's rollout costs, piece by piece: its generate against variants of it, in one process.

The tiny bench model of grpo_step.py (digits vocabulary, hidden 128, 2 layers, random init), one vLLM
engine, P prompts x G samples x T new tokens (default 32 x 8 x 32, a GRPO step's rollout; EOS ignored, so
every variant generates the same number of tokens). Variants, each one call of the same engine:

  adapter        VLLMEngine.generate as shipped (one seeded stream per call, FlatLogprobs)
  request_seeds  the same with a vLLM `seed=` per request (a torch.Generator per row in vLLM's sampler)
  dict_logprobs  the same with vLLM's default logprobs (a dict and a Logprob object per token)
  old            both, and a SamplingParams object per prompt: the adapter before this change
  no_logprobs    no logprobs at all (a lower bound; the adapter needs them)

The variants run in rounds, in alternating order, so a shared, noisy machine slows them alike; the table
gives each one's median seconds and the median of its per-round ratio to `old`. --profile VARIANT prints
cProfile's top functions for that variant (run with 1 thread: with 2, cProfile distorts the OpenMP kernels).

    OMP_NUM_THREADS=1 python benchmarks/vllm_rollout_ab.py [--rounds 12] [--profile adapter]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from typing import Optional

import torch
import vllm_bench  # noqa: F401  (sets vLLM's log stream before vLLM is imported)

VARIANTS = ("adapter", "request_seeds", "dict_logprobs", "old", "no_logprobs")


def variant_call(engine, prompts, params, request_seeds: bool, flat: bool, shared: bool, logprobs: Optional[int] = 0):
    """The adapter's generate (tp 1) with its choices toggled: -> list of (token_ids, logprobs)."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    from hybrid_rl.rollout.vllm import setup as S
    from hybrid_rl.rollout.vllm.engine import to_completion

    stop = engine._stop_ids(params)
    kw = dict(
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        stop_token_ids=stop,
        logprobs=logprobs,
        flat_logprobs=flat,
        detokenize=False,
    )
    if request_seeds:
        sampling = [VSP(seed=params.seed * 1_000_003 + i, **kw) for i in range(len(prompts))]
    else:
        sampling = [VSP(**kw)] * len(prompts) if shared else [VSP(**kw) for _ in prompts]
    with S.sampling_stream(params.seed, engine.device):
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    if logprobs is None:
        return [(list(o.outputs[0].token_ids), []) for o in outs]
    return [(c.token_ids, c.logprobs) for c in (to_completion(o.outputs[0], i, stop) for i, o in enumerate(outs))]


def runners(engine, prompts, params):
    """name -> a no-argument call."""

    def adapter():
        return [(c.token_ids, c.logprobs) for c in engine.generate(prompts, params)]

    return {
        "adapter": adapter,
        "request_seeds": lambda: variant_call(engine, prompts, params, True, True, True),
        "dict_logprobs": lambda: variant_call(engine, prompts, params, False, False, True),
        "old": lambda: variant_call(engine, prompts, params, True, False, False),
        "no_logprobs": lambda: variant_call(engine, prompts, params, False, True, True, logprobs=None),
    }


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", choices=VARIANTS, default=None)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="start vLLM with enforce_eager=False (on CPU: its dynamo + inductor trace, as TRL's engine)",
    )
    a = ap.parse_args(argv)

    from hybrid_rl.data.digits import DIGIT_WORDS, digits_rows
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.models.tiny import build_tiny_model_dir
    from hybrid_rl.types import SamplingParams

    model_dir = build_tiny_model_dir(
        os.path.join(tempfile.mkdtemp(prefix="vllm_ab_"), "tiny_qwen2"),
        DIGIT_WORDS,
        hidden_size=128,
        num_layers=2,
        seed=0,
    )
    tok, model = load_tokenizer(model_dir), load_causal_lm(model_dir)
    prompts = [tok(r["prompt"])["input_ids"] for r in digits_rows(a.prompts, 0) for _ in range(a.samples)]
    max_len = max(map(len, prompts)) + a.new_tokens
    cfg = copy.deepcopy(model.config)
    cfg.eos_token_id = None  # vLLM then knows no EOS (config.json only), and eos_id -1: no row stops early
    engine = vllm_bench.synced_engine(
        model,
        vllm_bench.config_dir(cfg, type(model).__name__),
        max_len,
        len(prompts),
        engine_kwargs={"enforce_eager": False} if a.compile else None,
    )
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, seed=1)
    run = runners(engine, prompts, params)
    same = run["adapter"]() == run["dict_logprobs"]()  # one stream, two logprob readers: the same numbers
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(a.warmup + a.rounds):
        for k in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            t0 = time.perf_counter()
            out = run[k]()
            if r >= a.warmup:
                times[k].append(time.perf_counter() - t0)
            assert sum(len(t) for t, _ in out) == len(prompts) * a.new_tokens, f"{k}: every row must decode T tokens"
    rows = {
        k: {
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "ratio_to_old": statistics.median(t / o for t, o in zip(ts, times["old"])),
        }
        for k, ts in times.items()
    }
    print(
        f"vLLM rollout, {a.prompts} prompts x {a.samples} samples x {a.new_tokens} tokens, {torch.get_num_threads()} "
        f"threads, {a.rounds} rounds; ratio_to_old = median of per-round ratios"
    )
    print(f"{'variant':14s} {'median_s':>9s} {'min_s':>8s} {'ratio_to_old':>12s}")
    for k, v in rows.items():
        print(f"{k:14s} {v['median_s']:9.4f} {v['min_s']:8.4f} {v['ratio_to_old']:12.3f}")
    load = os.getloadavg()
    print(
        f"adapter == dict_logprobs (tokens and logprobs): {same}; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            run[a.profile]()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
    engine.shutdown()
    result = {
        "variants": rows,
        "adapter_equals_dict_logprobs": same,
        "loadavg": list(load),
        "args": vars(a),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
