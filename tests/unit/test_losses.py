"""Policy losses vs naive per-token Python loops (values, gradients, metrics).

Legend: N sequences, T response tokens; _NT per token, _N per sequence.
"""
import math

import pytest
import torch

from hybrid_rl.algorithms import POLICY_LOSSES, aggregate_loss, compute_policy_loss, normalizer_count


# ---------------------------------------------------------------- random batches
def _batch(seed, n, t, spread=0.3, token_adv=False, lengths=None):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    old = logp + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn((n, t) if token_adv else (n,), generator=g, dtype=torch.float64)
    if lengths is None:
        lengths = torch.randint(0, t + 1, (n,), generator=g).tolist()
        lengths[0] = 0  # always one empty row
        lengths[-1] = t
    mask = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return logp, old, adv, mask


SHAPES = [(6, 1), (7, 11), (3, 257)]


def _adv_at(adv, i, j):
    return adv[i][j] if isinstance(adv[i], list) else adv[i]


def _clip(x, lo, hi):
    if lo is not None:
        x = max(x, lo)
    if hi is not None:
        x = min(x, hi)
    return x


# ---------------------------------------------------------------- naive references
def naive(name, logp, old, adv, mask, low, high, c=None):
    """Per-token loss, d loss_t / d logp_t, and metrics computed with plain floats."""
    lp, o, a, m = logp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    lo = None if low is None else 1 - low
    hi = None if high is None else 1 + high
    n, t = len(lp), len(lp[0])
    loss = [[0.0] * t for _ in range(n)]
    grad = [[0.0] * t for _ in range(n)]
    cnt = dict(low=0, high=0, dual=0, valid=0)
    kl_sum, ratios = 0.0, []
    for i in range(n):
        valid = [j for j in range(t) if m[i][j] != 0]
        seq_ratio = math.exp(sum(lp[i][j] - o[i][j] for j in valid) / len(valid)) if valid else 1.0
        for j in valid:
            A = _adv_at(a, i, j)
            d = lp[i][j] - o[i][j]
            r = seq_ratio if name == "gspo" else math.exp(d)
            cnt["valid"] += 1
            kl_sum += math.exp(d) - 1 - d
            ratios.append(r)
            if name == "cispo":
                w = _clip(r, lo, hi)
                loss[i][j] = -w * A * lp[i][j]
                grad[i][j] = -w * A
                cnt["high"] += hi is not None and r > hi
                cnt["low"] += lo is not None and r < lo
                continue
            pg = max(-A * r, -A * _clip(r, lo, hi))
            high_on = A > 0 and hi is not None and r > hi
            low_on = A < 0 and lo is not None and r < lo
            dual_on = c is not None and A < 0 and pg > -A * c
            if dual_on:
                pg = -A * c
            cnt["high"] += high_on
            cnt["low"] += low_on
            cnt["dual"] += dual_on
            loss[i][j] = pg
            grad[i][j] = 0.0 if (high_on or low_on or dual_on) else -A * r
    v = max(cnt["valid"], 1)
    metrics = {
        "clip_frac_low": cnt["low"] / v,
        "clip_frac_high": cnt["high"] / v,
        "clip_frac": (cnt["low"] + cnt["high"]) / v,
        "approx_kl": kl_sum / v,
        "ratio_mean": sum(ratios) / v if ratios else 1.0,
        "ratio_max": max(ratios) if ratios else 1.0,
        "ratio_min": min(ratios) if ratios else 1.0,
    }
    if name == "ppo_clip":
        metrics["dual_clip_frac"] = cnt["dual"] / v
    return loss, grad, metrics


CONFIGS = [
    ("ppo_clip", dict(clip_ratio_low=0.2, clip_ratio_high=0.2)),
    ("ppo_clip", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.3)),
    ("gspo", dict(clip_ratio_low=0.003, clip_ratio_high=0.004)),
    ("cispo", dict()),  # its default: upper bound only
    ("cispo", dict(clip_ratio_low=0.1, clip_ratio_high=0.3)),
]


def _run(name, kwargs, logp, old, adv, mask):
    x = logp.clone().requires_grad_(True)
    loss_NT, metrics = compute_policy_loss(name, x, old, adv, mask, **kwargs)
    loss_NT.sum().backward()
    return loss_NT.detach(), x.grad, metrics


