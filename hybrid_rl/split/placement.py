"""Which rank does what under `trainer.placement=split`, and the combinations refused before a model is built.

Pure functions of plain values, so the config's runtime validation (loop/preflight.py validate_runtime)
can call `check_placement` with what it knows, and a test can name every refusal without a process
group. Every refusal is a ValueError reading `config key '<key>': ...`, the format of config/checks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_rl.split.staleness import STALE_SAMPLES, check_k


def _refuse(key: str, msg: str) -> None:
    raise ValueError(f"config key '{key}': {msg}")


@dataclass(frozen=True)
class Layout:
    """The last R ranks of the world generate; ranks 0 .. W-R-1 train (learner rank 0 = global rank 0, which
    writes metrics and checkpoints as in a colocated run)."""

    world_size: int
    rollout_ranks: int

    @property
    def learners(self) -> list[int]:
        return list(range(self.world_size - self.rollout_ranks))

    @property
    def rollouts(self) -> list[int]:
        return list(range(self.world_size - self.rollout_ranks, self.world_size))

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.world_size - self.rollout_ranks

    def role(self, rank: int) -> str:
        """'learner rank i' / 'rollout rank i' with the global rank: what an error names."""
        return f"{'rollout' if self.is_rollout(rank) else 'learner'} rank {rank}"


def check_placement(
    world_size: int,
    rollout_ranks: int,
    max_staleness: int,
    stale_samples: str,
    *,
    tp_size: int = 1,
    batch_size: int = 1,
    group_size: int = 1,
    mini_batch_size: int = 0,
    rollout_correction: str = "none",
    engine: str = "native",
) -> Layout:
    """Refuse a split placement that cannot run; return its layout.

    batch_size: prompts per step (data.batch_size); group_size: samples per prompt (rollout.n);
    mini_batch_size: sequences per optimizer step (algorithm.mini_batch_size, 0 = the whole batch)."""
    check_k(max_staleness)
    if stale_samples not in STALE_SAMPLES:
        _refuse("trainer.stale_samples", f"got {stale_samples!r}, expected one of {list(STALE_SAMPLES)}")
    if not isinstance(rollout_ranks, int) or rollout_ranks < 1:
        _refuse("trainer.rollout_ranks", f"split needs at least 1 rollout rank, got {rollout_ranks!r}")
    if rollout_ranks >= world_size:
        _refuse(
            "trainer.rollout_ranks",
            f"{rollout_ranks} rollout ranks leave no learner in a world of {world_size} "
            f"ranks; use at most {world_size - 1} (or trainer.placement=colocated)",
        )
    if rollout_ranks % tp_size:
        _refuse(
            "rollout.tp_size",
            f"{tp_size} does not divide trainer.rollout_ranks={rollout_ranks}: every "
            "inference engine needs tp_size whole rollout ranks",
        )
    if engine == "vllm":
        _refuse(
            "rollout.engine",
            "vllm cannot run on split rollout ranks yet: under torchrun vLLM builds its process groups over the whole "
            "world (external_launcher), collectives the learner ranks never join, so its start fails; use "
            "rollout.engine=native with trainer.placement=split, or vllm colocated",
        )
    if stale_samples == "correct" and rollout_correction == "none":
        _refuse(
            "trainer.stale_samples",
            "'correct' reweights stale samples through the rollout correction, and "
            "algorithm.rollout_correction is 'none'; set it (e.g. tis_token) or use trainer.stale_samples=drop",
        )
    layout = Layout(world_size, rollout_ranks)
    _check_batches(layout, tp_size, batch_size, group_size, mini_batch_size)
    return layout


def _check_batches(layout: Layout, tp_size: int, batch_size: int, group_size: int, mini_batch_size: int) -> None:
    """Each rollout engine generates an equal share of the prompts, and each learner rank trains an equal share
    of the sequences of every mini-batch (FSDP ranks step together)."""
    engines = layout.rollout_ranks // tp_size
    learners = len(layout.learners)
    if batch_size % engines:
        _refuse(
            "data.batch_size",
            f"{batch_size} prompts do not divide over the {engines} rollout engines "
            f"(trainer.rollout_ranks={layout.rollout_ranks} / rollout.tp_size={tp_size}); use a multiple of "
            f"{engines}",
        )
    n_seq = batch_size * group_size
    mb = mini_batch_size or n_seq
    if mb % learners:
        _refuse(
            "algorithm.mini_batch_size" if mini_batch_size else "data.batch_size",
            f"{mb} sequences per optimizer step do not divide over the {learners} learner ranks "
            f"(world size {layout.world_size} - trainer.rollout_ranks={layout.rollout_ranks}); change it or "
            "trainer.rollout_ranks",
        )
