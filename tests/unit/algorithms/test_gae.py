"""GAE, the clipped value loss, outcome token rewards and explained variance (algorithms/gae.py).

References, all plain Python floats:
    naive_gae        the GAE paper (Schulman et al. 2016, arXiv:1506.02438) per token, run on the
                     subsequence of generated tokens (mask 1) of each row
    verl_gae         verl's compute_gae_advantage_return (verl/trainer/ppo/core_algos.py, read at
                     commit 012be9d) restated: a reversed loop over every column whose carried
                     next-value and advantage are only updated on tokens with mask 1
    naive_value_loss verl's compute_value_loss restated per token, token-mean
plus tables computed by hand.

Legend: N sequences, T response tokens; mask 1 = generated token, 0 = padding or observation token.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybrid_rl.algorithms import (
    LOSS_AGG_MODES,
    aggregate_loss,
    explained_variance,
    gae_advantages_returns,
    outcome_token_rewards,
    value_loss,
)
from tests.unit.algorithms.test_reinforce_pp import _split_run

EPS = 1e-6
F64 = torch.float64


# ---------------------------------------------------------------- naive references
def naive_gae(r, v, m, gamma, lam):
    """Per row: GAE over the generated tokens only; 0 advantage and return elsewhere."""
    adv, ret = [], []
    for r_i, v_i, m_i in zip(r, v, m):
        idx = [t for t, k in enumerate(m_i) if k]
        a_row, g_row = [0.0] * len(m_i), [0.0] * len(m_i)
        for k in range(len(idx)):
            t = idx[k]
            a = 0.0
            # A_t = sum_l (gamma lam)^l delta_{t+l}, l counting generated tokens.
            for step, s in enumerate(idx[k:]):
                nxt = v_i[idx[k + step + 1]] if k + step + 1 < len(idx) else 0.0
                delta = r_i[s] + gamma * nxt - v_i[s]
                a += (gamma * lam) ** step * delta
            a_row[t], g_row[t] = a, a + v_i[t]
        adv.append(a_row)
        ret.append(g_row)
    return adv, ret


def verl_gae(r, v, m, gamma, lam):
    """verl's loop, per row; returns (advantages, returns) unwhitened, at every column as verl leaves them."""
    adv, ret = [], []
    for r_i, v_i, m_i in zip(r, v, m):
        next_value, last = 0.0, 0.0
        a_row = [0.0] * len(m_i)
        for t in reversed(range(len(m_i))):
            delta = r_i[t] + gamma * next_value - v_i[t]
            new = delta + gamma * lam * last
            if m_i[t]:
                next_value, last = v_i[t], new
            a_row[t] = last
        adv.append(a_row)
        ret.append([a + b for a, b in zip(a_row, v_i)])
    return adv, ret


def _valid(x, m):
    return [x[i][t] for i in range(len(m)) for t in range(len(m[i])) if m[i][t]]


def naive_whiten(x, m, eps=EPS):
    """Ours: (x - mean) / (std + eps) over the valid tokens, unbiased std; 0 elsewhere."""
    vals = _valid(x, m)
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((a - mean) ** 2 for a in vals) / (len(vals) - 1))
    return [[(x[i][t] - mean) / (std + eps) if m[i][t] else 0.0 for t in range(len(m[i]))] for i in range(len(m))]


def verl_whiten(x, m):
    """verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8), unbiased var over the mask."""
    vals = _valid(x, m)
    mean = sum(vals) / len(vals)
    var = sum((a - mean) ** 2 for a in vals) / (len(vals) - 1)
    return [[(x[i][t] - mean) / math.sqrt(var + 1e-8) for t in range(len(m[i]))] for i in range(len(m))]


def naive_value_loss(vp, ret, old, m, c):
    """verl's compute_value_loss with token-mean, per token: (loss, clipfrac)."""
    total, clipped, n = 0.0, 0, 0
    for i in range(len(m)):
        for t in range(len(m[i])):
            if not m[i][t]:
                continue
            v_clip = min(max(vp[i][t], old[i][t] - c), old[i][t] + c)
            l1, l2 = (vp[i][t] - ret[i][t]) ** 2, (v_clip - ret[i][t]) ** 2
            total += max(l1, l2)
            clipped += l2 > l1
            n += 1
    return 0.5 * total / n, clipped / n


