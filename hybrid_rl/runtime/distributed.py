"""Process-group set-up and collective helpers that are no-ops on one rank.

Under `torchrun` the env vars RANK/WORLD_SIZE/MASTER_ADDR are set and we join a
process group, always with a timeout so a dead rank cannot hang the others forever.
In a plain process (a notebook) on CPU nothing is initialised and every helper below
acts on the single local rank.

One group serves both kinds of tensor. The step reduces small host tensors (metric
sums, counts, sampling decisions) and device tensors (loss normalisers, whitening
statistics); a plain `nccl` group serves only CUDA tensors and would fail at the
first metric reduction of a GPU run. So a CUDA run joins `cpu:gloo,cuda:nccl`
(as verl does): host tensors go over gloo, device tensors over NCCL. Every tensor
helper checks the tensor's device against what the group serves and says so if it
cannot (the object helpers pickle into tensors torch itself places on a served device).

When a rank dies the others must not wait for it: a dead peer fails their next gloo
collective at once ("Connection closed by peer"), a hung one fails it after the group's
timeout (`trainer.dist_timeout_s`), and torchrun tears the rest down. `report_failures`
wraps a recipe's `main` so that each failing rank prints one line saying which rank it
is and where it was, and a rank whose collective lost its peer names the ranks that
failed first or never answered (the only way node 0's log can name a rank on node 1).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from hybrid_rl.runtime.errors import UserError


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


# The split placement (hybrid_rl/split/) scopes each rank's library collectives to its own pool: the
# learner ranks reduce metrics, normalisers and whitening statistics among themselves, the rollout ranks
# theirs, exactly as a colocated world of that size would. (group, global ranks); None = the whole world.
_SCOPE: tuple[Any, tuple[int, ...]] | None = None


def use_group(group, ranks: list[int] | None) -> None:
    """From now on rank(), world_size() and the collectives below act within `group` (global `ranks`, sorted);
    None restores the whole world. `src`/`dst` arguments stay global ranks."""
    global _SCOPE
    _SCOPE = None if ranks is None else (group, tuple(ranks))


def _group():
    return _SCOPE[0] if _SCOPE is not None else None


def rank() -> int:
    """This rank's index in its scope (the whole world unless `use_group` narrowed it)."""
    if not is_dist():
        return 0
    return _SCOPE[1].index(dist.get_rank()) if _SCOPE is not None else dist.get_rank()


def world_size() -> int:
    if not is_dist():
        return 1
    return len(_SCOPE[1]) if _SCOPE is not None else dist.get_world_size()


def is_main() -> bool:
    """Global rank 0 (it writes metrics, configs and checkpoints in either placement)."""
    return (dist.get_rank() if is_dist() else 0) == 0


def env_world_size() -> int:
    """World size the launcher asked for (before the group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def backend_for(device: torch.device) -> str:
    """The process-group backend string for a run whose compute device is `device`."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def served_device_types(backend: str) -> set[str]:
    """Device types whose tensors a backend string serves ("gloo" alone serves cpu and cuda)."""
    if ":" not in backend:
        return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}, "mpi": {"cpu", "cuda"}}.get(backend, set())
    return {part.split(":")[0] for part in backend.split(",")}


def _served() -> set[str]:
    return served_device_types(dist.get_backend_config())


def _check_served(x: torch.Tensor) -> None:
    served = _served()
    if x.device.type not in served:
        raise RuntimeError(
            f"a collective got a {x.device.type} tensor but the process group "
            f"({dist.get_backend_config()}) serves only {sorted(served)}; initialise it with "
            f"hybrid_rl.runtime.distributed.init (backend {backend_for(torch.device('cuda'))!r} on GPUs)"
        )


