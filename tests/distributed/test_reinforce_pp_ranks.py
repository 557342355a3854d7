"""REINFORCE++ whitening over the global batch on 2 real gloo ranks.

Each rank holds some whole groups of one batch and calls the token-level
estimators with reduce_sum=hybrid_rl.runtime.distributed.all_reduce_sum. The
concatenation of the ranks' advantages must equal a 1-process computation on
the whole batch, and every call must all-reduce exactly once (also on a rank
with no rows, which would otherwise leave its peer waiting).

Legend: N sequences, T response tokens; _N per sequence, _NT per token.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.algorithms import compute_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

N, T, G = 12, 10, 3  # 4 groups of 3
CUTS = (6, 9, 12)  # rows of rank 0: halves, unequal, everything (rank 1 empty)


def _make_data():
    """Scores, group ids (groups contiguous), ragged right-padded mask and a per-token KL."""
    g = torch.Generator().manual_seed(7)
    scores_N = torch.randn(N, generator=g, dtype=torch.float64)
    scores_N[:3] = 0.25  # one group with equal scores
    group_ids_N = torch.arange(N) // G * 10 + 3
    lengths = [10, 1, 0, 4, 7, 2, 9, 10, 3, 1, 6, 8]  # includes length 1 and an empty row
    mask_NT = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
    kl_NT = 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    return scores_N, group_ids_N, mask_NT, kl_NT


def _estimates(rows, reduce_sum):
    """All token-level variants on `rows`; the number of reduce_sum calls each made."""
    s, g, m, k = (x[rows] for x in _make_data())
    out, calls = {}, {}
    variants = {
        "rpp": lambda rs: reinforce_pp_advantages(s, m, reduce_sum=rs),
        "rpp_gamma_kl": lambda rs: reinforce_pp_advantages(s, m, gamma=0.9, kl_NT=k, kl_coef=0.2, reduce_sum=rs),
        "baseline": lambda rs: reinforce_pp_baseline_advantages(s, g, m, reduce_sum=rs),
        "dispatch": lambda rs: compute_advantages(
            "reinforce_pp", s, g, m, gamma=0.95, kl_NT=k, kl_coef=0.1, reduce_sum=rs
        ),
    }
    for name, fn in variants.items():
        n = [0]

        def counting(x, n=n):
            n[0] += 1
            return reduce_sum(x) if reduce_sum is not None else x

        out[name] = fn(counting)
        calls[name] = n[0]
    return out, calls


def _rank_main(rank: int, cuts: tuple) -> dict:
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    assert D.is_dist() and D.world_size() == 2
    results = {}
    for cut in cuts:
        rows = torch.arange(0, cut) if rank == 0 else torch.arange(cut, N)
        results[cut] = _estimates(rows, D.all_reduce_sum)
    return results


def test_two_ranks_equal_one_process():
    per_rank = run_ranks(_rank_main, world=2, args=(CUTS,), timeout=180)
    whole, _ = _estimates(torch.arange(N), None)
    for cut in CUTS:
        (out0, calls0), (out1, calls1) = per_rank[0][cut], per_rank[1][cut]
        assert out0["rpp"].shape == (cut, T) and out1["rpp"].shape == (N - cut, T)
        for name, want in whole.items():
            assert calls0[name] == calls1[name] == 1, (cut, name)
            got = torch.cat([out0[name], out1[name]])
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=f"cut={cut} {name}")
            assert want.abs().max() > 0.5
    # Guard: with only local statistics the halves would differ from the whole batch.
    local = torch.cat([_estimates(torch.arange(0, 6), None)[0]["rpp"], _estimates(torch.arange(6, N), None)[0]["rpp"]])
    assert not torch.allclose(local, whole["rpp"], atol=1e-3)
