"""Peak extra memory and time of per-token logp + entropy, forward + backward:
the chunked LM head (`hybrid_rl.kernels.chunked_logprob_entropy`) vs the naive path.

naive:   logits_RV = hidden_RH @ weight_VH^T, then logprob_entropy(logits_RV.float(), ...)
         (what `response_logprobs` did before: full logits, an fp32 copy, and autograd
         keeps them for the backward).
chunked: the head folded into the logprob computation, C rows of logits at a time,
         recomputed in the backward (C = `chunk_rows(R, V)` unless --chunk is given).

Both run the same loss, sum(a * logp + b * entropy), so the gradient goes through the
logprob and the entropy, and both produce grad_hidden_RH and grad_weight_VH.

How memory is measured (CPU and CUDA alike): `AllocTracker`, a TorchDispatchMode that
sees every aten op of the forward and the backward and counts the bytes of each new
storage an op returns (views and in-place/out= results of existing storages are not
new) until the storage is freed (a weakref finalizer on it). peak = the most bytes live
at once; largest = the biggest single storage. Inputs made before tracking starts
(hidden, weight) are not counted; gradients are. Scratch space internal to a kernel
(e.g. a matmul's workspace) is invisible to it. On CUDA, torch.cuda.max_memory_allocated
above the starting point is reported as well. temp_peak replays the same history
without the two gradients every method must return (grad_hidden R*H and grad_weight
V*H, the latter 519 MiB in fp32 at Qwen2.5-0.5B's head): the temporaries alone.

    python benchmarks/logprob_memory.py                              # V=151936, H=896, R in 256 1024 2048
    python benchmarks/logprob_memory.py --tokens 64 --vocab 4096 --hidden 64

Prints a table, then one JSON object as the last line. `main(argv) -> dict`.
Legend: R tokens (rows), H hidden size, V vocabulary size, C rows per chunk.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybrid_rl.kernels import chunk_rows, chunked_logprob_entropy, logprob_entropy


class AllocTracker(TorchDispatchMode):
    """Live bytes of the storages torch ops create while the mode is active.

    Attributes: live (bytes now), peak (most bytes live at once), largest (biggest
    single new storage), count (new storages seen). `peak_without(tensors)` replays the
    allocation history leaving out the storages of `tensors` (e.g. the gradients a
    backward must produce whatever the method), which gives the peak of temporaries.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = self.count = 0
        self._live_ids: dict[int, int] = {}  # storage data_ptr -> allocation id
        self._history: list[tuple[int, int]] = []  # (allocation id, +bytes or -bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output sharing storage with an input is a view, an in-place result or an
        # out= buffer: nothing new was allocated for it.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or ptr in inputs or ptr in self._live_ids:
            return
        self._live_ids[ptr] = self.count
        self._history.append((self.count, n))
        self.count += 1
        self.live += n
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, n)
        weakref.finalize(storage, self._freed, ptr, n)

    def _freed(self, ptr: int, n: int) -> None:
        self._history.append((self._live_ids.pop(ptr), -n))
        self.live -= n

    def peak_without(self, tensors: list[torch.Tensor]) -> int:
        """Peak live bytes had the storages of `tensors` (still alive) never been counted."""
        skip = {self._live_ids.get(t.untyped_storage().data_ptr()) for t in tensors}
        live = peak = 0
        for alloc_id, n in self._history:
            if alloc_id not in skip:
                live += n
                peak = max(peak, live)
        return peak


