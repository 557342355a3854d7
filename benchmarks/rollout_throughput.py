"""Decode throughput of the native rollout engine: the previous decode loop and the current one, in one run.

For each model (random weights from a Qwen2 config, nothing downloaded), each
completion length T and each scenario, both paths generate for the same batch of
prompts, one after the other, and the table shows generated tokens per second:

  old  the loop as it was before the static cache (kept here, `legacy_generate`, for
       this comparison only): a growing DynamicCache, a host sync every token, every
       row decoded until the last one stops, multinomial over a masked softmax;
  new  NativeEngine.generate: preallocated cache, stop checks (every token on CPU, every 8
       on CUDA), finished rows dropped, sort-free sampling; the one-token step as a CUDA
       graph on CUDA, elsewhere through the lean step (`rollout/native/lean_step.py`);
  forward  the same engine with the lean step off (lean_step=False): each token through
       the model's Hugging Face forward (`--paths old,forward,new` to include it);
  lean the same engine with CUDA graphs off (cuda_graphs=False, `rollout.cuda_graphs=false`): the lean
       step run eagerly, what `new` is on CPU; on CUDA `--paths lean,new` measures eager against graphs
       (graphs read every cache slot up to the longest row each step and are captured per batch);
  vllm the vLLM engine (rollout/vllm/engine.py, `--paths new,vllm`): an in-process vllm.LLM holding
       the same weights (synced once), eager on CPU; its prefill is timed as a 1-token generate.

Scenarios: `full`, no stop token (every row decodes T tokens, the same work in both
paths); `ragged`, a block of the vocabulary is a stop set so that a row stops with
probability ~4/T per token (random weights give a near-uniform softmax): lengths are
geometric with mean ~T/4 and a long tail, as in RL rollouts. The two paths sample with
different random streams, so their ragged lengths differ by chance: tokens/s counts
the tokens each actually generated.

On a GPU the `new` rows also show the fraction of the HBM roofline: useful bytes read
per decode step (all weights once, plus the KV cache of the rows still running at
their current length, left padding not counted) over the measured step time, against
--peak-tbs (looked up by GPU name: H100 SXM 3.35, H100 PCIe 2.0, H100 NVL 3.9, H200 4.8 TB/s).

    python benchmarks/rollout_throughput.py                     # CPU, ~2-3 minutes
    python benchmarks/rollout_throughput.py --device cuda --models 0.1b,0.5b --new-tokens 128,512
    python benchmarks/rollout_throughput.py --device cuda --models 1.5b --batch 64,512 --new-tokens 512 --paths lean,new

Prints a human table, then one JSON object as the last line. `main(argv) -> dict`.
Legend: N sequences (the batch), P prompt tokens, T new tokens, V vocab.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch
import vllm_bench
from phase_swap import hardware, sync  # run as a script: benchmarks/ is on sys.path

from hybrid_rl.models.logprobs import left_pad, position_ids
from hybrid_rl.rollout.native.decode_loop import to_completions
from hybrid_rl.rollout.native.engine import NativeEngine, check_every, filter_logits
from hybrid_rl.types import Completion, SamplingParams

# name -> (hidden, layers, intermediate, heads, KV heads); vocab from --vocab, tied embeddings.
MODELS = {
    "tiny": (128, 2, 512, 4, 2),
    "0.1b": (1024, 8, 2816, 16, 4),  # 123M parameters at V = 32000, as benchmarks/phase_swap.py
    "0.5b": (896, 24, 4864, 14, 2),  # Qwen2.5-0.5B's shape (GPU)
    "1.5b": (1536, 28, 8960, 12, 2),  # Qwen2.5-1.5B's shape (GPU; benchmarks/gpu_session.sh)
}
# HBM peak by GPU name; the first key found in torch.cuda.get_device_name wins.
PEAK_TBS = {"H200": 4.8, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35}
PAD = 0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--models", default="tiny,0.1b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument(
        "--new-tokens",
        default=None,
        help="comma list of T per model 'tiny:32,128;0.1b:32' or one list for all "
        "(default: CPU tiny 32,128 and 0.1b 16; CUDA 128,512 for every model)",
    )
    p.add_argument("--scenarios", default="full,ragged")
    p.add_argument("--paths", default="old,new", help="comma list of old, forward, lean, new, vllm")
    p.add_argument("--batch", default="64", help="N, or a comma list of N (each a case of its own)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="P: prompts have P/2..P tokens, left-padded (default: CPU 16, CUDA 128)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="V (default: Qwen2.5's 151936 on CUDA, so the 0.5b model has its real head; 32000 on CPU)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="timed generate calls per case (median), after one warm-up per model"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads; default 1 on CPU (shared machine), torch's on CUDA"
    )
    p.add_argument("--peak-tbs", type=float, default=None, help="HBM peak in TB/s (default: looked up for H100/H200)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batch = [int(n) for n in str(args.batch).split(",")]
    if min(args.batch) <= 0 or (args.prompt_len or 2) <= 1 or args.repeats <= 0:
        p.error("--batch and --repeats must be > 0, --prompt-len > 1")
    args.models = args.models.split(",")
    if bad := [m for m in args.models if m not in MODELS]:
        p.error(f"unknown model(s) {bad}; valid: {sorted(MODELS)}")
    args.scenarios, args.paths = args.scenarios.split(","), args.paths.split(",")
    if bad := [x for x in args.paths if x not in ("old", "forward", "lean", "new", "vllm")]:
        p.error(f"unknown path(s) {bad}; valid: old, forward, lean, new, vllm")
    return args


def lengths_for(args: argparse.Namespace, model: str, device: torch.device) -> list[int]:
    if args.new_tokens is None:
        if device.type == "cuda":
            return [128, 512]
        return {"tiny": [32, 128], "0.1b": [16]}.get(model, [16])
    spec = args.new_tokens
    if ":" in spec:
        per = dict(part.split(":") for part in spec.split(";"))
        spec = per.get(model, "16")
    return [int(x) for x in spec.split(",")]


def build_model(name: str, vocab: int, dtype: torch.dtype, device: torch.device, max_len: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, inter, heads, kv_heads = MODELS[name]
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=True,
        max_position_embeddings=max(512, max_len),
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1.5B model's init on the host takes a minute
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


@torch.no_grad()
def legacy_generate(model, prompts: list[list[int]], sp: SamplingParams, pad_id: int, eos_id: int) -> list[Completion]:
    """The native engine's decode loop before the static cache (for this comparison only)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(sp.seed)
    ids, attn = left_pad(prompts, pad_id, dev)
    pos = position_ids(attn)
    stop_ids = torch.tensor(sorted({eos_id, *sp.stop_token_ids}), device=dev)
    cache = DynamicCache()
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
    ).logits[:, -1]
    next_pos = pos[:, -1:] + 1
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=dev)
    toks, lps = [], []
    for t in range(sp.max_new_tokens):
        scaled = logits.float() / sp.temperature
        logp = scaled.log_softmax(-1)
        if sp.greedy:
            tok = scaled.argmax(-1)
        else:
            tok = torch.multinomial(filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1), 1, generator=gen).squeeze(-1)
        alive = ~finished
        toks.append(torch.where(alive, tok, pad_id))
        lps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
        finished = finished | torch.isin(tok, stop_ids)
        if bool(finished.all()) or t == sp.max_new_tokens - 1:
            break
        attn = torch.cat([attn, alive.long()[:, None]], dim=1)
        logits = model(
            input_ids=toks[-1][:, None],
            attention_mask=attn,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        next_pos = next_pos + 1
    return to_completions(torch.stack(toks, 1), torch.stack(lps, 1), stop_ids)


def useful_bytes(model, comps: list[Completion], prompt_lens: list[int], elem: int) -> tuple[int, int]:
    """(bytes, decode steps): weights once per step plus the KV cache of each row still running,
    at its current length (its own prompt's tokens, not the left padding, plus what it has
    generated), summed over the decode steps (the forwards after the prefill)."""
    cfg = model.config
    weights = sum(p.numel() for p in model.parameters()) * elem
    if not cfg.tie_word_embeddings:  # an untied input embedding is looked up, not read whole
        weights -= model.get_input_embeddings().weight.numel() * elem
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * elem
    )
    lengths = [len(c.token_ids) for c in comps]
    steps = max(lengths) - 1
    total = 0
    for t in range(1, steps + 1):  # step t feeds token t-1: a row of prompt p attends to p + t tokens
        total += weights + sum(p + t for n, p in zip(lengths, prompt_lens) if n > t) * kv_per_token
    return total, steps


