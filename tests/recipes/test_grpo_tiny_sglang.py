"""The demo recipe with rollout.engine=sglang (the CPU stand-in of sglang 0.5.21) under torchrun,
2 ranks, tp_size 1 and 2, learns as the native engine does (issue 7).

Three runs of the same recipe, seed and number of steps: the native engine, then the stand-in
with rollout.tp_size=1 and 2. Each must reach a last-10% reward (mean reward/mean over the
last 10% of steps) of at least 0.8, and each stand-in run must be within 0.05 of the native run.

The engines draw different sampling streams (native: one torch generator; the stand-in: a seed
per sample), so at a fixed number of steps they differ as runs with different seeds do. The
recipe's defaults (recipes/grpo_tiny.yaml, found while building this test) make that difference
small: 128 prompts x 8 samples a step in mini-batches of 128 sequences, and a cosine learning-rate
decay from a high peak (2.5e-3) to 20% of it, so that in the runs measured every stream had learned
the digits and the stop token before the last 10% of steps, and the lower final rate holds it there
(with a constant rate a converged run can fall back by ~0.1 within a few steps). It is not immune:
the stop token is a rare event learned abruptly, and a stream that learns it only in the last steps
ends ~0.08 low (1 such stream in the ~30 measured of this family of settings). The search and every
run are in benchmarks/results/sglang_vs_native_cpu_2026-11-22.md, the seed table of the defaults in
benchmarks/results/grpo_tiny_seeds_cpu_2026-11-25.md. The runs are bit-reproducible on one
machine (two tp2 runs of 8 steps gave identical metrics), so for given code and CPU the outcome
is fixed, not a coin toss; a change to sampling or numerics moves every stream, and if a stream
then learns late the assertion prints its reward curve.

SGLang starts its schedulers as child processes, so this runs under torchrun (a launcher with
daemonic workers cannot). The stand-in decodes for real in those processes and receives the
weights through shared-memory handles every step; the trainer compares the engine's
log-probs with its own every step (rollout/logp_mismatch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 40  # the recipe's default; passed explicitly so that the curve checked here stays this one
SEED = 0
MIN_REWARD = 0.8  # last-10% reward every engine must reach
MAX_GAP = 0.05  # |stand-in - native| in last-10% reward
MAX_MISMATCH = 1e-4  # engine vs trainer log-probs (fp32), every step


def _run(root, name: str, *overrides: str) -> list[dict]:
    from hybrid_rl.runtime.distributed import free_port

    out = root / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "fake_sglang"), ROOT])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(ROOT, "recipes", "grpo_tiny.py"),
        "--create-model",
        f"model.path={root / 'model'}",
        f"trainer.out_dir={out}",
        f"trainer.total_steps={STEPS}",
        f"trainer.seed={SEED}",
        "trainer.resume=none",
        "trainer.progress_bar=false",
        "trainer.log_every=10",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _last10(history: list[dict]) -> float:
    k = max(1, len(history) // 10)
    return sum(h["reward/mean"] for h in history[-k:]) / k


def _check_run(history: list[dict], label: str) -> float:
    assert len(history) == STEPS, f"{label}: {len(history)} steps logged, expected {STEPS}"
    worst = max(h["rollout/logp_mismatch"] for h in history)
    assert worst < MAX_MISMATCH, (
        f"{label}: engine vs trainer log-probs differ by {worst:.2e} (fp32, limit {MAX_MISMATCH})"
    )
    last = _last10(history)
    curve = " ".join(f"{h['reward/mean']:.2f}" for h in history)
    assert last >= MIN_REWARD, f"{label}: last-10% reward {last:.3f} < {MIN_REWARD}; reward/mean per step: {curve}"
    return last


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("grpo_tiny_sglang")  # one model directory (seed 0) for all three runs


@pytest.fixture(scope="module")
def native_history(runs_root):
    return _run(runs_root, "native", "rollout.engine=native")


def test_recipe_native_reference_run_learns(runs_root, native_history):
    """The reference the stand-in is compared with; it also checks what the recipe writes."""
    _check_run(native_history, "native")
    k = max(1, STEPS // 10)
    first = sum(h["reward/mean"] for h in native_history[:k]) / k
    assert first < 0.2, f"a random-init policy should score low, got first-10% reward {first:.3f}"
    out = runs_root / "native"
    assert (out / "reward_curve.png").is_file() and (out / "config.yaml").is_file()
    # The trained policy is saved as a normal HF directory that the ordinary loader reads back.
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer

    saved = str(out / "final_model")
    assert load_tokenizer(saved).eos_token_id is not None
    trained = dict(load_causal_lm(saved).named_parameters())
    initial = dict(load_causal_lm(str(runs_root / "model")).named_parameters())
    assert max((trained[n] - initial[n]).abs().max().item() for n in initial) > 1e-3


@pytest.mark.parametrize("tp_size", [1, 2])
def test_recipe_with_sglang_learns_as_native(runs_root, native_history, tp_size):
    history = _run(runs_root, f"sglang_tp{tp_size}", "rollout.engine=sglang", f"rollout.tp_size={tp_size}")
    label = f"sglang tp{tp_size}"
    last = _check_run(history, label)
    native = _last10(native_history)
    assert abs(last - native) <= MAX_GAP, (
        f"{label}: last-10% reward {last:.3f} vs native {native:.3f} (same seed {SEED}, {STEPS} steps): "
        f"gap {abs(last - native):.3f} > {MAX_GAP}"
    )
    assert all(h["switch/sync_weights_s"] > 0 for h in history), f"{label}: weights are synced every step"
    assert all(h["memory/engine_weights_peak"] > 0 for h in history), f"{label}: the ledger sees the engine's weights"
