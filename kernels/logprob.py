"""Fused per-token log-probability + softmax entropy from logits (Triton).

Why fuse: the hot op of RL post-training is, for every response token,
log p(target) and the entropy H of softmax(logits / T). The obvious torch code,
log_softmax(logits).gather(...), materialises an fp32 (R, V) log-softmax (plus a
probability tensor for the entropy). For a Qwen-style vocabulary V = 151,936 and
R = 16k tokens in a micro-batch that is 16,384 * 151,936 * 4 B = 9.96 GB per
(R, V) fp32 temporary, on top of the bf16 logits themselves. The kernel here
streams over the vocabulary in blocks of BLOCK_V with an online logsumexp, so
its only outputs are a handful of fp32 numbers per row: memory O(R), one read of
the logits in the forward, and one read + one write (the gradient) in the
backward.

Maths, per row, with z = logits / T, running max m and s = sum exp(z - m):
    lse  = m + log s
    logp = (z_target - m) - log s           (m subtracted first: exact at |z|~1e4)
    H    = lse - sum p z = log s - t / s,   t = sum exp(z - m) * (z - m)
Tracking t relative to the running max keeps H free of the catastrophic
cancellation that lse - sum p z has in fp32 when logits are large. When the max
grows from m to m' the running sums are rescaled with c = exp(m - m'):
    s' = c * s,   t' = c * (t + (m - m') * s).
Backward (dL/dz scaled by 1/T to get dL/dlogits):
    dlogp/dz_j = onehot_j - p_j,      dH/dz_j = -p_j * (logp_j + H).

Shapes legend:
    R: rows (tokens; leading dims of the input are flattened into R)
    V: vocabulary size (any value; need not be a multiple of BLOCK_V)

`triton` is imported lazily, inside functions, so that importing this module
(and `hybrid_rl.kernels`) works on machines without it. Because triton.jit reads
TRITON_INTERPRET when it decorates a function, the kernels are also decorated
lazily, on first use; set TRITON_INTERPRET=1 before the first call to run them
in the interpreter on CPU tensors.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal

import torch
from torch import Tensor

from .reference import token_logprob_entropy_ref

__all__ = ["logprob_entropy", "token_logprob_entropy", "triton_available"]

# Bound to `triton.language` by `_kernels()` on first use. The kernel bodies below
# are plain functions that name `tl` as a module global; triton.jit (and the
# interpreter) resolve it through the function's __globals__ at compile time. The
# string annotations (from __future__ import annotations) let the `tl.constexpr`
# annotations exist before triton is imported; triton normalises the string.
tl: Any = None

_DEFAULT_MAX_BLOCK_V = 4096  # 16 fp32 per thread at 8 warps; enough to hide latency


def _fwd_kernel(
    logits_ptr,  # (R, V) rows with stride `stride_row`, unit column stride
    targets_ptr,  # (R,) int
    logp_ptr,  # (R,) fp32 out
    ent_ptr,  # (R,) fp32 out
    m_ptr,  # (R,) fp32 out: final running max of z (saved for backward)
    logs_ptr,  # (R,) fp32 out: log sum exp(z - m) (saved for backward)
    V,
    stride_row,
    temperature,
    BLOCK_V: tl.constexpr,
):
    # int64 row offset: R * V exceeds 2**31 at V = 152k and R > 14k.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max of z
    s = 0.0  # sum exp(z - m)
    t = 0.0  # sum exp(z - m) * (z - m)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Shift by m_new unless every logit so far is -inf (masked vocabulary):
        # then shift by 0 so that z - shift is -inf (exp -> 0) instead of NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        # m == -inf means nothing accumulated yet (s = t = 0); use a zero shift
        # delta there, since (m - shift) * s would be -inf * 0 = NaN.
        dm = tl.where(m == float("-inf"), 0.0, m - shift)
        c = tl.exp(dm)
        t = c * (t + dm * s)
        s = c * s
        e = tl.exp(z - shift)
        s += tl.sum(e, axis=0)
        # e == 0 lanes may have z - shift = -inf; zero them before multiplying,
        # as 0 * -inf would poison the sum with NaN.
        zs = tl.where(e > 0.0, z - shift, 0.0)
        t += tl.sum(e * zs, axis=0)
        m = m_new
    log_s = tl.log(s)
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    # Out-of-range targets read nothing (no out-of-bounds access) and give NaN.
    valid = (tgt >= 0) & (tgt < V)
    z_t = tl.load(row_ptr + tgt, mask=valid, other=float("nan")).to(tl.float32) / temperature
    tl.store(logp_ptr + row, (z_t - m) - log_s)
    tl.store(ent_ptr + row, log_s - t / s)
    tl.store(m_ptr + row, m)
    tl.store(logs_ptr + row, log_s)


def _bwd_kernel(
    logits_ptr,  # (R, V) as in the forward
    targets_ptr,  # (R,)
    m_ptr,  # (R,) fp32 from the forward
    logs_ptr,  # (R,) fp32 from the forward
    ent_ptr,  # (R,) fp32 entropy from the forward
    g_logp_ptr,  # (R,) fp32 upstream grad of logp (unused unless HAS_G_LOGP)
    g_ent_ptr,  # (R,) fp32 upstream grad of entropy (unused unless HAS_G_ENT)
    grad_ptr,  # (R, V) out, dtype of the logits
    V,
    stride_row,
    stride_grad_row,
    temperature,
    HAS_G_LOGP: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    out_ptr = grad_ptr + row * stride_grad_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.load(m_ptr + row)
    log_s = tl.load(logs_ptr + row)
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    if HAS_G_LOGP:
        g_lp = tl.load(g_logp_ptr + row)
    else:
        g_lp = 0.0
    if HAS_G_ENT:
        g_h = tl.load(g_ent_ptr + row)
        ent = tl.load(ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        logp = (z - m) - log_s
        p = tl.exp(logp)
        # p == 0 lanes (masked vocab, z = -inf) have logp = -inf and p * -inf
        # would be NaN; their gradient is 0, so any finite logp will do.
        logp = tl.where(p > 0.0, logp, 0.0)
        # Combined dL/dz = g_lp * (onehot - p) - g_h * p * (logp + H).
        if HAS_G_ENT:
            coef = g_lp + g_h * (logp + ent)
        else:
            coef = g_lp
        g = -p * coef
        g = tl.where(offs == tgt, g + g_lp, g)
        g = g / temperature
        tl.store(out_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when `import triton` succeeds (cached; imports triton on first call)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _require_triton() -> None:
    if not triton_available():
        raise ImportError(
            "impl='triton' needs the `triton` package (pip install 'triton>=3.3'); "
            "use impl='torch' or impl='auto' to fall back to the torch reference"
        )


def _interpreting() -> bool:
    # Same env var triton.jit consults; read directly to avoid importing triton.
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """Decorate the kernels with triton.jit on first use.

    Keyed on the interpreter flag because triton.jit returns a different object
    (InterpretedFunction vs JITFunction) depending on TRITON_INTERPRET at
    decoration time.
    """
    global tl
    import triton
    import triton.language as triton_language

    tl = triton_language
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pick_block(V: int, block_v: int | None) -> int:
    if block_v is None:
        return min(_next_pow2(V), _DEFAULT_MAX_BLOCK_V)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two (tl.arange requirement), got {block_v}")
    return block_v


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _check_device(x: Tensor) -> None:
    if not x.is_cuda and not _interpreting():
        raise RuntimeError(
            f"the Triton logprob kernel needs CUDA tensors (got device {x.device}); "
            "set TRITON_INTERPRET=1 before the first call to run it on CPU in the "
            "interpreter, or use impl='torch'"
        )


def _launch_fwd(
    logits_RV: Tensor, targets_R: Tensor, temperature: float, block_v: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    R, V = logits_RV.shape
    fwd, _ = _kernels(_interpreting())
    logp_R, ent_R, m_R, logs_R = (torch.empty(R, device=logits_RV.device, dtype=torch.float32) for _ in range(4))
    if R > 0:
        block = _pick_block(V, block_v)
        fwd[(R,)](
            logits_RV,
            targets_R,
            logp_R,
            ent_R,
            m_R,
            logs_R,
            V,
            logits_RV.stride(0),
            float(temperature),
            BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    return logp_R, ent_R, m_R, logs_R


def _launch_bwd(
    logits_RV: Tensor,
    targets_R: Tensor,
    m_R: Tensor,
    logs_R: Tensor,
    ent_R: Tensor,
    g_logp_R: Tensor | None,
    g_ent_R: Tensor | None,
    temperature: float,
    block_v: int | None,
) -> Tensor:
    R, V = logits_RV.shape
    _, bwd = _kernels(_interpreting())
    grad_RV = torch.empty((R, V), device=logits_RV.device, dtype=logits_RV.dtype)
    if R > 0:
        block = _pick_block(V, block_v)
        # A dummy pointer for an absent grad; the constexpr flag stops any load.
        g_lp = g_logp_R.float().contiguous() if g_logp_R is not None else m_R
        g_h = g_ent_R.float().contiguous() if g_ent_R is not None else m_R
        bwd[(R,)](
            logits_RV,
            targets_R,
            m_R,
            logs_R,
            ent_R,
            g_lp,
            g_h,
            grad_RV,
            V,
            logits_RV.stride(0),
            grad_RV.stride(0),
            float(temperature),
            HAS_G_LOGP=g_logp_R is not None,
            HAS_G_ENT=g_ent_R is not None,
            BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    return grad_RV


class _TokenLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits_RV: Tensor, targets_R: Tensor, temperature: float, block_v: int | None
    ) -> tuple[Tensor, Tensor]:
        logp_R, ent_R, m_R, logs_R = _launch_fwd(logits_RV, targets_R, temperature, block_v)
        ctx.save_for_backward(logits_RV, targets_R, m_R, logs_R, ent_R)
        ctx.temperature = temperature
        ctx.block_v = block_v
        # Keep unused-output grads as None so the kernel skips their terms
        # (the common case is a loss on logp only, with entropy as a metric).
        ctx.set_materialize_grads(False)
        return logp_R, ent_R

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp_R: Tensor | None, g_ent_R: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        if g_logp_R is None and g_ent_R is None:
            return None, None, None, None
        logits_RV, targets_R, m_R, logs_R, ent_R = ctx.saved_tensors
        grad_RV = _launch_bwd(logits_RV, targets_R, m_R, logs_R, ent_R, g_logp_R, g_ent_R, ctx.temperature, ctx.block_v)
        return grad_RV, None, None, None


def _validate(logits: Tensor, targets: Tensor, temperature: float) -> None:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dim, got {tuple(logits.shape)}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"leading shape mismatch: logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprob_entropy(
    logits_RV: Tensor,
    targets_R: Tensor,
    temperature: float = 1.0,
    *,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused Triton log p(target) and softmax entropy, differentiable w.r.t. logits.

    Args:
        logits_RV: (..., V) fp32/bf16/fp16 logits on CUDA (or CPU with
            TRITON_INTERPRET=1). Any V. Rows may be strided; the vocab dim must
            be contiguous or it is copied.
        targets_R: (...) integer ids in [0, V); out-of-range ids give NaN logp
            (no bounds check on the host, which would force a device sync).
        temperature: logits are divided by it before the softmax.
        block_v: vocab block per iteration (power of two); default
            min(next_pow2(V), 4096). Tests shrink it to exercise the streaming path.

    Returns:
        (logp_R, entropy_R): fp32, shaped like `targets_R`. Backward gives the
        gradient for either or both outputs, in the dtype of the logits.
    """
    _require_triton()
    _validate(logits_RV, targets_R, temperature)
    _check_device(logits_RV)
    V = logits_RV.shape[-1]
    lead = targets_R.shape
    # reshape is a view for the usual (B, T, V) contiguous logits; a stride-1
    # vocab dim is all the kernel needs, rows are addressed through stride(0).
    x_RV = logits_RV.reshape(-1, V)
    if x_RV.stride(-1) != 1:
        x_RV = x_RV.contiguous()
    t_R = targets_R.reshape(-1).contiguous()
    logp_R, ent_R = _TokenLogprobEntropy.apply(x_RV, t_R, float(temperature), block_v)
    return logp_R.reshape(lead), ent_R.reshape(lead)


Impl = Literal["auto", "triton", "torch"]


def logprob_entropy(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, impl: Impl = "auto"
) -> tuple[Tensor, Tensor]:
    """Per-token log p(target) and entropy of softmax(logits / temperature), fp32.

    impl:
        "auto":   Triton kernel when `logits` is on CUDA and triton imports,
                  else the torch reference (CPU paths, no triton installed).
        "triton": always the Triton kernel (ImportError if triton is missing;
                  RuntimeError on CPU tensors unless TRITON_INTERPRET=1).
        "torch":  always the torch reference (materialises (R, V) fp32).
    Both paths are differentiable w.r.t. `logits`.
    """
    if impl == "torch":
        return token_logprob_entropy_ref(logits, targets, temperature)
    if impl == "triton":
        return token_logprob_entropy(logits, targets, temperature)
    if impl == "auto":
        if logits.is_cuda and triton_available():
            return token_logprob_entropy(logits, targets, temperature)
        return token_logprob_entropy_ref(logits, targets, temperature)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
