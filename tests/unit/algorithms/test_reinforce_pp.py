"""REINFORCE++ token-level advantages vs naive loops written from the paper's equations.

Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262): token reward
r_t = 1[t = last] * score - beta * KL_t, return G_t = sum_{s >= t} gamma^(s - t) r_s,
then whitening over every valid token of the global batch.

Legend: N sequences, T response tokens; _N per sequence, _NT per token.
"""

import math
import random

import pytest
import torch

from hybrid_rl.algorithms import (
    TOKEN_LEVEL_ESTIMATORS,
    compute_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)

EPS = 1e-6


# ---------------------------------------------------------------- naive references (plain floats)
def _valid(mask_row):
    return [j for j, m in enumerate(mask_row) if m != 0]


def naive_returns(scores, mask, gamma=1.0, kl=None, kl_coef=0.0):
    """G[i][t] from the per-token rewards, discounting over valid tokens; 0 on padding."""
    out = []
    for i, row in enumerate(mask):
        valid = _valid(row)
        rewards = [(-kl_coef * kl[i][j] if kl is not None else 0.0) for j in valid]
        if valid:
            rewards[-1] += scores[i]
        g = [0.0] * len(row)
        for k, j in enumerate(valid):
            g[j] = sum(gamma ** (m - k) * rewards[m] for m in range(k, len(valid)))
        out.append(g)
    return out


def naive_whiten(values, mask, eps=EPS):
    """(x - mean) / (unbiased std + eps) over every valid token; 0 if all equal or < 2 tokens."""
    flat = [values[i][j] for i, row in enumerate(mask) for j in _valid(row)]
    out = [[0.0] * len(row) for row in mask]
    if len(flat) < 2 or len(set(flat)) == 1:
        return out
    m = sum(flat) / len(flat)
    s = math.sqrt(sum((x - m) ** 2 for x in flat) / (len(flat) - 1))
    for i, row in enumerate(mask):
        for j in _valid(row):
            out[i][j] = (values[i][j] - m) / (s + eps)
    return out


def naive_reinforce_pp(scores, mask, gamma=1.0, kl=None, kl_coef=0.0, eps=EPS):
    return naive_whiten(naive_returns(scores, mask, gamma, kl, kl_coef), mask, eps)


def naive_reinforce_pp_baseline(scores, ids, mask, eps=EPS):
    centred = []
    for i in range(len(scores)):
        members = [scores[j] for j in range(len(scores)) if ids[j] == ids[i]]
        centred.append(0.0 if len(set(members)) == 1 else scores[i] - sum(members) / len(members))
    return naive_whiten([[c] * len(row) for c, row in zip(centred, mask)], mask, eps)


# ---------------------------------------------------------------- random batches
def _batch(seed, lengths, t, group_sizes=None, binary=False, holes=False):
    """Scores, shuffled group ids, right-padded (or holed) mask, and a per-token KL with garbage on padding."""
    rng = random.Random(seed)
    n = len(lengths)
    scores = [float(rng.randint(0, 1)) if binary else rng.gauss(0.5, 1.0) for _ in range(n)]
    group_sizes = group_sizes or [n]
    assert sum(group_sizes) == n
    group_ids = [rng.randint(-50, 50) * 100 + k for k in range(len(group_sizes))]  # unique, arbitrary
    ids = [gid for gid, size in zip(group_ids, group_sizes) for _ in range(size)]
    rng.shuffle(ids)
    mask = [[1 if j < length else 0 for j in range(t)] for length in lengths]
    if holes:
        for row in mask:
            for j in range(t):
                if row[j] and rng.random() < 0.3:
                    row[j] = 0
    kl = [[rng.gauss(0.0, 0.5) if mask[i][j] else float("nan") for j in range(t)] for i in range(n)]
    return scores, ids, mask, kl


