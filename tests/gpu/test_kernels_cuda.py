"""The Triton kernels compiled for the GPU against their torch twins (skipped without CUDA).

tests/unit/kernels/test_kernels.py runs its cases in the Triton interpreter on CPU tensors, which
executes the kernel body as numpy: the compiled code (approximate exp and log, fused
multiply-adds, masked loads, constexpr branches) is only ever compiled there, never run.
Here a selection of the same cases runs compiled on CUDA tensors, and the chunked LM head,
which the trainer runs through these kernels in every CUDA forward and backward, is compared
with its torch path at the Qwen2.5 vocabulary. Legend: R rows, H hidden size, V vocab.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Each case compiles its own kernel specialisations (a second or so apiece), so the 18-case
# random-logits matrix is represented by one member (test_cuda_large_vocab covers large V).
CASES = [
    "randn-R33-V300-T0.7",
    "extreme-1e4",
    "masked-vocab-neginf",
    "bf16",
    "one-output-grad",
    "strided-and-leading-dims",
    "default-block-and-dispatcher",
    "target-ids-and-empty",
    "chunked-lm-head",
]


def _compiled_triton() -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: these tests are for the compiled kernels")


@pytest.mark.parametrize("case", CASES)
def test_interpreter_case_compiled_on_cuda(case: str) -> None:
    _compiled_triton()
    from tests.unit.kernels.test_kernels import CASES as ALL_CASES

    with torch.device("cuda"):  # every tensor the case makes is made on the GPU
        ALL_CASES[case]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_lm_head_triton_equals_torch_at_qwen_vocab(dtype: torch.dtype) -> None:
    """Values and gradients of the Triton chunked head against its torch path, two chunks (441 + 159 rows)."""
    _compiled_triton()
    from hybrid_rl.kernels import chunked_logprob_entropy, default_chunk_tokens

    R, H, V = 600, 64, 151_936
    assert default_chunk_tokens(V) < R < 2 * default_chunk_tokens(V)
    g = torch.Generator().manual_seed(0)
    hidden_RH = torch.randn(R, H, generator=g).to("cuda", dtype)
    weight_VH = (torch.randn(V, H, generator=g) * 0.5).to("cuda", dtype)  # logits of std ~4, as trained heads give
    targets_R = torch.randint(0, V, (R,), generator=g).to("cuda")
    a_R, b_R = torch.randn(R, generator=g).cuda(), torch.randn(R, generator=g).cuda()
    out = {}
    for impl in ("triton", "torch"):
        h, w = hidden_RH.clone().requires_grad_(True), weight_VH.clone().requires_grad_(True)
        lp, ent = chunked_logprob_entropy(h, w, None, targets_R, 0.7, impl=impl)
        out[impl] = (lp, ent, *torch.autograd.grad((lp * a_R + ent * b_R).sum(), (h, w)))
    names = ("logp", "entropy", "grad hidden", "grad weight")
    for name, x, y in zip(names, out["triton"], out["torch"]):
        assert x.dtype == y.dtype and torch.isfinite(x).all(), name
        if not name.startswith("grad"):
            # fp32 maths over the same logits in both: only the summation order differs.
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-5, msg=lambda m: f"{dtype} {name}: {m}")
            continue
        # bf16: both round dL/dlogits to bf16 once before the head's matmuls, at values that
        # differ in the last fp32 bits, so a few elements land one bf16 ulp apart.
        rel = ((x.float() - y.float()).norm() / y.float().norm()).item()
        assert rel < (1e-4 if dtype == torch.float32 else 1e-2), f"{dtype} {name}: relative error {rel:.2e}"
