"""Advantage estimators vs naive per-sample Python loops (plain floats).

Sequence-level estimators are checked here; the token-level REINFORCE++ ones go
through the same compute_advantages cases here and are tested in depth (gamma,
KL, length weighting, ranks) in test_reinforce_pp.py, whose naive references
this file reuses.

Legend: N sequences, T response tokens, group_ids_N prompt id of each sequence.
"""

import math
import random

import pytest
import torch

from hybrid_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_LEVEL_ESTIMATORS,
    AdvantageInputs,
    Estimator,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
    takes_token_kl,
)
from tests.unit.algorithms.test_reinforce_pp import naive_reinforce_pp, naive_reinforce_pp_baseline

EPS = 1e-6


# ---------------------------------------------------------------- naive references
def _groups(ids):
    out = {}
    for i, g in enumerate(ids):
        out.setdefault(g, []).append(i)
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def naive_grpo(r, ids, eps=EPS):
    out = [0.0] * len(r)
    for members in _groups(ids).values():
        vals = [r[i] for i in members]
        if len(vals) < 2 or len(set(vals)) == 1:
            continue
        m, s = _mean(vals), _std_unbiased(vals)
        for i in members:
            out[i] = (r[i] - m) / (s + eps)
    return out


def naive_drgrpo(r, ids, eps=EPS):
    out = [0.0] * len(r)
    for members in _groups(ids).values():
        m = _mean([r[i] for i in members])
        for i in members:
            out[i] = r[i] - m
    return out


def naive_rloo(r, ids, eps=EPS):
    out = [0.0] * len(r)
    for members in _groups(ids).values():
        for i in members:
            others = [r[j] for j in members if j != i]
            out[i] = r[i] - _mean(others) if others else 0.0
    return out


NAIVE_SEQ = {
    "grpo": naive_grpo,
    "drgrpo": naive_drgrpo,
    "rloo": naive_rloo,
}
# The critic-free estimators (gae's baseline is a learned value: test_gae.py and test_gae_is_a_table_entry below).
NAMES = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.critic)
SEQ_FNS = {"grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages}
T = 5


def naive_token(name, r, ids, mask):
    """(N, T) lists: token-level references, or the sequence value on every valid token."""
    if name == "reinforce_pp":
        return naive_reinforce_pp(r, mask)
    if name == "reinforce_pp_baseline":
        return naive_reinforce_pp_baseline(r, ids, mask)
    adv = NAIVE_SEQ[name](r, ids)
    return [[adv[i] if m else 0.0 for m in row] for i, row in enumerate(mask)]


def _mask(seed, n, t=T):
    """Right-padded response mask with ragged lengths (some rows empty, some full)."""
    rng = random.Random(seed + 1000)
    lengths = [rng.randint(0, t) for _ in range(n)]
    if n:
        lengths[0] = t
    return [[1 if j < length else 0 for j in range(t)] for length in lengths]


# ---------------------------------------------------------------- random batches
def _batch(seed, sizes, binary=False, shuffle=True):
    """Rewards and non-contiguous, shuffled group ids for groups of the given sizes."""
    rng = random.Random(seed)
    ids, r = [], []
    for k, size in enumerate(sizes):
        gid = rng.randint(-1000, 1000) * 1000 + k  # unique, arbitrary, possibly negative
        for _ in range(size):
            ids.append(gid)
            r.append(float(rng.randint(0, 1)) if binary else rng.gauss(0.0, 2.0))
    order = list(range(len(r)))
    if shuffle:
        rng.shuffle(order)
    return [r[i] for i in order], [ids[i] for i in order]


CASES = {
    "G8": [8, 8, 8, 8],
    "G2": [2, 2, 2, 2, 2],
    "unequal": [1, 2, 3, 5, 8, 13],
    "single_group": [6],
    "singletons": [1, 1, 1],
}


def _check(name, r, ids, mask, dtype=torch.float64, atol=1e-9):
    got = compute_advantages(name, torch.tensor(r, dtype=dtype), torch.tensor(ids), torch.tensor(mask))
    want = naive_token(name, r, ids, mask)
    assert got.dtype == dtype and got.shape == (len(r), len(mask[0]) if mask else T)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=atol, rtol=1e-6), (got, want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("binary", [False, True])
def test_matches_naive_loop(name, case, binary):
    for seed in range(3):
        r, ids = _batch(seed, CASES[case], binary=binary)
        _check(name, r, ids, _mask(seed, len(r)))


@pytest.mark.parametrize("name", NAMES)
def test_float32_matches_naive(name):
    r, ids = _batch(7, [4, 3, 6, 2])
    _check(name, r, ids, _mask(7, len(r)), dtype=torch.float32, atol=1e-4)


@pytest.mark.parametrize("name", sorted(NAIVE_SEQ))
def test_seq_level_is_broadcast_over_valid_tokens(name):
    r, ids = _batch(2, [3, 5, 2])
    r_t, ids_t, mask_t = torch.tensor(r, dtype=torch.float64), torch.tensor(ids), torch.tensor(_mask(2, len(r)))
    adv_N = SEQ_FNS[name](r_t, ids_t)
    got = compute_advantages(name, r_t, ids_t, mask_t)
    assert torch.equal(got, torch.where(mask_t != 0, adv_N[:, None], 0.0))


@pytest.mark.parametrize("name", sorted(NAIVE_SEQ))
def test_all_equal_groups_give_exact_zero(name):
    # 0.1 is not exactly representable: sum/n can differ from the value by an ulp.
    # (reinforce_pp_baseline zeroes c for such groups but then whitens over the batch,
    # so its value there is -mean/std; see test_reinforce_pp.py for its exact zeros.)
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 1.0, 0.0], dtype=dtype)
        ids = torch.tensor([5, 5, 5, 2, 2, 2, 2, 9, 9])
        adv = SEQ_FNS[name](r, ids)
        assert torch.equal(adv[:7], torch.zeros(7, dtype=dtype))
        assert (adv[7] > 0) and (adv[8] < 0)
        adv_NT = compute_advantages(name, r, ids, torch.ones(9, 3))
        assert torch.equal(adv_NT[:7], torch.zeros(7, 3, dtype=dtype))


