"""Loss aggregation vs naive loops, and gradient-accumulation invariance.

Legend: N rows (sequences), T response tokens; _NT per token.
"""

import pytest
import torch

from hybrid_rl.algorithms import (
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_policy_loss,
    masked_sum,
    normalizer_count,
)

NORM_LEN = 16


def _random_batch(seed, n, t, empty_rows=(), lengths=None):
    g = torch.Generator().manual_seed(seed)
    loss_NT = torch.randn(n, t, generator=g, dtype=torch.float64)
    if lengths is None:
        lengths = torch.randint(1, t + 1, (n,), generator=g).tolist()
    mask_NT = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask_NT[i, :length] = 1.0
    for i in empty_rows:
        mask_NT[i] = 0.0
    return loss_NT, mask_NT


def naive_count(mask_NT, mode):
    rows = mask_NT.tolist()
    if mode == "token-mean":
        return float(sum(1 for row in rows for m in row if m != 0))
    return float(sum(1 for row in rows if any(m != 0 for m in row)))


def naive_aggregate(loss_NT, mask_NT, mode, denom, norm_length=None):
    total = 0.0
    for lrow, mrow in zip(loss_NT.tolist(), mask_NT.tolist()):
        row_sum, row_len = 0.0, 0
        for l, m in zip(lrow, mrow):
            if m != 0:
                row_sum += l
                row_len += 1
        if mode == "seq-mean-token-mean":
            total += row_sum / row_len if row_len else 0.0
        else:
            total += row_sum
    if mode == "seq-mean-token-sum-norm":
        denom = denom * norm_length
    return total / denom


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("n,t", [(6, 1), (5, 7), (3, 300)])
def test_full_batch_matches_naive(mode, n, t):
    loss_NT, mask_NT = _random_batch(n * t, n, t, empty_rows=(1,))
    # Garbage at masked positions must be ignored.
    loss_NT = torch.where(mask_NT != 0, loss_NT, torch.full_like(loss_NT, float("nan")))
    d = normalizer_count(mask_NT, mode)
    assert d == naive_count(mask_NT, mode)
    got = aggregate_loss(loss_NT, mask_NT, mode, d, norm_length=NORM_LEN)
    assert got.dim() == 0
    assert abs(got.item() - naive_aggregate(loss_NT, mask_NT, mode, d, NORM_LEN)) < 1e-10


def test_normalizer_count_values():
    mask_NT = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert normalizer_count(mask_NT, "token-mean") == 3.0
    for mode in LOSS_AGG_MODES[1:]:
        assert normalizer_count(mask_NT, mode) == 2.0
        assert normalizer_count(mask_NT, mode, count_empty_rows=True) == 3.0
    assert isinstance(normalizer_count(mask_NT, "token-mean"), float)


def _naive_masked_mean(loss_NT, mask_NT):
    """(mean over every valid token, mean over rows of each row's valid-token mean; 0 for an empty row)."""
    rows = [[float(x) for x, m in zip(r, mr) if m] for r, mr in zip(loss_NT.tolist(), mask_NT.tolist())]
    tokens = [x for r in rows for x in r]
    return sum(tokens) / max(len(tokens), 1), sum(sum(r) / max(len(r), 1) for r in rows) / len(rows)


def test_token_mean_equals_masked_mean_and_grpo_seq_mean():
    loss_NT, mask_NT = _random_batch(1, 4, 6)
    token_mean, seq_mean = _naive_masked_mean(loss_NT, mask_NT)
    d = normalizer_count(mask_NT, "token-mean")
    assert torch.allclose(
        aggregate_loss(loss_NT, mask_NT, "token-mean", d), torch.tensor(token_mean, dtype=torch.float64)
    )
    d = normalizer_count(mask_NT, "seq-mean-token-mean")
    want = torch.tensor(seq_mean, dtype=torch.float64)
    assert torch.allclose(aggregate_loss(loss_NT, mask_NT, "seq-mean-token-mean", d), want)


def test_drgrpo_norm_is_length_independent_constant():
    loss_NT = torch.ones(2, 8)
    mask_NT = torch.zeros(2, 8)
    mask_NT[0, :2] = 1
    mask_NT[1, :8] = 1
    d = normalizer_count(mask_NT, "seq-mean-token-sum-norm")
    assert aggregate_loss(loss_NT, mask_NT, "seq-mean-token-sum-norm", d, norm_length=10).item() == pytest.approx(
        10 / (2 * 10)
    )


