"""The vLLM rollout engine, colocated in the trainer's own process(es): one `vllm.LLM` per process, SPMD.

Placement. In a plain process (a notebook) there is one engine (vLLM's uniprocess executor). Under
torchrun every rank builds an engine with `distributed_executor_backend="external_launcher"` on the
launcher's world: `rollout.tp_size` consecutive ranks form one engine, each holding 1/tp of it.
Every rank of a TP group must call `generate` with the same prompts, so `generate` gathers the
group's prompts, every rank generates them all (the same seeded sampling stream on every rank makes the
ranks agree), and each rank keeps its own slice, in order. vLLM is imported lazily, here and in setup.py.

Sampling stream. One seeded stream per generate call, not a vLLM `seed=` per request: a per-request seed
makes vLLM keep a torch.Generator per request and draw each row's noise alone in Python at every decode
step (v1/sample/ops/topk_topp_sampler.py: `forward_cpu` loops over `generators`, `random_sample` too),
which cost ~8% of a 256 x 32-token rollout of the tiny model. Without one, vLLM's sampler draws every
row's noise in one call from torch's default generator (CPU; the engine device's on CUDA), which generate
seeds from the call's seed (the group's seeds at tp > 1) and restores afterwards, so the trainer's own
stream is untouched. Each row still gets its own draws (a prompt's samples differ; same distribution).
Guarantee: the same weights, prompts (the group's, in order) and seed give the same tokens; a sample
depends on the whole call (the other prompts, their order, tp_size), no longer on its prompt, seed and
index alone as it did with a seed per request.
That is the CPU build (Model Runner V1). On CUDA vLLM runs Model Runner V2 (pinned: setup.RUNNER_ENV), whose
sampler never reads torch's generators: each request gets an explicit seed derived from the call's
(setup.request_seeds), which V2 hashes with the position at no cost; a request without one would take its
seed from NumPy's global stream.
Logprobs come back as vLLM's FlatLogprobs (`flat_logprobs`: flat lists instead of a dict and a Logprob
object per token), read without building those objects (~4% of the same rollout).

Partial rollouts (issue 37, types.PartialRequest). A call with one drives vLLM's engine loop itself (drive.py), not
the blocking `LLM.generate`: a row of a PartialRequest gets its own max_tokens / min_tokens, and once `groups_needed`
groups have every row finished the rest are aborted in vLLM (their KV blocks freed) and returned "abort" with the
tokens and log-probs they reached. The loop adds and steps as `LLM.generate` does, and every call runs through it
(one without a PartialRequest asks for FINAL_ONLY outputs, as `LLM.generate` does, and samples its very tokens), so
each call measures its tail (`last_tail_s`).
A continued row is a plain prompt (prompt + carried prefix, ids): vLLM prefills it whole, reusing what its prefix
cache holds (rollout.enable_prefix_caching; dropped at every weight change, `_drop_prefix_cache`, so a prefix is
never served KV of older weights). Its random stream: on CPU its new tokens are drawn from the continuing call's
stream at the row's place in that call, on CUDA from a seed of the continuing call (setup.request_seeds); so a
sample cut and continued is a draw from the same distribution but not the tokens an uninterrupted call with the
same seed would have drawn (greedy continues exactly), and a call repeats exactly given its weights, prompts (with
their prefixes), budgets and seed. The early stop reads only outputs, never a clock: every rank of a TP group stops
at the same step (drive.py).

Construction: `skip_tokenizer_init` (the trainer owns the tokenizer), `load_format="dummy"` (the
weights come from the policy at the first sync, never from a second read of the checkpoint), the
inference dtype (bf16 on CUDA, fp32 on CPU), `max_model_len` = longest kept prompt + max_new_tokens,
prefix caching off unless asked, `logprobs_mode="processed_logprobs"`. Memory: on CPU the KV cache
is `kv_cache_memory_bytes` (rollout.kv_cache_bytes, or one batch's need from the planner's formula;
left to itself vLLM would take half the host); on CUDA `gpu_memory_utilization` (rollout.mem_fraction)
or the same explicit KV budget. What vLLM's start does to the process, and what is undone, is in
setup.py's docstring.

Logprobs: with `processed_logprobs` vLLM returns the sampled token's log_softmax(logits / T), the
native engine's convention, when top-k and top-p are off. With either on, vLLM's processed values are
after filtering (renormalised over the kept tokens, so never below the unfiltered value), while the
trainer recomputes log_softmax(logits / T) over the whole vocabulary: the rollout correction then
compares the truncated sampling distribution with the full one, and the mismatch includes the log of
the kept mass. Greedy requests (temperature 0 in vLLM) return log_softmax(logits), as the native engine
does at temperature 1.

Weights, in switch/phases.py's order: resume(["weights"]) wakes vLLM's weights; the buckets of full
tensors, cast to the inference dtype, go through vLLM's layer-wise in-place reload (model_loader/
reload: initialize at begin_weight_update, `model.load_weights(bucket)` per bucket, finalize at
end_weight_update; vLLM's own `reload_weights` is those three steps over one iterator, and finalizing
after every bucket would process a fused layer (qkv, gate-up) split across two buckets half-loaded);
resume(["kv_cache"]) wakes the KV cache. Leaving ROLLOUT, release(["kv_cache", "weights"]) puts the
engine to sleep. vLLM's sleep covers both at once; the REWARD stage's release of the KV cache alone
is `sleep(level=0)` + `release_kv_cache_memory()` on CUDA and nothing on CPU.
Sleep level 2: the weights are discarded, not copied to host as level 1 does, because they are
re-sent in full at every resume anyway (a copy to host and back would move them twice for nothing).
On CPU vLLM's worker ignores sleep (it frees nothing), so `memory_bytes` keeps reporting the weights and
KV cache as resident there, and `kv_cache_kept` tells the ledger (PhaseManager.resident) to count the KV
cache in the train and score rows too (it counts the native engine's, which lives for one rollout, inside
ROLLOUT only).

Legend: N sequences (this rank's).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Iterable, Optional, Sequence

import torch

from hybrid_rl.rollout.base import check_tags
from hybrid_rl.rollout.vllm import drive
from hybrid_rl.rollout.vllm import setup as S
from hybrid_rl.rollout.vllm.lora import AdapterPush
from hybrid_rl.rollout.vllm.lora import engine_kwargs as lora_engine_kwargs
from hybrid_rl.runtime import distributed as D
from hybrid_rl.types import Completion, PartialRequest, RankGroups, SamplingParams, WeightUpdates

SLEEP_LEVEL = 2


def to_completion(out: Any, index: int, stop_ids: Iterable[int] = ()) -> Completion:
    """vLLM's CompletionOutput -> Completion (stop token included, logprob i of token i, 'stop' | 'length')."""
    ids = list(out.token_ids)
    kind = out.finish_reason
    if kind not in ("stop", "length"):
        raise RuntimeError(f"vLLM did not finish request {index}: finish_reason={kind!r}")
    if kind == "length" and ids and ids[-1] in set(stop_ids):
        kind = "stop"  # as the native engine: a stop token at the length limit still stopped
    return Completion(token_ids=ids, logprobs=_logprobs(out, ids, index), finish_reason=kind)