def init(device: str = "auto", timeout_s: int = 300) -> torch.device:
    """Join the launcher's process group if there is one; idempotent. Returns this rank's device. The
    collectives act on the whole world again (a split Trainer built earlier in this process narrowed them)."""
    use_group(None, None)
    dev = pick_device(device)
    if env_world_size() > 1 and not is_dist():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend=backend_for(dev), timeout=timedelta(seconds=timeout_s))
    elif dev.type == "cuda" and not is_dist():
        # A single GPU process (a notebook) still gets a 1-rank group, so bf16 mixed
        # precision goes through the same FSDP2 path as a multi-GPU run.
        torch.cuda.set_device(dev)
        dist.init_process_group(
            backend=backend_for(dev),
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )
    if dev.type == "cpu" and is_dist():
        # torchrun sets OMP_NUM_THREADS=1; several ranks share the cores anyway.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return dev


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    if is_dist():
        dist.destroy_process_group()


def barrier() -> None:
    if is_dist():
        dist.barrier(group=_group())


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned; identity on one rank."""
    if is_dist():
        _check_served(x)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_group())
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    if is_dist():
        _check_served(x)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_group())
    return x


def all_gather_object(obj: Any) -> list[Any]:
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=_group())
    return out


def store():
    """The launcher's key-value store (torchrun's TCPStore, prefixed by the default group): small flags between
    ranks that must not wait for each other (split/inflight.py)."""
    return dist.distributed_c10d._get_default_store()


def new_group(ranks: list[int], timeout_s: int = 300, backend: str = "gloo"):
    """A group over `ranks` (gloo: host objects and control traffic; `backend_for(device)` for one that also
    reduces device tensors); every rank must call this for every group, in the same order. None when not
    distributed."""
    if not is_dist():
        return None
    return dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s))


def scope_group():
    """The group `use_group` narrowed this rank's collectives to (None: the whole world), for the library calls
    that take a process group of their own (a distributed checkpoint's save and load)."""
    return _group()


def gather_object_to(obj: Any, dst: int, group=None) -> list[Any] | None:
    """Objects of every rank of `group`, in group-rank order, on global rank `dst` (None elsewhere)."""
    if not is_dist():
        return [obj]
    group = group if group is not None else _group()
    size = dist.get_world_size(group)
    out: list[Any] | None = [None] * size if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def scatter_object_from(objs: list[Any] | None, src: int, group=None) -> Any:
    """Group rank i receives objs[i] from global rank `src`."""
    if not is_dist():
        return objs[0]
    out: list[Any] = [None]
    group = group if group is not None else _group()
    dist.scatter_object_list(out, objs if dist.get_rank() == src else None, src=src, group=group)
    return out[0]


def broadcast_object_from(obj: Any, src: int, group=None) -> Any:
    """`obj` of global rank `src` on every rank of `group`."""
    if not is_dist():
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group if group is not None else _group())
    return box[0]


def broadcast_tensor_(tensor: torch.Tensor, src: int, group=None, timeout_s: float | None = None) -> None:
    """Overwrite `tensor` on every rank of `group` (default: all) with global rank `src`'s (in place; no-op when
    not distributed). `timeout_s`: wait at most that long for this broadcast, whatever the group's own timeout
    (the split placement's weight sync names the silent peer sooner than a long step's timeout would)."""
    if is_dist():
        _check_served(tensor)
        group = group if group is not None else _group()
        if timeout_s is None:
            dist.broadcast(tensor, src=src, group=group)
        else:
            dist.broadcast(tensor, src=src, group=group, async_op=True).wait(timedelta(seconds=timeout_s))


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; the world size when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


# -- when a rank fails ------------------------------------------------------
_F = TypeVar("_F", bound=Callable[..., Any])
_STORE_TIMEOUT_S = 5  # a failing rank spends at most about this long talking to the store