# ------------------------------------------------ gradient-accumulation invariance
def _policy_batch(seed, n=8, t=9):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv_N = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = [9, 1, 4, 0, 7, 2, 9, 5][:n]  # includes an empty row and T=1-like row
    mask_NT = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask_NT[i, :length] = 1
    return logp, old, adv_N, mask_NT


def _accumulated(logp, old, adv_N, mask_NT, mode, chunks):
    """Loss and grad of logp summed over micro-batches with the global normaliser."""
    rows = torch.arange(logp.shape[0]).chunk(chunks)
    denom = sum(normalizer_count(mask_NT[r], mode) for r in rows)
    if logp.grad is not None:
        logp.grad = None
    total = 0.0
    for r in rows:
        loss_NT, _ = compute_policy_loss("ppo_clip", logp[r], old[r], adv_N[r], mask_NT[r])
        part = aggregate_loss(loss_NT, mask_NT[r], mode, denom, norm_length=NORM_LEN)
        part.backward()
        total += part.item()
    return total, logp.grad.clone()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("chunks", [8, 2])
def test_grad_accumulation_invariance(mode, chunks):
    logp, old, adv_N, mask_NT = _policy_batch(0)
    full_loss, full_grad = _accumulated(logp, old, adv_N, mask_NT, mode, 1)
    acc_loss, acc_grad = _accumulated(logp, old, adv_N, mask_NT, mode, chunks)
    assert full_grad.abs().sum() > 0
    assert acc_loss == pytest.approx(full_loss, rel=1e-12, abs=1e-12)
    assert torch.allclose(acc_grad, full_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_local_normaliser_would_break_invariance(mode):
    # Guard that the invariance test can fail: per-micro-batch means differ.
    logp, old, adv_N, mask_NT = _policy_batch(0)
    full_loss, _ = _accumulated(logp, old, adv_N, mask_NT, mode, 1)
    local = 0.0
    for r in torch.arange(8).chunk(2):
        loss_NT, _ = compute_policy_loss("ppo_clip", logp[r], old[r], adv_N[r], mask_NT[r])
        local += aggregate_loss(loss_NT, mask_NT[r], mode, normalizer_count(mask_NT[r], mode)).item() / 2
    assert abs(local - full_loss) > 1e-6


# ------------------------------------------------ edge cases and errors
def test_zero_normaliser_gives_zero_with_graph():
    x = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    for d in (0.0, torch.tensor(0.0)):
        out = aggregate_loss(x, mask, "token-mean", d)
        assert out.item() == 0.0 and out.requires_grad
        out.backward()
        assert torch.equal(x.grad, torch.zeros(2, 3))
        x.grad = None


def test_tensor_normaliser_matches_float():
    loss_NT, mask_NT = _random_batch(4, 3, 5)
    for mode in LOSS_AGG_MODES:
        d = normalizer_count(mask_NT, mode)
        a = aggregate_loss(loss_NT, mask_NT, mode, d, norm_length=NORM_LEN)
        b = aggregate_loss(loss_NT, mask_NT, mode, torch.tensor(d), norm_length=NORM_LEN)
        assert torch.allclose(a, b)


def test_masked_sum():
    # (masked_mean, which only this test used, was removed as dead code; its masking checks stay.)
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_sum(x, m).item() == 3.0
    assert torch.equal(masked_sum(x, m, dim=1), torch.tensor([3.0, 0.0]))
    with pytest.raises(ValueError, match="same shape"):
        masked_sum(x, m[:, :2])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="mean"), "valid modes"),
        (dict(mode="seq-mean-token-sum-norm"), "norm_length"),
        (dict(mode="token-mean", global_normalizer=-1.0), ">= 0"),
        (dict(mode="token-mean", loss_NT=torch.zeros(2, 4)), "same"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    args = dict(loss_NT=torch.zeros(2, 3), mask_NT=torch.ones(2, 3), global_normalizer=6.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        aggregate_loss(**args)


def test_normalizer_count_bad_inputs():
    with pytest.raises(ValueError, match="valid modes"):
        normalizer_count(torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match="2-D"):
        normalizer_count(torch.ones(3), "token-mean")
