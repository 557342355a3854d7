"""Tests for hybrid_rl.kernels: fused token logprob + entropy (Triton) vs torch.

Why the kernel exists: log_softmax(logits) of shape (R, V) in fp32 is ~10 GB at
V = 151,936 and R = 16k tokens; the fused kernel streams over the vocabulary and
keeps O(R) state. These tests pin it to the plain-torch reference.

Shapes legend: R rows (tokens), V vocabulary size.

How Triton is exercised without a GPU: TRITON_INTERPRET=1 runs kernels in the
Triton interpreter on CPU tensors. triton.jit reads that variable when a kernel
is decorated, and our kernels are decorated lazily on first call, so setting it
here (before any kernel call) suffices in-process; but to be independent of
whatever the rest of the suite imported or set, the full matrix runs once in a
subprocess started with TRITON_INTERPRET=1 (`python test_kernels.py --interp-worker`),
which reports one result per case as JSON. Shapes are small because the
interpreter runs each program in numpy; BLOCK_V is kept below V so the streaming
(multi-block online logsumexp) path is what gets tested.

The interpreter is more lenient than the compiler, so a second subprocess
(`--aot-worker`, TRITON_INTERPRET=0) compiles every kernel specialisation for
sm_90 down to a cubin with triton's bundled ptxas; no GPU is needed for that.
On a CUDA machine the in-process and large-vocab tests run the compiled kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable

import torch

# Only on CPU-only machines: on a GPU machine this env var would leak into the
# rest of the pytest process and silently turn every later triton.jit (other
# GPU tests) into the slow interpreter. Must happen before any kernel is built.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hybrid_rl.kernels import logprob as logprob_mod  # noqa: E402
from hybrid_rl.kernels import (  # noqa: E402
    logprob_entropy,
    token_logprob_entropy,
    token_logprob_entropy_ref,
)

ATOL = 1e-5
RTOL = 1e-5
WORKER_TIMEOUT_S = 300


# --------------------------------------------------------------------------- helpers


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _fwd_bwd_check(
    logits_RV: torch.Tensor,
    targets_R: torch.Tensor,
    temperature: float,
    block_v: int | None,
    *,
    use_logp: bool = True,
    use_ent: bool = True,
    grad_atol: float = ATOL,
    grad_rtol: float = RTOL,
    lse_atol: float = 0.0,
) -> None:
    """Triton forward and backward against the reference and its autograd.

    lse_atol: the absolute rounding allowed in a row's log-sum-exp (0: none beyond ATOL). It reaches logp
    and H one for one, and each gradient entry through p = exp(logp) (relative error lse_atol): with
    dL/dz_j = g_lp (onehot_j - p_j) - g_h p_j (logp_j + H), that entry may move by
    lse_atol * p_j * (|g_lp| + |g_h| (|logp_j + H| + 2)) / T, which is 0 where p_j is."""
    torch.manual_seed(1)
    g_logp = torch.randn(targets_R.shape)
    g_ent = torch.randn(targets_R.shape)

    x_tri = logits_RV.detach().clone().requires_grad_(True)
    lp_tri, h_tri = token_logprob_entropy(x_tri, targets_R, temperature, block_v=block_v)
    x_ref = logits_RV.detach().clone().requires_grad_(True)
    lp_ref, h_ref = token_logprob_entropy_ref(x_ref, targets_R, temperature)

    assert lp_tri.dtype == torch.float32 and h_tri.dtype == torch.float32
    assert lp_tri.shape == targets_R.shape and h_tri.shape == targets_R.shape
    _close(lp_tri, lp_ref, "logp", atol=ATOL + lse_atol)
    _close(h_tri, h_ref, "entropy", atol=ATOL + lse_atol)

    def loss(lp: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        if use_logp:
            total = total + (lp * g_logp).sum()
        if use_ent:
            total = total + (h * g_ent).sum()
        return total

    loss(lp_tri, h_tri).backward()
    loss(lp_ref, h_ref).backward()
    assert x_tri.grad is not None and x_tri.grad.dtype == logits_RV.dtype
    assert torch.isfinite(x_tri.grad).all(), "non-finite gradient"
    if not lse_atol:
        _close(x_tri.grad.float(), x_ref.grad.float(), "grad_logits", atol=grad_atol, rtol=grad_rtol)
        return
    logp = torch.log_softmax(logits_RV.detach().double() / temperature, -1)
    p, h = logp.exp(), h_ref.detach().double()[..., None]
    upstream = g_logp.abs()[..., None] * use_logp + g_ent.abs()[..., None] * use_ent * ((logp + h).abs() + 2)
    moved = lse_atol * torch.where(p > 0, p * upstream, 0.0) / temperature
    err = (x_tri.grad.double() - x_ref.grad.double()).abs()
    allowed = grad_atol + grad_rtol * x_ref.grad.double().abs() + moved
    assert (err <= allowed).all(), f"grad_logits: {int((err > allowed).sum())} entries beyond the bound"


def _randn_case(R: int, V: int, T: float, block_v: int) -> Callable[[], None]:
    def run() -> None:
        torch.manual_seed(R * 1000 + V)
        logits = torch.randn(R, V) * 4.0
        targets = torch.randint(0, V, (R,))
        _fwd_bwd_check(logits, targets, T, block_v)

    return run


def _case_extreme() -> None:
    # +-1e4 logits, ties at the max, and the max first appearing in a later block
    # (the running max jumps by 2e4: the rescale factor underflows to exactly 0).
    R, V, block = 6, 70, 16
    logits = torch.full((R, V), -1e4)
    logits[0, 3] = 1e4  # single winner in the first block
    logits[1, 65] = 1e4  # winner in the last, partial block
    logits[2, [5, 40]] = 1e4  # tie across blocks -> entropy log 2
    logits[3] = torch.where(torch.arange(V) % 2 == 0, 1e4, -1e4)  # 35-way tie
    logits[4] = torch.linspace(-1e4, 1e4, V)  # huge spread
    logits[5, 50:] = 0.0  # moderate values after a run of -1e4
    targets = torch.tensor([3, 0, 40, 2, V - 1, 60])
    for T in (1.0, 0.7):
        # Here z = logits / T reaches 1.4e4, where one fp32 ulp is 2**-10 ~ 1e-3: the compiled kernel's
        # exp/log (ex2/lg2 of z * log2(e), the max subtracted after the scaling) round at that magnitude and
        # moved logp by 2.2e-4 on an H200, far above ATOL yet a fraction of an ulp of z. So this case allows
        # its log-sum-exp two fp32 ulps of max|z| (eps * max|z| bounds one ulp); the other cases' logits are
        # O(10), where that would add ~5e-6, and keep ATOL alone.
        lse_atol = 2 * torch.finfo(torch.float32).eps * float(logits.abs().max()) / T
        _fwd_bwd_check(logits, targets, T, block, lse_atol=lse_atol)


def _case_masked_vocab() -> None:
    # -inf logits (masked/padded vocab), including a first block that is all -inf,
    # so the kernel must start its running max at -inf without producing NaN.
    R, V, block = 4, 40, 8
    torch.manual_seed(3)
    logits = torch.randn(R, V) * 3.0
    logits[:, :8] = float("-inf")
    logits[1, 20:] = float("-inf")
    logits[2, ::3] = float("-inf")
    targets = torch.tensor([10, 15, 11, 39])
    _fwd_bwd_check(logits, targets, 1.0, block)
    _fwd_bwd_check(logits, targets, 0.7, block)
    # A target on a -inf logit has logp = -inf (both paths agree).
    lp, h = token_logprob_entropy(logits, torch.tensor([0, 15, 11, 39]), block_v=block)
    assert lp[0].item() == float("-inf") and torch.isfinite(h).all()


def _case_bf16() -> None:
    torch.manual_seed(4)
    logits = (torch.randn(7, 67) * 4.0).to(torch.bfloat16)
    targets = torch.randint(0, 67, (7,))
    # Both paths upcast the same bf16 values to fp32, so outputs agree to fp32
    # precision; the bf16 gradient differs by at most one bf16 rounding.
    _fwd_bwd_check(logits, targets, 0.7, 16, grad_atol=1e-2, grad_rtol=1e-2)


def _case_one_output_grad() -> None:
    # Backward with one upstream grad None: the kernel's constexpr branches.
    torch.manual_seed(5)
    logits = torch.randn(7, 67) * 4.0
    targets = torch.randint(0, 67, (7,))
    _fwd_bwd_check(logits, targets, 0.7, 16, use_ent=False)
    _fwd_bwd_check(logits, targets, 1.0, 16, use_logp=False)


def _case_strided_and_leading_dims() -> None:
    torch.manual_seed(7)
    # Rows with a stride larger than V (a column slice of a wider buffer): no copy.
    wide = torch.randn(5, 80) * 3.0
    targets = torch.randint(0, 67, (5,))
    _fwd_bwd_check(wide[:, :67], targets, 1.0, 16)
    # (B, T, V) input; the [:, :-1] slice cannot be viewed as (R, V) and is copied.
    logits_BTV = torch.randn(2, 4, 67) * 3.0
    targets_BT = torch.randint(0, 67, (2, 4))
    _fwd_bwd_check(logits_BTV, targets_BT, 0.7, 16)
    _fwd_bwd_check(logits_BTV[:, :-1], targets_BT[:, :-1], 0.7, 16)
    # Column stride != 1 (a transposed view) is made contiguous.
    _fwd_bwd_check((torch.randn(67, 5) * 3.0).t(), targets, 1.0, 16)


def _case_default_block_and_dispatcher() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, 300) * 4.0
    targets = torch.randint(0, 300, (3,))
    _fwd_bwd_check(logits, targets, 1.0, None)  # default block: one block covers V
    lp_ref, h_ref = token_logprob_entropy_ref(logits, targets, 0.7)
    lp, h = logprob_entropy(logits, targets, 0.7, impl="triton")
    _close(lp, lp_ref, "logp")
    _close(h, h_ref, "entropy")


def _case_target_ids_and_empty() -> None:
    torch.manual_seed(9)
    logits = torch.randn(7, 67) * 4.0
    _fwd_bwd_check(logits, torch.randint(0, 67, (7,), dtype=torch.int32), 1.0, 16)
    # Out-of-range ids: no host-side bounds check (it would sync the GPU); the
    # kernel masks the load, so a bad id gives NaN logp, never a stray read.
    lp, h = token_logprob_entropy(logits[:3], torch.tensor([1, -100, 67]), block_v=16)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1:]).all() and torch.isfinite(h).all()
    # R = 0: no launch, empty outputs, and an empty gradient.
    x = torch.randn(0, 67, requires_grad=True)
    lp, h = token_logprob_entropy(x, torch.zeros(0, dtype=torch.long), block_v=16)
    (lp.sum() + h.sum()).backward()
    assert lp.shape == (0,) and x.grad is not None and x.grad.shape == (0, 67)


def _case_chunked_lm_head() -> None:
    # kernels/lm_head.py with the Triton kernels on each chunk (the CUDA path) against
    # its torch path: head matmul + logprob/entropy per chunk, logits recomputed in
    # the backward. Chunk 3 does not divide R = 7; every upstream-grad combination.
    from hybrid_rl.kernels import chunked_logprob_entropy

    torch.manual_seed(15)
    t = torch.randint(0, 67, (7,))
    dev = t.device  # every tensor below is made there explicitly (a GPU run wraps the case in torch.device)
    w_lp, w_h = torch.arange(7.0, device=dev), torch.linspace(1, -1, 7, device=dev)
    # bf16: the same bf16 logits feed fp32 maths, so values agree to fp32 rounding; the
    # gradients are rounded to bf16 before the head's matmuls at different points
    # (Triton stores bf16 dL/dlogits, torch casts its fp32 one), a few bf16 ulps apart.
    # fp32 on CUDA: grad hidden and grad weight each sum 67 (or 7) products of magnitude ~10, and cuBLAS orders
    # that sum otherwise than the Triton path's per-chunk products: about 67 x eps32 x 10 ~ 1e-4 apart (an H200
    # measured 1.5e-5). On CPU both go through the same BLAS and agree to ATOL.
    fp32_grad_tol = 1e-4 if dev.type == "cuda" else ATOL
    for dtype, val_tol, grad_tol in ((torch.float32, ATOL, fp32_grad_tol), (torch.bfloat16, 1e-4, 0.1)):
        inputs = [(torch.randn(*shape, device=dev) * 2.0).to(dtype) for shape in ((7, 16), (67, 16), (67,))]
        for use_lp, use_h in ((True, True), (True, False), (False, True)):
            outs = {}
            for impl in ("triton", "torch"):
                h, w, b = (x.clone().requires_grad_(True) for x in inputs)
                lp, ent = chunked_logprob_entropy(h, w, b, t, 0.7, chunk_tokens=3, impl=impl)
                loss = (lp * w_lp).sum() * use_lp + (ent * w_h).sum() * use_h
                outs[impl] = (lp, ent, *torch.autograd.grad(loss, (h, w, b)))
            names = ("logp", "entropy", "grad hidden", "grad weight", "grad bias")
            for name, x, y in zip(names, outs["triton"], outs["torch"]):
                assert x.dtype == y.dtype, f"{name}: {x.dtype} vs {y.dtype}"
                tol = grad_tol if name.startswith("grad") else val_tol
                _close(x.float(), y.float(), f"{dtype} lp={use_lp} h={use_h} {name}", atol=tol, rtol=tol)


def _build_cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    blocks = {5: 4, 67: 32, 300: 128}  # always < V: 2, 3 and 3 vocab blocks, last partial
    for R in (1, 7, 33):
        for V in (5, 67, 300):
            for T in (1.0, 0.7):
                cases[f"randn-R{R}-V{V}-T{T}"] = _randn_case(R, V, T, blocks[V])
    cases["extreme-1e4"] = _case_extreme
    cases["masked-vocab-neginf"] = _case_masked_vocab
    cases["bf16"] = _case_bf16
    cases["one-output-grad"] = _case_one_output_grad
    cases["strided-and-leading-dims"] = _case_strided_and_leading_dims
    cases["default-block-and-dispatcher"] = _case_default_block_and_dispatcher
    cases["target-ids-and-empty"] = _case_target_ids_and_empty
    cases["chunked-lm-head"] = _case_chunked_lm_head
    return cases


CASES = _build_cases()


def _worker_main() -> None:
    """Run every case under the interpreter; print {name: {ok, msg, seconds}} as JSON."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "worker must run with TRITON_INTERPRET=1"
    results: dict[str, dict[str, object]] = {}
    for name, fn in CASES.items():
        t0 = time.perf_counter()
        try:
            fn()
            results[name] = {"ok": True, "msg": ""}
        except Exception as exc:  # report every case, not just the first failure
            results[name] = {"ok": False, "msg": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.perf_counter() - t0, 3)
    # Marker line: the interpreter may print warnings to stdout as well.
    print("RESULTS_JSON " + json.dumps(results))


