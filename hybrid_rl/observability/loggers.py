"""Where the per-step metrics go: `trainer.loggers` picks any of console, tensorboard, wandb;
the jsonl file (out_dir/metrics.jsonl) is always written. Every logger gets the same dict
under the same names (TensorBoard and W&B take its numbers; `bottleneck` is a word).

Only rank 0 logs. TensorBoard (torch.utils.tensorboard, needs the `tensorboard`
package) and W&B (`wandb`) are imported when asked for, so neither is a dependency;
asking for one that is not installed fails at start-up with the pip command.
W&B runs offline by default (`trainer.wandb_mode`): nothing needs a network, and
`wandb sync out_dir/wandb/offline-run-*` uploads later.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from typing import Optional, Protocol

from hybrid_rl.observability.metrics import append_jsonl, console_legend, format_line, format_val_line


class Logger(Protocol):
    def log(self, metrics: dict, step: int) -> None: ...

    def close(self) -> None: ...


def _numbers(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"
    }


def restart_jsonl(path: str, resume_step: Optional[int] = None) -> None:
    """Start a per-step JSON-lines file of the run: none for a new run (its writer creates it at its first
    line, so a run that logs nothing there leaves no empty file); for a resumed one, the lines up to the
    step it resumed from (steps the interrupted run did after its last checkpoint are done again, so
    every step appears once)."""
    kept = []
    if resume_step is not None and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by the crash: nothing after it is trusted
                if isinstance(record, dict) and record.get("step", resume_step + 1) <= resume_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    if not kept:
        if os.path.isfile(path):
            os.remove(path)
        return
    with open(path, "w") as f:
        f.writelines(kept)


class JsonlLogger:
    """One JSON object per step, appended to `path` (started by `restart_jsonl`)."""

    def __init__(self, path: str, resume_step: Optional[int] = None):
        self.path = path
        restart_jsonl(path, resume_step)

    def log(self, metrics: dict, step: int) -> None:
        append_jsonl(self.path, metrics)

    def close(self) -> None:
        pass


class ConsoleLogger:
    """One line every `every` steps (and a `val` line whenever validation ran), via `write`; `legend`, if
    given, once before the first step line (what the columns mean)."""

    def __init__(self, every: int, write=print, legend: str = ""):
        self.every, self.write, self.legend = every, write, legend

    def log(self, metrics: dict, step: int) -> None:
        if self.every and step % self.every == 0 and "reward/mean" in metrics:
            if self.legend:
                self.write(self.legend)
                self.legend = ""
            self.write(format_line(metrics))
        if any(k.startswith("val/") for k in metrics):
            self.write(format_val_line(metrics))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, log_dir: str, resume_step: Optional[int] = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "trainer.loggers includes 'tensorboard' but the tensorboard package is not installed: "
                "pip install tensorboard (or drop it from trainer.loggers)"
            ) from None
        self.log_dir = log_dir
        # purge_step: events past the resumed step (written before the interruption) are hidden.
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=None if resume_step is None else resume_step + 1)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in _numbers(metrics).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run; a resumed run continues the same W&B run (its id is kept in `<out_dir>/wandb_run_id`)."""

    def __init__(
        self,
        project: str,
        name: str,
        out_dir: str,
        mode: str,
        config: Optional[dict] = None,
        resume_step: Optional[int] = None,
    ):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "trainer.loggers includes 'wandb' but wandb is not installed: pip install wandb "
                "(or drop it from trainer.loggers)"
            ) from None
        self.wandb = wandb
        id_path = os.path.join(out_dir, "wandb_run_id")
        run_id = None
        if resume_step is not None and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = wandb.util.generate_id()
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        # resume="allow": the same id continues the run's charts; steps after the checkpoint are logged again.
        self.run = wandb.init(
            project=project, name=name, dir=out_dir, mode=mode, config=config, id=run_id, resume="allow"
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def build_loggers(cfg, write=print, resume_step: Optional[int] = None) -> list[Logger]:
    """The loggers of `cfg.trainer` (a `Config`), jsonl first; call on rank 0 only.

    resume_step: the step a resumed run starts after (its files keep what came before)."""
    t = cfg.trainer
    loggers: list[Logger] = [JsonlLogger(os.path.join(t.out_dir, "metrics.jsonl"), resume_step)]
    if "console" in t.loggers:
        legend = console_legend(cfg.reward.success_threshold, episodes=cfg.env.enabled)
        loggers.append(ConsoleLogger(t.log_every, write, legend))
    if "tensorboard" in t.loggers:
        loggers.append(TensorBoardLogger(os.path.join(t.out_dir, "tensorboard"), resume_step))
    if "wandb" in t.loggers:
        name = t.experiment or os.path.basename(os.path.normpath(t.out_dir))
        loggers.append(WandbLogger(t.project, name, t.out_dir, t.wandb_mode, _plain(cfg), resume_step))
    # Validation and the rollout log write their samples themselves; the files restart with the run's metrics.
    restart_jsonl(os.path.join(t.out_dir, "val_samples.jsonl"), resume_step)
    restart_jsonl(os.path.join(t.out_dir, "rollouts.jsonl"), resume_step)
    return loggers


def _plain(cfg) -> dict:
    try:
        return asdict(cfg)
    except TypeError:
        return {}


def check_loggers(names) -> None:
    """On every rank, before anything is built: each optional logger asked for must be importable."""
    import importlib.util

    for name, module, pip in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
        if name in names and importlib.util.find_spec(module) is None:
            raise ImportError(
                f"config key 'trainer.loggers': {name!r} needs the {pip} package, which is not "
                f"installed: pip install {pip} (or drop {name!r} from trainer.loggers)"
            )


def console_write(line: str) -> None:
    """Print a line above any progress bar (tqdm.write), flushed so a log file shows it at once."""
    from tqdm.auto import tqdm

    tqdm.write(line)
    sys.stdout.flush()


def interactive() -> bool:
    """A progress bar only where a person watches (a terminal, a notebook): in a log file its
    carriage-return redraws would interleave with the console lines."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def log_rollouts(
    path: str,
    step: int,
    rows: list[dict],
    texts: list[str],
    completions: list,
    rewards: list[float],
    scores: list[float],
    group_size: int,
) -> None:
    """Append one record per training completion (`trainer.log_rollouts` of them, rank 0's) to rollouts.jsonl:
    the step, its group, the prompt text, the completion text, the reward, the score the advantage sees."""
    with open(path, "a") as f:
        for i, (text, c, reward, score) in enumerate(zip(texts, completions, rewards, scores)):
            row = rows[i // group_size]
            record = {
                "step": step,
                "group": i // group_size,
                "prompt": row["prompt"],
                "completion": text,
                "reward": reward,
                "score": score,
                "finish_reason": c.finish_reason,
                "tokens": len(c.token_ids),
            }
            if "answer" in row:
                record["answer"] = str(row["answer"])
            f.write(json.dumps(record) + "\n")
