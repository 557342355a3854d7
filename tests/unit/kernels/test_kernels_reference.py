"""The torch reference of the fused logprob + entropy kernel, and the dispatcher.

The reference is the oracle the Triton kernel is tested against (test_kernels.py),
so it is itself pinned here to float64 computations and closed-form gradients.
Shapes legend: R rows (tokens), V vocabulary size.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.kernels import logprob as logprob_mod
from hybrid_rl.kernels import logprob_entropy, token_logprob_entropy_ref


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def test_reference_matches_naive_float64() -> None:
    """The oracle itself: against log_softmax/probabilities computed in float64."""
    torch.manual_seed(12)
    logits = torch.randn(9, 50) * 5.0
    targets = torch.randint(0, 50, (9,))
    for T in (1.0, 0.7):
        lp, h = token_logprob_entropy_ref(logits, targets, T)
        z = logits.double() / T
        logp_all = torch.log_softmax(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        _close(lp.double(), logp_all.gather(-1, targets[:, None]).squeeze(-1), "logp")
        _close(h.double(), -(p * logp_all).sum(-1), "entropy")


def test_reference_grad_matches_closed_form() -> None:
    """The closed-form gradients the Triton backward implements, checked via autograd."""
    torch.manual_seed(13)
    R, V, T = 6, 30, 0.7
    logits = (torch.randn(R, V, dtype=torch.float64) * 3.0).requires_grad_(True)
    targets = torch.randint(0, V, (R,))
    g_lp, g_h = torch.randn(R, dtype=torch.float64), torch.randn(R, dtype=torch.float64)
    z = logits / T
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    lp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    h = -(p * logp_all).sum(-1)
    (g_auto,) = torch.autograd.grad((lp * g_lp + h * g_h).sum(), logits)
    with torch.no_grad():
        onehot = torch.nn.functional.one_hot(targets, V).double()
        # dlogp/dz = onehot - p; dH/dz = -p * (logp + H); chain rule 1/T.
        closed = (g_lp[:, None] * (onehot - p) - g_h[:, None] * p * (logp_all + h[:, None])) / T
    torch.testing.assert_close(g_auto, closed)


def test_reference_masked_vocab_grad_is_finite() -> None:
    logits = torch.randn(3, 10)
    logits[:, 7:] = float("-inf")
    x = logits.clone().requires_grad_(True)
    lp, h = token_logprob_entropy_ref(x, torch.tensor([0, 1, 2]))
    assert torch.isfinite(lp).all() and torch.isfinite(h).all()
    # Upstream grads > 1 in magnitude: a finite-floor trick (clamp logp to
    # finfo.min) would overflow to inf here and turn into NaN.
    (3.0 * lp.sum() - 5.0 * h.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad[:, 7:] == 0).all()


def test_dispatcher_torch_and_auto_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(14)
    logits = torch.randn(4, 12)
    targets = torch.randint(0, 12, (4,))
    expected = token_logprob_entropy_ref(logits, targets, 0.7)

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("Triton path taken for CPU tensors under impl='auto'")

    monkeypatch.setattr(logprob_mod, "token_logprob_entropy", boom)
    for impl in ("torch", "auto"):
        lp, h = logprob_entropy(logits, targets, 0.7, impl=impl)
        torch.testing.assert_close(lp, expected[0])
        torch.testing.assert_close(h, expected[1])
    with pytest.raises(ValueError, match="impl must be"):
        logprob_entropy(logits, targets, impl="cuda")  # type: ignore[arg-type]


def test_dispatcher_triton_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(2, 8)
    targets = torch.tensor([1, 2])
    monkeypatch.setattr(logprob_mod, "triton_available", lambda: False)
    with pytest.raises(ImportError, match="needs the `triton` package"):
        logprob_entropy(logits, targets, impl="triton")
    monkeypatch.setattr(logprob_mod, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        logprob_entropy(logits, targets, impl="triton")


def test_input_validation() -> None:
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="leading shape"):
        token_logprob_entropy_ref(logits, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprob_entropy_ref(logits, torch.tensor([1, 2]), temperature=0.0)
    with pytest.raises(ValueError, match="block_v"):
        logprob_mod._pick_block(67, 24)
