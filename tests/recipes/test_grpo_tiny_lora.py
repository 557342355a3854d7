"""End to end with LoRA (issue 29): the tiny recipe with `model.lora.rank=8` learns the digits task.

Why the base is not the recipe's random model: the tiny model ties its LM head to a random embedding (std 0.02)
and ends in an RMSNorm of weight 1, and LoRA freezes both. The largest probability any hidden state can then
give one digit is 0.45-0.57 (seed 0, gradient ascent on the hidden state), so rank 8 all-linear plateaued at a
reward of 0.46-0.48 whatever the learning rate: the ceiling, not the optimizer. LoRA adapts a pretrained model,
so the base here is the tiny model after 100 supervised steps on another skill, copying the three digits
(`_pretrain_copying`, a few seconds); its head then allows 0.97 per digit, and it scores ~0.1 on "add one"
(stopping right is all it gets), so the adapters have to learn the task.

Settings: 1 process, rank 8, alpha 32 (the schema's default), the recipe's lr 2.5e-3 and cosine schedule, 60
steps, and the recipe's 1024 samples a step drawn as 64 prompts x 16 instead of 128 x 8. Last-10% reward
0.866 / 0.870 / 0.850 / 0.873 for seeds 0 / 1 / 2 / 3 (~70 s on the shared 2 cores). With 128 x 8, seed 1
stalled at 0.783 (60 steps) and 0.790 (80 steps) while seeds 0 and 2 passed: a base sure of copying rarely
samples the "+1" digit, and 16 samples of a prompt find it. On seed 0 at 40 steps and 128 x 8: lr 5e-3 reached
0.63, 1e-2 0.13; 25 / 200 copying steps 0.59 / 0.71 (a lower ceiling, or a base too sure to explore); a random
base with its embedding scaled x5 0.36. All runs: benchmarks/results/lora_cpu_2026-11-25.md.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 60
# The recipe's 1024 samples a step as 64 prompts x 16 (not 128 x 8), optimizer steps of 128 sequences as the
# recipe's: more samples per prompt find the rare "+1" digit of a base that copies (module docstring).
SETTINGS = ["rollout.n=16", "data.batch_size=64", "algorithm.mini_batch_size=128"]


def _pretrain_copying(path: str, seed: int, steps: int = 100) -> str:
    """The recipe's tiny model (hidden 128, 2 layers, `seed`) trained to copy the prompt's digits, saved at `path`."""
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.models.tiny import build_tiny_model_dir

    random_dir = build_tiny_model_dir(path + "_random", DIGIT_WORDS, hidden_size=128, num_layers=2, seed=seed)
    tok, model = load_tokenizer(random_dir), load_causal_lm(random_dir).train()
    rng = random.Random(seed + 1000)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        rows = []
        for _ in range(64):
            digits = " ".join(str(rng.randrange(10)) for _ in range(3))
            rows.append(tok(f"{digits} = {digits}", add_special_tokens=False).input_ids + [tok.eos_token_id])
        ids = torch.tensor(rows)
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt "d d d =": train the answer and EOS only
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_tiny_recipe_with_lora_rank_8_learns_the_task(tmp_path):
    """Catches: adapters that do not train (the reward stays at the base's ~0.1), or a change to LoRA's
    defaults or to the recipe that stops a LoRA run from learning."""
    model_dir = _pretrain_copying(str(tmp_path / "model"), seed=0)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "grpo_tiny.py"),
        f"model.path={model_dir}",
        "model.lora.rank=8",
        *SETTINGS,
        f"trainer.total_steps={STEPS}",
        f"trainer.out_dir={out}",
        "trainer.resume=none",
        "trainer.progress_bar=false",
        "trainer.log_every=10",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        rewards = [json.loads(line)["reward/mean"] for line in f]
    assert len(rewards) == STEPS
    k = STEPS // 10
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert first < 0.2, f"the copying base should score low on 'add one', got {first:.3f}"
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert last >= 0.8, f"last-10% reward {last:.3f} < 0.8 (first 10% {first:.3f}); reward/mean per step: {curve}"
