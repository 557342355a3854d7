"""What one phase switch costs: every stage of TRAIN -> ROLLOUT -> SCORE -> TRAIN, timed.

Builds a causal LM with random weights (a Qwen2 of ~120M parameters by default, or any
HF config.json), an AdamW with real state, an optional frozen reference, a native
rollout engine and a `PhaseManager`, then runs `--warmup` + `--k` full cycles:

    TRAIN -> rollout() [generate a small batch] -> score() [ref forward] -> train() [one step]

For each switch stage (from `pm.pop_stats()`) it reports the median seconds, the bytes
the stage moved, the achieved GB/s, and the GB/s of a bare copy of the SAME byte count
measured in the same run, interleaved with the cycles (CPU: host memcpy between
preallocated buffers; CUDA: pinned device->host / host->device, device->device).
ratio = stage GB/s / copy GB/s: 1.0 means the stage is as fast as a plain copy.

Engines: `zero-copy` decodes with the policy module itself (no weight handoff);
`copy` is a second model with its own weights that receives the policy's weights in
buckets in the sync stage (what SGLang does). Default: both, one after the other,
over the same policy, optimizer and reference.

    python benchmarks/phase_swap.py                                   # CPU, one process
    torchrun --nproc_per_node=2 benchmarks/phase_swap.py              # FSDP2 over gloo
    python benchmarks/phase_swap.py --device cuda --config path/to/config.json

Prints a human table, then one JSON object as the last line. `main(argv) -> dict`.
Legend: N sequences in the rollout batch, P prompt tokens, T new tokens, L = P + T.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Optional

import torch

from hybrid_rl.models.fsdp import prepare_reference, shard_model
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.runtime import distributed as D
from hybrid_rl.switch import memory
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.types import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the report module beside this script
import vllm_bench  # noqa: E402
from phase_swap_report import (  # noqa: E402
    SCORE,
    STAGES,
    TO_ROLLOUT,
    TO_TRAIN,
    human_table,
    max_over_ranks,
    summarize,
)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    m = p.add_argument_group("model (ignored with --config)")
    p.add_argument("--config", default=None, help="a HF config.json (or a directory holding one); random weights")
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--intermediate", type=int, default=None, help="default: 2.75 x hidden")
    m.add_argument("--heads", type=int, default=16)
    m.add_argument("--kv-heads", type=int, default=4)
    m.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="auto: bf16 mixed precision on CUDA (as the trainer), fp32 on CPU",
    )
    p.add_argument("--k", type=int, default=5, help="measured cycles")
    p.add_argument("--warmup", type=int, default=1, help="cycles run first and not measured")
    p.add_argument(
        "--engine",
        choices=("both", "zero-copy", "copy", "sglang", "vllm"),
        default="both",
        help="sglang: an sglang.Engine (on CPU: put tests/fake_sglang on PYTHONPATH for the stand-in); "
        "vllm: an in-process vllm.LLM (rollout/vllm/engine.py), weights reloaded in place",
    )
    p.add_argument(
        "--bucket-mb", type=float, default=256.0, help="weight-sync bucket size (copy, sglang and vllm engines)"
    )
    p.add_argument("--tp-size", type=int, default=1, help="sglang, vllm: ranks per engine")
    p.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--ref",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a frozen reference copy, resident only inside SCORE",
    )
    p.add_argument(
        "--critic",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="PPO: a critic (value model of the policy's architecture) with AdamW state, weights and optimizer "
        "offloaded during ROLLOUT (critic.offload_params / offload_optimizer)",
    )
    p.add_argument(
        "--train-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one real optimizer step inside each TRAIN (so zero_grad has gradients to free)",
    )
    p.add_argument("--batch", type=int, default=4, help="N sequences generated per rollout")
    p.add_argument("--prompt-len", type=int, default=32, help="P")
    p.add_argument("--new-tokens", type=int, default=8, help="T")
    p.add_argument("--kv-tokens", type=int, default=0, help="if > 0: batch = ceil(kv_tokens / (P + T))")
    p.add_argument(
        "--train-tokens",
        type=int,
        default=16,
        help="one sequence of this many tokens for the train step and the ref forward "
        "(compute is not what is measured)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads; 0: torch's default. Default: 1 on CPU (see README), torch's on CUDA",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    for key in ("k", "batch", "prompt_len", "new_tokens", "train_tokens", "hidden", "layers"):
        if getattr(args, key) <= 0:
            p.error(f"--{key.replace('_', '-')} must be > 0")
    if args.warmup < 0 or args.bucket_mb <= 0 or (args.threads or 0) < 0:
        p.error("--warmup and --threads must be >= 0 and --bucket-mb > 0")
    if args.kv_tokens > 0:
        args.batch = -(-args.kv_tokens // (args.prompt_len + args.new_tokens))
    return args


def build_config(args: argparse.Namespace):
    from transformers import AutoConfig, Qwen2Config

    if args.config:
        path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
        with open(path) as f:
            d = json.load(f)
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    else:
        inter = args.intermediate or 32 * round(2.75 * args.hidden / 32)
        cfg = Qwen2Config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=inter,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            tie_word_embeddings=True,
            max_position_embeddings=max(512, args.prompt_len + args.new_tokens),
        )
    cfg.use_cache = False  # training default; the engine asks for its cache explicitly
    return cfg


def hardware(dev: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    hw = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "system": platform.system(),
        "gpu": None,
    }
    if dev.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(dev)
        hw["gpu_memory_gb"] = round(torch.cuda.get_device_properties(dev).total_memory / 1e9, 1)
    return hw


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class CopyRef:
    """Bare copies of n bytes, for the ratio column. One buffer pair of the largest size,
    sliced for smaller counts; halved (and reported) if the device cannot hold it."""

    def __init__(self, dev: torch.device, nbytes: int):
        self.dev, self.cuda, self.requested = dev, dev.type == "cuda", nbytes
        while True:
            try:
                self.a = torch.ones(nbytes, dtype=torch.uint8, device=dev)  # touched: no page faults in the timing
                self.b = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
                self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) if self.cuda else None
                break
            except (torch.OutOfMemoryError, RuntimeError):
                self.a = self.b = self.host = None
                gc.collect()
                if nbytes < (64 << 20):
                    raise
                nbytes //= 2
        self.max_bytes = nbytes

    def seconds(self, direction: str, nbytes: int) -> tuple[float, int]:
        """Time one copy of min(nbytes, capacity) bytes; returns (seconds, bytes copied)."""
        n = min(nbytes, self.max_bytes)
        if not self.cuda or direction == "d2d":
            src, dst = self.a[:n], self.b[:n]
        elif direction == "d2h":
            src, dst = self.a[:n], self.host[:n]
        else:
            src, dst = self.host[:n], self.a[:n]
        sync(self.dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=self.cuda)
        sync(self.dev)
        return time.perf_counter() - t0, n


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids_NL: torch.Tensor) -> None:
    loss = model(input_ids=ids_NL, labels=ids_NL).loss
    loss.backward()
    opt.step()  # gradients stay: the next switch to ROLLOUT must free them


def timed_generate(engine: NativeEngine, prompts: list[list[int]], sp: SamplingParams, dev: torch.device) -> dict:
    """generate(), with the engine module's forward calls timed: the first is the prefill."""
    calls: list[float] = []
    t0 = [0.0]

    def pre(*_):
        sync(dev)
        t0[0] = time.perf_counter()

    def post(*_):
        sync(dev)
        calls.append(time.perf_counter() - t0[0])

    model = getattr(engine, "model", None)  # SGLang decodes in its own processes: total time only
    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)] if model is not None else []
    try:
        start = time.perf_counter()
        out = engine.generate(prompts, sp)
        sync(dev)
        total = time.perf_counter() - start
    finally:
        for h in hooks:
            h.remove()
    assert len(out) == len(prompts)
    return {
        "generate_s": total,
        "prefill_s": calls[0] if calls else 0.0,
        "decode_s_per_token": statistics.median(calls[1:]) if len(calls) > 1 else 0.0,
    }