def _aot_worker_main() -> None:
    """Compile both kernels for sm_90 without a GPU (TRITON_INTERPRET=0).

    The interpreter executes the kernel body as Python and accepts code the real
    compiler rejects (loop-carried type changes, constexpr branches, pointer
    arithmetic types), so compile every specialisation down to a cubin to check
    the GPU path's front end on a CPU-only machine.
    """
    assert os.environ.get("TRITON_INTERPRET") == "0", "AOT worker must run with TRITON_INTERPRET=0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        ptxas = triton.knobs.nvidia.ptxas.path
    except Exception as exc:  # no NVIDIA backend in this triton build
        print(f"AOT_SKIP no NVIDIA backend/ptxas: {exc}")
        return
    if not ptxas or not os.path.exists(ptxas):
        print(f"AOT_SKIP ptxas not found ({ptxas})")
        return
    fwd, bwd = logprob_mod._kernels(False)

    def compile_one(kernel: object, types: dict[str, str], consts: dict[str, object]) -> None:
        # Parameter types in signature order: a "*" type is a pointer, "constexpr" a constant.
        names = list(kernel.arg_names)  # type: ignore[attr-defined]
        sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
        k = triton.compile(
            ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}
        )
        assert "cubin" in k.asm, f"{names[0]}: no cubin for {types} {consts}"

    for dt in ("fp32", "bf16"):
        types = {n: "*fp32" for n in ("logp_ptr", "ent_ptr", "m_ptr", "logs_ptr", "g_logp_ptr", "g_ent_ptr")}
        types.update(
            logits_ptr=f"*{dt}",
            grad_ptr=f"*{dt}",
            targets_ptr="*i64",
            V="i32",
            stride_row="i64",
            stride_grad_row="i64",
            temperature="fp32",
        )
        compile_one(fwd, types, {"BLOCK_V": 4096})
        for has_lp, has_h in ((True, True), (True, False), (False, True)):
            compile_one(bwd, types, {"BLOCK_V": 4096, "HAS_G_LOGP": has_lp, "HAS_G_ENT": has_h})
    print("AOT_OK")


