"""What the GPU tests share: the tiny model with seeded noise on every weight matrix, on CUDA (tests/conftest.py's
`sharp_model` on the GPU): its greedy tokens depend on the context, so equality with a full forward is a real check."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.models.loading import load_causal_lm


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = load_causal_lm(tiny_model_dir, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.add_(0.15 * torch.randn(p.shape, generator=g).cuda())
    return m
