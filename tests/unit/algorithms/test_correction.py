"""Rollout correction (TIS / MIS) vs naive per-token Python loops.

Legend: N sequences, T tokens; _NT per token, _N per sequence.
"""

import math

import pytest
import torch

from hybrid_rl.algorithms import CORRECTION_MODES, rollout_correction


def _batch(seed, n, t):
    """Rows with mismatch scales from tiny to large, so every mode both keeps and corrects."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    scale_N = torch.logspace(-2.5, 0, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
    engine = old + scale_N[:, None] * torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (n,), generator=g).tolist()
    lengths[int(torch.randint(0, n, (1,), generator=g))] = 0  # one empty row
    mask = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return old, engine, mask


SHAPES = [(5, 1), (8, 8), (6, 257)]
CAPS = [(2.0, None), (1.5, 0.8)]


def naive(old, engine, mask, mode, cap, lower):
    o, e, m = old.tolist(), engine.tolist(), mask.tolist()
    n, t = len(o), len(o[0])
    if lower is None and mode.startswith("mis"):
        lower = 1 / cap
    weight = [[1.0] * t for _ in range(n)]
    out_mask = [[float(x != 0) for x in row] for row in m]
    n_valid = n_masked = n_capped = 0
    abs_sum = k3_sum = 0.0
    ratio_max = None
    seq_abs_max = 0.0
    for i in range(n):
        valid = [j for j in range(t) if m[i][j] != 0]
        seq_log = sum(o[i][j] - e[i][j] for j in valid)
        if valid:
            seq_abs_max = max(seq_abs_max, abs(seq_log))
        if valid and mode.endswith("_seq"):
            ratio_max = max(ratio_max or 0.0, math.exp(min(seq_log, 20.0)))  # logged value is capped at e^20
        for j in valid:
            d = o[i][j] - e[i][j]
            n_valid += 1
            abs_sum += abs(d)
            k3_sum += math.exp(d) - 1 - d
            if not mode.endswith("_seq"):
                ratio_max = max(ratio_max or 0.0, math.exp(min(d, 20.0)))
            rho = math.exp(seq_log if mode.endswith("_seq") else d)
            out = rho > cap or (lower is not None and rho < lower)
            if mode.startswith("tis"):
                weight[i][j] = min(rho, cap) if lower is None else min(max(rho, lower), cap)
                n_capped += out
            elif mode.startswith("mis") and out:
                out_mask[i][j] = 0.0
                n_masked += 1
    v = max(n_valid, 1)
    metrics = {
        "mismatch_abs_logp_mean": abs_sum / v,
        "mismatch_k3_mean": k3_sum / v,
        "mismatch_ratio_max": ratio_max if ratio_max is not None else 1.0,
        "mismatch_seq_log_ratio_abs_max": seq_abs_max,
        "mismatch_frac_masked": n_masked / v,
        "mismatch_frac_capped": n_capped / v,
    }
    return weight, out_mask, metrics


@pytest.mark.parametrize("mode", CORRECTION_MODES)
@pytest.mark.parametrize("n,t", SHAPES)
@pytest.mark.parametrize("cap,lower", CAPS)
def test_matches_naive_loop(mode, n, t, cap, lower):
    old, engine, mask = _batch(n * t, n, t)
    w, out_mask, metrics = rollout_correction(old, engine, mask, mode, cap=cap, lower=lower)
    want_w, want_mask, want_metrics = naive(old, engine, mask, mode, cap, lower)
    assert not w.requires_grad
    assert torch.allclose(w, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12)
    assert out_mask.dtype == mask.dtype and torch.equal(out_mask, torch.tensor(want_mask))
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        assert metrics[k].dim() == 0
        assert metrics[k].item() == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("mode", CORRECTION_MODES[1:])
@pytest.mark.parametrize("n,t", SHAPES[1:])
@pytest.mark.parametrize("cap,lower", CAPS)
def test_cases_exercise_both_outcomes(mode, n, t, cap, lower):
    # Guard that test_matches_naive_loop compares both kept and corrected tokens.
    old, engine, mask = _batch(n * t, n, t)
    w, _, m = rollout_correction(old, engine, mask, mode, cap=cap, lower=lower)
    frac = (m["mismatch_frac_masked"] + m["mismatch_frac_capped"]).item()
    assert 0 < frac < 1


def test_none_mode_is_identity():
    old, engine, mask = _batch(1, 4, 5)
    mask = mask.bool()
    w, out_mask, m = rollout_correction(old, engine, mask, "none")
    assert torch.equal(w, torch.ones_like(w)) and torch.equal(out_mask, mask)
    assert m["mismatch_frac_masked"].item() == 0 and m["mismatch_frac_capped"].item() == 0
    assert m["mismatch_abs_logp_mean"].item() > 0


def test_mis_seq_masks_whole_rows_and_tis_seq_is_constant_per_row():
    old = torch.zeros(3, 4)
    engine = torch.tensor([[-0.5] * 4, [0.0, 0.0, 0.0, -0.1], [0.3] * 4])  # seq log-ratio 2, 0.1, -1.2
    mask = torch.ones(3, 4)
    _, out_mask, _ = rollout_correction(old, engine, mask, "mis_seq", cap=2.0)
    assert out_mask.tolist() == [[0.0] * 4, [1.0] * 4, [0.0] * 4]
    w, _, _ = rollout_correction(old, engine, mask, "tis_seq", cap=2.0)
    assert torch.allclose(w[0], torch.full((4,), 2.0)) and torch.allclose(w[1], torch.full((4,), math.exp(0.1)))
    assert torch.allclose(w[2], torch.full((4,), math.exp(-1.2)))


def test_extreme_mismatch_is_finite_and_padding_ignored():
    old = torch.tensor([[0.0, -300.0, float("nan")]])
    engine = torch.tensor([[-300.0, 0.0, -float("inf")]])
    mask = torch.tensor([[1, 1, 0]])
    for mode in CORRECTION_MODES:
        w, out_mask, m = rollout_correction(old, engine, mask, mode)
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in m.values()), mode
        assert w[0, 2].item() == 1.0 and out_mask[0, 2].item() == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="is"), "valid modes"),
        (dict(cap=0.0), "cap"),
        (dict(lower=3.0), "lower"),
        (dict(engine_logp_NT=torch.zeros(2, 2)), "engine_logp_NT"),
        (dict(mask_NT=torch.ones(2)), "mask_NT"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    args = dict(
        old_logp_NT=torch.zeros(2, 3), engine_logp_NT=torch.zeros(2, 3), mask_NT=torch.ones(2, 3), mode="tis_token"
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rollout_correction(**args)
