"""Advantage estimators vs naive per-sample Python loops (plain floats).

Legend: N sequences, group_ids_N prompt id of each sequence.
"""
import math
import random

import pytest
import torch

from hybrid_rl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages

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


def naive_reinforce_pp(r, ids, eps=EPS):
    if len(r) < 2 or len(set(r)) == 1:
        return [0.0] * len(r)
    m, s = _mean(r), _std_unbiased(r)
    return [(x - m) / (s + eps) for x in r]


def naive_reinforce_pp_baseline(r, ids, eps=EPS):
    c = naive_drgrpo(r, ids)
    s = _std_unbiased(c)
    return [x / (s + eps) for x in c]


NAIVE = {
    "grpo": naive_grpo,
    "drgrpo": naive_drgrpo,
    "rloo": naive_rloo,
    "reinforce_pp": naive_reinforce_pp,
    "reinforce_pp_baseline": naive_reinforce_pp_baseline,
}
NAMES = sorted(NAIVE)


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


def _check(name, r, ids, dtype=torch.float64, atol=1e-9):
    got = compute_advantages(name, torch.tensor(r, dtype=dtype), torch.tensor(ids))
    want = NAIVE[name](r, ids)
    assert got.dtype == dtype and got.shape == (len(r),)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=atol, rtol=1e-6), (got, want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("binary", [False, True])
def test_matches_naive_loop(name, case, binary):
    for seed in range(3):
        r, ids = _batch(seed, CASES[case], binary=binary)
        _check(name, r, ids)


@pytest.mark.parametrize("name", NAMES)
def test_float32_matches_naive(name):
    r, ids = _batch(7, [4, 3, 6, 2])
    _check(name, r, ids, dtype=torch.float32, atol=1e-4)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_all_equal_groups_give_exact_zero(name):
    # 0.1 is not exactly representable: sum/n can differ from the value by an ulp.
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 1.0, 0.0], dtype=dtype)
        ids = torch.tensor([5, 5, 5, 2, 2, 2, 2, 9, 9])
        adv = compute_advantages(name, r, ids)
        assert torch.equal(adv[:7], torch.zeros(7, dtype=dtype))
        assert (adv[7] > 0) and (adv[8] < 0)


def test_reinforce_pp_all_equal_batch_is_zero():
    adv = compute_advantages("reinforce_pp", torch.full((6,), 0.3), torch.arange(6))
    assert torch.equal(adv, torch.zeros(6))


def test_grpo_equals_verl_style_contiguous_formula():
    torch.manual_seed(0)
    r_BG = torch.randn(5, 4, dtype=torch.float64)
    want = (r_BG - r_BG.mean(1, keepdim=True)) / (r_BG.std(1, keepdim=True) + EPS)
    ids = torch.arange(5).repeat_interleave(4)
    got = compute_advantages("grpo", r_BG.reshape(-1), ids)
    assert torch.allclose(got, want.reshape(-1), atol=1e-12)


def test_grpo_known_values_g2():
    # G=2: unbiased std of {0, 1} is 1/sqrt(2), so A = +-0.5 * sqrt(2).
    adv = compute_advantages("grpo", torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([3, 3]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([-math.sqrt(0.5), math.sqrt(0.5)], dtype=torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_permutation_equivariant(name):
    r, ids = _batch(3, [3, 5, 2, 4])
    r_t, ids_t = torch.tensor(r, dtype=torch.float64), torch.tensor(ids)
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(0))
    a = compute_advantages(name, r_t, ids_t)
    b = compute_advantages(name, r_t[perm], ids_t[perm])
    assert torch.allclose(a[perm], b, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_integer_rewards_give_float32(name):
    adv = ADVANTAGE_ESTIMATORS[name](torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0, 0, 0, 1, 1]))
    assert adv.dtype == torch.float32
    want = NAIVE[name]([0.0, 1.0, 1.0, 0.0, 1.0], [0, 0, 0, 1, 1])
    assert torch.allclose(adv.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    adv = compute_advantages(name, torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert adv.shape == (0,)


def test_registry_keys():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="grpo.*rloo|rloo.*grpo"):
        compute_advantages("ppo", torch.zeros(2), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize(
    "rewards,ids,match",
    [
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (torch.zeros(4), torch.zeros(3, dtype=torch.long), "same shape"),
        (torch.zeros(4), torch.zeros(4), "integer"),
        (torch.tensor([0.0, float("nan")]), torch.zeros(2, dtype=torch.long), "NaN"),
    ],
)
def test_bad_inputs_raise(rewards, ids, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages("grpo", rewards, ids)