def report_failures(main: _F) -> _F:
    """Decorate a recipe's `main`. On a multi-rank run, a rank where it raises prints one line
    to stderr and re-raises:

        hybrid_rl: rank 1/2 (host, pid 123) failed at step 2, last phase rollout, in
        Trainer.fit > Trainer.step > Trainer._rollout > ... > compute_rewards: RuntimeError: ...

    The line is also left in the launcher's store; a rank whose collective failed (a peer
    died or hung) appends what the other ranks reported, or names those that reported
    nothing. Under torchrun the traceback goes into the agent's error summary too (`record`).
    On one rank (a notebook, a test calling `main`) it only calls `main`."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        call = main
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import record

            call = record(main)
        try:
            return call(*args, **kwargs)
        except Exception as err:
            # A UserError (a clean stop on a signal, a refused resume) says itself what happened, on every rank.
            if env_world_size() > 1 and not isinstance(err, UserError):
                print(failure_line(err), file=sys.stderr, flush=True)
            raise

    return wrapper  # type: ignore[return-value]


def failure_line(err: BaseException) -> str:
    """The one-line report of `err` on this rank (module docstring); tells the store as a side effect."""
    me, world = int(os.environ.get("RANK", rank())), env_world_size()
    message = (str(err).strip().splitlines() or [""])[0][:400]
    line = (
        f"hybrid_rl: rank {me}/{world} ({socket.gethostname()}, pid {os.getpid()}) failed"
        f"{_where(err)}: {type(err).__name__}: {message}"
    )
    return line + _exchange_reports(me, world, line, lost_peer=_in_collective(err.__traceback__))


@contextlib.contextmanager
def failure_context(where: Callable[[], tuple[int, object]]) -> Iterator[None]:
    """Tag an exception leaving the block with `where()` = (step, phase) for its one-line report (the
    innermost tag wins: Trainer.step tags the failing step, Trainer.fit what fails between steps), so the
    report needs no Trainer: this module reads the tag, not the trainer's attributes."""
    try:
        yield
    except BaseException as err:
        if not hasattr(err, "hybrid_rl_where"):
            try:
                err.hybrid_rl_where = where()
            except Exception:  # noqa: BLE001 - the tag must not hide the error being tagged
                pass
        raise


def _where(err: BaseException) -> str:
    """' at step S, last phase P, in A > B > C': the tag of `failure_context` and the library frames of the
    traceback."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hybrid_rl/, this is runtime/
    chain = [
        getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        for frame, _ in traceback.walk_tb(err.__traceback__)
        if frame.f_code.co_filename.startswith(pkg)
    ]
    out = ""
    step, phase = getattr(err, "hybrid_rl_where", (None, None))
    if step is not None:
        phase = getattr(phase, "value", phase)
        out = f" at step {step}" + (f", last phase {phase}" if phase else "")
    if chain:
        out += (", in " if out else " in ") + " > ".join(chain[-5:])
    return out


def _in_collective(tb) -> bool:
    """Whether the error was raised inside torch.distributed (a collective or the store), so maybe by a
    lost peer; only the innermost frame counts (torchrun's `record` wrapper is in torch.distributed too)."""
    frames = [frame for frame, _ in traceback.walk_tb(tb)]
    marker = os.sep + os.path.join("torch", "distributed") + os.sep
    return bool(frames) and marker in frames[-1].f_code.co_filename


def _exchange_reports(me: int, world: int, line: str, lost_peer: bool) -> str:
    """Leave `line` in the launcher's store; when a peer was lost, say what the others left there."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return ""
    prefix = f"hybrid_rl/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S))
        store.set(prefix + str(me), line)
        if not lost_peer:
            return ""
        others = [r for r in range(world) if r != me]
        keys = {r: prefix + str(r) for r in others}
        reported = {r: store.get(k).decode(errors="replace") for r, k in keys.items() if store.check([k])}
    except Exception as err:  # noqa: BLE001 - the report must not hide the error being reported
        if not lost_peer:
            return ""
        return (
            f" | the launcher's store at {addr}:{port} is unreachable too ({type(err).__name__}): the node "
            "that hosts it (node 0) is gone or hangs"
        )
    silent = [r for r in others if r not in reported]
    parts = [f"rank {r} reported: {reported[r].removeprefix('hybrid_rl: ')}" for r in sorted(reported)]
    if silent:
        names = ", ".join(str(r) for r in silent)
        parts.append(
            f"rank{'s' if len(silent) > 1 else ''} {names} reported no failure (yet): killed, hung, "
            "or on a node that is gone (see its launcher's log)"
        )
    return " | " + " | ".join(parts)