# lengths include a length-1 response and an all-masked row; T = 9.
LENGTHS = [9, 1, 0, 5, 3, 9, 2, 7, 4, 6, 1, 8]
GROUPS = [3, 4, 2, 3]


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def _assert_close(got, want, atol=1e-10):
    want_t = _t(want)
    assert got.shape == want_t.shape
    assert torch.allclose(got.double(), want_t, atol=atol, rtol=1e-9), (got, want_t)


# ---------------------------------------------------------------- vs naive
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_pp_matches_naive(gamma, with_kl, holes):
    for seed in range(3):
        scores, ids, mask, kl = _batch(seed, LENGTHS, 9, GROUPS, binary=seed == 1, holes=holes)
        kl_coef = 0.3 if with_kl else 0.0
        got = reinforce_pp_advantages(
            _t(scores), torch.tensor(mask), gamma=gamma, kl_NT=_t(kl) if with_kl else None, kl_coef=kl_coef
        )
        want = naive_reinforce_pp(scores, mask, gamma, kl if with_kl else None, kl_coef)
        assert got.dtype == torch.float64
        _assert_close(got, want)
        via = compute_advantages(
            "reinforce_pp",
            _t(scores),
            torch.tensor(ids),
            torch.tensor(mask),
            gamma=gamma,
            kl_NT=_t(kl) if with_kl else None,
            kl_coef=kl_coef,
        )
        assert torch.equal(via, got)


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_pp_baseline_matches_naive(holes):
    for seed in range(4):
        scores, ids, mask, _ = _batch(seed, LENGTHS, 9, GROUPS, binary=seed % 2 == 1, holes=holes)
        got = reinforce_pp_baseline_advantages(_t(scores), torch.tensor(ids), torch.tensor(mask))
        _assert_close(got, naive_reinforce_pp_baseline(scores, ids, mask))
        via = compute_advantages("reinforce_pp_baseline", _t(scores), torch.tensor(ids), torch.tensor(mask))
        assert torch.equal(via, got)


def test_long_sequence_and_small_gamma_are_accurate():
    # 300 tokens with gamma 0.9 and KL: the scan must not lose the far-away terms.
    scores, ids, mask, kl = _batch(11, [300, 1, 0, 150, 299], 300)
    got = reinforce_pp_advantages(_t(scores), torch.tensor(mask), gamma=0.9, kl_NT=_t(kl), kl_coef=0.05)
    _assert_close(got, naive_reinforce_pp(scores, mask, 0.9, kl, 0.05), atol=1e-9)
    got0 = reinforce_pp_advantages(_t(scores), torch.tensor(mask), gamma=0.0, kl_NT=_t(kl), kl_coef=0.05)
    _assert_close(got0, naive_reinforce_pp(scores, mask, 0.0, kl, 0.05), atol=1e-9)


def test_returns_discount_the_score_by_position():
    # One row of 4 tokens, score 1, gamma 0.5: returns 1/8, 1/4, 1/2, 1 (whitening is affine).
    adv = reinforce_pp_advantages(_t([1.0]), torch.ones(1, 4), gamma=0.5, eps=0.0)
    g = torch.tensor([0.125, 0.25, 0.5, 1.0], dtype=torch.float64)
    assert torch.allclose(adv[0], (g - g.mean()) / g.std(), atol=1e-12)


