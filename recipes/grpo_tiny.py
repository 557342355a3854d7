"""GRPO on a tiny model, on CPU, in a few minutes.

    torchrun --nproc_per_node=2 recipes/grpo_tiny.py [--create-model] [key.sub=value ...]
    python recipes/grpo_tiny.py [--create-model] [key.sub=value ...]

The task: the prompt is three digits, the answer is each digit plus one (mod 10).
A random policy scores ~0.06; with the defaults (40 steps) the trained one scores above 0.9
over the last 10% of steps on every engine (benchmarks/results/grpo_tiny_seeds_cpu_2026-11-25.md).
The reward pays 0.9 for the digits and 0.1 for stopping right after them; the console's accuracy
counts full marks only, so it stays near 0 until the policy learns to stop (truncated: the share
that never stops) while reward climbs (docs/metrics.md). The model is the YAML's runs/tiny_qwen2, a
random-weight tiny Qwen2 the recipe creates when it is missing (and says so); a model.path given on the
command line must hold a model, unless --create-model asks for a new tiny one there (a typo'd path is
refused, not filled with random weights). The tiny model's vocabulary is the ten digits and `=`
(README, Supported models): a prompt with any other text is refused, naming its file and row.
"""

import os
import sys

from hybrid_rl import Trainer, load_config
from hybrid_rl.config.checks import RecipeParser, command_line
from hybrid_rl.data.digits import DIGIT_WORDS
from hybrid_rl.models.tiny import build_tiny_model_dir
from hybrid_rl.observability.metrics import reward_summary, run_history
from hybrid_rl.runtime import distributed

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str]):
    """(the recipe's flags, the key=value overrides)."""
    parser = RecipeParser(__doc__, "recipes/grpo_tiny.yaml")
    parser.add_argument(
        "--config",
        default=os.path.join(HERE, "grpo_tiny.yaml"),
        help="the YAML the overrides apply to (default: grpo_tiny.yaml beside this file; recipes/ppo_tiny.yaml: the "
        "same task with PPO and a critic)",
    )
    parser.add_argument(
        "--create-model",
        action="store_true",
        help="create a random-weight tiny Qwen2 at a model.path that holds no model (without it, only the "
        "YAML's own runs/tiny_qwen2 is created)",
    )
    return parser.parse(argv)


def check_model_path(path: str, given: bool, create: bool) -> bool:
    """True when the tiny model must be created at `path`; raises when a model.path given on the command line
    holds no model and --create-model was not passed (a typo would otherwise train a random model)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return False
    if given and not create:
        raise ValueError(
            f"config key 'model.path': {path!r} holds no model (no config.json); point it at a Hugging Face model "
            "directory, or add --create-model to create a random-weight tiny model there"
        )
    return True


@distributed.report_failures
def main(argv: list[str]) -> dict:
    # 1. Config: the YAML next to this file (or --config), then command-line overrides.
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides)
    given = any(o.startswith("model.path=") for o in overrides)
    create = check_model_path(cfg.model.path, given, args.create_model)

    # 2. Model: a random-init Qwen2 saved as a normal HF directory (rank 0 writes it once).
    distributed.init(cfg.trainer.device, timeout_s=cfg.process_group_timeout_s)
    if distributed.is_main() and create:
        print(
            f"NOTE: creating a RANDOM-weight tiny Qwen2 at model.path={cfg.model.path} (the demo's; it learns the "
            "digits task from scratch). To train a real model, set model.path to its Hugging Face directory.",
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
