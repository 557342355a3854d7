"""GRPO on a tiny model, on CPU, in a few minutes.

    torchrun --nproc_per_node=2 recipes/grpo_tiny.py [key.sub=value ...]
    python recipes/grpo_tiny.py [key.sub=value ...]

The task: the prompt is three digits, the answer is each digit plus one (mod 10).
A random policy scores ~0.06; with the defaults (40 steps) the trained one scores above 0.9
over the last 10% of steps on every engine (benchmarks/results/grpo_tiny_seeds_cpu_2026-11-25.md).
The reward pays 0.9 for the digits and 0.1 for stopping right after them; the console's accuracy
counts full marks only, so it stays near 0 until the policy learns to stop (truncated: the share
that never stops) while reward climbs (docs/metrics.md). model.path that does not exist is made a
random-weight model, and the recipe says so.
"""

import os
import sys

from hybrid_rl import Trainer, load_config
from hybrid_rl.config.checks import command_line
from hybrid_rl.data.digits import DIGIT_WORDS
from hybrid_rl.models.tiny import build_tiny_model_dir
from hybrid_rl.observability.metrics import reward_summary, run_history
from hybrid_rl.runtime import distributed

HERE = os.path.dirname(os.path.abspath(__file__))


@distributed.report_failures
def main(argv: list[str]) -> dict:
    # 1. Config: the YAML next to this file, then command-line overrides.
    cfg = load_config(os.path.join(HERE, "grpo_tiny.yaml"), argv)

    # 2. Model: a random-init Qwen2 saved as a normal HF directory (rank 0 writes it once).
    distributed.init(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    if distributed.is_main():
        if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            print(
                f"NOTE: model.path={cfg.model.path} has no model: creating a RANDOM-weight tiny Qwen2 there (the "
                "demo's; it learns the digits task from scratch). To train a real model, set model.path to its "
                "Hugging Face directory.",
                flush=True,
            )
        build_tiny_model_dir(cfg.model.path, DIGIT_WORDS, hidden_size=128, num_layers=2, seed=cfg.trainer.seed)
    distributed.barrier()

    # 3. Train, then save the policy as a normal HF directory.
    trainer = Trainer(cfg)
    history = trainer.fit()
    trainer.save_pretrained(os.path.join(cfg.trainer.out_dir, "final_model"))
    trainer.close()

    # 4. Summary: mean reward of the first and last 10% of the whole run's steps (a resumed run's too).
    summary, line = reward_summary(run_history(cfg.trainer.out_dir, history), len(history))
    summary.update(seconds=sum(h["time/step"] for h in history), out_dir=cfg.trainer.out_dir)
    if distributed.is_main():
        print(line)
    distributed.shutdown()
    return summary


if __name__ == "__main__":
    sys.exit(command_line(main, sys.argv[1:]))  # a config error: its one line, exit 2
