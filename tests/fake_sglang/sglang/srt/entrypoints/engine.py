"""`sglang.Engine` stand-in (`srt/entrypoints/engine.py`, note sections 1, 6, 7).

Building an Engine forces the "spawn" start method for the whole process, sets
CUDA_DEVICE_MAX_CONNECTIONS=8, and starts one real scheduler process per TP rank;
each loads the HF model from `model_path` with transformers and decodes on CPU.

Known differences from SGLang 0.5.21 (each one documented where it lives):
* Every TP rank holds the full model; rank 0 decodes, and every other rank's weights
  must equal rank 0's at each generate (else RankMismatchError).
* dtype "auto" means float32 (the real engine follows the checkpoint, and turns an
  fp32 checkpoint into fp16). Only pp_size = dp_size = nnodes = 1.
* enable_memory_saver=True fails (no CUDA), yet release(["weights"]) behaves as if the
  memory saver were on: contents are discarded (NaN) unless enable_weights_cpu_backup.
  With the memory saver off, the real engine keeps the contents; do not rely on it.
* A fatal scheduler error raises EngineCrashed instead of killing the caller.
* Unknown memory tags raise ValueError in the caller (the real engine's behaviour is
  unverified). Releasing "weights" twice is fatal (the buffer stash would read unmapped
  memory; unverified).
* A payload a TP rank already opened in an earlier call is refused (fatal), as the hang
  of sglang#17870 would be on a GPU; a CPU file_system handle would open again.
* The prefix cache only counts hits (cached_tokens, and stale_cache_hits in
  _debug_state() for hits on KV computed before a weight update without a flush); it
  never reuses stale KV the way the real engine would.
* input_token_logprobs: entries for input_ids[logprob_start_len:] (default: the last
  prompt token), the first padded with None, as SGLang pads it.
* shutdown() stops only the schedulers; the real one kills every child process of the
  caller (kill_process_tree(os.getpid(), include_parent=False)): DataLoader workers too.
* LoRA (engine_lora.py, lora/lora_manager.py): adapters from tensors only, applied unmerged per
  request; no lora_paths, max_loaded_loras eviction, pinning or load_lora_adapter from disk.
* Streaming and aborts (note 10; managers/tokenizer_manager.py, managers/scheduler.py `_Stream`):
  every request of a call starts at once, so an abort reaches a waiting request only when it
  arrives before the prefill (no retraction, no max_running_requests queue); a streamed call
  with n > 1 and incremental_streaming_output are not implemented; while a stream's requests
  run, rank 0 serves release (whose idle assertion then fails), flush_cache (refused) and
  queries, and crashes on any other call (the real engine would run a second generate or a
  weight load alongside). A streamed request's cached_tokens is its hit at the call's start.
* Not provided: async_* methods, multimodal inputs, top_logprobs_num,
  update_weights_from_distributed/disk/ipc, HTTP.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import multiprocessing as mp
import os
import random
import socket
import time
import uuid
from typing import Any, Dict, List, Optional, Union

import torch

from sglang.fake_errors import RankMismatchError
from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
from sglang.srt.entrypoints.engine_lora import LoraEngineMixin
from sglang.srt.entrypoints.sync_api import _sync_api
from sglang.srt.lora.lora_manager import check_lora_server_args
from sglang.srt.managers.io_struct import FlushCacheReqOutput
from sglang.srt.managers.scheduler_client import SchedulerClient
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads

_SESSION_MSG = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"


def _read_json(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _as_ids(value) -> List[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine(LoraEngineMixin):
    def __init__(self, **kwargs: Any):
        if os.environ.get("SGLANG_RUST_SERVER") == "1":
            raise ValueError("SGLANG_RUST_SERVER=1 cannot be used with sglang.Engine")
        if "server_args" in kwargs:
            server_args = kwargs.pop("server_args")
            if kwargs:
                raise TypeError("pass either server_args or keyword arguments, not both")
        else:
            kwargs.setdefault("log_level", "error")
            server_args = ServerArgs(**kwargs)
        self.server_args = server_args
        a = server_args.as_dict()
        self._validate(a)
        self._lora_init(a)
        config = _read_json(os.path.join(a["model_path"], "config.json"))
        gen_config = _read_json(os.path.join(a["model_path"], "generation_config.json"))
        self._vocab_size = int(config["vocab_size"])
        self._context_len = int(a["context_length"] or config.get("max_position_embeddings") or 1 << 30)
        eos = set(_as_ids(config.get("eos_token_id"))) | set(_as_ids(gen_config.get("eos_token_id")))
        self.tokenizer = None
        if not a["skip_tokenizer_init"]:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(a["tokenizer_path"] or a["model_path"])
            if self.tokenizer.eos_token_id is not None:
                eos.add(int(self.tokenizer.eos_token_id))
        seed = a["random_seed"] if a["random_seed"] is not None else random.randint(0, 1 << 30)
        self._nccl_port = a["nccl_port"] if a["nccl_port"] is not None else _free_port()
        self._weight_version = a["weight_version"]
        self._session = False
        sched_args = dict(a, random_seed=seed, eos_token_ids=sorted(eos), nccl_port=self._nccl_port)
        # What the real _set_envs_and_config does to the caller's process (note 1.1, 7).
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
        mp.set_start_method("spawn", force=True)
        self._client = SchedulerClient(a["tp_size"], sched_args)
        self.tokenizer_manager = TokenizerManager(self._client)
        atexit.register(self.shutdown)
        self.loop = self._ensure_event_loop()

    @staticmethod
    def _ensure_event_loop() -> asyncio.AbstractEventLoop:
        """0.5.21: the running loop if there is one, else this thread's loop (a new one, set as the
        thread's loop, on a thread that has none)."""
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            pass
        try:
            return asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop

    @staticmethod
    def _validate(a: Dict[str, Any]) -> None:
        if not isinstance(a["tp_size"], int) or a["tp_size"] < 1:
            raise ValueError(f"tp_size must be a positive int, got {a['tp_size']!r}")
        for key in ("pp_size", "dp_size", "nnodes"):
            if a[key] != 1:
                raise NotImplementedError(f"the sglang stand-in supports only {key}=1")
        if a["enable_memory_saver"]:
            # What torch_memory_saver does without a GPU.
            raise RuntimeError("torch_memory_saver: enable_memory_saver=True needs CUDA, and no CUDA device is "
                               "available (the CPU stand-in cannot pause or resume memory)")
        check_lora_server_args(a)
        if not os.path.isfile(os.path.join(a["model_path"], "config.json")):
            raise FileNotFoundError(f"{a['model_path']!r} is not a Hugging Face model directory (no config.json)")

    # -- generation -------------------------------------------------------------
    def generate(self, prompt: Optional[Union[str, List[str]]] = None, sampling_params=None,
                 input_ids: Optional[Union[List[int], List[List[int]]]] = None, image_data=None,
                 audio_data=None, video_data=None, return_logprob: Union[bool, List[bool]] = False,
                 logprob_start_len: Optional[int] = None, top_logprobs_num=None, token_ids_logprob=None,
                 lora_path=None, custom_logit_processor=None, return_hidden_states: bool = False,
                 stream: bool = False, bootstrap_host=None, bootstrap_port=None, bootstrap_room=None,
                 data_parallel_rank=None, rid: Optional[Union[str, List[str]]] = None):
        """One dict for one prompt with n == 1; otherwise a list, prompt-major (i * n + j).

        stream=True (note 10): an iterator instead, nothing sent before its first item; each item runs the
        Engine's loop once, as the real generator_wrapper does, and is one request's output so far (a batch's
        items carry "index", the request's position): finish_reason None while it runs, its whole output
        when it finishes. rid: request ids (a str is a prefix for a batch's "<rid>_<i>")."""
        unsupported = {"image_data": image_data, "audio_data": audio_data, "video_data": video_data,
                       "top_logprobs_num": top_logprobs_num, "token_ids_logprob": token_ids_logprob,
                       "custom_logit_processor": custom_logit_processor,
                       "return_hidden_states": return_hidden_states,
                       "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port,
                       "bootstrap_room": bootstrap_room, "data_parallel_rank": data_parallel_rank}
        for key, value in unsupported.items():
            if value not in (None, False, 0):
                raise NotImplementedError(f"the sglang stand-in does not implement generate({key}=...)")
        args = (prompt, sampling_params, input_ids, return_logprob, logprob_start_len, lora_path, rid, stream)
        if stream:
            return self._stream_wrapper(self._stream_chunks(args))
        return self._generate_now(args)

    def _requests(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, lora_path, rid,
                  stream) -> tuple:
        """(scheduler requests, single, n), everything checked before anything is sent."""
        self._client.check_alive()
        prompts, single = self._prompts(prompt, input_ids)
        lora_ids = self._lora_ids(lora_path, len(prompts))  # names resolved before anything runs
        params = self._sampling_params(sampling_params, len(prompts), single)
        n = params[0].n
        if stream and n > 1:
            raise NotImplementedError("the sglang stand-in does not stream parallel samples (n > 1)")
        rids = self._rids(rid, len(prompts), single)
        want_lp = return_logprob if isinstance(return_logprob, list) else [return_logprob] * len(prompts)
        reqs = []
        for i, ids in enumerate(prompts):
            sp = params[i].normalized()
            # SGLang's TokenizerManager._validate_one_request (not in the note): the whole call fails.
            if sp["max_new_tokens"] is not None and len(ids) + sp["max_new_tokens"] >= self._context_len:
                raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                                 f"{self._context_len} tokens. You requested a total of "
                                 f"{len(ids) + sp['max_new_tokens']} tokens: {len(ids)} tokens from the input "
                                 f"messages and {sp['max_new_tokens']} tokens for the completion.")
            for j in range(n):
                # n > 1: each sample gets a fresh rid (TokenizerManager regenerate_rid).
                reqs.append({"rid": rids[i] if n == 1 else uuid.uuid4().hex, "input_ids": ids, "sampling_params": sp,
                             "return_logprob": bool(want_lp[i]), "prefill_prefix": n > 1 and j == 0,
                             "lora_id": lora_ids[i], "stream": bool(stream),
                             "logprob_start_len": -1 if logprob_start_len is None else logprob_start_len})
        return reqs, single, n

    @staticmethod
    def _rids(rid, num: int, single: bool) -> List[str]:
        """GenerateReqInput._normalize_rid and _validate_rid_uniqueness."""
        if rid is None:
            return [uuid.uuid4().hex for _ in range(num)]
        if single:
            return [rid]
        if isinstance(rid, str):
            return [f"{rid}_{i}" for i in range(num)]
        if not isinstance(rid, list):
            raise ValueError("The rid should be a string or a list of strings.")
        if len(rid) != num:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            duplicates = sorted({r for r in rid if rid.count(r) > 1})
            raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
        return list(rid)

    @_sync_api
    def _generate_now(self, args: tuple) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        reqs, single, n = self._requests(*args)
        rids = [r["rid"] for r in reqs]
        self.tokenizer_manager.add(rids)  # in flight until the call returns
        try:
            start = time.perf_counter()
            per_rank = self._client.call("generate", reqs)
            latency = time.perf_counter() - start
        finally:
            self.tokenizer_manager.finish_all(rids)
        self._check_ranks(per_rank[0]["weights_digest"], per_rank[1:])
        outs = [self._format(req, res, latency) for req, res in zip(reqs, per_rank[0]["results"])]
        return outs[0] if single and n == 1 else outs

    @staticmethod
    def _check_ranks(digest0: Optional[str], others: List[Dict[str, Any]]) -> None:
        for rank, reply in enumerate(others, start=1):
            if reply["weights_digest"] != digest0:
                raise RankMismatchError(
                    f"TP rank {rank} holds different weights than rank 0 (a real TP engine would decode "
                    "garbage). Check that every rank's payload carries the same tensors")

    async def _stream_chunks(self, args: tuple):
        """TokenizerManager.generate_request for stream=True: requests go out at the first item, then each
        chunk rank 0 streams becomes an output dict (with "index" for a batch), in the order they come."""
        reqs, single, _ = self._requests(*args)
        rids = [r["rid"] for r in reqs]
        self.tokenizer_manager.add(rids)
        try:
            digest0, others = self._client.start_stream("generate", reqs)
            self._check_ranks(digest0, others)
            start = time.perf_counter()
            while True:
                status, value = self._client.read_stream("generate")
                if status == "stream_end":
                    return
                index, res, finished = value
                out = self._format(reqs[index], res, time.perf_counter() - start if finished else None)
                if finished:
                    self.tokenizer_manager.finish(rids[index])
                if not single:
                    out["index"] = index
                yield out
        finally:
            # Abandoned: its requests still run in the scheduler; only a finished one's state goes.
            if not self._client.stream_open:
                self.tokenizer_manager.finish_all(rids)

    def _stream_wrapper(self, chunks):
        """Engine.generate's generator_wrapper: every item is one run of the Engine's loop."""
        while True:
            step = chunks.__anext__()
            try:
                chunk = self.loop.run_until_complete(step)
            except StopAsyncIteration:
                break
            finally:
                step.close()  # never started when the loop refused to run: no "never awaited" warning
            yield chunk

    def _prompts(self, prompt, input_ids):
        if (prompt is None) == (input_ids is None):
            raise ValueError("Either text or input_ids should be provided (exactly one of them).")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs the tokenizer; with skip_tokenizer_init=True pass input_ids")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            prompts = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            single = len(input_ids) > 0 and not isinstance(input_ids[0], (list, tuple))
            prompts = [list(input_ids)] if single else [list(p) for p in input_ids]
        if not prompts:
            raise ValueError("no prompts given")
        for ids in prompts:
            if not ids:
                raise ValueError("a prompt must have at least one token")
            if any(not 0 <= int(t) < self._vocab_size for t in ids):
                raise ValueError(f"input_ids contain a token outside the vocabulary (size {self._vocab_size})")
            if len(ids) >= self._context_len:
                raise ValueError(f"the prompt ({len(ids)} tokens) is longer than the context ({self._context_len})")
        return [[int(t) for t in ids] for ids in prompts], single

    def _sampling_params(self, sampling_params, num: int, single: bool) -> List[SamplingParams]:
        if sampling_params is None:
            sampling_params = {}
        if isinstance(sampling_params, dict):
            dicts = [sampling_params] * num
        elif single:
            raise TypeError("a single request takes one sampling_params dict, not a list")
        else:
            dicts = list(sampling_params)
            if len(dicts) != num:
                raise ValueError(f"got {len(dicts)} sampling_params for {num} prompts")
        params = [SamplingParams(**d) for d in dicts]  # unknown key: TypeError
        for sp in params:
            sp.check_tokenizer(self.tokenizer)
            sp.verify(self._vocab_size)
        if len({sp.n for sp in params}) > 1:
            raise ValueError("all requests in a batch must use the same n")
        return params

    def _format(self, req: Dict[str, Any], res: Dict[str, Any], latency: Optional[float]) -> Dict[str, Any]:
        """A request's output dict; latency None: a streamed chunk of a request still running (finish_reason
        None, no e2e_latency). A request aborted before it started gets the TokenizerManager's own reply to
        the scheduler's abort echo (_handle_abort_req): no prompt or cache counts, nothing generated."""
        out_ids = res["output_ids"]
        finish = res["finish_reason"] if latency is not None else None
        if res.get("waiting_abort"):
            meta = {"id": req["rid"], "finish_reason": finish, "weight_version": self._weight_version,
                    "e2e_latency": latency}
        else:
            meta = {"id": req["rid"], "finish_reason": finish, "prompt_tokens": len(req["input_ids"]),
                    "weight_version": self._weight_version, "num_retractions": 0, "reasoning_tokens": 0,
                    "completion_tokens": len(out_ids), "cached_tokens": res["cached_tokens"]}
            if latency is not None:
                meta["e2e_latency"] = latency
        if req["return_logprob"]:
            meta["input_token_logprobs"] = res["input_logprobs"]
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(res["output_logprobs"], out_ids)]
            meta["output_token_logprobs_length"] = len(out_ids)
        if res.get("waiting_abort"):
            meta["completion_tokens"] = len(out_ids)
        out: Dict[str, Any] = {}
        if self.tokenizer is not None:
            sp = req["sampling_params"]
            text = self.tokenizer.decode(out_ids, skip_special_tokens=sp["skip_special_tokens"])
            matched = (finish or {}).get("matched")
            if isinstance(matched, str) and not sp["no_stop_trim"] and matched in text:
                text = text[: text.index(matched)]
            out["text"] = text
        out["output_ids"] = out_ids
        out["meta_info"] = meta
        return out

    # -- memory -----------------------------------------------------------------
    @_sync_api
    def release_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        self._client.check_alive()
        self._client.call("release", self._tags(tags))

    @_sync_api
    def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        self._client.check_alive()
        self._client.call("resume", self._tags(tags))

    @staticmethod
    def _tags(tags: Optional[List[str]]) -> List[str]:
        tags = list(GPU_MEMORY_ALL_TYPES) if not tags else list(tags)
        bad = [t for t in tags if t not in GPU_MEMORY_ALL_TYPES]
        if bad:
            raise ValueError(f"unknown memory tag(s) {bad}; valid: {GPU_MEMORY_ALL_TYPES}")
        return tags

    @_sync_api
    def flush_cache(self) -> FlushCacheReqOutput:
        self._client.check_alive()
        replies = self._client.call("flush_cache")
        ok = all(success for success, _ in replies)
        return FlushCacheReqOutput(success=ok, message="; ".join(m for _, m in replies if m))

    # -- weights ----------------------------------------------------------------
    @_sync_api
    def begin_weight_update(self, selector: str = "all") -> tuple:
        self._client.check_alive()
        if self._session:
            return False, "A weight update session is already active; call end_weight_update() first."
        self._client.call("begin", selector)
        self._session = True
        return True, "Weight update session started."

    @_sync_api
    def end_weight_update(self) -> tuple:
        self._client.check_alive()
        if not self._session:
            return False, "No weight update session is active; call begin_weight_update() first."
        self._client.call("end")
        self._session = False
        return True, "Weight update session ended."

    @_sync_api
    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None,
                                   flush_cache: bool = True) -> tuple:
        """Load tensors on every TP rank (note 1.4). flattened_bucket: one payload per rank.

        As in 0.5.21, nothing here checks the payloads against tp_size: every rank receives the
        whole list and opens its own index (TpModelWorker.deserialize_own_rank), so too few is an
        IndexError inside a scheduler (fatal) and extras are never opened. Nor are equal bytes
        for two ranks refused: both ranks open the same handle, which fd handles allow once only
        (the second claim fails in that scheduler), file_system handles allow, and CUDA IPC
        miscounts (the producer's refcount drops twice)."""
        self._client.check_alive()
        tp = len(self._client.conns)
        if load_format == "flattened_bucket":
            # Normalised by the Engine, then again by the TokenizerManager, both in this process.
            payloads = normalize_serialized_named_tensor_payloads(named_tensors)
            payloads = normalize_serialized_named_tensor_payloads(payloads)
        else:
            # The real Engine pickles the whole list once per rank, in the caller's process,
            # before the scheduler checks the session.
            payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(tp)]
        if not self._session:
            return False, _SESSION_MSG  # nothing was opened, so the payloads may be sent again
        replies = self._client.call("update_tensor", (payloads, load_format, flush_cache))
        return replies[0]

    @_sync_api
    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        self._client.check_alive()
        return self._client.call("get_weights_by_name", (name, truncate_size))[0]

    # -- lifetime -----------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the schedulers (idempotent). The real one kills every child of the caller."""
        client = getattr(self, "_client", None)
        if client is not None:
            client.shutdown()
        atexit.unregister(self.shutdown)

    # -- stand-in only ------------------------------------------------------------
    def _debug_state(self) -> Dict[str, Any]:
        """Per-rank counters: payloads_opened, payload_bytes, tensor_bytes, names_loaded,
        names_skipped, all_params_loaded_since_release, offload_tags, weights_digest, ..."""
        ranks = self._client.call("debug_state")
        return {"session_active": self._session, "tp_size": len(ranks), "ranks": ranks}

    def _debug_get_param(self, name: str, rank: int = 0) -> torch.Tensor:
        shape, dtype, data = self._client.call("debug_get_param", name)[rank]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)

    def _debug_pending_requests(self, n: int) -> None:
        """Pretend n requests are running (0 clears it), to exercise the idle checks."""
        self._client.call("debug_pending", n)

    def _debug_step_delay(self, seconds: float) -> None:
        """Make rank 0 sleep this long after each token of a streamed generate (0 clears it): a test can
        then abort requests long before they would finish, however busy the machine."""
        self._client.call("debug_step_delay", seconds)


class Engine0517(Engine):
    """sglang 0.5.17 (note section 8): no begin/end_weight_update (`hasattr` is False), and
    update_weights_from_tensor loads at once, with no session to open first."""

    _MISSING = ("begin_weight_update", "end_weight_update")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._session = True  # the 0.5.21 session gate, always open

    @staticmethod
    def _ensure_event_loop() -> asyncio.AbstractEventLoop:
        """0.5.17 (end of Engine.__init__): the running loop if there is one, else a new loop,
        set as this thread's loop."""
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop

    def __getattribute__(self, name: str):
        if name in Engine0517._MISSING:
            raise AttributeError(f"'Engine' object has no attribute {name!r}")
        return super().__getattribute__(name)