def aborted_completion(out: Any, index: int) -> Completion:
    """A row a partial call stopped unfinished: its tokens and log-probs so far (vLLM's latest cumulative report;
    None: never scheduled, no token), finish_reason 'abort'."""
    if out is None:
        return Completion(token_ids=[], logprobs=[], finish_reason="abort")
    ids = list(out.token_ids)
    return Completion(token_ids=ids, logprobs=_logprobs(out, ids, index), finish_reason="abort")


def _logprobs(out: Any, ids: list[int], index: int) -> list[float]:
    lps = out.logprobs
    if lps is None or len(lps) != len(ids):
        raise RuntimeError(f"request {index}: vLLM returned no logprob for every token")
    flat = getattr(lps, "logprobs", None)  # FlatLogprobs: one entry per token when only the sampled one is asked
    if flat is not None and len(flat) == len(ids) and list(lps.token_ids) == ids:
        return list(flat)
    return [float(lp[t].logprob) for t, lp in zip(ids, lps)]  # list of {token: Logprob} (or top-k entries)


def build_requests(
    requests: list,
    stop_ids,
    device: torch.device,
    partials: Optional[Sequence[Optional[PartialRequest]]] = None,
    stepwise: bool = False,
) -> tuple[list, list, list, int]:
    """(vLLM prompts, their SamplingParams, their stop ids, the call's seed) for the group's requests, a list of
    (prompt ids, our SamplingParams) in rank order; `stop_ids(params)` gives a request's stop ids; `partials`: each
    rank's PartialRequest or None (its rows then take the SamplingParams' budget and minimum).

    On CPU one vLLM SamplingParams per rank's request and budget, shared by its prompts (vLLM copies it per request
    anyway), without a seed: the call's stream is seeded (module docstring, "Sampling stream"). On CUDA one per
    prompt, each with its own seed (setup.request_seeds), the same on every rank of the group. A row of a
    PartialRequest gets its own max_tokens / min_tokens; the seeds do not depend on them. Output kind: FINAL_ONLY
    (what LLM.generate asks) without a PartialRequest in the group, CUMULATIVE with one or when `stepwise` (an
    in-flight update reads each row's tokens so far: drive.py)."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    partials = list(partials) if partials is not None else [None] * len(requests)
    final = all(p is None for p in partials) and not stepwise
    kind = RequestOutputKind.FINAL_ONLY if final else RequestOutputKind.CUMULATIVE
    call_seed = S.group_seed(p.seed for _, p in requests)
    seeds = iter(S.request_seeds(call_seed, sum(len(ids) for ids, _ in requests), device))
    prompts, sampling, stops = [], [], []
    for (ids, p), part in zip(requests, partials):
        stop = stop_ids(p)
        fields = dict(
            temperature=0.0 if p.greedy else p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            stop_token_ids=stop,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=kind,
        )
        shared: dict[tuple[int, int], Any] = {}
        budgets = None if part is None else list(zip(part.max_new_tokens, part.min_new_tokens))
        for i, one in enumerate(ids):
            seed = next(seeds)
            hi, lo = (p.max_new_tokens, p.min_new_tokens) if part is None else budgets[i]
            if seed is None:
                if (hi, lo) not in shared:
                    shared[(hi, lo)] = VSP(**fields, max_tokens=hi, min_tokens=lo)
                sp = shared[(hi, lo)]
            else:
                sp = VSP(**fields, max_tokens=hi, min_tokens=lo, seed=seed)
            prompts.append(TokensPrompt(prompt_token_ids=one))
            sampling.append(sp)
            stops.append(stop)
    return prompts, sampling, stops, call_seed


@contextlib.contextmanager
def _quiet(name: str):
    """vLLM's CPU worker logs a warning at every sleep and wake (it ignores both): twice a step."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class VLLMEngine:
    """RolloutEngine over an in-process `vllm.LLM` (module docstring). LoRA: the adapter push it holds (lora.py),
    the base's names, sleep level 1 while an adapter is served (the base survives the release between rollouts),
    and what the phase switch calls (switch/phases.py `_sync_weights`): `base_synced`, then `update_adapter`."""

    adapter: Optional[AdapterPush] = None
    last_tail_s: Optional[float] = None  # what the last generate measured (generate's docstring)
    last_generated_tokens: Optional[int] = None
    last_cached_tokens: Optional[int] = None

    def __init__(
        self,
        model: torch.nn.Module,
        model_path: str,
        pad_id: int,
        eos_id: int,
        max_model_len: int,
        sequences: int,
        tp_size: int = 1,
        weights_dtype: Optional[torch.dtype] = None,
        kv_cache_bytes: Optional[int] = None,
        mem_fraction: Optional[float] = None,
        enable_prefix_caching: bool = False,
        seed: int = 0,
        timeout_s: int = 300,
        engine_kwargs: Optional[dict] = None,
    ):
        """sequences: the most sequences one generate call of this rank asks for (sizes the KV budget)."""
        S.check_importable()
        W, r = D.world_size(), D.rank()
        S.check_tp(tp_size, W, D.local_world_size())
        S.check_max_model_len(model_path, max_model_len)
        first = next(iter(model.parameters()))
        self.device = first.device if first.device.type != "meta" else torch.device("cpu")
        S.check_model(model_path, self.device)
        self.tp_size, self.pad_id, self.eos_id = tp_size, pad_id, eos_id
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        self.dtype = weights_dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.expected = self.base_shapes(model)  # HF names (with LoRA the frozen base's: lora.py)
        self._full_bytes = sum(torch.Size(s).numel() for s in self.expected.values()) * self.dtype.itemsize
        groups = [D.new_group(list(range(g, g + tp_size)), timeout_s) for g in range(0, W, tp_size)] if W > 1 else []
        self.group = groups[r // tp_size] if groups else None
        self.group_rank = r % tp_size
        group_sequences = sequences * tp_size
        needed = S.kv_bytes_needed(model_path, self.dtype, group_sequences, max_model_len, tp_size)
        use_fraction = self.device.type == "cuda" and mem_fraction is not None and kv_cache_bytes is None
        self.kv_bytes = 0 if use_fraction else S.kv_budget(kv_cache_bytes, needed, group_sequences)
        self._had_group = D.is_dist()
        self.released: set[str] = set()  # vLLM starts awake
        self._kv_paused = False
        self.session = False
        self.synced = False  # the engine holds dummy weights until the first complete sync
        self._sent: set[str] = set()
        self.sync_stats = {"bytes": 0, "buckets": 0}
        self.llm = self._start(
            model_path, max_model_len, group_sequences, mem_fraction, enable_prefix_caching, seed, engine_kwargs or {}
        )
        self.sleep_level = self.start_adapter(engine_kwargs or {}, SLEEP_LEVEL)  # LoRA: 1, the base survives
        cache = self.llm.llm_engine.vllm_config.cache_config
        if use_fraction:  # vLLM sized it: read back what it took
            per_block = S.kv_bytes_needed(model_path, self.dtype, 1, cache.block_size, tp_size, cache.block_size)
            self.kv_bytes = per_block * (cache.num_gpu_blocks or 0)
        self.release(["kv_cache", "weights"])  # the trainer has the memory until the first rollout

    # -- start-up -------------------------------------------------------------
    def _start(self, model_path, max_model_len, max_num_seqs, mem_fraction, prefix_caching, seed, extra):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
        os.environ[S.RUNNER_ENV] = "1" if S.model_runner_v2(self.device) else "0"  # setup.py: why pinned
        cuda = self.device.type == "cuda"
        args = dict(
            model=model_path,
            skip_tokenizer_init=True,
            load_format="dummy",
            tensor_parallel_size=self.tp_size,
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.dtype],
            max_model_len=max_model_len,
            max_num_seqs=max(1, max_num_seqs),
            seed=seed,
            enable_prefix_caching=prefix_caching,
            logprobs_mode="processed_logprobs",
            enforce_eager=not cuda,
            enable_sleep_mode=cuda,
        )
        if self.kv_bytes:
            args["kv_cache_memory_bytes"] = self.kv_bytes
        if cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            args["gpu_memory_utilization"] = S.cuda_memory_utilization(mem_fraction, self.kv_bytes, free, total)
        if D.world_size() > 1:
            args["distributed_executor_backend"] = "external_launcher"
        args.update(extra)
        from vllm import LLM

        with S.ProcessGuard() as guard:
            try:
                llm = LLM(**args)
            except Exception as err:
                raise RuntimeError(
                    f"vllm.LLM failed to start on {self.device}: {type(err).__name__}: {err}. Likely causes: a KV "
                    f"budget ({self.kv_bytes} bytes, rollout.kv_cache_bytes) or rollout.mem_fraction too small for one "
                    "sequence "
                    "of max_model_len tokens, not enough free memory, or a vLLM build for another device"
                ) from err
        self.process_changes = guard.changes
        runs_v2 = llm.llm_engine.vllm_config.use_v2_model_runner
        if runs_v2 != S.model_runner_v2(self.device):
            self.llm = llm
            self.shutdown()  # keeps the trainer's process group
            raise RuntimeError(
                f"vLLM runs Model Runner {'V2' if runs_v2 else 'V1'} on {self.device}, not the one the adapter seeds "
                f"its requests for ({S.RUNNER_ENV} is read once per process: an earlier engine, or a feature only "
                "one runner has, decided it); start the engine in a fresh process"
            )
        return llm

    @property
    def _worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    # -- memory ---------------------------------------------------------------
    @property
    def kv_cache_kept(self) -> bool:
        """True where release frees nothing (CPU): the ledger then counts the KV cache outside ROLLOUT too."""
        return self.device.type != "cuda"

    def memory_bytes(self) -> dict[str, int]:
        """This rank's share of the engine: 1/tp of the weights and its KV cache. On CPU sleep frees nothing,
        so both count whatever was released (the ledger must not claim memory that never came back)."""
        if self.device.type != "cuda":
            return {"engine_weights": self._full_bytes // self.tp_size, "kv_cache": self.kv_bytes}
        return {
            "engine_weights": 0 if "weights" in self.released else self._full_bytes // self.tp_size,
            "kv_cache": 0 if "kv_cache" in self.released else self.kv_bytes,
        }

    def resume(self, tags: Sequence[str]) -> None:
        check_tags(tags)
        if self.session and "kv_cache" in tags:
            raise RuntimeError("resume(['kv_cache']) inside a weight-update session; call end_weight_update() first")
        tags = [t for t in ("weights", "kv_cache") if t in tags and t in self.released]  # vLLM's order
        if not tags:
            return
        if "weights" in tags:
            self._sent = set()
            if self.sleep_level == 2:
                self.synced = False  # discarded: only a complete sync makes them valid again
        with _quiet("vllm.v1.worker.cpu_worker"):
            if self._kv_paused:  # the KV-only release below: a level-0 pause (+ the KV memory dropped on CUDA)
                self.llm.wake_up(["kv_cache", "scheduling"] if self.device.type == "cuda" else ["scheduling"])
                self._kv_paused = False
            else:
                self.llm.wake_up(tags if self.released - set(tags) else None)
        self.released -= set(tags)

    def release(self, tags: Sequence[str]) -> None:
        check_tags(tags)
        tags = [t for t in tags if t not in self.released]
        if not tags:
            return
        if self.session:
            raise RuntimeError("release inside a weight-update session; call end_weight_update() first")
        with _quiet("vllm.v1.worker.cpu_worker"):
            if "weights" in tags or "weights" in self.released:
                if "kv_cache" in self.released:  # only the KV cache was off (REWARD stage): wake it to sleep whole
                    self.resume(["kv_cache"])
                self.llm.sleep(level=self.sleep_level)
                self.released = {"weights", "kv_cache"}
                return
            self.llm.sleep(level=0)  # the KV cache alone (REWARD stage): pause, then drop its memory on CUDA
            if self.device.type == "cuda":
                self.llm.release_kv_cache_memory()
            self._kv_paused = True
            self.released.add("kv_cache")

    # -- weights --------------------------------------------------------------
    def begin_weight_update(self) -> None:
        if "weights" in self.released:
            raise RuntimeError(
                "begin_weight_update() while the engine's weights are released; resume(['weights']) first"
            )
        if self.session:
            raise RuntimeError("begin_weight_update() called twice")
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self._worker.vllm_config):
            initialize_layerwise_reload(self._worker.model_runner.get_model())
        self.session = True
        self.sync_stats = {"bytes": 0, "buckets": 0}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of (name, full tensor), HF names; every rank of a TP group passes the same bucket
        (each vLLM TP rank keeps its own slice of every tensor)."""
        if not self.session:
            raise RuntimeError("update_weights outside a weight-update session; call begin_weight_update() first")
        bucket = []
        for name, t in named_tensors:
            if name not in self.expected:
                raise KeyError(f"parameter {name!r} is not in the policy; vLLM would skip it silently")
            if tuple(t.shape) != self.expected[name]:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} != the model's {self.expected[name]}; send full tensors"
                )
            bucket.append((name, t.detach().to(self.device, self.dtype)))
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self._worker.vllm_config), torch.no_grad():
            self._worker.model_runner.get_model().load_weights(iter(bucket))
        self._sent.update(n for n, _ in bucket)
        self.sync_stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
        self.sync_stats["buckets"] += 1

    def end_weight_update(self) -> None:
        if not self.session:
            raise RuntimeError("end_weight_update() without begin_weight_update()")
        self._finish_reload()
        self._drop_prefix_cache()
        missing = sorted(set(self.expected) - self._sent)
        if missing:
            raise RuntimeError(
                f"weight sync incomplete: {len(missing)} parameters not sent (e.g. {missing[:3]}); "
                "the engine keeps stale or discarded weights until every parameter is sent"
            )
        self.synced = True

    def abort_weight_update(self) -> None:
        """Close a sync an exception interrupted (PhaseManager.recover): the layers vLLM parked on the meta
        device are put back; the weights are then partly updated, so generate refuses until a full sync."""
        if self.session:
            self._finish_reload()
            self._drop_prefix_cache()
            self.synced = False

    def _drop_prefix_cache(self) -> None:
        """New weights (a sync, an adapter push): the KV blocks vLLM's prefix cache keeps were computed under the old
        ones, and a prompt sharing their prefix (a carried sample continued from prompt + prefix, a group's prompt)
        would attend to them. vLLM's sleep at level >= 1 drops them too (v1/engine/core.py `sleep` ->
        `pause_scheduler(clear_cache=True)`), but a sync need not follow one (the REWARD stage's level-0 pause, a
        sync without a release). Within one rollout the weights do not change and the cache is kept."""
        if not self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
            return
        if not self.llm.reset_prefix_cache():  # refused while a request holds blocks: none may, between calls
            raise RuntimeError("vLLM refused to reset its prefix cache: a request still holds KV blocks")

    def _finish_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self.session = False
        worker = self._worker
        model = worker.model_runner.get_model()
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            finalize_layerwise_reload(model, worker.model_config)
            _repack_tied_head(model)

    # -- generation -----------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        partial: Optional[PartialRequest] = None,
        updates: Optional[WeightUpdates] = None,
    ) -> list[Completion]:
        """This rank's completions, in order (module docstring). partial: per-row budgets and the early stop
        ("Partial rollouts"); its unfinished rows come back "abort" with their tokens so far.

        Sets `last_tail_s` (seconds of the engine's loop with fewer than half of the group's rows unfinished: the
        engine decodes the whole TP group's rows, so every rank of a group reports the same), `last_generated_tokens`
        (tokens sampled for this rank's rows; summed over ranks each row counts once) and `last_cached_tokens`
        (prompt tokens of this rank's rows served from vLLM's prefix cache).

        updates (trainer.inflight_update=continue): weight versions taken between engine steps (drive.py), the call
        asks for CUMULATIVE outputs even without a PartialRequest; `last_update_marks` says where (types.WeightUpdates).
        One engine per rank only (tp_size 1: the ranks of a group would poll apart), refused before this by the
        config (config/schema.py)."""
        self.last_tail_s, self.last_generated_tokens, self.last_cached_tokens = None, None, None
        self.last_update_marks: list[list[int]] = []
        if updates is not None and self.tp_size > 1:
            raise ValueError("in-flight weight updates need one engine per rank (rollout.tp_size=1)")
        if self.released:
            raise RuntimeError(
                f"engine memory is released ({sorted(self.released)}); resume(['weights', 'kv_cache']) first"
            )
        if self.session:
            raise RuntimeError("generate inside a weight-update session; call end_weight_update() first")
        if not self.synced:
            raise RuntimeError(
                "the engine holds no synced weights (never synced, or the last sync failed); "
                "enter the rollout phase, which sends them"
            )
        request = (list(map(list, prompt_ids)), params, partial)
        group = [request]
        if self.tp_size > 1:  # the whole group generates the same requests (external_launcher's rule)
            group = [None] * self.tp_size
            torch.distributed.all_gather_object(group, request, group=self.group)
        for ids, p, part in group:  # every rank checks the whole group's requests: a refusal is the group's
            if any(len(one) == 0 for one in ids):
                raise ValueError("every prompt needs at least one token")
            if part is not None:
                part.check(len(ids), p)
        requests, partials = [(ids, p) for ids, p, _ in group], [part for _, _, part in group]
        prompts, sampling, stops, call_seed = build_requests(
            requests, self._stop_ids, self.device, partials, stepwise=updates is not None
        )
        start = sum(len(ids) for ids, _ in requests[: self.group_rank])
        rows = slice(start, start + len(prompt_ids))  # this rank's
        # Every call drives vLLM's engine loop itself (drive.py): the same requests and steps as `LLM.generate`, which
        # samples the same tokens (test_vllm_partial.py), and the loop sees the rollout's tail on the way.
        stop = (
            None if all(part is None for part in partials) else RankGroups(partials, [len(ids) for ids, _ in requests])
        )
        with S.sampling_stream(call_seed, self.device):
            run = drive.run(self.llm, prompts, sampling, self.lora_request, stop, updates)
        self.last_update_marks = run.update_marks
        completions = [
            to_completion(out, i, stops[i]) if done else aborted_completion(out, i)
            for i, (out, done) in enumerate(zip(run.outputs, run.finished))
        ]
        tail, cached = run.tail_s, run.cached_tokens
        own = completions[rows]
        self.last_tail_s = tail
        self.last_generated_tokens = sum(len(c.token_ids) for c in own)
        self.last_cached_tokens = sum(cached[rows])
        return own

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        # Without a tokenizer vLLM knows no EOS of the trainer's: it is passed as a stop id, as in SGLang.
        stops = sorted({*p.stop_token_ids, *([self.eos_id] if self.eos_id is not None and self.eos_id >= 0 else [])})
        bad = [t for t in stops if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary (0..{self.vocab_size - 1})")
        return stops

    # -- LoRA (lora.py) ------------------------------------------------------
    @staticmethod
    def base_shapes(model: torch.nn.Module) -> dict[str, tuple]:
        """HF name -> shape of what a full sync sends: the frozen base's names with LoRA (models.lora)."""
        from hybrid_rl.models.lora import base_named_parameters

        return {n: tuple(p.shape) for n, p in base_named_parameters(model)}

    def start_adapter(self, engine_kwargs: dict, sleep_level: int) -> int:
        """The adapter push when the engine was started with `engine_kwargs(rank)`; returns the sleep level to use."""
        self.adapter = AdapterPush(self.llm) if engine_kwargs.get("enable_lora") else None
        return sleep_level if self.adapter is None else 1

    @property
    def base_synced(self) -> bool:
        """The engine holds a complete base (level 1 keeps it across sleeps; level 2 clears `synced` at wake)."""
        return self.synced

    @property
    def lora_request(self):
        """What each generate call passes: the pushed adapter's request, or None (no adapter yet: the base)."""
        return self.adapter.request if self.adapter is not None and self.adapter.version else None

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> int:
        """Push the policy's adapter (peft names, full tensors); returns its bytes, counted in `sync_stats`."""
        if self.adapter is None:
            raise RuntimeError(
                "this vLLM engine was started without LoRA (engine_kwargs(rank)); model.lora.rank "
                "must be set when the engine is built"
            )
        if "weights" in self.released:
            raise RuntimeError("update_adapter() while the engine's weights are released; resume(['weights']) first")
        sent = self.adapter.push(named_tensors, config)
        self._drop_prefix_cache()
        self.sync_stats["bytes"] += sent
        return sent

    # -- end ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine before the process group goes (vLLM's exit hook would destroy vLLM's groups after it).
        vLLM's shutdown destroys the default group too; a group the trainer made before the engine is kept."""
        if self.llm is None:
            return
        import torch.distributed as dist

        keep = self._had_group and dist.is_initialized()
        destroy = dist.destroy_process_group
        if keep:
            dist.destroy_process_group = lambda *a, **k: None
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = destroy
            self.llm = None


def check_config(cfg, device: torch.device) -> None:
    """The checks that need no model (Trainer.__init__, before the policy is built)."""
    S.check_importable()
    S.check_tp(cfg.rollout.tp_size, D.world_size(), D.local_world_size())
    S.check_model(cfg.model.path, device)


def build_for_trainer(
    cfg, policy: torch.nn.Module, tok, longest: int, has_val: bool, weights_dtype: Optional[torch.dtype]
) -> VLLMEngine:
    """The engine: max_model_len = `longest` (kept prompt) + rollout.max_new_tokens, or with an environment
    rollout.max_episode_tokens (vLLM caps a sample there); KV for the largest call a rank makes x that length.

    With rollout.partial a call holds every sample of the groups in flight (loop/partial.py: ceil(partial_over x the
    rank's data.batch_size groups), of rollout.n samples each); a continued row is prompt + carried prefix and asks
    for at most max_new_tokens less that prefix, so max_model_len stays the same."""
    r = cfg.rollout
    W = D.world_size()
    train = cfg.data.batch_size * r.n // W
    if getattr(r, "partial", False):
        train = partial_rows(cfg.data.batch_size // W, getattr(r, "partial_over", 1.0), r.n)
    val = -(-(cfg.data.val_batch_size or cfg.data.batch_size) // W) * max(r.n, 1) if has_val else 0
    return VLLMEngine(
        policy,
        cfg.model.path,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        max_model_len=r.max_episode_tokens if cfg.env.enabled else longest + r.max_new_tokens,
        sequences=max(train, val),
        tp_size=r.tp_size,
        weights_dtype=weights_dtype,
        kv_cache_bytes=r.kv_cache_bytes,
        mem_fraction=r.mem_fraction,
        enable_prefix_caching=r.enable_prefix_caching,
        seed=r.seed,
        timeout_s=r.engine_timeout_s,
        engine_kwargs={
            **(lora_engine_kwargs(cfg.model.lora.rank) if cfg.model.lora.enabled else {}),
            **({} if r.enforce_eager is None else {"enforce_eager": r.enforce_eager}),
        },
    )


def partial_rows(batch_groups: int, over: float, n: int) -> int:
    """The most rows one partial-rollout call of a rank holds: the groups in flight (loop/partial.py
    `PartialRollouts.in_flight`, the same rule: at least a batch) x rollout.n samples."""
    return max(batch_groups, math.ceil(over * batch_groups)) * n


def _repack_tied_head(model: torch.nn.Module) -> None:
    """A head tied to the embedding receives no weight of its own in a reload (load_weights skips lm_head.*),
    so vLLM never re-processes it; on CPU that processing packs a private copy of the weight for its GEMM
    (dispatch_cpu_unquantized_gemm), which would stay the first sync's: greedy output then follows a stale
    head. Processing it again repacks the (shared, already updated) weight; elsewhere it is a no-op."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