@pytest.mark.parametrize("name,kwargs", CONFIGS)
@pytest.mark.parametrize("n,t", SHAPES)
@pytest.mark.parametrize("token_adv", [False, True])
def test_matches_naive_loop(name, kwargs, n, t, token_adv):
    spread = 0.02 if name == "gspo" else 0.3
    logp, old, adv, mask = _batch(n * t + token_adv, n, t, spread=spread, token_adv=token_adv)
    loss_NT, grad_NT, metrics = _run(name, kwargs, logp, old, adv, mask)
    full_kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None)
    if name == "cispo":
        full_kwargs["clip_ratio_low"] = None
    full_kwargs.update(kwargs)
    want_loss, want_grad, want_metrics = naive(
        name, logp, old, adv, mask, full_kwargs["clip_ratio_low"], full_kwargs["clip_ratio_high"],
        full_kwargs["clip_ratio_c"] if name == "ppo_clip" else None,
    )
    assert torch.allclose(loss_NT, torch.tensor(want_loss, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(grad_NT, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12)
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        assert metrics[k].dim() == 0 and not metrics[k].requires_grad
        assert metrics[k].item() == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_clipping_actually_happens_in_the_random_cases():
    # Guard that the naive comparisons above exercise the clipped branches.
    for name, kwargs in CONFIGS:
        spread = 0.02 if name == "gspo" else 0.3
        _, _, m = _run(name, kwargs, *_batch(7 * 11, 7, 11, spread=spread))
        assert m["clip_frac"].item() > 0, name
    _, _, m = _run("ppo_clip", dict(clip_ratio_c=1.3), *_batch(3 * 257, 3, 257))
    assert m["dual_clip_frac"].item() > 0


def test_gspo_token_form_matches_sequence_level_objective():
    """seq-mean-token-mean of GSPO-token == mean_i max(-A s_i, -A clip(s_i)) with s_i differentiable."""
    logp, old, adv_N, mask = _batch(3, 8, 13, spread=0.05)
    low, high = 0.01, 0.015
    x = logp.clone().requires_grad_(True)
    loss_NT, _ = compute_policy_loss("gspo", x, old, adv_N, mask, clip_ratio_low=low, clip_ratio_high=high)
    ours = aggregate_loss(loss_NT, mask, "seq-mean-token-mean", normalizer_count(mask, "seq-mean-token-mean"))
    ours.backward()
    y = logp.clone().requires_grad_(True)
    terms = []
    for i in range(8):
        valid = mask[i] != 0
        if not valid.any():
            continue
        s = torch.exp((y[i][valid] - old[i][valid]).mean())
        A = adv_N[i]
        terms.append(torch.maximum(-A * s, -A * s.clamp(1 - low, 1 + high)))
    ref = torch.stack(terms).mean()
    ref.backward()
    assert torch.allclose(ours, ref, atol=1e-12)
    assert torch.allclose(x.grad, y.grad, atol=1e-12)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_on_policy_ratio_one(name):
    logp, _, adv, mask = _batch(1, 4, 5)
    loss_NT, m = compute_policy_loss(name, logp, logp.clone(), adv, mask)
    if name != "cispo":
        assert torch.allclose(loss_NT, torch.where(mask != 0, -adv[:, None].expand(4, 5), 0.0))
    assert m["clip_frac"].item() == 0 and m["approx_kl"].item() == 0
    assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_garbage_at_masked_positions_is_ignored(name):
    logp, old, adv, mask = _batch(2, 5, 6)
    bad = torch.where(mask != 0, logp, torch.full_like(logp, -float("inf")))
    bad_old = torch.where(mask != 0, old, torch.full_like(old, float("nan")))
    ref_loss, ref_grad, ref_m = _run(name, {}, logp, old, adv, mask)
    loss_NT, grad_NT, m = _run(name, {}, bad, bad_old, adv, mask)
    assert torch.equal(loss_NT, ref_loss) and torch.equal(grad_NT, ref_grad)
    assert torch.equal(loss_NT[mask == 0], torch.zeros_like(loss_NT[mask == 0]))
    assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_all_masked_batch(name):
    logp, old, adv, _ = _batch(2, 3, 4)
    loss_NT, m = compute_policy_loss(name, logp, old, adv, torch.zeros(3, 4, dtype=torch.bool))
    assert torch.equal(loss_NT, torch.zeros(3, 4, dtype=torch.float64))
    assert m["clip_frac"].item() == 0 and m["approx_kl"].item() == 0
    assert m["ratio_max"].item() == m["ratio_min"].item() == m["ratio_mean"].item() == 1.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_weight_multiplies_and_bf16_upcasts(name):
    logp, old, adv, mask = _batch(5, 4, 6)
    w = torch.rand(4, 6, dtype=torch.float64)
    base, _ = compute_policy_loss(name, logp, old, adv, mask)
    weighted, _ = compute_policy_loss(name, logp, old, adv, mask, weight_NT=w)
    assert torch.allclose(weighted, base * w)
    out, _ = compute_policy_loss(name, logp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert out.dtype == torch.float32


def test_extreme_ratios_stay_finite():
    logp = torch.tensor([[0.0, -200.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 0.0]])
    for name in POLICY_LOSSES:
        for a in (1.0, -1.0):
            loss_NT, m = compute_policy_loss(name, logp, old, torch.tensor([a]), torch.ones(1, 2))
            loss_NT.sum().backward()
            assert torch.isfinite(loss_NT).all() and torch.isfinite(logp.grad).all()
            assert all(torch.isfinite(v) for v in m.values())
            logp.grad = None


def test_registry_and_unknown_name():
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo"}
    with pytest.raises(ValueError, match="cispo.*gspo.*ppo_clip"):
        compute_policy_loss("grpo", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1))


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(logp_NT=torch.zeros(3)), "2-D"),
        (dict(old_logp_NT=torch.zeros(2, 4)), "old_logp_NT"),
        (dict(mask_NT=torch.ones(3, 3)), "mask_NT"),
        (dict(adv=torch.zeros(3)), "advantages"),
        (dict(adv=torch.zeros(2, 4)), "advantages"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(weight_NT=torch.ones(2)), "weight_NT"),
    ],
)
def test_bad_inputs_raise(override, match):
    args = dict(logp_NT=torch.zeros(2, 3), old_logp_NT=torch.zeros(2, 3), adv=torch.zeros(2), mask_NT=torch.ones(2, 3))
    args.update(override)
    with pytest.raises(ValueError, match=match):
        POLICY_LOSSES["ppo_clip"](**args)
