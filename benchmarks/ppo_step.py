"""What PPO's critic costs: a PPO step's time split beside a GRPO step's, at the same batch, in one run.

    python benchmarks/ppo_step.py                      # the tiny demo model, 128 prompts x 4 samples, 12 steps
    python benchmarks/ppo_step.py --hidden 256 --layers 4 --steps 20

Two Trainers over the same tiny model and the same prompts (rollout.n samples each): GRPO (algorithm.advantage=grpo)
and PPO (algorithm.advantage=gae with a critic of the policy's size). Their steps alternate, one of each, so load
on the machine falls on both alike; the first `--warmup` steps of each are not measured. Prints, per stage (rollout,
score, advantage, train, switch, step), the median seconds of each and the ratio PPO / GRPO, then the critic's
share: `score` gains the critic's forward, `train` its forward + backward. The target of issue 36: the critic's
training time (PPO train - GRPO train) at most the actor's (GRPO train), for the same model. SCORE's value pass
(PPO score - GRPO score) is set beside GRPO's score, which at these settings (4 mini-batches: off-policy) is the
actor's one old-log-prob forward over the same rows: about 1.0 when the critic's forward costs what the actor's does.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile

STAGES = ("rollout", "score", "advantage", "train", "switch", "step")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (both runs)")
    p.add_argument("--steps", type=int, default=12, help="measured steps of each")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from hybrid_rl import Trainer, load_config
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    work = tempfile.mkdtemp(prefix="ppo_step_")
    model = build_tiny_model_dir(
        os.path.join(work, "model"), DIGIT_WORDS, hidden_size=args.hidden, num_layers=args.layers, seed=args.seed
    )
    common = [
        f"model.path={model}",
        f"data.batch_size={args.prompts}",
        f"rollout.n={args.n}",
        "rollout.max_new_tokens=4",
        f"algorithm.mini_batch_size={args.prompts * args.n // 4}",
        f"trainer.micro_batch_size={args.prompts * args.n}",
        f"trainer.seed={args.seed}",
        "trainer.progress_bar=false",
        "trainer.log_every=0",
        "trainer.resume=none",
        f"trainer.total_steps={args.steps + args.warmup}",
    ]
    runs = {
        "grpo": Trainer(load_config(None, [*common, "algorithm.advantage=grpo", f"trainer.out_dir={work}/grpo"])),
        "ppo": Trainer(load_config(None, [*common, "algorithm.advantage=gae", f"trainer.out_dir={work}/ppo"])),
    }
    seconds = {name: {s: [] for s in STAGES} for name in runs}
    for i in range(args.steps + args.warmup):
        for name, trainer in runs.items():
            m = trainer.step()
            if i >= args.warmup:
                for s in STAGES:
                    seconds[name][s].append(m.get(f"time/{s}", 0.0))
    for trainer in runs.values():
        trainer.close()
    med = {name: {s: statistics.median(v) for s, v in st.items()} for name, st in seconds.items()}
    critic_train = med["ppo"]["train"] - med["grpo"]["train"]
    critic_score = med["ppo"]["score"] - med["grpo"]["score"]
    result = {
        "benchmark": "ppo_step",
        "date": datetime.date.today().isoformat(),
        "hardware": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        "load_avg": list(os.getloadavg()),
        "settings": vars(args),
        "median_s": med,
        "ratio_ppo_over_grpo": {s: med["ppo"][s] / med["grpo"][s] if med["grpo"][s] else None for s in STAGES},
        "critic_train_s": critic_train,
        "critic_train_over_actor_train": critic_train / med["grpo"]["train"] if med["grpo"]["train"] else None,
        "critic_score_s": critic_score,
        "critic_score_over_actor_score": critic_score / med["grpo"]["score"] if med["grpo"]["score"] else None,
    }
    print(f"{'stage':<10}{'GRPO s':>10}{'PPO s':>10}{'PPO/GRPO':>10}   (medians of {args.steps} steps each)")
    for s in STAGES:
        ratio = result["ratio_ppo_over_grpo"][s]
        print(f"{s:<10}{med['grpo'][s]:>10.4f}{med['ppo'][s]:>10.4f}{ratio if ratio is None else f'{ratio:.2f}':>10}")
    print(
        f"critic's training (PPO train - GRPO train): {critic_train:.4f} s = "
        f"{result['critic_train_over_actor_train']:.2f} x the actor's (target: at most 1.0)"
    )
    if result["critic_score_over_actor_score"] is not None:
        print(
            f"critic's SCORE pass (PPO score - GRPO score): {critic_score:.4f} s = "
            f"{result['critic_score_over_actor_score']:.2f} x the actor's scoring forward (about 1.0: one forward)"
        )
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