def run_case(model, path: str, prompts, sp: SamplingParams, eos_id: int, dev, repeats: int, vllm_engine=None) -> dict:
    engine = (
        vllm_engine
        if path == "vllm"
        else NativeEngine(
            model,
            PAD,
            eos_id,
            lean_step=False if path == "forward" else None,
            cuda_graphs=False if path == "lean" else None,
        )
    )
    times, captures, comps = [], [], None
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        comps = legacy_generate(model, prompts, sp, PAD, eos_id) if path == "old" else engine.generate(prompts, sp)
        sync(dev)
        times.append(time.perf_counter() - t0)
        captures.append(getattr(engine, "last_capture_s", 0.0) if path != "old" else 0.0)
    s = statistics.median(times)
    tokens = sum(len(c.token_ids) for c in comps)
    # The graphs are captured inside every generate call (the cache is allocated per call): the
    # capture seconds of the run whose time is the median, reported apart from the decode.
    capture = captures[times.index(s)] if s in times else statistics.median(captures)
    return {
        "seconds": s,
        "tokens": tokens,
        "comps": comps,
        "decode_path": getattr(engine, "last_decode_path", None) or ("vllm" if path == "vllm" else "legacy"),
        "graph_error": getattr(engine, "last_graph_error", None) if path != "old" else None,
        "capture_s": capture,
    }