@pytest.mark.parametrize("name", sorted(TOKEN_LEVEL_ESTIMATORS & set(NAMES)))
def test_token_level_all_equal_batch_is_zero(name):
    mask = torch.tensor(_mask(4, 6))
    adv = compute_advantages(name, torch.full((6,), 0.3), torch.arange(6), mask)
    assert torch.equal(adv, torch.zeros(6, T))


def test_grpo_equals_verl_style_contiguous_formula():
    torch.manual_seed(0)
    r_BG = torch.randn(5, 4, dtype=torch.float64)
    want = (r_BG - r_BG.mean(1, keepdim=True)) / (r_BG.std(1, keepdim=True) + EPS)
    ids = torch.arange(5).repeat_interleave(4)
    got = grpo_advantages(r_BG.reshape(-1), ids)
    assert torch.allclose(got, want.reshape(-1), atol=1e-12)


def test_grpo_known_values_g2():
    # G=2: unbiased std of {0, 1} is 1/sqrt(2), so A = +-0.5 * sqrt(2).
    adv = grpo_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([3, 3]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([-math.sqrt(0.5), math.sqrt(0.5)], dtype=torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_permutation_equivariant(name):
    r, ids = _batch(3, [3, 5, 2, 4])
    r_t, ids_t = torch.tensor(r, dtype=torch.float64), torch.tensor(ids)
    mask_t = torch.tensor(_mask(3, len(r)))
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(0))
    a = compute_advantages(name, r_t, ids_t, mask_t)
    b = compute_advantages(name, r_t[perm], ids_t[perm], mask_t[perm])
    assert torch.allclose(a[perm], b, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_integer_rewards_give_float32(name):
    mask = _mask(5, 5)
    adv = compute_advantages(name, torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0, 0, 0, 1, 1]), torch.tensor(mask))
    assert adv.dtype == torch.float32
    want = naive_token(name, [0.0, 1.0, 1.0, 0.0, 1.0], [0, 0, 0, 1, 1], mask)
    assert torch.allclose(adv.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    adv = compute_advantages(name, torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, T))
    assert adv.shape == (0, T)


def test_registry_keys():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"}
    assert TOKEN_LEVEL_ESTIMATORS == {"reinforce_pp", "reinforce_pp_baseline", "gae"}
    assert set(SEQ_FNS) == set(ADVANTAGE_ESTIMATORS) - TOKEN_LEVEL_ESTIMATORS


def test_flags_say_what_each_estimator_takes():
    """The trainer and the config ask these flags instead of naming an estimator. Only REINFORCE++ has token
    returns (a per-token KL reward, a discount) and no group baseline (so it may run with one sample per prompt),
    and GAE the same plus a critic's values."""
    assert {n for n in ADVANTAGE_ESTIMATORS if takes_token_kl(n)} == {"reinforce_pp", "gae"}
    assert {n for n, e in ADVANTAGE_ESTIMATORS.items() if e.discounted} == {"reinforce_pp", "gae"}
    assert {n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.group_baseline} == {"reinforce_pp", "gae"}
    assert {n for n, e in ADVANTAGE_ESTIMATORS.items() if e.critic} == {"gae"}
    with pytest.raises(ValueError, match="valid names"):
        takes_token_kl("ppo")