def test_whitening_is_length_weighted():
    # Scores 1 (1 token) and 0 (9 tokens). Per-sequence whitening gives +-0.707 whatever
    # the lengths; per-token whitening has mean 0.1, so the long row's tokens are near 0.
    scores, mask = [1.0, 0.0], [[1] + [0] * 8, [1] * 9]
    got = reinforce_pp_advantages(_t(scores), torch.tensor(mask))
    _assert_close(got, naive_reinforce_pp(scores, mask))
    per_seq = naive_whiten([[1.0], [0.0]], [[1], [1]])
    assert abs(per_seq[0][0] - got[0, 0].item()) > 1.0 and abs(per_seq[1][0] - got[1, 0].item()) > 0.3
    assert got[1, 0].item() == pytest.approx(-0.1 / math.sqrt(0.1), rel=1e-5)  # std = sqrt(0.9 / 9)
    # The baseline variant too: groups {1, 0} and {1, 0} with different lengths.
    ids, mask2 = [0, 0, 1, 1], [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
    got_b = reinforce_pp_baseline_advantages(_t([1.0, 0.0, 1.0, 0.0]), torch.tensor(ids), torch.tensor(mask2))
    _assert_close(got_b, naive_reinforce_pp_baseline([1.0, 0.0, 1.0, 0.0], ids, mask2))
    assert got_b[0, 0].item() != pytest.approx(-got_b[1, 0].item(), abs=1e-3)  # not symmetric as per-sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_returns_give_exact_zero(dtype):
    # 0.1 is not exactly representable: a mean of 0.1s can differ from 0.1 by an ulp.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    for fn in (
        lambda s: reinforce_pp_advantages(s, mask),
        lambda s: reinforce_pp_baseline_advantages(s + torch.arange(4.0, dtype=dtype), torch.arange(4), mask),
    ):
        adv = fn(torch.full((4,), 0.1, dtype=dtype))
        assert adv.dtype == dtype and torch.equal(adv, torch.zeros(4, 4, dtype=dtype))
    # eps = 0 must not give 0 / 0; one valid token has no spread either.
    assert torch.equal(
        reinforce_pp_advantages(torch.full((4,), 0.1, dtype=dtype), mask, eps=0.0), torch.zeros(4, 4, dtype=dtype)
    )
    one = torch.tensor([[0, 1, 0]])
    assert torch.equal(reinforce_pp_advantages(torch.tensor([3.0], dtype=dtype), one), torch.zeros(1, 3, dtype=dtype))


def test_integer_scores_bool_mask_and_empty_batches():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = reinforce_pp_advantages(torch.tensor([1, 0]), mask)
    assert adv.dtype == torch.float32
    _assert_close(adv, naive_reinforce_pp([1.0, 0.0], mask.int().tolist()), atol=1e-6)
    for name in sorted(TOKEN_LEVEL_ESTIMATORS - {"gae"}):  # gae takes a critic's values: test_gae.py
        for n, t in ((0, 4), (3, 0)):
            out = compute_advantages(name, torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n, t))
            assert out.shape == (n, t)


def test_padding_garbage_is_ignored():
    scores, ids, mask, kl = _batch(5, LENGTHS, 9, GROUPS)
    # kl holds NaN on padding (see _batch); it must not leak anywhere.
    got = reinforce_pp_advantages(_t(scores), torch.tensor(mask), gamma=0.9, kl_NT=_t(kl), kl_coef=0.2)
    assert torch.isfinite(got).all()
    assert torch.equal(got[torch.tensor(mask) == 0], torch.zeros_like(got[torch.tensor(mask) == 0]))


# ---------------------------------------------------------------- global batch across ranks (one process)
class _Recorder:
    """A reduce_sum that records what it was given and returns it unchanged."""

    def __init__(self):
        self.calls = []

    def __call__(self, x):
        self.calls.append(x.clone())
        return x


def _split_run(fn, halves):
    """Run fn on each half with a reduce_sum that adds the other half's stats (as an all-reduce would)."""
    local = []
    for half in halves:
        rec = _Recorder()
        fn(half, rec)
        assert len(rec.calls) == 1 and rec.calls[0].dtype == torch.float64
        local.append(rec.calls[0])
    outs = []
    for k, half in enumerate(halves):
        calls = []

        def reduce_sum(x, other=local[1 - k], calls=calls):
            calls.append(1)
            return x.add_(other)

        outs.append(fn(half, reduce_sum))
        assert calls == [1]
    return outs


SPLITS = [6, 2, 0, 12]  # rows on the first half; 0 and 12 leave one half with no rows at all