def cycle_line(mode: str, cycle: int, args: argparse.Namespace, secs: dict[str, float], gen: dict) -> str:
    """One cycle's switch seconds, printed as soon as the cycle ends: a run cut short by its time limit still
    leaves every cycle it finished (the table and the JSON line come only at the end)."""

    def part(names) -> float:
        return sum(secs.get(n, 0.0) for n in names)

    tag = "warm-up" if cycle < args.warmup else "measured"
    return (
        f"cycle {cycle + 1}/{args.warmup + args.k} {mode} ({tag}): to_rollout {part(TO_ROLLOUT):.3f} s, "
        f"score_ref {part(SCORE):.3f} s, to_train {part(TO_TRAIN):.3f} s; generate {gen['generate_s']:.3f} s"
    )


def run_engine(
    mode: str, args, dev, policy, opt, ref, engine_module, train_ids, prompts, sp, shared: dict, critic=None
) -> dict:
    """Warm-up + k cycles with one engine; returns per-stage samples and the last ledger.
    shared["copyref"]: the reference-copy buffers, kept across engines (first touch is slow)."""
    if mode == "sglang":
        from hybrid_rl.rollout.sglang.engine import SGLangEngine

        engine = SGLangEngine(
            policy,
            shared["model_dir"],
            pad_id=0,
            eos_id=-1,
            tp_size=args.tp_size,
            weights_dtype=torch.bfloat16 if args.mixed else None,
        )
    elif mode == "vllm":
        engine = vllm_bench.engine_for(
            policy,
            shared["model_dir"],
            args.prompt_len + args.new_tokens,
            args.batch,
            args.tp_size,
            torch.bfloat16 if args.mixed else None,
        )
    else:
        engine = NativeEngine(
            policy if mode == "zero-copy" else engine_module,
            pad_id=0,
            eos_id=-1,
            weights_dtype=torch.bfloat16 if args.mixed else None,
            own_weights=mode == "copy",
        )
    pm = PhaseManager(
        policy,
        opt,
        engine,
        dev,
        ref=ref,
        offload_optimizer=args.offload_optimizer,
        offload_ref=True,
        bucket_bytes=int(args.bucket_mb * (1 << 20)),
        always_copy=dev.type == "cpu",
        critic=critic[0] if critic else None,
        critic_optimizer=critic[1] if critic else None,
        offload_critic=bool(critic),
        offload_critic_optimizer=bool(critic),
    )
    assert pm.zero_copy == (mode == "zero-copy")
    split = vllm_bench.SyncSplit(engine) if mode == "vllm" else None  # where vLLM's sync time goes
    samples: dict[str, dict[str, list]] = {}
    compute: dict[str, list[float]] = {}
    for cycle in range(args.warmup + args.k):
        grads = memory.grad_bytes(policy, dev)
        with pm.rollout() as eng:
            gen = timed_generate(eng, prompts, sp, dev)
        with pm.score() as r:
            t0 = time.perf_counter()
            if r is not None:
                with torch.no_grad():
                    r(input_ids=train_ids).logits.float().mean().item()
            sync(dev)
            gen["score_s"] = time.perf_counter() - t0
        with pm.train() as o:
            t0 = time.perf_counter()
            if args.train_step:
                train_step(policy, o, train_ids)
            sync(dev)
            gen["train_step_s"] = time.perf_counter() - t0
        st = pm.pop_stats()
        if split is not None:
            gen.update(split.pop())
        snaps = {s.label: s.roles for s in pm.ledger.rollout_snapshots(pm.rollouts)}
        secs, nbytes, freed = dict(st.seconds), dict(st.bytes), {}
        secs["kv_prefill"] = gen["prefill_s"]
        nbytes["kv_prefill"] = snaps["rollout:generated"]["kv_cache"]
        freed["zero_grad"] = grads
        freed["release_engine"] = snaps["rollout:ready"]["engine_weights"] + snaps["rollout:generated"]["kv_cache"]
        if args.progress:
            print(cycle_line(mode, cycle, args, secs, gen), flush=True)
        if cycle < args.warmup:
            continue
        need = max(max(nbytes.values()), 1)
        if shared.get("copyref") is None or shared["copyref"].requested < need:
            shared["copyref"] = None
            gc.collect()
            shared["copyref"] = CopyRef(dev, need)
        copyref = shared["copyref"]
        for name in secs:
            s = samples.setdefault(name, {"s": [], "bytes": [], "freed": [], "copy_s": [], "copy_bytes": []})
            s["s"].append(secs[name])
            s["bytes"].append(nbytes.get(name, 0))
            s["freed"].append(freed.get(name, 0))
            kind, direction, _ = STAGES.get(name, ("copy", "d2d", ""))
            if kind in ("copy", "gather") and nbytes.get(name, 0) > 0:
                s["copy_kind"] = direction if dev.type == "cuda" else "memcpy"
                cs, cb = copyref.seconds(s["copy_kind"], nbytes[name])
                s["copy_s"].append(cs)
                s["copy_bytes"].append(cb)
        for key, v in gen.items():
            compute.setdefault(key, []).append(v)
    ledger = [{"boundary": s.label, **s.roles, "total": s.total} for s in pm.ledger.rollout_snapshots(pm.rollouts)]
    out = {
        "samples": samples,
        "compute": compute,
        "ledger": ledger,
        "ledger_table": pm.ledger.table(pm.rollouts),
        "engine_module_bytes": memory.module_bytes(engine_module, dev) if mode == "copy" else 0,
        "sync": dict(getattr(engine, "sync_stats", {})),
    }  # sglang: bytes, payloads, handles of one sync
    if split is not None:
        split.close()
        out["process_changes"] = sorted(getattr(engine, "process_changes", {}))
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    del pm, engine
    gc.collect()
    return out


