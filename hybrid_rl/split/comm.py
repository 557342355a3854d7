"""The process groups of a split run, made once per process before any model is built.

Every rank creates every group, in the same order (torch requires it): the learner mesh (a DeviceMesh over
the learner ranks: the policy's FSDP2 shards), the learner pool's group (metrics, normalisers, whitening),
the rollout pool's group (dynamic-sampling decisions and reward statistics), and the sync group (learner
rank 0 + the rollout ranks: weights and the run's start message), and, for a run with a reward model on
R > 1 rollout ranks, the rollout mesh (a DeviceMesh over the rollout ranks: the reward model's FSDP2 shards,
split/roles.py says why it lives there). Then `distributed.use_group` scopes this
rank's library collectives to its own pool, so the colocated code runs on each pool as it would on a world
of that pool's size (a rollout rank's prompt slice and sampling seeds are those of rank r - (W - R) of R).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hybrid_rl.runtime import distributed as D
from hybrid_rl.split.placement import Layout


@dataclass
class SplitComm:
    layout: Layout
    is_rollout: bool
    mesh: Any  # the learner ranks' DeviceMesh (None on rollout ranks)
    sync_group: Any
    timeout_s: float
    rollout_mesh: Any = None  # the rollout ranks' DeviceMesh for the reward model (None: none, or R == 1, or a learner)
    pairs: Optional[dict] = None  # trainer.inflight_update=continue: rollout rank -> its group [0, r] (inflight.py)

    @property
    def role(self) -> str:
        return self.layout.role(torch.distributed.get_rank())

    @property
    def n_learners(self) -> int:
        return len(self.layout.learners)


def setup_split(
    rollout_ranks: int, device: torch.device, timeout_s: float, reward_model: bool = False, inflight: bool = False
) -> SplitComm:
    """The groups (module docstring) and this rank's scope; call on every rank, right after distributed.init.
    reward_model: the run has one (reward.model_path), so the rollout mesh is made (every rank, same order);
    inflight: trainer.inflight_update=continue, so each rollout rank's pair group [0, r] is made (every rank, in
    rank order, after the others)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not D.is_dist():
        raise ValueError(
            "config key 'trainer.placement': split needs several processes; launch with torchrun "
            "(--nproc-per-node >= trainer.rollout_ranks + 1) or use trainer.placement=colocated"
        )
    me = torch.distributed.get_rank()
    layout = Layout(torch.distributed.get_world_size(), rollout_ranks)
    mesh = DeviceMesh(device.type, torch.tensor(layout.learners))  # every rank builds it; learners are in it
    backend = D.backend_for(device)
    learner_group = D.new_group(layout.learners, int(timeout_s), backend=backend)
    rollout_group = D.new_group(layout.rollouts, int(timeout_s), backend=backend)
    sync_group = D.new_group([0, *layout.rollouts], int(timeout_s))
    # Made after the other groups, so a run without a reward model creates exactly the groups it did before.
    rollout_mesh = (
        DeviceMesh(device.type, torch.tensor(layout.rollouts)) if reward_model and len(layout.rollouts) > 1 else None
    )
    pairs = {r: D.new_group([0, r], int(timeout_s)) for r in layout.rollouts} if inflight else None
    rollout = layout.is_rollout(me)
    if rollout:
        D.use_group(rollout_group, layout.rollouts)
    else:
        D.use_group(learner_group, layout.learners)
    return SplitComm(
        layout, rollout, None if rollout else mesh, sync_group, timeout_s, rollout_mesh if rollout else None, pairs
    )


def start_message(
    comm: SplitComm,
    first_batch: int,
    last_batch: int,
    loader_state: Optional[dict],
    reward_norm: Optional[dict] = None,
    partial: Optional[list] = None,
    fit: str = "",
) -> dict:
    """Learner rank 0 tells the rollout ranks which batches this fit() generates, where their loaders stand and
    the reward normaliser's state (a resumed run's, as of the last trained batch) and, with rollout.partial, each
    rollout rank's carried samples as of that batch (a list in rollout-rank order), and the fit's name (under
    trainer.inflight_update=continue the offers' keys: split/inflight.py); every rank of the sync group returns the
    same dict."""
    msg = {
        "first": first_batch,
        "last": last_batch,
        "loader": loader_state,
        "reward_norm": reward_norm,
        "partial": partial,
        "fit": fit,
    }
    return D.broadcast_object_from(msg, 0, group=comm.sync_group)
