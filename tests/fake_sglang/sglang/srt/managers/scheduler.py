"""The scheduler process of one TP rank: memory tags, weight updates, prefix cache.

`run_scheduler_process` is the target of each spawned process. Every handler that
raises in the real scheduler kills the caller's process tree (note 0.1); here any
exception is sent back as a "crash" and the process exits, and the Engine turns that
into `EngineCrashed`. Only `WeightsNotLoadedError` (a stand-in-only check) is sent back
as an ordinary error.

A streamed generate (note 10) is answered by rank 0 with messages of its own, never "ok":
("stream_start", weights digest), ("chunk", (request index, result so far, finished)) as the
output streamer would send them, then ("stream_end", None). While it decodes, rank 0 reads
what the Engine sends between tokens (`_Stream.poll`): aborts, and any other command, which
then sees the running requests (release's idle assertion fails, flush_cache refuses).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

from sglang.fake_errors import WeightsNotLoadedError
from sglang.srt.constants import (
    GPU_MEMORY_TYPE_CUDA_GRAPH,
    GPU_MEMORY_TYPE_KV_CACHE,
    GPU_MEMORY_TYPE_WEIGHTS,
)
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

_ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered (stand-in: {what} while {tag!r} is released)"


class Scheduler:
    def __init__(self, tp_rank: int, args: Dict[str, Any]):
        self.tp_rank, self.tp_size = tp_rank, args["tp_size"]
        self.worker = TpModelWorker(tp_rank, args)
        # Built after the model, outside the memory saver's "weights" region (note 9): release keeps it.
        self.lora = LoRAManager(args, self.worker.model) if args["enable_lora"] else None
        self.cpu_backup = args["enable_weights_cpu_backup"]
        # Without this variable the "cuda_graph" tag frees nothing (note 1.2).
        self.cuda_graph_freed = os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "0") == "1"
        self.gpu_id = args["base_gpu_id"] + tp_rank * args["gpu_id_step"]
        self.offload_tags: set = set()
        self.stashed_buffers: Optional[Dict[str, torch.Tensor]] = None
        self.host_copy: Optional[Dict[str, torch.Tensor]] = None
        self.pending_requests = 0  # injected by Engine._debug_pending_requests
        self.running = 0  # requests of a streamed generate still decoding (rank 0 answers commands meanwhile)
        self.conn = None  # the pipe to the Engine (run_scheduler_process): a streamed generate writes to it
        self.stream_interval = args["stream_interval"]  # the server's, for requests that name none
        self.step_delay_s = 0.0  # stand-in only (Engine._debug_step_delay): seconds slept per streamed token
        self.prefix_cache = _PrefixTrie()  # the finished sequences, each token with its weight epoch
        self.weight_epoch = 0
        self.opened_payloads: set = set()
        self.loaded_since_release: set = set()
        self.weights_released_ever = False
        self.stats = {"payloads_opened": 0, "payload_bytes": 0, "tensor_bytes": 0, "names_loaded": 0,
                      "names_skipped": 0, "update_calls": 0, "flushes": 0, "stale_cache_hits": 0}

    def handle(self, cmd: str, arg: Any) -> Any:
        return getattr(self, f"_cmd_{cmd}")(arg)

    def _busy(self) -> int:
        return self.pending_requests + self.running

    # -- generation -------------------------------------------------------------
    def _cmd_generate(self, reqs: List[Dict[str, Any]]) -> Any:
        for tag in (GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE):
            if tag in self.offload_tags:
                raise RuntimeError(_ILLEGAL_ACCESS.format(what="generate", tag=tag))
        if GPU_MEMORY_TYPE_CUDA_GRAPH in self.offload_tags and self.cuda_graph_freed:
            raise RuntimeError(_ILLEGAL_ACCESS.format(what="generate", tag=GPU_MEMORY_TYPE_CUDA_GRAPH))
        bad = self.worker.nan_params()
        if bad:
            raise WeightsNotLoadedError(
                f"TP rank {self.tp_rank}: {len(bad)} of {len(self.worker.params)} parameters hold garbage (NaN), "
                f"e.g. {bad[:4]}. After release_memory_occupation(['weights']) every parameter must be sent "
                "again before generating; the real engine would silently decode garbage")
        digest = self._weights_digest() if self.tp_size > 1 else None  # compared across ranks only
        if self.tp_rank > 0:
            # Only rank 0 decodes (its output is what the Engine returns, as in SGLang); the other
            # ranks show that they hold the same weights, which is all a second decode could show.
            return {"weights_digest": digest}
        if reqs[0]["stream"]:
            return self._generate_streamed(reqs, digest)
        results = self._generate_by_adapter(reqs)
        for req, res in zip(reqs, results):  # the prefix cache sees the requests in order
            # The real cache key includes the adapter's lora_id (schedule_batch.py): a leading key token here.
            key = [("lora_id", req.get("lora_id"))]
            if req["prefill_prefix"]:  # n > 1: SGLang prefills the shared prompt once first
                self.prefix_cache.add(key + req["input_ids"], self.weight_epoch)
            res["cached_tokens"] = self._match_prefix(key + req["input_ids"])
            self.prefix_cache.add(key + req["input_ids"] + res["output_ids"], self.weight_epoch)
        return {"weights_digest": digest, "results": results}

    def _generate_streamed(self, reqs: List[Dict[str, Any]], digest: Optional[str]) -> Any:
        """Rank 0's streamed generate: each request's prefix-cache hit is taken at its prefill (so
        before this call's own outputs are cached), the results go out as chunks, the cache takes
        every finished sequence (aborted ones too: SGLang caches what a finished request computed)."""
        self.conn.send(("stream_start", digest))
        key = [[("lora_id", req.get("lora_id"))] for req in reqs]
        cached = [self._match_prefix(k + req["input_ids"]) for k, req in zip(key, reqs)]
        stream = _Stream(self, reqs, cached)
        try:
            results = self._generate_by_adapter(reqs, stream)
        finally:
            self.running = 0
        for k, req, res in zip(key, reqs, results):
            self.prefix_cache.add(k + req["input_ids"] + res["output_ids"], self.weight_epoch)
        self.conn.send(("stream_end", None))
        return _NO_REPLY

    def _generate_by_adapter(self, reqs: List[Dict[str, Any]], stream: Any = None) -> List[Dict[str, Any]]:
        """One decode per adapter (None: the base), each with only its requests; results in request order."""
        groups: Dict[Optional[str], List[int]] = {}
        for i, req in enumerate(reqs):
            groups.setdefault(req.get("lora_id"), []).append(i)
        results: List[Any] = [None] * len(reqs)
        for lora_id, rows in groups.items():
            with self.lora.applied(lora_id) if self.lora is not None else contextlib.nullcontext():
                for i, res in zip(rows, self.worker.generate([reqs[i] for i in rows], stream, rows)):
                    results[i] = res
        return results

    def _cmd_abort(self, arg: Dict[str, Any]) -> Any:
        """An AbortReq while nothing decodes: no request matches it; the real scheduler answers nothing."""
        return _NO_REPLY

    def _weights_digest(self) -> str:
        return _digest(self.worker.params) + (self.lora.digest() if self.lora is not None else "")

    def _match_prefix(self, key_ids: List[Any]) -> int:
        # At least one prompt token is always computed, so a hit covers at most len - 1 (the key is no token).
        best, epoch = self.prefix_cache.longest(key_ids[:-1])
        best = max(0, best - 1)
        if best and epoch != self.weight_epoch:
            # The real engine would reuse KV computed with old weights (RLinf#96): flush after updates.
            self.stats["stale_cache_hits"] += 1
        return best

    def _cmd_flush_cache(self, _arg=None):
        if self._busy():
            return False, f"Cannot flush the cache: {self._busy()} requests are running or queued."
        self.prefix_cache = _PrefixTrie()
        self.stats["flushes"] += 1
        return True, ""

    # -- memory -----------------------------------------------------------------
    def _cmd_release(self, tags: List[str]) -> None:
        assert self._busy() == 0, "release_memory_occupation requires a fully idle engine"
        if GPU_MEMORY_TYPE_WEIGHTS in tags and GPU_MEMORY_TYPE_WEIGHTS in self.offload_tags:
            # The buffer stash would read memory that is already unmapped (judgment call: unverified).
            raise RuntimeError(_ILLEGAL_ACCESS.format(what="releasing weights again", tag=GPU_MEMORY_TYPE_WEIGHTS))
        self.offload_tags.update(tags)
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            self._cmd_flush_cache()
        if GPU_MEMORY_TYPE_WEIGHTS in tags:
            model = self.worker.model
            self.stashed_buffers = {n: b.clone() for n, b in model.named_buffers()}
            if self.cpu_backup:
                self.host_copy = {n: p.detach().clone() for n, p in self.worker.params.items()}
            # Released memory is gone: what a later resume maps back is uninitialised.
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
                for b in model.buffers():
                    if b.is_floating_point():
                        b.fill_(float("nan"))
            self.loaded_since_release = set()
            self.weights_released_ever = True

    def _cmd_resume(self, tags: List[str]) -> None:
        for tag in tags:
            self.offload_tags.remove(tag)  # KeyError for a tag that was not released: fatal
        if GPU_MEMORY_TYPE_WEIGHTS in tags:
            with torch.no_grad():
                for name, buf in self.worker.model.named_buffers():
                    buf.copy_(self.stashed_buffers[name])
                if self.host_copy is not None:
                    for name, p in self.worker.params.items():
                        p.copy_(self.host_copy[name])
                    self.loaded_since_release = set(self.worker.params)
            self.stashed_buffers, self.host_copy = None, None

    # -- weight updates ---------------------------------------------------------
    def _open_once(self, data: bytes) -> Any:
        digest = hashlib.sha256(data).hexdigest()
        # CUDA-IPC handles opened twice hang (sglang#17870); fd-based CPU handles fail on the
        # second claim by themselves, file_system ones do not, hence this explicit check.
        assert digest not in self.opened_payloads, f"TP rank {self.tp_rank}: a weight payload was opened twice"
        self.opened_payloads.add(digest)
        self.stats["payloads_opened"] += 1
        self.stats["payload_bytes"] += len(data)
        return MultiprocessingSerializer.deserialize(data)

    def _cmd_update_tensor(self, arg) -> tuple:
        payloads, load_format, flush_cache = arg
        if GPU_MEMORY_TYPE_WEIGHTS in self.offload_tags:
            raise RuntimeError(_ILLEGAL_ACCESS.format(what="loading weights", tag=GPU_MEMORY_TYPE_WEIGHTS))
        payload = payloads[self.tp_rank]  # deserialize_own_rank: too few payloads is an IndexError here
        monkey_patch_torch_reductions()  # the real runner does this before deserializing
        obj = self._open_once(payload)
        if load_format == "flattened_bucket":
            bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
            self.stats["tensor_bytes"] += bucket.get_flattened_tensor().nbytes
            named, direct = bucket.reconstruct_tensors(), False
        elif load_format in (None, "direct"):
            named, direct = [(name, self._unwrap(value)) for name, value in obj], load_format == "direct"
        else:
            raise NotImplementedError(f"update_weights_from_tensor: unknown load_format {load_format!r}")
        loaded = self.worker.load_weights(named, direct=direct)
        self.stats["update_calls"] += 1
        self.stats["names_loaded"] += len(loaded)
        self.stats["names_skipped"] += len(named) - len(loaded)
        self.loaded_since_release.update(loaded)
        self.weight_epoch += 1
        if flush_cache:
            ok, _ = self._cmd_flush_cache()
            assert ok, "Cache flush failed after updating weights"
        return True, "Succeeded to update model weights."

    def _cmd_lora_load(self, arg) -> dict:
        payloads, load_format, name, lora_id, config = arg
        assert self.lora is not None, "LoRA is not enabled"  # the Engine answers this itself
        monkey_patch_torch_reductions()  # deserialize_own_rank patches first, as for weights
        obj = self._open_once(payloads[self.tp_rank])  # outside the manager's try: a failure here is fatal
        if load_format == "flattened_bucket":
            bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
            obj = dict(bucket.reconstruct_tensors())
        return self.lora.load(lora_id, name, config, obj)

    def _cmd_lora_unload(self, lora_id: str) -> dict:
        return self.lora.unload(lora_id)

    def _unwrap(self, value: Any) -> torch.Tensor:
        if isinstance(value, LocalSerializedTensor):
            value = self._open_once(value.values[self.tp_rank])
        self.stats["tensor_bytes"] += value.nbytes
        return value.to("cpu")  # the real runner moves it to its GPU (an H2D copy for CPU tensors)

    # -- queries ----------------------------------------------------------------
    def _cmd_get_weights_by_name(self, arg) -> Optional[list]:
        name, truncate_size = arg
        if self.worker.model.config.model_type != "llama":
            return None  # 0.5.21 implements it for Llama-family models only (note 7)
        return self.worker.params[name].detach().float()[:truncate_size].tolist()

    def _cmd_debug_state(self, _arg=None) -> Dict[str, Any]:
        params = self.worker.params
        return dict(self.stats, tp_rank=self.tp_rank, pid=os.getpid(), gpu_id=self.gpu_id,
                    # The allocator settings this process inherited (torch reads the first that is set).
                    alloc_conf_env={n: os.environ.get(n) for n in _ALLOC_CONF_NAMES},
                    offload_tags=sorted(self.offload_tags), weight_epoch=self.weight_epoch,
                    pending_requests=self._busy(),
                    all_params_loaded_since_release=set(params) <= self.loaded_since_release,
                    params_not_loaded_since_release=sorted(set(params) - self.loaded_since_release),
                    weights_released_ever=self.weights_released_ever,
                    weights_digest=_digest(params),
                    lora=dict(self.lora.stats, loaded=self.lora.loaded()) if self.lora is not None else None)

    def _cmd_debug_get_param(self, name: str) -> tuple:
        t = self.worker.params[name].detach().contiguous()
        # Raw bytes, not a tensor: the reducers may be patched in this process (IndexError on CPU).
        return tuple(t.shape), str(t.dtype).removeprefix("torch."), t.view(torch.uint8).numpy().tobytes()

    def _cmd_debug_pending(self, n: int) -> None:
        self.pending_requests = n

    def _cmd_debug_step_delay(self, seconds: float) -> None:
        self.step_delay_s = float(seconds)

    def _cmd_begin(self, _arg=None) -> None:
        pass  # the real begin restores quantized layouts and does a TP barrier; nothing to do here

    def _cmd_end(self, _arg=None) -> None:
        pass


_NO_REPLY = object()  # a handler that answers by itself (a streamed generate) or not at all (an abort)
# What rank 0 serves while a streamed generate decodes, seeing its requests running (anything else: a crash).
_SERVED_WHILE_RUNNING = ("release", "flush_cache", "get_weights_by_name", "debug_state", "debug_get_param",
                         "debug_pending", "debug_step_delay")


class _Shutdown(Exception):
    """The Engine shut down while a streamed generate was decoding."""


class _Stream:
    """Rank 0's side of a streamed generate (tokenizer_manager.py, note 10): aborts in, chunks out.

    An AbortReq matches the requests of this call not finished yet whose rid starts with its rid (or
    all, abort_all), as Scheduler.abort_request does; a request that has not started is answered at
    once with no tokens ("Abort in waiting queue", the TokenizerManager's reply to the scheduler's
    echo), a running one samples one more token and finishes "abort" (Req.to_finish). A chunk goes
    out when a request finishes, and while it runs as the output streamer sends one: at output
    length % stream_interval == 1 for an interval > 1, every token for 1 (the request's
    sampling_params.stream_interval, else the server's)."""

    def __init__(self, scheduler: "Scheduler", reqs: List[Dict[str, Any]], cached: List[int]):
        self.sched, self.reqs, self.cached = scheduler, reqs, cached
        self.unfinished = set(range(len(reqs)))
        self.marked: set = set()  # requests an abort reached, not finished yet
        self.default_interval = scheduler.stream_interval
        scheduler.running = len(reqs)

    # -- what the Engine sends ----------------------------------------------------
    def poll(self) -> None:
        conn = self.sched.conn
        while conn.poll(0):
            cmd, arg = conn.recv()
            if cmd == "abort":
                self.marked |= {i for i in self.unfinished
                                if arg["abort_all"] or self.reqs[i]["rid"].startswith(arg["rid"])}
            elif cmd == "shutdown":
                conn.send(("ok", None))
                raise _Shutdown
            elif cmd in _SERVED_WHILE_RUNNING:
                conn.send(("ok", self.sched.handle(cmd, arg)))
            else:
                raise RuntimeError(
                    f"stand-in: {cmd!r} arrived while {len(self.unfinished)} requests of a streamed generate are "
                    "still running (drain the stream, or abort its requests and drain it, first); the stand-in "
                    "serves no generate, weight load or resume alongside running requests")

    def abort_waiting(self, rows: List[int], results: List[Dict[str, Any]]) -> set:
        """Before a batch's prefill: its requests an abort reached finish now, with nothing generated."""
        self.poll()
        waiting = set()
        for k, row in enumerate(rows):
            if row in self.marked:
                results[k].update(finish_reason={"type": "abort", "message": "Abort in waiting queue"},
                                  waiting_abort=True, input_logprobs=[])
                self.emit(row, results[k], True)
                waiting.add(k)
        return waiting

    def aborts(self, rows: List[int]) -> set:
        """Before a decode step: those of `rows` an abort reached."""
        self.poll()
        return self.marked & set(rows)

    # -- what goes out --------------------------------------------------------------
    def emit(self, row: int, res: Dict[str, Any], finished: bool) -> None:
        n = len(res["output_ids"])
        interval = self.reqs[row]["sampling_params"]["stream_interval"] or self.default_interval
        if not finished and not (n % interval == 1 if interval > 1 else n % interval == 0):
            return
        if finished:
            self.unfinished.discard(row)
            self.marked.discard(row)
            self.sched.running = len(self.unfinished)
        chunk = dict(res, output_ids=list(res["output_ids"]), output_logprobs=list(res["output_logprobs"]),
                     cached_tokens=self.cached[row])
        self.sched.conn.send(("chunk", (row, chunk, finished)))

    def step_done(self) -> None:
        if self.sched.step_delay_s:
            time.sleep(self.sched.step_delay_s)


class _PrefixTrie:
    """Token sequences as a trie; each node keeps the weight epoch of the first sequence through it."""

    def __init__(self) -> None:
        self.root: Dict[int, tuple] = {}  # token -> (epoch, children)

    def add(self, seq: List[int], epoch: int) -> None:
        node = self.root
        for token in seq:
            if token not in node:
                node[token] = (epoch, {})
            node = node[token][1]

    def longest(self, ids: List[int]) -> tuple:
        """(n, epoch): the longest cached prefix of ids, and the epoch of the first sequence that had it."""
        node, n, epoch = self.root, 0, None
        for token in ids:
            if token not in node:
                break
            epoch, node = node[token]
            n += 1
        return n, epoch


def _digest(params: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _join_tp_group(tp_rank: int, args: Dict[str, Any]) -> None:
    """What a real scheduler does first (init_distributed_environment): its TP ranks meet at
    tcp://127.0.0.1:<nccl_port> through torch's own rendezvous, which reads the environment the
    scheduler inherited. Under TORCHELASTIC_USE_AGENT_STORE=True (torchrun's workers) no rank
    serves that store and every rank waits until the timeout (here
    FAKE_SGLANG_RENDEZVOUS_TIMEOUT_S, default 120 s; the real one is much longer)."""
    import datetime

    import torch.distributed as dist

    timeout = float(os.environ.get("FAKE_SGLANG_RENDEZVOUS_TIMEOUT_S", "120"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['nccl_port']}", rank=tp_rank,
                            world_size=args["tp_size"], timeout=datetime.timedelta(seconds=timeout))


def run_scheduler_process(tp_rank: int, args: Dict[str, Any], conn) -> None:
    """Serve commands from the Engine until "shutdown", a crash, or the Engine's death."""
    # One thread per rank: the ranks share a few cores with the trainer's processes.
    torch.set_num_threads(1)
    try:
        _join_tp_group(tp_rank, args)
        scheduler = Scheduler(tp_rank, args)
    except BaseException:  # noqa: BLE001 - a failed start is reported, not raised into nothing
        conn.send(("crash", f"scheduler TP rank {tp_rank} failed to start:\n{traceback.format_exc()}"))
        return
    scheduler.conn = conn
    conn.send(("ok", os.getpid()))
    while True:
        try:
            cmd, arg = conn.recv()
        except (EOFError, OSError):
            return  # the Engine's process is gone; real schedulers die with their parent too
        if cmd == "shutdown":
            conn.send(("ok", None))
            return
        try:
            reply = scheduler.handle(cmd, arg)
            if reply is not _NO_REPLY:
                conn.send(("ok", reply))
        except WeightsNotLoadedError as err:
            conn.send(("error", str(err)))
        except (_Shutdown, EOFError, BrokenPipeError):
            return  # shut down, or the Engine's process is gone, while a streamed generate decoded
        except BaseException:  # noqa: BLE001 - every other failure is fatal, as in SGLang
            conn.send(("crash", f"scheduler TP rank {tp_rank} crashed in {cmd!r}:\n{traceback.format_exc()}"))
            return