@pytest.mark.parametrize("cut", SPLITS)
@pytest.mark.parametrize("gamma,with_kl", [(1.0, False), (0.9, True)])
def test_split_batch_with_reduce_sum_equals_whole_batch(cut, gamma, with_kl):
    scores, ids, mask, kl = _batch(3, LENGTHS, 9, [2, 2, 2, 2, 2, 2])
    # A group is always whole on one rank: sort rows by group so every even cut keeps groups whole.
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    s, g, m, k = (x[order] for x in (_t(scores), torch.tensor(ids), torch.tensor(mask), _t(kl)))
    kl_coef = 0.25 if with_kl else 0.0

    def rpp(rows, reduce_sum):
        return reinforce_pp_advantages(
            s[rows], m[rows], gamma=gamma, kl_NT=k[rows] if with_kl else None, kl_coef=kl_coef, reduce_sum=reduce_sum
        )

    def base(rows, reduce_sum):
        return reinforce_pp_baseline_advantages(s[rows], g[rows], m[rows], reduce_sum=reduce_sum)

    halves = [torch.arange(0, cut), torch.arange(cut, len(scores))]
    for fn in (rpp, base):
        whole = fn(torch.arange(len(scores)), None)
        split = torch.cat(_split_run(fn, halves))
        assert torch.allclose(split, whole, rtol=1e-12, atol=1e-13)
        assert split.abs().max() > 0.5
    if 0 < cut < len(scores):
        # Guard: the halves really differ, so using only local statistics would be wrong.
        local_only = torch.cat([rpp(h, None) for h in halves])
        assert not torch.allclose(local_only, rpp(torch.arange(len(scores)), None), atol=1e-3)


def test_split_all_equal_is_exact_zero():
    # Each half is constant (0.1) and so is the whole: exactly 0 on both "ranks".
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    s = torch.full((4,), 0.1, dtype=torch.float64)

    def fn(rows, reduce_sum):
        return reinforce_pp_advantages(s[rows], mask[rows], reduce_sum=reduce_sum)

    for out in _split_run(fn, [torch.arange(0, 1), torch.arange(1, 4)]):
        assert torch.equal(out, torch.zeros_like(out))


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mask_NT=torch.ones(3)), "mask_NT"),
        (dict(mask_NT=torch.ones(4, 5)), "mask_NT"),
        (dict(kl_coef=0.1), "kl_NT"),
        (dict(kl_NT=torch.zeros(3, 4), kl_coef=0.1), "kl_NT"),
        (dict(kl_NT=torch.zeros(3, 5), kl_coef=-0.1), "kl_coef"),
        (dict(kl_NT=torch.full((3, 5), float("nan")), kl_coef=0.1), "NaN"),
        (dict(gamma=1.5), "gamma"),
        (dict(eps=-1.0), "eps"),
        (dict(scores_N=torch.tensor([0.0, float("inf"), 1.0])), "NaN or inf"),
        (dict(reduce_sum=lambda x: x[:2]), "reduce_sum"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    args = dict(scores_N=torch.zeros(3), mask_NT=torch.ones(3, 5))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        reinforce_pp_advantages(**args)


def test_compute_advantages_rejects_kl_and_gamma_where_unused():
    s, g, m = torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 3)
    for name in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="kl_NT"):
            compute_advantages(name, s, g, m, kl_NT=torch.zeros(2, 3), kl_coef=0.1)
        with pytest.raises(ValueError, match="gamma"):
            compute_advantages(name, s, g, m, gamma=0.9)
    with pytest.raises(ValueError, match="mask_NT"):
        compute_advantages("grpo", s, g, torch.ones(3, 3))


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_whitening_over_the_trained_tokens_only(name):
    """Tokens the loss leaves out (a truncated row under the overlong filter) must not move the baseline:
    with stats_mask_NT the mean and std are those of the trained tokens (a naive loop), so the advantages
    of the trained tokens average to 0. The reviewer's example: a long truncated low-score row."""
    from hybrid_rl.algorithms.advantages import compute_advantages

    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    lengths = [2, 8, 3, 2]
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.zeros(4, 8)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    trained = mask.clone()
    trained[1] = 0  # row 1 was truncated: out of the loss
    adv = compute_advantages(name, scores, groups, mask, eps=1e-6, stats_mask_NT=trained)
    # Naive: the per-token value before whitening (gamma = 1, no KL: the score; baseline: score - group mean).
    value = scores if name == "reinforce_pp" else scores - torch.tensor([0.5, 0.5, 0.5, 0.5])
    xs = [float(value[i]) for i in range(4) for t in range(8) if trained[i, t]]
    mean = sum(xs) / len(xs)
    std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    for i in range(4):
        for t in range(8):
            want = (float(value[i]) - mean) / (std + 1e-6) if mask[i, t] else 0.0
            assert adv[i, t].item() == pytest.approx(want, abs=1e-6), (i, t)
    assert (adv * trained).sum().item() == pytest.approx(0.0, abs=1e-5)
    untouched = compute_advantages(name, scores, groups, mask, eps=1e-6)
    assert not torch.allclose(untouched * trained, adv * trained), "without the stats mask row 1 moves the baseline"