def build(args: argparse.Namespace, dev: torch.device):
    """Policy (one real AdamW step done), optimizer, optional ref, copy-engine module, inputs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed + D.rank())
    cfg = build_config(args)
    with torch.device(dev):
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    base.train()
    # The copy engine holds a dense replica (bf16 under mixed precision, as an inference engine would).
    engine_module = copy.deepcopy(base).requires_grad_(False).eval() if args.engine in ("both", "copy") else None
    if engine_module is not None and args.mixed:
        engine_module.to(torch.bfloat16)
    # The reference as the trainer builds it (models/fsdp.py): bf16 under mixed precision, so its offload and
    # onload move the bytes a run moves.
    ref_dtype = torch.bfloat16 if args.mixed else torch.float32
    ref = prepare_reference(copy.deepcopy(base), ref_dtype) if args.ref else None
    policy = shard_model(base, dev, args.mixed)
    ref = shard_model(ref, dev, args.mixed) if ref is not None else None
    opt = torch.optim.AdamW(
        policy.parameters(), lr=1e-5, foreach=True
    )  # CUDA's default path, on every device; same m, v state
    g = torch.Generator().manual_seed(args.seed + D.rank())
    prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    train_ids = torch.randint(3, cfg.vocab_size, (1, args.train_tokens), generator=g).to(dev)
    train_step(policy, opt, train_ids)  # real AdamW state (m, v) to move
    cfg.architectures = [type(base).__name__]  # what vLLM reads to pick its model class (sharding renames the type)
    critic = build_critic(cfg, dev, args, train_ids) if args.critic else None
    return cfg, policy, opt, ref, engine_module, prompts, train_ids, critic


def build_critic(cfg, dev: torch.device, args, train_ids: torch.Tensor):
    """PPO's critic as the trainer builds it (models/value.py, sharded like the policy), with real AdamW state."""
    from hybrid_rl.models.value import ValueModel, response_values

    with torch.device(dev):
        critic = ValueModel.from_config(cfg, torch.float32, "sdpa", seed=args.seed)
    critic = shard_model(critic, dev, args.mixed)
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-5, foreach=True)
    attn = torch.ones_like(train_ids)
    response_values(critic, train_ids, attn, train_ids.shape[1] // 2).mean().backward()
    opt.step()
    return critic, opt


def _config_dir(cfg) -> str:
    """A model directory SGLang or vLLM can start from: config.json only (both load dummy weights)."""
    import tempfile

    path = None
    if D.is_main():
        path = tempfile.mkdtemp(prefix="phase_swap_model_")
        cfg.save_pretrained(path)
    return D.broadcast_object_from(path, 0)


def run(args: argparse.Namespace, dev: torch.device) -> tuple[dict, dict[str, str]]:
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    cfg, policy, opt, ref, engine_module, prompts, train_ids, critic = build(args, dev)
    if args.progress:
        n = sum(p.numel() for p in policy.parameters())
        print(
            f"built {n:,} params (policy, optimizer, reference) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    # eos_id=-1 and no stop tokens: every row decodes exactly T tokens, the same work each cycle.
    sp = SamplingParams(max_new_tokens=args.new_tokens, seed=args.seed)
    modes = ["zero-copy", "copy"] if args.engine == "both" else [args.engine]
    shared: dict = {}
    if "sglang" in modes or "vllm" in modes:
        shared["model_dir"] = _config_dir(cfg)
    raw = {
        mode: run_engine(mode, args, dev, policy, opt, ref, engine_module, train_ids, prompts, sp, shared, critic)
        for mode in modes
    }
    shared.clear()
    gathered = D.all_gather_object({m: {k: v for k, v in r.items() if k != "ledger_table"} for m, r in raw.items()})
    n_params = sum(p.numel() for p in policy.parameters())  # DTensor numel is the global size
    settings = {
        k: getattr(args, k)
        for k in (
            "k",
            "warmup",
            "engine",
            "bucket_mb",
            "offload_optimizer",
            "ref",
            "train_step",
            "batch",
            "prompt_len",
            "new_tokens",
            "train_tokens",
            "threads",
            "seed",
        )
    }
    res = {
        "benchmark": "phase_swap",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": dev.type,
        "world_size": D.world_size(),
        "hardware": hardware(dev),
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "model": {
            "params": n_params,
            "param_bytes": n_params * 4,
            "dtype": "bf16 mixed (fp32 master)" if args.mixed else "float32",
            "type": cfg.model_type,
            "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers,
            "vocab": cfg.vocab_size,
            "config": args.config,
        },
        "settings": {**settings, "kv_tokens": args.batch * (args.prompt_len + args.new_tokens)},
        "engines": {m: summarize(max_over_ranks([g_[m] for g_ in gathered])) for m in modes},
    }
    for m in modes:
        if raw[m]["sync"]:
            res["engines"][m]["sync"] = raw[m]["sync"]
        if "process_changes" in raw[m]:
            res["engines"][m]["process_changes"] = raw[m]["process_changes"]
        sync_stage = res["engines"][m]["stages"].get("sync_weights", {})
        if sync_stage.get("ratio"):  # the target for vLLM: a sync in at most 2x a memcpy of its bytes
            res["engines"][m]["sync_over_memcpy"] = 1.0 / sync_stage["ratio"]
    return res, {m: r["ledger_table"] for m, r in raw.items()}


def main(argv: Optional[list[str]] = None) -> dict:
    """Run the benchmark; print the table (rank 0) and the JSON line; return the JSON object."""
    args = parse_args(argv)
    owns_group = not D.is_dist()
    threads = torch.get_num_threads()
    dev = D.init(args.device)
    args.mixed = args.dtype == "bfloat16" or (args.dtype == "auto" and dev.type == "cuda")
    is_main = D.is_main()
    args.progress = is_main and not args.json_only  # a line per cycle as it ends, before the table
    if args.threads is None:
        # One thread on CPU: one core already copies at memcpy speed, and on a shared machine a second
        # OpenMP thread makes every per-tensor copy wait for a descheduled peer (measured: up to ~15x slower).
        args.threads = 1 if dev.type == "cpu" else 0
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        res, ledgers = run(args, dev)
    finally:
        torch.set_num_threads(threads)  # main() may run inside a test process
        if owns_group:
            D.shutdown()
    if is_main:
        if not args.json_only:
            print(human_table(res, ledgers))
        print(json.dumps(res, separators=(",", ":")), flush=True)
    return res


if __name__ == "__main__":
    main()