def naive_logprob_entropy(
    hidden_RH: torch.Tensor, weight_VH: torch.Tensor, targets_R: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (R, V) logits, upcast to fp32, then the unchunked logprob/entropy (the old path)."""
    logits_RV = torch.nn.functional.linear(hidden_RH, weight_VH)
    return logprob_entropy(logits_RV.float(), targets_R, temperature)


def measure(
    fn: Callable, hidden_RH: torch.Tensor, weight_VH: torch.Tensor, targets_R: torch.Tensor, temperature: float
) -> dict[str, Any]:
    """One forward + backward of sum(a*logp + b*entropy) under the tracker; bytes and seconds."""
    R = hidden_RH.shape[0]
    a_R = torch.linspace(-1.0, 1.0, R)
    b_R = torch.full((R,), 0.01)
    h = hidden_RH.detach().requires_grad_(True)
    w = weight_VH.detach().requires_grad_(True)
    gc.collect()
    cuda = hidden_RH.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with AllocTracker() as tr:
        logp_R, ent_R = fn(h, w, targets_R, temperature)
        (logp_R * a_R.to(logp_R.device) + ent_R * b_R.to(ent_R.device)).sum().backward()
        del logp_R, ent_R
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out = {
        "peak_bytes": tr.peak,
        "temp_peak_bytes": tr.peak_without([h.grad, w.grad]),
        "largest_bytes": tr.largest,
        "seconds": seconds,
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
    }
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - cuda_base
    return out


def _row(R: int, impl: str, C: str, r: dict, naive: dict | None) -> str:
    def ratio(key: str) -> str:
        return f"{r[key] / naive[key]:.3f}" if naive else "-"

    mib = {k: r[k] / 2**20 for k in ("temp_peak_bytes", "peak_bytes", "largest_bytes")}
    return (
        f"{R:>6} {impl:>8} {C:>5} {mib['temp_peak_bytes']:>12.1f} {ratio('temp_peak_bytes'):>10} "
        f"{mib['peak_bytes']:>12.1f} "
        f"{ratio('peak_bytes'):>10} {mib['largest_bytes']:>12.1f} {r['seconds']:>8.2f} {ratio('seconds'):>10}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 4096 would take ~4 more minutes on a 2-core VM and ~15 GB for the naive path.
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048], help="R values")
    ap.add_argument(
        "--naive-max-tokens",
        type=int,
        default=4096,
        help="skip the naive path above this R (its (R, V) temporaries may not fit)",
    )
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--chunk", type=int, default=None, help="rows per chunk (default: chunk_rows(R, V), per R)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    V, H = args.vocab, args.hidden
    g = torch.Generator().manual_seed(0)
    weight_VH = (torch.randn(V, H, generator=g) * H**-0.5).to(dev, dtype)

    def chunked(h, w, t, temp):
        return chunked_logprob_entropy(h, w, None, t, temp, chunk_tokens=args.chunk)

    if dev.type == "cuda":  # compile the Triton kernels and start cuBLAS before anything is timed
        R0 = min(args.tokens[0], args.chunk or chunk_rows(args.tokens[0], V))
        h0 = torch.randn(R0, H, generator=g).to(dev, dtype).requires_grad_(True)
        t0 = torch.randint(0, V, (R0,), generator=g).to(dev)
        for fn in (naive_logprob_entropy, chunked):
            lp, ent = fn(h0, weight_VH.detach().requires_grad_(True), t0, args.temperature)
            (lp.sum() + ent.sum()).backward()
        del h0, t0, lp, ent
        torch.cuda.synchronize()

    rows: list[dict[str, Any]] = []
    lines = [
        f"{'R':>6} {'impl':>8} {'C':>5} {'temp MiB':>12} {'/naive':>10} {'peak MiB':>12} {'/naive':>10} "
        f"{'largest MiB':>12} {'seconds':>8} {'/naive':>10}"
    ]
    for R in args.tokens:
        C = args.chunk or chunk_rows(R, V)  # what chunked_logprob_entropy picks for chunk_tokens=args.chunk
        hidden_RH = torch.randn(R, H, generator=g).to(dev, dtype)
        targets_R = torch.randint(0, V, (R,), generator=g).to(dev)
        naive = (
            measure(naive_logprob_entropy, hidden_RH, weight_VH, targets_R, args.temperature)
            if R <= args.naive_max_tokens
            else None
        )
        ch = measure(chunked, hidden_RH, weight_VH, targets_R, args.temperature)
        max_grad_diff = None
        if naive is not None:
            max_grad_diff = max(
                (ch["grad_hidden"] - naive["grad_hidden"]).abs().max().item(),
                (ch["grad_weight"] - naive["grad_weight"]).abs().max().item(),
            )
            lines.append(_row(R, "naive", "-", naive, None))
        lines.append(_row(R, "chunked", str(C), ch, naive))
        row: dict[str, Any] = {"tokens": R, "chunk": C, "max_abs_grad_diff": max_grad_diff}
        for name, r in (("naive", naive), ("chunked", ch)):
            if r is not None:
                row[name] = {
                    k: (round(v, 4) if k == "seconds" else v) for k, v in r.items() if not k.startswith("grad")
                }
        if naive is not None:
            row["temp_peak_ratio_chunked_over_naive"] = round(ch["temp_peak_bytes"] / naive["temp_peak_bytes"], 4)
            row["peak_ratio_chunked_over_naive"] = round(ch["peak_bytes"] / naive["peak_bytes"], 4)
            row["time_ratio_chunked_over_naive"] = round(ch["seconds"] / naive["seconds"], 3)
        rows.append(row)
        del naive, ch, hidden_RH, targets_R
        gc.collect()
    result = {
        "benchmark": "logprob_memory",
        "date": datetime.date.today().isoformat(),
        "device": str(dev),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "vocab": V,
        "hidden": H,
        "temperature": args.temperature,
        "chunk": args.chunk or "chunk_rows(R, V), per row",
        "memory_measure": (
            "AllocTracker (TorchDispatchMode): live bytes of storages created by aten ops during "
            "forward+backward; temp_peak leaves out the returned gradients of hidden and weight"
        ),
        "rows": rows,
    }
    if not args.json_only:
        print(
            f"logp + entropy, forward + backward: V={V} H={H} dtype={args.dtype} device={dev} "
            f"chunk C={args.chunk or 'chunk_rows(R, V) (see rows)'} "
            f"T={args.temperature}, torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print(
            "peak = most bytes of torch-allocated storages live at once during forward+backward (AllocTracker;"
            " inputs excluded, gradients included); temp = the same without the two gradients every method"
            " returns (grad_hidden R*H, grad_weight V*H); largest = biggest single storage"
        )
        print("\n".join(lines))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
