"""PPO's four models on CUDA (issue 36): actor and critic under FSDP2 bf16 mixed precision, the critic's
weights and optimizer state offloaded during ROLLOUT and brought back for SCORE and TRAIN, and the ledger's
bytes on the device. Skipped without CUDA; run on a GPU machine with `pytest tests/gpu`."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_ppo_steps_on_cuda_with_the_critic_offloaded_in_rollout(tiny_model_dir, tmp_path):
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime import distributed as D

    overrides = [
        f"model.path={tiny_model_dir}",
        f"trainer.out_dir={tmp_path}",
        "trainer.device=cuda",
        "trainer.progress_bar=false",
        "data.batch_size=8",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=2",
        "algorithm.advantage=gae",
        "algorithm.lam=0.95",
        "algorithm.kl_coef=0.01",
        "critic.lr=1e-3",
        "critic.offload_params=true",
        "critic.offload_optimizer=true",
        "offload.optimizer=true",
    ]
    try:
        trainer = Trainer(load_config(None, overrides))
        history = trainer.fit()
        last = history[-1]
        for key in ("actor/loss", "critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var"):
            assert math.isfinite(last[key]), (key, last[key])
        assert last["critic/grad_norm"] > 0
        assert all(p.dtype == torch.float32 for p in trainer.critic.parameters())  # the sharded masters
        rows = {s.label: s.roles for s in trainer.phases.ledger.snapshots if s.rollout == 2}
        # Device bytes: the critic and its AdamW state leave the GPU for ROLLOUT and are back for TRAIN.
        assert rows["rollout:ready"]["critic"] == 0 and rows["rollout:ready"]["critic_optimizer"] == 0
        critic_bytes = sum(p.numel() * p.element_size() for p in trainer.critic.parameters())
        assert rows["train:ready"]["critic"] == critic_bytes
        assert rows["train:ready"]["critic_optimizer"] == 2 * critic_bytes
        assert next(trainer.critic.parameters()).device.type == "cuda"
    finally:
        D.shutdown()
