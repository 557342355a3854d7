"""The SGLang rollout engine, colocated: one `sglang.Engine` per inference-TP group.

Ranks are cut into groups of `tp_size` consecutive ranks. The group's first rank
(the owner) builds the Engine on its own GPU (`base_gpu_id`), with dummy weights
and the memory saver, and releases all its memory right away: the first rollout's
`resume(["weights"])` is then legal and the trainer has the GPU until then. The
other ranks reach the engine only through collectives on the group's gloo group:

    generate        gather prompts to the owner -> one Engine.generate -> scatter each
                    rank's completions back, in order; with a partial rollout's request, one
                    streamed generate that the owner stops per rank (partial.py)
    update_weights  every rank exports its bucket as a handle (weight_transport.py);
                    the owner sends the tp_size payloads in one update_weights_from_tensor
                    inside a begin/end weight-update session; SGLang TP rank i opens
                    trainer rank owner+i's payload
    release/resume  the owner only; every rank learns the result

SGLang kills the process that built the Engine when a control call fails inside its
scheduler (sglang-api.md section 0). So every call is checked here first (tags
against the engine's release state, session state, parameter names, shapes and
dtypes, a complete sync after a weights release) and a mistake is a Python
exception that names it. Engine calls go through `calls.EngineThread`: inside a
running event loop (a notebook cell) SGLang's synchronous methods cannot run on the caller's
thread. `sglang` is imported lazily, here and in weight_transport.py.

Legend: N sequences (this rank's), G samples per prompt.
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
from typing import Callable, Iterable, Optional, Sequence

import torch

from hybrid_rl.models.lora import base_named_parameters
from hybrid_rl.rollout.base import check_tags
from hybrid_rl.rollout.sglang import alloc_conf
from hybrid_rl.rollout.sglang.calls import EngineThread, attempt, scoped_env, uninterrupted, unwrap
from hybrid_rl.rollout.sglang.lora import MAX_LORAS_PER_BATCH, NAME, lora_spec
from hybrid_rl.rollout.sglang.partial import GroupStops, stream_until_enough
from hybrid_rl.rollout.sglang.weight_transport import push_bucket
from hybrid_rl.runtime import distributed as D
from hybrid_rl.types import Completion, PartialRequest, SamplingParams

SGLANG_TAGS = ("weights", "kv_cache")  # cuda_graph stays resident: released and resumed only in pairs
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # set by torchrun for its workers


def check_available() -> None:
    """Raise a config error when `sglang` cannot be imported (before any model is built)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise ValueError(
            "config key 'rollout.engine': sglang is not importable here; install the GPU extra "
            "(pip install 'hybrid_rl[gpu]', SGLang 0.5.21 on torch 2.13, or 0.5.17 on torch 2.11) "
            "or use rollout.engine=native"
        )


def to_completion(
    out: dict, index: int, stop_ids: Iterable[int] = (), aborted: bool = False, budget: Optional[int] = None
) -> Completion:
    """SGLang's output dict -> Completion, with the native engine's conventions:
    token ids include the stop token, logprob i belongs to token i, finish 'stop' | 'length'.

    SGLang tests the length limit before the stop tokens (Req.check_finished), so a completion whose
    last allowed token is a stop token comes back as 'length'; it stopped, and is 'stop' here (as in
    the native engine): otherwise the overlong filter and the truncation rules would drop a finished answer.

    aborted: this adapter aborted the request (a partial rollout, partial.py), which then holds its tokens so far:
    'abort', unless the token it sampled after the abort ended it anyway (a stop token: 'stop'; its `budget`
    reached: 'length'). Any other abort is SGLang's own, and an error."""
    meta = out["meta_info"]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type")
    if kind not in ("stop", "length") and not (kind == "abort" and aborted):
        raise RuntimeError(f"SGLang aborted request {index}: {reason.get('message', reason)}")
    ids = list(out["output_ids"])
    if kind == "length" and ids and ids[-1] in set(stop_ids):
        kind = "stop"
    if kind == "abort" and ids and ids[-1] in set(stop_ids):
        kind = "stop"
    elif kind == "abort" and budget is not None and len(ids) >= budget:
        kind = "length"
    logprobs = [lp for lp, _tok, _text in meta["output_token_logprobs"]]
    if [tok for _lp, tok, _text in meta["output_token_logprobs"]] != ids:
        raise RuntimeError(f"request {index}: SGLang's logprobs do not follow its output ids")
    return Completion(token_ids=ids, logprobs=[float(x) for x in logprobs], finish_reason=kind)