# --------------------------------------------------------------------------- interpreter (subprocess)


def _run_worker(flag: str, **env: str) -> str:
    """Run this file as a script in a fresh interpreter; return its stdout."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), flag],
        env=dict(os.environ, PYTHONWARNINGS="ignore", **env),
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{flag} rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def interp_results() -> dict[str, dict[str, object]]:
    pytest.importorskip("triton")
    out = _run_worker("--interp-worker", TRITON_INTERPRET="1")
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULTS_JSON ")]
    assert lines, out[-4000:]
    return json.loads(lines[-1].removeprefix("RESULTS_JSON "))


@pytest.mark.parametrize("case", list(CASES))
def test_triton_interpreter_matches_reference(case: str, interp_results: dict[str, dict]) -> None:
    res = interp_results[case]
    assert res["ok"], res["msg"]


def test_triton_compiles_for_sm90_without_gpu() -> None:
    pytest.importorskip("triton")
    out = _run_worker("--aot-worker", TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    if "AOT_SKIP" in out:
        pytest.skip(out.strip().splitlines()[-1])
    assert "AOT_OK" in out, out[-4000:]


# --------------------------------------------------------------------------- in-process


def test_in_process_kernel_after_other_imports() -> None:
    """The kernel works in the pytest process too, whatever was imported before.

    Kernels are jitted lazily, keyed on TRITON_INTERPRET at call time, so an
    earlier `import triton` elsewhere in the suite does not matter. On a GPU
    machine this runs the compiled kernel on CUDA instead.
    """
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1 in this process")
    torch.manual_seed(10)
    logits = (torch.randn(7, 67) * 4.0).to(device).requires_grad_(True)
    targets = torch.randint(0, 67, (7,), device=device)
    lp, h = token_logprob_entropy(logits, targets, 0.7, block_v=16)
    lp_ref, h_ref = token_logprob_entropy_ref(logits, targets, 0.7)
    _close(lp, lp_ref, "logp")
    _close(h, h_ref, "entropy")
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), logits)
    (g_ref,) = torch.autograd.grad(lp_ref.sum() + h_ref.sum(), logits)
    _close(g, g_ref, "grad_logits")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_large_vocab() -> None:
    """Compiled kernel at a real vocabulary size (Qwen2: V = 151,936), bf16."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: large shapes are too slow in the interpreter")
    torch.manual_seed(11)
    R, V = 64, 151_936
    logits = (torch.randn(R, V, device="cuda") * 5.0).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, V, (R,), device="cuda")
    lp, h = logprob_entropy(logits, targets, 0.7)  # auto -> Triton on CUDA
    lp_ref, h_ref = token_logprob_entropy_ref(logits, targets, 0.7)
    _close(lp, lp_ref, "logp", atol=1e-4, rtol=1e-5)
    _close(h, h_ref, "entropy", atol=1e-4, rtol=1e-5)
    (g,) = torch.autograd.grad((lp - 0.1 * h).sum(), logits)
    (g_ref,) = torch.autograd.grad((lp_ref - 0.1 * h_ref).sum(), logits)
    _close(g.float(), g_ref.float(), "grad_logits", atol=1e-2, rtol=1e-2)


def test_import_does_not_need_triton() -> None:
    # Fresh interpreter: this process may already have triton in sys.modules.
    code = (
        "import sys, torch\n"
        "import hybrid_rl.kernels as k\n"
        "x = torch.randn(3, 11); t = torch.tensor([0, 5, 10])\n"
        "k.logprob_entropy(x, t)\n"  # auto on CPU -> torch reference, no triton
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    if "--interp-worker" in sys.argv:
        _worker_main()
    elif "--aot-worker" in sys.argv:
        _aot_worker_main()