# ---------------------------------------------------------------- batches
def _mask(rng, n, t, holes):
    """Rows of random length (some empty, some full), right-padded; with holes, runs of 0 inside (observations)."""
    rows = []
    for i in range(n):
        length = [0, t, 1][i] if i < 3 else rng.randint(1, t)
        row = [1] * length + [0] * (t - length)
        if holes and length > 3:
            a = rng.randint(1, length - 2)
            for s in range(a, min(a + rng.randint(1, 3), length - 1)):
                row[s] = 0
        rows.append(row)
    return rows


def _batch(seed, n=9, t=11, holes=True):
    """rewards on the last generated token plus a small per-token term; values with garbage where masked."""
    rng = random.Random(seed)
    m = _mask(rng, n, t, holes)
    v = [[rng.uniform(-1, 1) if k else rng.choice([7.0, -5.0]) for k in row] for row in m]
    r = []
    for row in m:
        last = max((s for s, k in enumerate(row) if k), default=-1)
        r.append(
            [
                (rng.choice([0.0, 1.0]) if s == last else 0.0) + (rng.uniform(-0.1, 0.1) if k else 0.0)
                for s, k in enumerate(row)
            ]
        )
    return r, v, m


def _t(x):
    return torch.tensor(x, dtype=F64)


def _run(r, v, m, gamma, lam, whiten=False):
    return gae_advantages_returns(_t(r), _t(v), torch.tensor(m), gamma, lam, whiten=whiten)


GAMMA_LAM = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (0.0, 0.0), (0.5, 1.0)]