class SGLangEngine:
    """RolloutEngine over SGLang, shared by a group of `tp_size` ranks (see module docstring); LoRA: lora.py."""

    lora: Optional[dict] = None
    base_complete = False  # a complete base sync ended since start (set by SGLangEngine.end_weight_update)
    adapter_name: Optional[str] = None
    last_tail_s: Optional[float] = None  # measured by a partial rollout's streamed generate only
    last_generated_tokens: Optional[int] = None

    def __init__(
        self,
        model: torch.nn.Module,
        model_path: str,
        pad_id: int,
        eos_id: int,
        tp_size: int = 1,
        weights_dtype: Optional[torch.dtype] = None,
        mem_fraction: Optional[float] = None,
        seed: int = 0,
        timeout_s: int = 300,
        engine_kwargs: Optional[dict] = None,
        release_wait_s: float = 60.0,
        with_tokenizer: bool = False,
    ):
        W, r = D.world_size(), D.rank()
        if tp_size < 1 or W % tp_size or D.local_world_size() % tp_size:
            raise ValueError(
                f"config key 'rollout.tp_size': {tp_size} must divide the ranks of one node "
                f"({D.local_world_size()}) and the world ({W})"
            )
        self.tp_size, self.pad_id, self.eos_id, self.with_tokenizer = tp_size, pad_id, eos_id, with_tokenizer
        self.vocab_size = model.config.vocab_size
        self.owner = r - r % tp_size
        self.is_owner = r == self.owner
        groups = [D.new_group(list(range(g, g + tp_size)), timeout_s) for g in range(0, W, tp_size)]
        self.group = groups[r // tp_size]
        # What a full sync must deliver: every parameter, full shape, inference dtype; with LoRA the frozen base's.
        self.expected = {n: tuple(p.shape) for n, p in base_named_parameters(model)}
        self.start_lora(model)  # a peft-injected policy: the engine serves its adapter (lora.py)
        self.dtype = weights_dtype or next(iter(model.parameters())).dtype
        self.device = next(iter(model.parameters())).device
        self._full_bytes = sum(torch.Size(s).numel() for s in self.expected.values()) * self.dtype.itemsize
        self.released = set(SGLANG_TAGS)  # mirrors the engine's offload_tags after the start-up release
        self.session, self.release_wait_s = False, release_wait_s
        self._sent: set[str] = set()
        self.sync_stats = {"bytes": 0, "payloads": 0, "handles": 0}
        self.freed_bytes = 0  # device memory that came back at the last release (CUDA; 0 on CPU)
        self._kv_bytes = 0
        self._restore_settings: Optional[str] = None  # the allocator's settings while an export switched them
        self._calls = EngineThread(self.device)  # a dedicated thread inside a running event loop (a notebook cell)
        self.engine = None
        if self.is_owner:
            self.engine = self._calls.run(self._start, model_path, mem_fraction, seed, engine_kwargs or {})
            # Scheduler processes outlive a forgotten engine and block interpreter exit.
            atexit.register(self.shutdown)
            # SGLang holds all its memory until the first release (verl#2208); every tag
            # counts as resident at start, so releasing now makes the first resume legal.
            self._calls.run(self.engine.release_memory_occupation, list(SGLANG_TAGS))
        D.broadcast_object_from(None, self.owner, self.group)  # the group waits for its engine

    # -- start-up -------------------------------------------------------------
    def _start(self, model_path: str, mem_fraction: Optional[float], seed: int, extra: dict):
        import sglang

        cuda = self.device.type == "cuda"
        args = dict(
            model_path=model_path,
            tp_size=self.tp_size,
            skip_tokenizer_init=not self.with_tokenizer,
            load_format="dummy",
            enable_memory_saver=cuda,
            base_gpu_id=(self.device.index or 0) if cuda else 0,
            random_seed=seed + self.owner,
            dtype=_dtype_name(self.dtype),
        )
        if mem_fraction is not None:
            args["mem_fraction_static"] = mem_fraction
        if cuda:
            # An unevenly loaded colocated trainer trips SGLang's TP balance check.
            os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"
        args.update({**extra, **self.lora_engine_args()})
        # What the schedulers inherit, for as long as the Engine starts them (this process keeps its own):
        # * torchrun's workers carry TORCHELASTIC_USE_AGENT_STORE=True, which makes torch join any
        #   rendezvous as a client of the launcher's store. The schedulers meet at their own tcp://
        #   port, which then no process serves: every scheduler would wait out the store timeout.
        # * expandable segments, under every name torch reads: torch_memory_saver does not support
        #   them, and checks PYTORCH_CUDA_ALLOC_CONF's text only, so under PYTORCH_ALLOC_CONF (the
        #   name torch reads first) they would pass its check unnoticed (alloc_conf.py).
        with scoped_env({_AGENT_STORE: "False", **alloc_conf.engine_env_updates(os.environ)}):
            try:
                engine = sglang.Engine(**args)
            except Exception as err:
                version = getattr(sglang, "__version__", "?")
                raise RuntimeError(
                    f"sglang.Engine (sglang {version}) failed to start on {self.device}: {type(err).__name__}: {err}. "
                    "Likely causes: an SGLang build that does not match this torch (0.5.21 needs torch 2.13, "
                    "0.5.17 torch 2.11), no CUDA device, a model architecture SGLang does not support, or "
                    "rollout.mem_fraction too small for the weights plus a KV cache (raise it, or offload the "
                    "optimizer so the engine starts on more free memory)"
                ) from err
        return engine

    # -- memory ---------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """This rank's share of the engine's weights while they are resident (1/tp of the model per GPU)."""
        weights = 0 if "weights" in self.released else self._full_bytes // self.tp_size
        return {"engine_weights": weights, "kv_cache": 0 if "kv_cache" in self.released else self._kv_bytes}

    @uninterrupted
    def resume(self, tags: Sequence[str]) -> None:
        tags = self._tags(tags)
        not_released = [t for t in tags if t not in self.released]
        if not_released:
            # Inside SGLang this is a KeyError in the scheduler, which kills this process.
            raise RuntimeError(
                f"resume({not_released}): not released; SGLang would kill the job. "
                "Release and resume tags in matching pairs"
            )
        if "kv_cache" in tags and self.session:
            raise RuntimeError("resume(['kv_cache']) inside a weight-update session; call end_weight_update() first")
        if "weights" in tags:
            self._sent = set()
        free_before = _free_device_bytes(self.device)
        self._owner_call("resume_memory_occupation", list(tags))
        self.released -= set(tags)
        if "kv_cache" in tags and free_before is not None:
            # SGLang sizes its KV pool itself (mem_fraction): measure what the resume took.
            self._kv_bytes = max(0, free_before - _free_device_bytes(self.device))

    @uninterrupted
    def release(self, tags: Sequence[str]) -> None:
        tags = [t for t in self._tags(tags) if t not in self.released]
        if not tags:
            return
        if self.session:
            raise RuntimeError("release inside a weight-update session; call end_weight_update() first")
        free_before = _free_device_bytes(self.device)
        self._owner_call("release_memory_occupation", list(tags))
        self.released |= set(tags)
        if "weights" in tags:
            self._wait_for_memory(free_before, self._full_bytes // self.tp_size)
        if free_before is not None:
            self.freed_bytes = max(0, _free_device_bytes(self.device) - free_before)

    def _wait_for_memory(self, free_before: Optional[int], expected: int) -> None:
        """SGLang can return from release before the memory is back (slime#579): wait, bounded."""
        if free_before is None:
            return
        deadline = time.monotonic() + self.release_wait_s
        while _free_device_bytes(self.device) - free_before < 0.9 * expected:
            if time.monotonic() > deadline:
                warnings.warn(
                    "SGLang released its weights but only "
                    f"{(_free_device_bytes(self.device) - free_before) / 2**20:.0f} "
                    f"MiB of {expected / 2**20:.0f} MiB came back within {self.release_wait_s:.0f} s"
                )
                return
            time.sleep(0.05)

    @staticmethod
    def _tags(tags: Sequence[str]) -> list[str]:
        check_tags(tags)
        if not tags:
            raise ValueError("name the tags to release or resume; an empty list means every tag to SGLang")
        return list(tags)

    # -- weights --------------------------------------------------------------
    @uninterrupted
    def begin_weight_update(self) -> None:
        if "weights" in self.released:
            raise RuntimeError(
                "begin_weight_update() while the engine's weights are released; resume(['weights']) first"
            )
        if self.session:
            raise RuntimeError("begin_weight_update() called twice")
        # 0.5.21 loads nothing outside a session; 0.5.17 has none.
        self._owner_call("begin_weight_update", check=True, optional=True)
        self.session = True
        self._export_allocator(True)
        self.sync_stats = {"bytes": 0, "payloads": 0, "handles": 0}

    @uninterrupted
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every rank of the group calls this with the same bucket (full tensors)."""
        if not self.session:
            raise RuntimeError("update_weights outside a weight-update session; call begin_weight_update() first")
        bucket = list(named_tensors)
        self._check_bucket(bucket)
        nbytes = push_bucket(
            bucket,
            self.dtype,
            self.owner,
            self.group,
            lambda payloads: self._owner_call(
                "update_weights_from_tensor",
                named_tensors=payloads,
                load_format="flattened_bucket",
                flush_cache=False,
                check=True,
                precheck=lambda: check_payloads(payloads, self.tp_size),
            ),
        )
        self._sent.update(n for n, _ in bucket)
        self.sync_stats["bytes"] += nbytes * self.tp_size
        self.sync_stats["payloads"] += self.tp_size
        self.sync_stats["handles"] += self.tp_size  # one flat buffer per rank per bucket

    @uninterrupted
    def end_weight_update(self) -> None:
        if not self.session:
            raise RuntimeError("end_weight_update() without begin_weight_update()")
        missing = sorted(set(self.expected) - self._sent)
        if missing:
            raise RuntimeError(
                f"weight sync incomplete: {len(missing)} parameters not sent (e.g. {missing[:3]}); "
                "after a weights release SGLang holds garbage until every parameter is re-sent"
            )
        self._owner_call("end_weight_update", check=True, optional=True)
        self.session, self.base_complete = False, True
        self._export_allocator(False)
        # One flush after the last bucket: a stale prefix cache degrades rewards (RLinf#96).
        self._owner_call("flush_cache")

    @uninterrupted
    def abort_weight_update(self) -> None:
        """Close a weight-update session an exception interrupted (PhaseManager.recover); nothing if none is open.

        The engine's weights are then partly updated: the phase manager releases them, and the next
        resume(["weights"]) starts a sync that must send every parameter again."""
        if not self.session:
            return
        self.session = self.base_complete = False  # whatever SGLang answers (it may have closed the session)
        self._export_allocator(False)
        self._owner_call("end_weight_update", optional=True)  # unchecked: "no session open" is fine here

    def _export_allocator(self, exporting: bool) -> None:
        """Expandable segments cannot be shared by CUDA IPC (pytorch#130330): a session exports from
        plain segments, and then the allocator gets its own settings back. Its settings string is
        switched whole, since a settings call resets every key it does not name (alloc_conf.py)."""
        if self.device.type != "cuda":
            return
        if exporting:
            settings = alloc_conf.current_settings()
            safe = alloc_conf.ipc_safe(settings)
            if safe is not None:
                alloc_conf.apply_settings(safe)
                self._restore_settings = settings
        elif self._restore_settings is not None:
            alloc_conf.apply_settings(self._restore_settings)
            self._restore_settings = None

    def _check_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in bucket:
            if name not in self.expected:
                raise KeyError(f"parameter {name!r} is not in the policy; SGLang would skip it silently")
            shape = self.expected[name]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} != the model's {shape}; send full tensors "
                    "(a wrong shape kills SGLang's scheduler)"
                )
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name}: dtype {t.dtype} is not a floating-point weight")

    # -- generation -----------------------------------------------------------
    @torch.no_grad()
    @uninterrupted
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, partial: Optional[PartialRequest] = None
    ) -> list[Completion]:
        """This rank's completions, in order (the group's rows run in one engine call on the owner).

        partial: per-row budgets and minimums, and the early stop: once this rank's `groups_needed` groups have
        every row finished, its other rows are aborted and come back "abort" with their tokens so far (partial.py).
        Sets last_generated_tokens (this rank's), and last_tail_s for a partial rollout (the group call's), else None.
        """
        if self.released:
            raise RuntimeError(
                f"engine memory is released ({sorted(self.released)}); resume(['weights', 'kv_cache']) first"
            )
        if self.session:
            raise RuntimeError("generate inside a weight-update session; call end_weight_update() first")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        self.last_tail_s = self.last_generated_tokens = None
        problem = _partial_problem(partial, len(prompt_ids), params)
        requests = D.gather_object_to((prompt_ids, params, partial, problem), self.owner, self.group)
        replies = None
        if self.is_owner:  # a failure goes to every rank of the group, as in _owner_call
            refused = [f"rank {self.owner + k}: {r[3]}" for k, r in enumerate(requests) if r[3]]
            if refused:
                status, value = "error", "refused " + "; ".join(refused)
            else:
                status, value = attempt(self._generate_for_group, [r[:3] for r in requests])
            replies = [(status, r) for r in value] if status == "ok" else [(status, value)] * len(requests)
        outcome = D.scatter_object_from(replies, self.owner, self.group)
        if problem:  # this rank's own mistake, as the error it is (the others hear of it from the owner)
            raise ValueError(problem)
        completions, self.last_tail_s = unwrap(outcome, "generate")
        self.last_generated_tokens = sum(len(c.token_ids) for c in completions)
        return completions

    def _generate_for_group(
        self, requests: list[tuple[list[list[int]], SamplingParams, Optional[PartialRequest]]]
    ) -> list[tuple[list[Completion], Optional[float]]]:
        """Every rank's rows in one engine call; each rank's completions, and the call's tail (partial rollouts)."""
        ids, sampling = [], []
        for prompts, params, partial in requests:
            for i, p in enumerate(prompts):
                ids.append(list(p))
                sampling.append(self._sampling_dict(params, i, partial))
        if any(partial is not None for _, _, partial in requests):
            completions, tail_s = self._generate_partial(ids, sampling, requests)
        else:
            completions, tail_s = self._generate_whole(ids, sampling), None
        replies, start = [], 0
        for prompts, _, _ in requests:
            replies.append((completions[start : start + len(prompts)], tail_s))
            start += len(prompts)
        return replies

    def _generate_whole(self, ids: list[list[int]], sampling: list[dict]) -> list[Completion]:
        outs = self._calls.run(
            self.engine.generate,
            input_ids=ids,
            sampling_params=sampling,
            return_logprob=True,
            lora_path=self.lora_paths(len(ids)),
        )
        outs = [outs] if isinstance(outs, dict) else outs
        if len(outs) != len(ids):
            raise RuntimeError(f"SGLang returned {len(outs)} results for {len(ids)} prompts")
        return [to_completion(o, i, sampling[i]["stop_token_ids"]) for i, o in enumerate(outs)]

    def _generate_partial(self, ids: list[list[int]], sampling: list[dict], requests: list) -> tuple:
        """The rows of ranks that still need groups, in one streamed generate (partial.py); the rows of a rank that
        needs none come back unstarted ("abort", no tokens), as the native engine's unstarted batches."""
        stops = GroupStops([r[2] for r in requests], [len(r[0]) for r in requests])
        sent = [i for i, k in enumerate(stops.rank_of) if not stops.met(k)]
        outs, aborted, tail_s = {}, set(), 0.0
        if sent:
            outs, aborted, tail_s = self._calls.run(
                stream_until_enough, self.engine, ids, sampling, stops, sent, self.lora_paths(len(sent))
            )
        completions = [
            to_completion(outs[i], i, sampling[i]["stop_token_ids"], i in aborted, sampling[i]["max_new_tokens"])
            if i in outs
            else Completion([], [], "abort")
            for i in range(len(ids))
        ]
        return completions, tail_s

    def _sampling_dict(self, p: SamplingParams, i: int, partial: Optional[PartialRequest] = None) -> dict:
        # EOS of the trainer's tokenizer stops here as it does in the native engine (SGLang
        # without a tokenizer knows only the model config's eos ids). A seed per sample: it
        # takes effect only with deterministic inference, never used for rollouts (it makes a
        # prompt's samples identical); the engine's random_seed drives sampling otherwise.
        stops = sorted({*p.stop_token_ids, *([self.eos_id] if self.eos_id >= 0 else [])})  # eos_id < 0: none
        bad = [t for t in stops if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"stop token ids {bad} are outside the vocabulary (0..{self.vocab_size - 1}); "
                "SGLang rejects the request"
            )
        # A partial rollout's row has its own budget and minimum (a continued sample's, less its prefix).
        max_new = p.max_new_tokens if partial is None else partial.max_new_tokens[i]
        min_new = p.min_new_tokens if partial is None else partial.min_new_tokens[i]
        if min_new and not self.with_tokenizer:  # 0.5.21: raise_if_tokenizer_required
            raise ValueError(
                "min_new_tokens needs SGLang's tokenizer (its eos ids are banned too): build "
                "SGLangEngine(with_tokenizer=True), as the Trainer does for rollout.min_new_tokens > 0"
            )
        return {
            "max_new_tokens": max_new,
            "min_new_tokens": min_new,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "temperature": 0.0 if p.greedy else p.temperature,
            "stop_token_ids": stops,
            "sampling_seed": p.seed * 1_000_003 + i,
        }

    # -- owner calls ----------------------------------------------------------
    def _owner_call(
        self,
        method: str,
        *args,
        check: bool = False,
        optional: bool = False,
        precheck: Optional[Callable[[], None]] = None,
        **kwargs,
    ):
        """Run engine.method(*args, **kwargs) on the owner, after `precheck()` there; every rank of the
        group gets the outcome (an exception there is re-raised on every rank, so none waits in a
        collective forever)."""
        outcome = None
        if self.is_owner:
            fn = getattr(self.engine, method, None)
            outcome = ("ok", None) if fn is None and optional else attempt(self._call, fn, precheck, *args, **kwargs)
        value = unwrap(D.broadcast_object_from(outcome, self.owner, self.group), method)
        if check and value is not None and not value[0]:
            raise RuntimeError(f"SGLang {method} refused: {value[1]}")
        return value

    def _call(self, fn, precheck: Optional[Callable[[], None]], *args, **kwargs):
        if precheck is not None:
            precheck()
        return self._calls.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        """Stop the engine. The real Engine.shutdown kills EVERY child process of this one."""
        if self.engine is not None:
            self.engine.shutdown()  # needs no event loop: inline, even at interpreter exit
            self.engine = None
        self._calls.close()

    # -- LoRA: the policy's adapter, pushed each step (lora.py) ---------------------
    def start_lora(self, model: torch.nn.Module) -> None:
        self.lora = lora_spec(model)
        self.adapter_version = 0

    def lora_engine_args(self) -> dict:
        """Engine keywords for serving the policy's adapter (empty without LoRA); they override engine_kwargs."""
        if self.lora is None:
            return {}
        return {
            "enable_lora": True,
            "max_lora_rank": self.lora["rank"],
            "lora_target_modules": self.lora["targets"],
            "max_loras_per_batch": MAX_LORAS_PER_BATCH,
            "enable_weights_cpu_backup": True,
        }

    @property
    def base_synced(self) -> bool:
        """The engine holds the whole base: the host copy keeps it across releases once a full sync ended."""
        return self.lora is not None and self.base_complete

    def lora_paths(self, n: int) -> Optional[list]:
        """generate's lora_path for n prompts: the pushed adapter's name for each, or None (no LoRA: the base)."""
        if self.lora is None:
            return None
        if self.adapter_name is None:
            raise RuntimeError(
                "no adapter loaded into SGLang yet; the phase switch's sync (update_adapter) comes first"
            )
        return [self.adapter_name] * n

    @uninterrupted
    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> int:
        """Every rank of the group passes the whole adapter (peft names, full tensors, the same order); the owner
        loads it under a new name and unloads the previous one. Returns the adapter's bytes (one copy)."""
        if self.lora is None:
            raise RuntimeError(
                "this SGLang engine was built for a policy without LoRA adapters; build it from the "
                "peft-injected policy (model.lora.rank > 0)"
            )
        if "weights" in self.released or self.session:
            raise RuntimeError("update_adapter() needs resumed weights and no open weight-update session")
        if (config.get("r"), config.get("lora_alpha")) != (self.lora["rank"], self.lora["alpha"]):
            raise ValueError(
                f"adapter config r={config.get('r')} lora_alpha={config.get('lora_alpha')} differs from the "
                f"engine's start ({self.lora['rank']}, {self.lora['alpha']})"
            )
        bucket = list(named_tensors)
        self._check_adapter(bucket)
        name = f"{NAME}-v{self.adapter_version + 1}"
        nbytes = push_bucket(
            bucket,
            self.dtype,
            self.owner,
            self.group,
            lambda payloads: self._lora_call(
                "load_lora_adapter_from_tensors",
                name,
                payloads,
                self.lora["config"],
                load_format="flattened_bucket",
                precheck=lambda: check_payloads(payloads, self.tp_size),
            ),
        )
        old, self.adapter_name, self.adapter_version = self.adapter_name, name, self.adapter_version + 1
        if old is not None:
            self._lora_call("unload_lora_adapter", old)
        self.sync_stats["bytes"] += nbytes * self.tp_size
        self.sync_stats["payloads"] += self.tp_size
        return nbytes

    def _check_adapter(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """SGLang drops unknown names and zeroes what is missing without a word, and finds a wrong shape only when
        a batch uses the adapter (a scheduler failure: fatal). So the whole adapter, exactly, is checked here."""
        shapes = self.lora["shapes"]
        got = {n: tuple(t.shape) for n, t in bucket}
        if set(got) != set(shapes):
            extra, missing = sorted(set(got) - set(shapes)), sorted(set(shapes) - set(got))
            raise ValueError(
                f"adapter sync must carry exactly the policy's {len(shapes)} LoRA tensors (peft names); "
                f"unknown {extra[:3]}, missing {missing[:3]}"
            )
        wrong = [n for n in got if got[n] != shapes[n]]
        if wrong:
            raise ValueError(f"adapter tensor {wrong[0]}: shape {got[wrong[0]]} != the policy's {shapes[wrong[0]]}")
        if any(not t.dtype.is_floating_point for _, t in bucket):
            raise TypeError("adapter tensors must be floating point")

    def _lora_call(self, method: str, *args, precheck=None, **kwargs) -> None:
        """engine.method(...) on the owner; its LoRAUpdateOutput's refusal is an error on every rank of the group."""
        outcome = None
        if self.is_owner:

            def call():
                fn = getattr(self.engine, method, None)
                if fn is None:
                    raise RuntimeError(
                        f"this SGLang has no {method} (0.5.21 has it); use rollout.engine=vllm or native "
                        "with model.lora.rank > 0, or model.lora.rank=0"
                    )
                if precheck is not None:
                    precheck()
                out = self._calls.run(fn, *args, **kwargs)
                return bool(out.success), str(out.error_message or "")

            outcome = attempt(call)
        ok, msg = unwrap(D.broadcast_object_from(outcome, self.owner, self.group), method)
        if not ok:
            raise RuntimeError(f"SGLang {method}({args[0]!r}) refused: {msg}")


def check_payloads(payloads: list, tp_size: int) -> None:
    """Refuse a flattened update's payload list that SGLang would take badly; it checks none of this.

    SGLang TP rank i opens payloads[i] (0.5.21 TpModelWorker.deserialize_own_rank): too few is an
    IndexError inside a scheduler, which kills this process, and extras are ignored. Two ranks given
    the same bytes would both open one handle, which breaks the producer's CUDA-IPC refcount (the
    reason deserialize_own_rank opens only its own copy)."""
    if len(payloads) != tp_size:
        raise ValueError(
            f"{len(payloads)} weight payloads for tp_size={tp_size}: SGLang needs exactly one per TP "
            "rank (too few kills its scheduler, extras are dropped silently)"
        )
    if len(set(payloads)) != len(payloads):
        raise ValueError("two TP ranks' weight payloads are the same bytes; every rank must export its own bucket")


def _partial_problem(partial: Optional[PartialRequest], n_prompts: int, params: SamplingParams) -> Optional[str]:
    """Why this rank's PartialRequest cannot run (types.PartialRequest.check), or None: found before the gather, and
    told to the group through it, so that no rank of the group waits in a collective for a rank that gave up."""
    if partial is None:
        return None
    try:
        partial.check(n_prompts, params)
    except ValueError as err:
        return str(err)
    return None


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return {None: "auto", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]


def _free_device_bytes(device: torch.device) -> Optional[int]:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None  # host memory: nothing to wait for
