"""KL estimators, controllers and reward-side KL penalty vs naive loops.

Legend: N sequences, T tokens; _NT per token.
"""

import math

import pytest
import torch

from hybrid_rl.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalty_rewards,
)


def naive_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    x = ref - lp
    try:
        v = math.exp(x) - x - 1
    except OverflowError:
        v = math.inf
    return min(max(v, -10.0), 10.0)


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
@pytest.mark.parametrize("n,t", [(4, 1), (3, 9), (2, 300)])
def test_kl_matches_naive(kind, n, t):
    g = torch.Generator().manual_seed(n * t)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 4
    ref = logp + torch.randn(n, t, generator=g, dtype=torch.float64)
    got = kl_estimate(logp, ref, kind)
    want = [[naive_kl(a, b, kind) for a, b in zip(r1, r2)] for r1, r2 in zip(logp.tolist(), ref.tolist())]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)


def test_k3_properties_and_clamp():
    logp = torch.tensor([[0.0, -50.0, -1.0, -3.0, -1e6]], dtype=torch.float64)
    ref = torch.tensor([[-50.0, 0.0, -1.0, -1e6, -3.0]], dtype=torch.float64)
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    assert k3[0, 0].item() == 10.0  # exp(-50) + 50 - 1 = 49 -> clamped to 10
    assert k3[0, 1].item() == 10.0  # exp(50) huge -> clamp
    assert k3[0, 2].item() == 0.0
    assert k3[0, 3].item() == 10.0 and k3[0, 4].item() == 10.0
    assert torch.equal(kl_estimate(logp, ref, "low_var_kl"), k3)
    assert (kl_estimate(torch.randn(50), torch.randn(50), "k3") >= 0).all()


def test_kl_gradient_and_mask():
    logp = torch.tensor([[-1.0, -2.0, -float("inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    kl = kl_estimate(logp, ref, "k3", mask_NT=mask)
    kl.sum().backward()
    assert kl[0, 2].item() == 0.0 and torch.isfinite(logp.grad).all()
    # d/dlogp of exp(ref - lp) - (ref - lp) - 1 = 1 - exp(ref - lp)
    want = [1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0]
    assert torch.allclose(logp.grad[0], torch.tensor(want), atol=1e-6)


def test_kl_errors():
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "kl")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 2), "k1")
    with pytest.raises(ValueError, match="mask_NT"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 3), "k1", mask_NT=torch.ones(3))


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(10.0, 100)
    assert c.value == 0.05
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


def test_adaptive_controller_matches_naive_sequence():
    c = AdaptiveKLController(init_coef=0.1, target_kl=2.0, horizon=1000)
    value = 0.1
    for current, n_steps in [(2.0, 64), (10.0, 64), (0.0, 128), (2.2, 32), (1.9, 500), (100.0, 1000)]:
        c.update(current, n_steps)
        err = min(max(current / 2.0 - 1, -0.2), 0.2)
        value *= 1 + err * n_steps / 1000
        assert c.value == pytest.approx(value, rel=1e-12)
    assert c.value != 0.1
    for bad in (
        dict(init_coef=-1, target_kl=1, horizon=1),
        dict(init_coef=1, target_kl=0, horizon=1),
        dict(init_coef=1, target_kl=1, horizon=0),
    ):
        with pytest.raises(ValueError):
            AdaptiveKLController(**bad)


@pytest.mark.parametrize("n,t", [(3, 1), (4, 6), (2, 200)])
def test_kl_penalty_rewards_matches_naive(n, t):
    g = torch.Generator().manual_seed(t)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    kl = torch.randn(n, t, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(n, t, generator=g) > 0.3).float()
    mask[0] = 0  # empty row: reward unchanged
    out = kl_penalty_rewards(rewards, kl, mask, 0.2)
    assert not out.requires_grad
    for i in range(n):
        s = sum(kl[i, j].item() for j in range(t) if mask[i, j] != 0)
        assert out[i].item() == pytest.approx(rewards[i].item() - 0.2 * s, abs=1e-12)
    assert out[0].item() == rewards[0].item()
    with pytest.raises(ValueError, match="rewards_N"):
        kl_penalty_rewards(torch.zeros(n + 1), kl, mask, 0.1)
    with pytest.raises(ValueError, match="kl_NT"):
        kl_penalty_rewards(rewards, kl.new_zeros(n, t + 1), mask, 0.1)
