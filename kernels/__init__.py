"""Custom kernels for hybrid_rl (installed as `hybrid_rl.kernels`).

Importing this package never imports triton: the Triton kernels are built on
first use. Entry points:

    logprob_entropy(logits, targets, temperature=1.0, impl="auto")
        dispatcher: Triton on CUDA when available, else the torch reference.
    token_logprob_entropy(logits_RV, targets_R, temperature=1.0, *, block_v=None)
        the fused Triton kernel (forward + backward).
    token_logprob_entropy_ref(logits_RV, targets_R, temperature=1.0)
        plain-torch reference / CPU path.
    chunked_logprob_entropy(hidden_RH, weight_VH, bias_V, targets_R, temperature=1.0,
                            chunk_tokens=None, impl="auto")
        the LM head folded in: logits built and dropped a chunk of tokens at a time,
        recomputed in the backward, so no (R, V) tensor ever exists.
"""

from .lm_head import chunk_rows, chunked_logprob_entropy, default_chunk_tokens
from .logprob import logprob_entropy, token_logprob_entropy, triton_available
from .reference import token_logprob_entropy_ref

__all__ = [
    "chunk_rows",
    "chunked_logprob_entropy",
    "default_chunk_tokens",
    "logprob_entropy",
    "token_logprob_entropy",
    "token_logprob_entropy_ref",
    "triton_available",
]