def vllm_prefill_seconds(engine, prompts) -> float:
    """vLLM's prompt forward: a 1-token generate (its scheduling and sampling of one token included)."""
    sp = SamplingParams(max_new_tokens=1, greedy=True)
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        engine.generate(prompts, sp)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def prefill_seconds(model, prompts, dev) -> float:
    """Median time of the prompt forward alone (subtracted from generate to get decode time)."""
    ids, attn = left_pad(prompts, PAD, dev)
    out = []
    for _ in range(2 if dev.type == "cpu" else 5):
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(
                input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False, logits_to_keep=1
            )
        sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if args.threads is None:
        args.threads = 1 if dev.type == "cpu" else 0
    if args.prompt_len is None:
        args.prompt_len = 16 if dev.type == "cpu" else 128
    if args.vocab is None:
        args.vocab = 32000 if dev.type == "cpu" else 151_936
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    peak = args.peak_tbs
    if peak is None and dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak = next((v for k, v in PEAK_TBS.items() if k in name), None)
        if peak is None:
            print(
                f"no HBM peak known for {name!r}: the roofline columns are left out; pass --peak-tbs", file=sys.stderr
            )
    load_start = os.getloadavg()
    g = torch.Generator().manual_seed(args.seed)
    rows, started = [], time.perf_counter()
    for name in args.models:
        Ts = lengths_for(args, name, dev)
        model = build_model(name, args.vocab, dtype, dev, args.prompt_len + max(Ts))
        n_params = sum(p.numel() for p in model.parameters())
        for N in args.batch:
            lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (N,), generator=g).tolist()
            prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lens]
            pre_s = prefill_seconds(model, prompts, dev)
            # Warm-up (allocator, kernels, first-call overheads), and a check that both paths agree.
            greedy = SamplingParams(max_new_tokens=4, greedy=True)
            native_greedy = [c.token_ids for c in NativeEngine(model, PAD, -1).generate(prompts, greedy)]
            same = [c.token_ids for c in legacy_generate(model, prompts, greedy, PAD, -1)] == native_greedy
            vllm_engine, same_vllm, pre_vllm = None, None, None
            if "vllm" in args.paths:
                vllm_engine = vllm_bench.synced_engine(
                    model, vllm_bench.config_dir(model.config, type(model).__name__), args.prompt_len + max(Ts), N
                )
                same_vllm = [c.token_ids for c in vllm_engine.generate(prompts, greedy)] == native_greedy
                pre_vllm = vllm_prefill_seconds(vllm_engine, prompts)
            for T in Ts:
                for scen in args.scenarios:
                    # ragged: the top ~4/T of the vocabulary ids stop a row (eos_id -1 never matches).
                    stops = (
                        tuple(range(args.vocab - max(1, round(4 * args.vocab / T)), args.vocab))
                        if scen == "ragged"
                        else ()
                    )
                    sp = SamplingParams(max_new_tokens=T, temperature=1.0, stop_token_ids=stops, seed=args.seed)
                    for path in args.paths:
                        r = run_case(model, path, prompts, sp, -1, dev, args.repeats, vllm_engine)
                        pre = pre_vllm if path == "vllm" else pre_s
                        decode_s = max(r["seconds"] - pre, 1e-9)
                        steady_s = max(decode_s - r["capture_s"], 1e-9)  # decode without the graph captures
                        nbytes, steps = useful_bytes(model, r["comps"], lens, dtype.itemsize)
                        row = {
                            "model": name,
                            "params": n_params,
                            "batch": N,
                            "T": T,
                            "scenario": scen,
                            "path": path,
                            "tokens": r["tokens"],
                            "longest": max(len(c.token_ids) for c in r["comps"]),
                            "generate_s": round(r["seconds"], 4),
                            "prefill_s": round(pre, 4),
                            "decode_s": round(decode_s, 4),
                            "decode_tokens_per_s": round(r["tokens"] / decode_s, 1),
                            "tokens_per_s_with_prefill": round(r["tokens"] / r["seconds"], 1),
                            "step_ms": round(1e3 * decode_s / max(steps, 1), 3),
                            "greedy_old_eq_new": same,
                            "greedy_native_eq_vllm": same_vllm if path == "vllm" else None,
                            "decode_path": r["decode_path"],
                            "graph_error": r["graph_error"],
                            "capture_s": round(r["capture_s"], 4),
                            "decode_tokens_per_s_excl_capture": round(r["tokens"] / steady_s, 1),
                            "roofline_frac": round(nbytes / decode_s / (peak * 1e12), 4)
                            if peak and dev.type == "cuda"
                            else None,
                            "roofline_frac_excl_capture": (
                                round(nbytes / steady_s / (peak * 1e12), 4) if peak and dev.type == "cuda" else None
                            ),
                        }
                        rows.append(row)
                        print(
                            f"  {name} N={N} T={T} {scen} {path}: {row['decode_tokens_per_s']} decode tok/s",
                            file=sys.stderr,
                            flush=True,
                        )
            if vllm_engine is not None:
                vllm_engine.shutdown()
        del model, vllm_engine

    def case(r: dict) -> str:
        return f"{r['model']}/N={r['batch']}/T={r['T']}/{r['scenario']}"

    def ratios(num: str, den: str, key: str = "decode_tokens_per_s") -> dict:
        out = {}
        for r in rows:
            if r["path"] == num:
                o = next((o for o in rows if o["path"] == den and case(o) == case(r)), None)
                if o:
                    out[case(r)] = round(r[key] / o[key], 2)
        return out

    speedups, vllm_vs_new = ratios("new", "old"), ratios("vllm", "new", "tokens_per_s_with_prefill")
    # Graphs against the eager lean step, each with its capture (what a rollout pays: graphs are captured per call)
    graphs_vs_lean = ratios("new", "lean")
    roof = bool(peak and dev.type == "cuda")
    print(
        f"\nrollout throughput: batch {args.batch}, prompts {args.prompt_len // 2}..{args.prompt_len} tokens, "
        f"{dev.type} {str(dtype).replace('torch.', '')}, {args.threads or torch.get_num_threads()} thread(s), "
        f"median of {args.repeats}" + (f", HBM peak {peak} TB/s" if roof else "")
    )
    print(
        f"{'model':>6} {'N':>5} {'T':>5} {'scenario':>8} {'path':>7} {'tokens':>7} {'longest':>7} {'generate s':>10} "
        f"{'decode s':>9} {'decode tok/s':>12} {'tok/s w/ prefill':>16} {'step ms':>8} {'ratio':>12}"
        + (f" {'capture s':>9} {'roofline':>8} {'roofline excl capture':>21}" if roof else "")
    )
    for r in rows:
        key = case(r)
        ratio = f"new/old {speedups[key]}x" if r["path"] == "new" and key in speedups else ""
        ratio = f"new/lean {graphs_vs_lean[key]}x" if r["path"] == "new" and key in graphs_vs_lean else ratio
        ratio = f"/new {vllm_vs_new[key]}x" if r["path"] == "vllm" and key in vllm_vs_new else ratio
        line = (
            f"{r['model']:>6} {r['batch']:>5} {r['T']:>5} {r['scenario']:>8} {r['path']:>7} {r['tokens']:>7} "
            f"{r['longest']:>7} "
            f"{r['generate_s']:>10.3f} {r['decode_s']:>9.3f} {r['decode_tokens_per_s']:>12.1f} "
            f"{r['tokens_per_s_with_prefill']:>16.1f} {r['step_ms']:>8.2f} {ratio:>12}"
        )
        if roof:
            line += f" {r['capture_s']:>9.3f} {r['roofline_frac']:>8.3f} {r['roofline_frac_excl_capture']:>21.3f}"
        print(line)
    if not all(r["greedy_old_eq_new"] for r in rows):
        print("WARNING: greedy tokens of the old and new paths differ")
    if any(r["greedy_native_eq_vllm"] is False for r in rows):
        print("WARNING: vLLM's greedy tokens differ from the native engine's (fp32 near-ties of random weights?)")
    if vllm_vs_new:
        print(
            "ratio for vllm rows: vLLM's tokens/s with prefill over the native engine's (the same work: "
            "prompt forward + T tokens per row)"
        )
    res = {
        "benchmark": "rollout_throughput",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": dev.type,
        "dtype": str(dtype).replace("torch.", ""),
        "hardware": hardware(dev),
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - started, 1),
        "settings": {
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "vocab": args.vocab,
            "repeats": args.repeats,
            "threads": args.threads,
            "seed": args.seed,
            "peak_tbs": peak,
            "temperature": 1.0,
            "top_p": 1.0,
            "stop_check_every": check_every(None, dev.type),
        },
        "results": rows,
        "speedup_new_over_old": speedups,
        "graphs_over_lean": graphs_vs_lean,
        "vllm_over_new_with_prefill": vllm_vs_new,
    }
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
