"""DAPO helpers vs naive Python loops.

Legend: N sequences, T tokens; _NT per token, _N per sequence.
"""

import random

import pytest
import torch

from hybrid_rl.algorithms import filter_groups, overlong_penalty, truncation_mask


def naive_filter(r, ids):
    by_group = {}
    for x, g in zip(r, ids):
        by_group.setdefault(g, []).append(x)
    return [len(set(by_group[g])) > 1 for g in ids]


@pytest.mark.parametrize("sizes", [[8, 8, 8], [2, 2, 2, 2], [1, 3, 2, 5, 4], [1]])
@pytest.mark.parametrize("binary", [True, False])
def test_filter_groups_matches_naive(sizes, binary):
    rng = random.Random(sum(sizes))
    for _ in range(5):
        r, ids = [], []
        for k, size in enumerate(sizes):
            gid = rng.randint(-50, 50) * 100 + k
            all_equal = rng.random() < 0.4
            base = float(rng.randint(0, 1))
            for _ in range(size):
                ids.append(gid)
                r.append(base if all_equal else (float(rng.randint(0, 1)) if binary else rng.random()))
        order = list(range(len(r)))
        rng.shuffle(order)
        r, ids = [r[i] for i in order], [ids[i] for i in order]
        keep = filter_groups(torch.tensor(r), torch.tensor(ids))
        assert keep.dtype == torch.bool
        assert keep.tolist() == naive_filter(r, ids)


def test_filter_groups_known_values():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    ids = torch.tensor([7, 7, 3, 3, 9, 9, 4])
    assert filter_groups(r, ids).tolist() == [False, False, True, True, False, False, False]
    assert filter_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="integer"):
        filter_groups(r, ids.float())
    with pytest.raises(ValueError, match="shape"):
        filter_groups(r, ids[:3])


def naive_penalty(length, lmax, buf, f):
    if length <= lmax - buf:
        return 0.0
    if length <= lmax:
        return ((lmax - buf) - length) / buf * f
    return -f


@pytest.mark.parametrize("lmax,buf,f", [(20, 5, 1.0), (20, 20, 0.5), (8, 1, 2.0), (10, 0, 1.0)])
def test_overlong_penalty_matches_naive(lmax, buf, f):
    lengths = list(range(0, lmax + 4))
    got = overlong_penalty(torch.tensor(lengths), lmax, buf, f)
    assert got.dtype == torch.float32
    want = [naive_penalty(x, lmax, buf, f) for x in lengths]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert (got <= 0).all() and (got >= -f).all()


def test_overlong_penalty_boundaries():
    p = overlong_penalty(torch.tensor([15, 16, 20, 21, 100]), max_new_tokens=20, buffer_len=5, penalty_factor=1.0)
    assert p.tolist() == pytest.approx([0.0, -0.2, -1.0, -1.0, -1.0])
    for bad in (
        dict(max_new_tokens=0, buffer_len=0),
        dict(max_new_tokens=5, buffer_len=6),
        dict(max_new_tokens=5, buffer_len=2, penalty_factor=-1.0),
    ):
        args = dict(penalty_factor=1.0)
        args.update(bad)
        with pytest.raises(ValueError):
            overlong_penalty(torch.tensor([1]), **args)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.long])
def test_truncation_mask(dtype):
    mask = (torch.rand(5, 7, generator=torch.Generator().manual_seed(0)) > 0.3).to(dtype)
    trunc = torch.tensor([True, False, True, False, False])
    out = truncation_mask(trunc, mask)
    assert out.dtype == dtype
    for i in range(5):
        for j in range(7):
            want = 0 if trunc[i] else mask[i, j].item()
            assert out[i, j].item() == want
    with pytest.raises(ValueError, match="finish_truncated_N"):
        truncation_mask(trunc[:3], mask)
    with pytest.raises(ValueError, match="2-D"):
        truncation_mask(trunc, mask[0])


def test_collector_reports_zero_std_groups_and_length_extremes():
    """Two rounds of 3 groups x 2 samples: the fraction of groups whose scores are all equal (zero
    advantage) and the longest / shortest completion, over everything generated, against a naive count."""
    from hybrid_rl.loop.dynamic_sampling import GroupCollector
    from hybrid_rl.types import Completion

    def comps(lengths):
        return [Completion(token_ids=[7] * n, logprobs=[0.0] * n, finish_reason="stop") for n in lengths]

    rounds = [
        ([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], [3, 9, 4, 4, 2, 5]),
        ([0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [6, 1, 8, 3, 7, 7]),
    ]
    col = GroupCollector(group_size=2, dynamic=False, max_rounds=1)
    for scores, lengths in rounds:
        s = torch.tensor(scores)
        col.add([{}] * 3, [[1]] * 3, comps(lengths), s, s)
    _, m = col.finish()
    groups = [tuple(sc[i : i + 2]) for sc, _ in rounds for i in range(0, 6, 2)]
    assert (
        m["reward/frac_zero_std"] == pytest.approx(sum(a == b for a, b in groups) / len(groups)) == pytest.approx(4 / 6)
    )
    assert m["response/length_max"] == 9 and m["response/length_min"] == 1