# ---------------------------------------------------------------- GAE vs the paper's loop
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("holes", [False, True])
def test_matches_naive_loop(seed, gamma, lam, holes):
    """Catches: an off-by-one bootstrap (V_t or V_{t+2} for V_{t+1}), a dropped or doubled discount, holes that
    accumulate or bootstrap, nonzero values at masked positions."""
    r, v, m = _batch(seed, holes=holes)
    adv, ret = _run(r, v, m, gamma, lam)
    want_adv, want_ret = naive_gae(r, v, m, gamma, lam)
    assert torch.allclose(adv, _t(want_adv), rtol=1e-12, atol=1e-12)
    assert torch.allclose(ret, _t(want_ret), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_whitened_matches_naive_whitening_over_the_mask(seed, gamma, lam):
    """Catches: whitening over padding or observation tokens, whitening the returns, a biased std."""
    r, v, m = _batch(seed)
    adv, ret = _run(r, v, m, gamma, lam, whiten=True)
    want_adv, want_ret = naive_gae(r, v, m, gamma, lam)
    assert torch.allclose(adv, _t(naive_whiten(want_adv, m)), rtol=1e-10, atol=1e-10)
    assert torch.allclose(ret, _t(want_ret), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_matches_verl_on_generated_tokens(seed, gamma, lam):
    """verl's loop: equal on every generated token, before and after whitening (verl divides by
    sqrt(var + 1e-8), we by std + 1e-6: a relative difference of about 1e-6 / std). At masked positions verl
    carries the next token's advantage (and returns = that + the garbage V there); we return 0 there, which
    no loss reads."""
    r, v, m = _batch(seed)
    adv, ret = _run(r, v, m, gamma, lam)
    adv_w, _ = _run(r, v, m, gamma, lam, whiten=True)
    v_adv, v_ret = verl_gae(r, v, m, gamma, lam)
    valid = torch.tensor(m) != 0
    assert torch.allclose(adv[valid], _t(v_adv)[valid], rtol=1e-12, atol=1e-12)
    assert torch.allclose(ret[valid], _t(v_ret)[valid], rtol=1e-12, atol=1e-12)
    assert torch.allclose(adv_w[valid], _t(verl_whiten(v_adv, m))[valid], rtol=1e-4, atol=1e-5)
    assert torch.equal(adv[~valid], torch.zeros_like(adv[~valid])) and torch.equal(ret[~valid], adv[~valid])


# ---------------------------------------------------------------- by hand
def test_hand_table_gamma_lam_one():
    """r = [0, 0, 1], V = [.5, .6, .7]: delta = [.1, .1, .3], A = [.5, .4, .3], R = [1, 1, 1] (lam = 1: the
    Monte Carlo return, whatever V)."""
    adv, ret = _run([[0, 0, 1]], [[0.5, 0.6, 0.7]], [[1, 1, 1]], 1.0, 1.0)
    assert torch.allclose(adv, _t([[0.5, 0.4, 0.3]]), atol=1e-12)
    assert torch.allclose(ret, _t([[1.0, 1.0, 1.0]]), atol=1e-12)


def test_hand_table_with_an_observation_hole_and_padding():
    """mask [1, 0, 1, 0], gamma .9, lam .8, V = [.5, 9, .7, -3] (9 and -3 never read):
    delta_0 = 0 + .9 * .7 - .5 = .13 (bootstraps from token 2 across the hole), delta_2 = 1 - .7 = .3,
    A_2 = .3, A_0 = .13 + .72 * .3 = .346; R = [.846, 0, 1, 0]. Catches: a hole that bootstraps (V=9) or
    discounts (an extra .72), or a reward read from the hole."""
    adv, ret = _run([[0, 0, 1, 0]], [[0.5, 9.0, 0.7, -3.0]], [[1, 0, 1, 0]], 0.9, 0.8)
    assert torch.allclose(adv, _t([[0.346, 0.0, 0.3, 0.0]]), atol=1e-12)
    assert torch.allclose(ret, _t([[0.846, 0.0, 1.0, 0.0]]), atol=1e-12)


def test_hand_table_gamma_zero_and_lam_zero():
    """gamma = 0: A = r - V (no bootstrap, no accumulation); lam = 0: A = r + gamma V_next - V (one-step TD)."""
    r, v, m = [[0.0, 0.2, 1.0]], [[0.5, 0.6, 0.7]], [[1, 1, 1]]
    adv, ret = _run(r, v, m, 0.0, 0.9)
    assert torch.allclose(adv, _t([[-0.5, -0.4, 0.3]]), atol=1e-12)
    assert torch.allclose(ret, _t(r), atol=1e-12)
    adv, ret = _run(r, v, m, 0.5, 0.0)
    assert torch.allclose(adv, _t([[0.5 * 0.6 - 0.5, 0.2 + 0.5 * 0.7 - 0.6, 1.0 - 0.7]]), atol=1e-12)
    assert torch.allclose(ret, _t([[0.3, 0.55, 1.0]]), atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_lam_one_returns_are_discounted_returns_whatever_the_values(gamma):
    """With lam = 1 the V terms telescope: R_t = sum_k gamma^k r_{t+k} over generated tokens."""
    r, v, m = _batch(4)
    _, ret = _run(r, v, m, gamma, 1.0)
    _, ret_other_v = _run(r, [[x * 3 + 1 for x in row] for row in v], m, gamma, 1.0)
    want = []
    for r_i, m_i in zip(r, m):
        idx = [t for t, k in enumerate(m_i) if k]
        row = [0.0] * len(m_i)
        for k, t in enumerate(idx):
            row[t] = sum(gamma**j * r_i[s] for j, s in enumerate(idx[k:]))
        want.append(row)
    assert torch.allclose(ret, _t(want), atol=1e-12) and torch.allclose(ret_other_v, _t(want), atol=1e-12)


def test_holes_are_invisible():
    """Inserting observation tokens (mask 0, NaN values) anywhere inside a row changes nothing on the generated
    tokens. Catches: a hole that accumulates (discounts) or bootstraps, NaN leaking from a hole."""
    r, v, m = [[0.1, 0.0, -0.2, 0.0, 1.0]], [[0.3, -0.1, 0.4, 0.2, 0.6]], [[1, 1, 1, 1, 1]]
    dense_adv, dense_ret = _run(r, v, m, 0.9, 0.7, whiten=True)
    holey = [0, 1, None, None, 2, 3, None, 4, None]  # source column, or None for an observation token
    r2 = [[r[0][s] if s is not None else 0.0 for s in holey]]
    v2 = [[v[0][s] if s is not None else float("nan") for s in holey]]
    m2 = [[1 if s is not None else 0 for s in holey]]
    adv, ret = _run(r2, v2, m2, 0.9, 0.7, whiten=True)
    cols = [k for k, s in enumerate(holey) if s is not None]
    assert torch.allclose(adv[:, cols], dense_adv, atol=1e-12) and torch.allclose(ret[:, cols], dense_ret, atol=1e-12)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


def test_whitening_is_over_the_mask_not_the_padding():
    """Two rows, one long and one short: padding zeros must not enter the mean. Catches whitening over padding."""
    r, v, m = [[0, 0, 0, 1.0], [0.5, 0, 0, 0]], [[0.1, 0.2, 0.3, 0.4], [0.9, 0, 0, 0]], [[1, 1, 1, 1], [1, 0, 0, 0]]
    adv, _ = _run(r, v, m, 1.0, 1.0, whiten=True)
    raw, _ = naive_gae(r, v, m, 1.0, 1.0)
    assert torch.allclose(adv, _t(naive_whiten(raw, m)), atol=1e-12)
    valid = torch.tensor(m) != 0
    assert abs(adv[valid].mean().item()) < 1e-12 and abs(adv[valid].std().item() - 1.0) < 1e-5


def test_whiten_false_and_degenerate_rows():
    """An empty row gives zeros; a single valid token in the whole batch whitens to exactly 0."""
    adv, ret = _run([[0, 0], [0, 1.0]], [[0, 0], [0.2, 0.5]], [[0, 0], [0, 1]], 0.9, 0.9, whiten=True)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert torch.allclose(ret, _t([[0, 0], [0, 1.0]]))


@pytest.mark.parametrize("cut", [3, 0, 9])
def test_split_batch_with_reduce_sum_equals_whole_batch(cut):
    r, v, m = _batch(5)
    rt, vt, mt = _t(r), _t(v), torch.tensor(m)

    def fn(rows, reduce_sum):
        return gae_advantages_returns(rt[rows], vt[rows], mt[rows], 0.95, 0.9, reduce_sum=reduce_sum)[0]

    whole = fn(torch.arange(9), None)
    split = torch.cat(_split_run(fn, [torch.arange(0, cut), torch.arange(cut, 9)]))
    assert torch.allclose(split, whole, rtol=1e-12, atol=1e-12)


def test_stats_mask_and_dtypes():
    r, v, m = _batch(6)
    mt = torch.tensor(m)
    keep = mt.clone()
    keep[3:] = 0  # only the first rows' tokens set the whitening statistics
    adv, _ = gae_advantages_returns(_t(r), _t(v), mt, 0.9, 0.9, stats_mask_NT=keep)
    raw, _ = naive_gae(r, v, m, 0.9, 0.9)
    stats = _valid(raw[:3], m[:3])
    mean = sum(stats) / len(stats)
    std = math.sqrt(sum((a - mean) ** 2 for a in stats) / (len(stats) - 1))
    want = [[(raw[i][t] - mean) / (std + EPS) if m[i][t] else 0.0 for t in range(11)] for i in range(9)]
    assert torch.allclose(adv, _t(want), atol=1e-10)
    a32, r32 = gae_advantages_returns(_t(r).float(), _t(v).float(), mt.bool(), 0.9, 0.9)
    a64, _ = gae_advantages_returns(_t(r), _t(v), mt, 0.9, 0.9)
    assert a32.dtype == r32.dtype == torch.float32 and a64.dtype == F64
    assert torch.allclose(a32.double(), a64, atol=1e-5)


def test_inputs_are_not_differentiated():
    v = _t([[0.1, 0.2]]).requires_grad_()
    adv, ret = gae_advantages_returns(_t([[0.0, 1.0]]), v, torch.ones(1, 2), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------- GAE bad input
@pytest.mark.parametrize(
    "change,match",
    [
        (dict(gamma=-0.1), "gamma must be in \\[0, 1\\]"),
        (dict(gamma=1.01), "gamma must be in \\[0, 1\\]"),
        (dict(gamma=float("nan")), "gamma must be in \\[0, 1\\]"),
        (dict(lam=-1e-9), "lam must be in \\[0, 1\\]"),
        (dict(lam=2.0), "lam must be in \\[0, 1\\]"),
        (dict(values=torch.zeros(2, 4)), "token_level_rewards must have the \\(N, T\\) shape \\(2, 4\\)"),
        (dict(mask=torch.ones(2, 2)), "mask must have the \\(N, T\\) shape"),
        (dict(values=torch.zeros(6)), "values must be a 2-D"),
        (dict(values=torch.zeros(2, 3, dtype=torch.long)), "values must be a float tensor"),
        (
            dict(token_level_rewards=_t([[0, 0, 1.0], [0, 0.5, 0]]), mask=torch.tensor([[1, 1, 1], [1, 0, 0]])),
            "nonzero on tokens with mask 0",
        ),
        (dict(values=_t([[0, float("nan"), 0], [0, 0, 0]])), "values has NaN or inf"),
        (dict(token_level_rewards=_t([[0, 0, float("inf")], [0, 0, 0]])), "token_level_rewards has NaN or inf"),
        (dict(eps=-1.0), "eps must be >= 0"),
    ],
)
def test_gae_bad_input_raises(change, match):
    kwargs = dict(
        token_level_rewards=_t([[0, 0, 1.0], [0, 0, 0]]),
        values=_t([[0.0] * 3] * 2),
        mask=torch.ones(2, 3),
        gamma=0.9,
        lam=0.9,
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        gae_advantages_returns(**kwargs)


# ---------------------------------------------------------------- outcome token rewards
def test_outcome_token_rewards_on_the_last_generated_token_minus_kl():
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    kl = _t([[0.1, 0.2, 9.0, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0, 9.0], [9.0] * 5])
    r = outcome_token_rewards(torch.tensor([1, 0, 1]), mask)
    assert r.dtype == torch.float32
    assert torch.equal(r, torch.tensor([[0, 0, 0, 1.0, 0], [0.0] * 5, [0.0] * 5]))
    r = outcome_token_rewards(_t([1.0, 0.5, 1.0]), mask, kl_NT=kl, kl_coef=0.5)
    want = _t([[-0.05, -0.1, 0, 1.0 - 0.15, 0], [0.5 - 0.2, 0, 0, 0, 0], [0.0] * 5])
    assert r.dtype == F64 and torch.allclose(r, want, atol=1e-12)
    # The sum over a row is kl_penalty_rewards' folded score: the two placements agree on the total.
    from hybrid_rl.algorithms import kl_penalty_rewards

    # An empty row has no token to carry its score: both give it 0 when its score is 0.
    assert torch.allclose(r.sum(1), kl_penalty_rewards(_t([1.0, 0.5, 0.0]), kl, mask, 0.5))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(scores_N=torch.zeros(2, 1)), "scores_N must be a 1-D"),
        (dict(mask_NT=torch.ones(3, 4)), "3 rows for 2 scores"),
        (dict(mask_NT=torch.ones(4)), "mask_NT must be a 2-D"),
        (dict(kl_coef=0.1), "needs kl_NT"),
        (dict(kl_NT=torch.zeros(2, 3)), "kl_NT must have the \\(N, T\\) shape"),
        (dict(scores_N=torch.tensor([float("nan"), 0.0])), "NaN or inf"),
    ],
)
def test_outcome_token_rewards_bad_input(kwargs, match):
    args = dict(scores_N=torch.zeros(2), mask_NT=torch.ones(2, 4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        outcome_token_rewards(args.pop("scores_N"), args.pop("mask_NT"), **args)


def test_rewards_feed_gae():
    """The two steps together: outcome on the last generated token of a multi-turn episode, one hole."""
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    r = outcome_token_rewards(torch.tensor([1.0]), mask)
    adv, ret = gae_advantages_returns(r, torch.zeros(1, 6), mask, 1.0, 1.0, whiten=False)
    assert torch.equal(ret, mask.float()) and torch.equal(adv, mask.float())


# ---------------------------------------------------------------- value loss
def _vl_batch(seed, n=6, t=7):
    rng = random.Random(seed)
    m = _mask(rng, n, t, holes=True)
    old = [[rng.uniform(-1, 1) for _ in range(t)] for _ in range(n)]
    vp = [[o + rng.uniform(-0.6, 0.6) for o in row] for row in old]
    ret = [[rng.uniform(-1.5, 1.5) for _ in range(t)] for _ in range(n)]
    return vp, ret, old, m


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("c", [0.2, 0.5, 10.0])
def test_value_loss_matches_verl_per_token(seed, c):
    """Catches: a dropped 0.5, min for max, a clip around the returns (or the new values) instead of the old
    values, clipfrac counting the wrong side."""
    vp, ret, old, m = _vl_batch(seed)
    loss, clipfrac = value_loss(_t(vp), _t(ret), _t(old), torch.tensor(m), c, "token-mean")
    want_loss, want_frac = naive_value_loss(vp, ret, old, m, c)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    assert clipfrac.item() == pytest.approx(want_frac, abs=1e-6)
    assert clipfrac.dtype == torch.float32 and not clipfrac.requires_grad


def test_value_loss_random_cases_do_clip():
    """Guard for the test above: in the random cases the clip is active on some tokens and not on others."""
    fracs = [naive_value_loss(*_vl_batch(s), 0.2)[1] for s in range(4)]
    assert all(0.05 < f < 0.95 for f in fracs)


def test_value_loss_by_hand():
    """Three tokens, c = 0.2, R = 1:
    t0: v = 0.5, old = 0.0 -> v_clip = 0.2; l1 = 0.25, l2 = 0.64 -> 0.64, clipped
    t1: v = 1.4, old = 1.0 -> v_clip = 1.2; l1 = 0.16, l2 = 0.04 -> 0.16, not clipped (moving away from R)
    t2: v = 0.9, old = 1.0 -> v_clip = 0.9; l1 = l2 = 0.01 -> 0.01, not clipped (within the range)
    loss = 0.5 * (0.64 + 0.16 + 0.01) / 3 = 0.135, clipfrac = 1/3; a masked 4th token (NaN) is ignored.
    Gradient: d/dv_t of 0.5 * l_t / 3 is (v - R) / 3 where the unclipped error wins, 0 where the clipped one does."""
    nan = float("nan")
    vp = _t([[0.5, 1.4, 0.9, nan]]).requires_grad_()
    loss, frac = value_loss(
        vp, _t([[1.0, 1.0, 1.0, nan]]), _t([[0.0, 1.0, 1.0, nan]]), torch.tensor([[1, 1, 1, 0]]), 0.2, "token-mean"
    )
    assert loss.item() == pytest.approx(0.135, abs=1e-12) and frac.item() == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(vp.grad, _t([[0.0, 0.4 / 3, -0.1 / 3, 0.0]]), atol=1e-12)


def test_value_loss_no_clip_and_modes():
    vp, ret, old, m = _vl_batch(7)
    args = (_t(vp), _t(ret), _t(old), torch.tensor(m))
    loss, frac = value_loss(*args, None, "token-mean")
    sq = (_t(vp) - _t(ret)).square()
    assert loss.item() == pytest.approx(0.5 * sq[torch.tensor(m) != 0].mean().item(), rel=1e-12)
    assert frac.item() == 0.0
    # Every aggregation mode goes through aggregate_loss with the same normaliser rules as the policy loss.
    _, _, _, mask = args
    vp_c = torch.minimum(torch.maximum(_t(vp), _t(old) - 0.3), _t(old) + 0.3)
    per_tok = torch.maximum(sq, (vp_c - _t(ret)).square())
    for mode in LOSS_AGG_MODES:
        got, _ = value_loss(*args, 0.3, mode, global_normalizer=7.0, norm_length=11)
        want = 0.5 * aggregate_loss(per_tok, mask, mode, 7.0, norm_length=11)
        assert got.item() == pytest.approx(want.item(), rel=1e-12), mode


def test_value_loss_micro_batches_sum_to_the_whole():
    """With a global normaliser, micro-batch losses add up to the mini-batch loss (gradient accumulation)."""
    vp, ret, old, m = _vl_batch(8)
    args = [_t(vp), _t(ret), _t(old), torch.tensor(m)]
    whole, _ = value_loss(*args, 0.3, "token-mean")
    denom = float((args[3] != 0).sum())
    parts = [
        value_loss(*(a[rows] for a in args), 0.3, "token-mean", global_normalizer=denom)[0]
        for rows in (slice(0, 2), slice(2, 6))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-12)


def test_value_loss_empty_mask_and_dtypes():
    v = torch.zeros(2, 3, requires_grad=True)
    loss, frac = value_loss(v, torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), 0.5, "token-mean")
    assert loss.item() == 0.0 and frac.item() == 0.0
    loss.backward()
    assert torch.equal(v.grad, torch.zeros(2, 3))
    loss, _ = value_loss(
        torch.zeros(1, 2, dtype=torch.bfloat16),
        torch.ones(1, 2),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        0.5,
        "token-mean",
    )
    assert loss.dtype == torch.float32


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cliprange_value=0.0), "cliprange_value must be > 0 or None"),
        (dict(cliprange_value=-0.5), "cliprange_value must be > 0 or None"),
        (dict(returns=torch.zeros(2, 4)), "returns must have the \\(N, T\\) shape \\(2, 3\\)"),
        (dict(old_values=torch.zeros(3, 3)), "old_values must have the \\(N, T\\) shape"),
        (dict(mask=torch.ones(2)), "mask must be a 2-D"),
        (dict(loss_agg_mode="mean"), "unknown loss aggregation mode"),
    ],
)
def test_value_loss_bad_input(change, match):
    kwargs = dict(
        vpreds=torch.zeros(2, 3),
        returns=torch.zeros(2, 3),
        old_values=torch.zeros(2, 3),
        mask=torch.ones(2, 3),
        cliprange_value=0.5,
        loss_agg_mode="token-mean",
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        value_loss(**kwargs)


# ---------------------------------------------------------------- explained variance
def test_explained_variance_matches_verl_metric():
    """verl: 1 - var(R - V) / (var(R) + 1e-5) over the mask, unbiased variances."""
    vp, ret, _, m = _vl_batch(9)
    got = explained_variance(_t(vp), _t(ret), torch.tensor(m)).item()
    diff = [ret[i][t] - vp[i][t] for i in range(len(m)) for t in range(7) if m[i][t]]
    rv = _valid(ret, m)

    def var(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)

    assert got == pytest.approx(1 - var(diff) / (var(rv) + 1e-5), rel=1e-6)
    perfect = explained_variance(_t(ret), _t(ret), torch.tensor(m)).item()
    assert perfect == pytest.approx(1.0, abs=1e-4)
    assert explained_variance(torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]])).item() == 0.0


def test_explained_variance_split_with_reduce_sum():
    vp, ret, _, m = _vl_batch(10)
    a, b, mt = _t(vp), _t(ret), torch.tensor(m)

    def fn(rows, reduce_sum):
        return explained_variance(a[rows], b[rows], mt[rows], reduce_sum=reduce_sum).reshape(1)

    whole = fn(torch.arange(6), None)
    for out in _split_run(fn, [torch.arange(0, 2), torch.arange(2, 6)]):
        assert out.item() == pytest.approx(whole.item(), rel=1e-6)
