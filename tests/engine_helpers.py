"""Shared by the engine adapter tests (vLLM, the SGLang stand-in): prompts over the digits vocabulary,
trained-looking weights for a policy before a sync, and one rollout through the phase switch."""

from __future__ import annotations

import torch

PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14]]


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Trained-looking weights: neither the checkpoint nor the engine's dummy init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def rollout(pm, prompts, params):
    """Generate through the phase switch (resume, sync, generate), then back to TRAIN (release)."""
    with pm.rollout() as engine:
        out = engine.generate(prompts, params)
    with pm.train():
        pass
    return out


def vllm_model_dir(tmp_path_factory, name: str) -> str:
    """The tiny digits model, wide enough for vLLM: its CPU attention needs head_dim 32 (hidden 128, 4 heads)."""
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(
        str(tmp_path_factory.mktemp(name) / "model"), DIGIT_WORDS, hidden_size=128, num_layers=2
    )
