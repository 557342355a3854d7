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
        name,
        logp,
        old,
        adv,
        mask,
        full_kwargs["clip_ratio_low"],
        full_kwargs["clip_ratio_high"],
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


def naive_gspo_objective(logp, old, adv_N, mask, low, high):
    """GSPO objective from the paper (Zheng et al. 2025, arXiv:2507.18071, Eq. for J_GSPO), per sample:

        s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t (logp_it - old_it))
        J   = mean_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i)
    over the non-empty rows; logp may require grad.
    """
    terms = []
    for i in range(logp.shape[0]):
        valid = [j for j in range(logp.shape[1]) if mask[i, j] != 0]
        if not valid:
            continue
        s_i = torch.exp(sum(logp[i, j] - old[i, j] for j in valid) / len(valid))
        a_i = adv_N[i]
        terms.append(torch.minimum(s_i * a_i, s_i.clamp(1 - low, 1 + high) * a_i))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_form_matches_sequence_level_objective(seed):
    """seq-mean-token-mean of the per-token GSPO loss == -J_GSPO, in value and in gradient."""
    logp, old, adv_N, mask = _batch(seed, 16, 13, spread=0.05)
    low, high = 0.01, 0.015
    x = logp.clone().requires_grad_(True)
    loss_NT, m = compute_policy_loss("gspo", x, old, adv_N, mask, clip_ratio_low=low, clip_ratio_high=high)
    ours = aggregate_loss(loss_NT, mask, "seq-mean-token-mean", normalizer_count(mask, "seq-mean-token-mean"))
    ours.backward()
    y = logp.clone().requires_grad_(True)
    objective = naive_gspo_objective(y, old, adv_N, mask, low, high)
    objective.backward()
    assert torch.allclose(ours, -objective, atol=1e-12)
    assert torch.allclose(x.grad, -y.grad, atol=1e-12)
    assert 0 < m["clip_frac"].item() < 1  # both clipped and unclipped sequences are compared


def _gspo_inputs(seed, n=256, t=48, dtype=torch.float32):
    """log-probs near -30 (float32 ulp 2e-6) and sequence ratios within ~1e-6 of a clip bound.

    Half the rows sit at 1 + high with A > 0 (upper bound), half at 1 - low with A < 0.
    """
    g = torch.Generator().manual_seed(seed)
    low, high = 3e-4, 4e-4
    logp = -30.0 + torch.rand(n, t, generator=g, dtype=torch.float64)
    up_N = torch.arange(n) % 2 == 0
    target_N = torch.where(
        up_N, torch.tensor(math.log1p(high), dtype=torch.float64), torch.tensor(math.log1p(-low), dtype=torch.float64)
    )
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    # token log-ratios spread by 1e-3 but with row mean at the bound, give or take 1e-6
    noise_NT = 1e-3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    noise_NT = noise_NT - (noise_NT * mask).sum(1, keepdim=True) / lengths[:, None]
    d_NT = target_N[:, None] + 1e-6 * torch.randn(n, 1, generator=g, dtype=torch.float64) + noise_NT
    adv_N = torch.where(up_N, 1.0, -1.0).double() * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))
    return logp.to(dtype), (logp - d_NT).to(dtype), adv_N.to(dtype), mask, low, high


def _old_gspo_ratio(logp, old, mask):
    """The previous implementation's s_NT: exp(seq_d + logp - sg[logp]) rounds seq_d + logp first."""
    valid = mask != 0
    logp = torch.where(valid, logp, 0.0)
    old = torch.where(valid, old, 0.0)
    seq_d_N = ((logp - old).sum(1) / valid.sum(1).clamp(min=1)).clamp(-20, 20)
    return torch.exp(seq_d_N[:, None] + logp - logp.detach())


def _split_rows(flag_NT, mask):
    """Rows whose valid tokens do not all share one value of flag_NT."""
    valid = mask != 0
    any_N = (flag_NT & valid).any(1)
    all_N = (flag_NT | ~valid).all(1)
    return int((any_N & ~all_N).sum())


def test_gspo_never_splits_a_sequence_at_a_clip_bound():
    old_splits = 0
    for seed in range(4):
        logp, old, adv_N, mask, low, high = _gspo_inputs(seed)
        valid = mask != 0
        # The old formula decides per token and splits sequences on these inputs.
        s_old = _old_gspo_ratio(logp, old, mask)
        old_splits += _split_rows((s_old > 1 + high) | (s_old < 1 - low), mask)

        x = logp.clone().requires_grad_(True)
        loss_NT, m = compute_policy_loss("gspo", x, old, adv_N, mask, clip_ratio_low=low, clip_ratio_high=high)
        loss_NT.sum().backward()
        clipped_N = torch.zeros(len(adv_N), dtype=torch.bool)
        for i in range(len(adv_N)):
            row_loss, row_grad = loss_NT[i][valid[i]], x.grad[i][valid[i]]
            # one value per sequence: the same loss and the same gradient on every valid token
            assert torch.equal(row_loss, row_loss[:1].expand_as(row_loss)), i
            assert torch.equal(row_grad, row_grad[:1].expand_as(row_grad)), i
            clipped_N[i] = row_grad[0] == 0
        n_clipped_tokens = mask.sum(1)[clipped_N].sum()
        assert m["clip_frac"].item() == pytest.approx((n_clipped_tokens / mask.sum()).item(), abs=1e-7)
        assert 0 < clipped_N.float().mean() < 1  # the bound is really in the middle of the rows
    assert old_splits > 0


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