def test_the_trainer_whitens_over_its_loss_mask(tiny_trainer_overrides, monkeypatch):
    from hybrid_rl import Trainer, load_config
    from hybrid_rl import trainer as trainer_mod
    from hybrid_rl.loop import advantage_stage as stage_mod

    calls = []
    real = stage_mod.compute_advantages
    monkeypatch.setattr(stage_mod, "compute_advantages", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    seen = {}
    real_update = trainer_mod.policy_update
    monkeypatch.setattr(trainer_mod, "policy_update", lambda **k: seen.update(batch=k["batch"]) or real_update(**k))
    tr = Trainer(
        load_config(
            None,
            [
                *tiny_trainer_overrides,
                "algorithm.advantage=reinforce_pp",
                "algorithm.overlong_filter=true",
                "rollout.max_new_tokens=3",
            ],
        )
    )
    tr.step()
    (_, _, _, resp_mask), kwargs = calls[0]
    # A wiring check: the whitening gets the mask the loss trains, whatever its values (they are pinned by
    # hand in tests/unit/test_batch.py), so comparing with the batch's own mask is the point here.
    assert torch.equal(kwargs["stats_mask_NT"], seen["batch"].mask_NT)
    assert not torch.equal(resp_mask.bool(), seen["batch"].mask_NT.bool()), "the test needs truncated rows"


def test_the_trainer_gives_a_reward_side_kl_per_token_only_to_estimators_that_take_it(
    tiny_trainer_overrides, monkeypatch
):
    """The trainer asks the estimator's token_kl flag: REINFORCE++ gets the per-token KL (KL-to-go in its returns)
    and the raw scores; reinforce_pp_baseline gets the KL folded into its scores and no kl_NT (compute_advantages
    would refuse one). Mutation: `if not takes_token_kl(...)` replaced by True (or False) fails one of them."""
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.loop import advantage_stage as stage_mod

    for name, token_kl in (("reinforce_pp", True), ("reinforce_pp_baseline", False)):
        calls = []
        real = stage_mod.compute_advantages
        monkeypatch.setattr(stage_mod, "compute_advantages", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
        tr = Trainer(
            load_config(
                None,
                [
                    *tiny_trainer_overrides,
                    f"algorithm.advantage={name}",
                    "algorithm.kl_placement=reward",
                    "algorithm.kl_coef=0.3",
                ],
            )
        )
        with torch.no_grad():  # a reference unlike the policy, so the KL is not 0
            for p in tr.ref.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        scores = []
        real_rollout = tr.rollout_stage.run
        monkeypatch.setattr(
            tr.rollout_stage,
            "run",
            lambda *a, **k: (lambda out: scores.append(out[0].scores_N) or out)(real_rollout(*a, **k)),
        )
        tr.step()
        (_, scores_N, _, _), kwargs = calls[0]
        assert (kwargs["kl_NT"] is not None) == token_kl, name
        assert kwargs["kl_coef"] == (0.3 if token_kl else 0.0), name
        assert torch.equal(scores_N, scores[0]) == token_kl, f"{name}: scores penalised iff the KL is not per token"
        tr.close()
        monkeypatch.setattr(stage_mod, "compute_advantages", real)
