"""Custom kernels for hybrid_rl (installed as `hybrid_rl.kernels`).

Importing this package never imports triton: the Triton kernels are built on
first use. Entry points:

    logprob_entropy(logits, targets, temperature=1.0, impl="auto")
        dispatcher: Triton on CUDA when available, else the torch reference.
    token_logprob_entropy(logits_RV, targets_R, temperature=1.0, *, block_v=None)
        the fused Triton kernel (forward + backward).
    token_logprob_entropy_ref(logits_RV, targets_R, temperature=1.0)
        plain-torch reference / CPU path.
"""
from .logprob import logprob_entropy, token_logprob_entropy, triton_available
from .reference import token_logprob_entropy_ref

__all__ = [
    "logprob_entropy",
    "token_logprob_entropy",
    "token_logprob_entropy_ref",
    "triton_available",
]