def test_compute_advantages_is_a_table_lookup(monkeypatch):
    """A new entry needs no change to compute_advantages: it receives every setting in one AdvantageInputs, and
    the settings its flags do not take are refused before it is called."""
    seen = []

    def fake(x: AdvantageInputs):
        seen.append(x)
        return torch.full(x.mask_NT.shape, 7.0)

    s, g, m, kl = torch.tensor([0.0, 1.0]), torch.tensor([4, 4]), torch.ones(2, 3), torch.zeros(2, 3)
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "fake_kl", Estimator(fake, token_kl=True, discounted=True))
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "fake_seq", Estimator(fake))
    out = compute_advantages("fake_kl", s, g, m, eps=0.5, gamma=0.9, kl_NT=kl, kl_coef=0.2, stats_mask_NT=m)
    assert torch.equal(out, torch.full((2, 3), 7.0))
    x = seen[0]
    assert (
        x.scores_N is s
        and x.group_ids_N is g
        and x.mask_NT is m
        and x.kl_NT is kl
        and x.stats_mask_NT is m
        and (x.eps, x.gamma, x.kl_coef) == (0.5, 0.9, 0.2)
    )
    with pytest.raises(ValueError, match="kl_NT.*'fake_kl'"):
        compute_advantages("fake_seq", s, g, m, kl_NT=kl, kl_coef=0.2)
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages("fake_seq", s, g, m, gamma=0.9)
    assert len(seen) == 1


@pytest.mark.parametrize("name", NAMES)
def test_table_entries_equal_compute_advantages(name):
    r, ids = _batch(5, [3, 4, 2])
    args = (torch.tensor(r, dtype=torch.float64), torch.tensor(ids), torch.tensor(_mask(5, len(r))))
    assert torch.equal(ADVANTAGE_ESTIMATORS[name].fn(AdvantageInputs(*args)), compute_advantages(name, *args))


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="grpo.*rloo|rloo.*grpo"):
        compute_advantages("ppo", torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2, T))


@pytest.mark.parametrize(
    "rewards,ids,match",
    [
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (torch.zeros(4), torch.zeros(3, dtype=torch.long), "same shape"),
        (torch.zeros(4), torch.zeros(4), "integer"),
        (torch.tensor([0.0, float("nan")]), torch.zeros(2, dtype=torch.long), "NaN"),
    ],
)
@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise(rewards, ids, match, name):
    with pytest.raises(ValueError, match=match):
        compute_advantages(name, rewards, ids, torch.ones(rewards.shape[0], T))


@pytest.mark.parametrize("name", NAMES)
def test_bad_mask_raises(name):
    with pytest.raises(ValueError, match="mask_NT"):
        compute_advantages(name, torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match="mask_NT"):
        compute_advantages(name, torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(3, T))


def test_gae_is_a_table_entry():
    """compute_advantages("gae") is GAE over the outcome token rewards against the critic's values (the same
    numbers as the two functions of algorithms/gae.py called by hand); values are required for it and refused
    for the critic-free estimators, and so is lam."""
    from hybrid_rl.algorithms.gae import gae_advantages_returns, outcome_token_rewards

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 1, 1, 0, 0]], dtype=torch.float64)
    values = torch.randn(4, 5, generator=g, dtype=torch.float64) * mask
    kl = torch.rand(4, 5, generator=g, dtype=torch.float64) * mask
    ids = torch.arange(4)
    got = compute_advantages("gae", scores, ids, mask, gamma=0.9, lam=0.8, kl_NT=kl, kl_coef=0.1, values_NT=values)
    rewards = outcome_token_rewards(scores, mask, kl_NT=kl, kl_coef=0.1)
    want, _ = gae_advantages_returns(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(got, want, atol=1e-12)
    with pytest.raises(ValueError, match="needs the critic's values_NT"):
        compute_advantages("gae", scores, ids, mask)
    with pytest.raises(ValueError, match="takes no values_NT"):
        compute_advantages("grpo", scores, ids, mask, values_NT=values)
    with pytest.raises(ValueError, match="no lambda"):
        compute_advantages("reinforce_pp", scores, ids, mask, lam=0.9)
