"""Memory planner for colocated RL post-training (pure functions, no torch import).

Given a model architecture, the number of GPUs, the dtype, the rollout batch and
context length and the offload flags, it bills each memory *role* per GPU and
sums the roles resident in each *phase*, so that a run can be sized before it
starts and the runtime memory ledger (same role names) can be compared with it.

Parameter counts and architectures: ``plan/arch.py`` (re-exported here).

Bytes per role (b = dtype bytes: 2 for bf16/fp16, 4 for fp32; G GPUs; tp
rollout tensor-parallel size; R = G/tp rollout data-parallel ranks):

  role            whole model              per GPU
  policy_weights  6N (b=2: bf16 2N +       /G  (FSDP shards all learner state)
                  fp32 master 4N); 4N fp32
  grads           2N (b=2); 4N fp32        /G
  optimizer       8N (Adam m + v, fp32)    /G      -> learner = 16N either way
  ref             b*N                      /G
  reward_model    b*N_rm (second model)    /G
  critic          6N_c (b=2) / 4N_c fp32   /G  (PPO: a second learner; its grads in the grads row,
  critic_optimizer 8N_c                    /G   2N_c / 4N_c: 16N_c with them)
  engine_weights  b*N (one copy; R copies  /tp (each rank holds a TP slice)
                  on the node)
  kv_cache        2*L*K*d*b per token      * ceil(batch/R)*context tokens,
                                           * ceil(K/tp)/K (heads split over tp)

LoRA (``lora_params`` A > 0, models/lora.py): the base is frozen in the inference dtype and the
adapters train in fp32, so policy_weights = b*N + 4A, grads = 4A, optimizer = 8A (Adam for the
adapters only): learner b*N + 16A; ref = 0 (the policy with its adapters off); engine_weights
+ b*A (the engine's adapter copy).

Margin: no plan may use the last `margin_bytes(cap)` of a GPU, MARGIN_FIXED_GIB plus
MARGIN_FRACTION of it, and a phase "fits" only at or below cap - margin ("usable"). Why
those numbers: memory the caching allocator never sees. The CUDA context with torch's
kernels and the cuBLAS/cuDNN handles takes about 0.5-1 GiB before the first tensor (781 MB
for an empty process in pytorch/pytorch#34323; PyTorch's "Understanding CUDA Memory Usage"
names NCCL as allocating outside the allocator); NCCL holds NCCL_BUFFSIZE (4 MiB by
default) per channel, peer and protocol, a few hundred MiB per communicator, and a run has
several (FSDP's, the engine's TP group); hence 2 GiB fixed. Fragmentation grows with the
device (the allocator's cached but unusable blocks), hence 5% of it, the share the native
engine already leaves unplanned at run time (rollout_memory.HEADROOM). 80 GiB: 6 GiB.

"total" = per GPU x G (memory used on all GPUs together).  The "bill" is the
whole-model view: learner 16N, reference b*N, inference copy b*N (one copy);
for a 70e9-param bf16 policy that is 1120 GB, 140 GB and 140 GB.

Phase residency (a role is on the GPU in a phase if the phase uses it, or if it
is not offloaded; grads and the engine's weights and KV cache are freed outside
the phase that uses them):

  role            train  rollout  reward  score   offload flag that parks it on CPU
  policy_weights  yes    flag     flag    yes     params
  grads           yes    -        -       -       (freed after the optimizer step)
  optimizer       yes    flag     flag    flag    optimizer
  engine_weights  -      yes      yes     -       (engine sleeps / is released)
  kv_cache        -      yes      -       -       (engine sleeps / is released)
  ref             flag   flag     flag    yes     ref
  reward_model    flag   flag     yes     flag    reward_model
  critic          yes    flag     flag    yes     critic
  critic_optimizer yes   flag     flag    flag    critic_optimizer

("flag": resident unless that offload flag is set.)  SGLang (``engine="sglang"`` with
``mem_fraction``) sizes its KV pool once, at start-up: mem_fraction_static of the memory free then
less its weights (SGLang's model_runner: rest = available - total * (1 - mem_fraction_static)),
so kv_cache is that pool, whole, not the batch's need; free at start = the GPU less the margin
and the roles resident in ROLLOUT but the optimizer state (AdamW makes it at the first step, after
the engine started: switch/advice.sglang_kv_room_warning). Without mem_fraction SGLang picks its own
fraction and the row bills one batch (a note says so).  "reward" is the REWARD stage
nested in ROLLOUT (switch/phases.py): the engine keeps its weights, its KV cache is
released, the reward model is onloaded; only a run with a reward model enters it (without
one, ``phases["reward"]`` is empty: it holds nothing because it never happens).  Optionally the train phase
also holds ``activations_estimate`` (an ESTIMATE, gradient checkpointing
assumed; see ``activation_estimate``).  Sizes are decimal GB (1e9 bytes) in
printed output; GPU capacity is given in GiB (80 GiB default).
The native engine (``native_prompt_tokens`` > 0) decodes as many rows at once as the rollout
phase leaves room for, and bills the prefill, sampling and graph pools (``rollout_memory.py``).
vLLM (``engine="vllm"``) holds its own weight copy (engine_weights, as above) and the KV cache it
allocated at start-up, whole: ``rollout_memory.vllm_kv_budget`` (the configured bytes, what its
``mem_fraction`` of the device leaves beside its weights, or one batch of ``context`` tokens in
whole blocks of 128); the adapter sizes it with the same function.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

# The architecture half of the planner; callers name these through plan.memory as well.
from hybrid_rl.plan.arch import (  # noqa: F401
    BUILTIN_ARCHS,
    DTYPE_BYTES,
    ModelArch,
    builtin_arch,
    count_parameters,
    critic_param_count,
    dtype_bytes,
    load_arch,
)
from hybrid_rl.plan.rollout_memory import HEADROOM, bill_native_rollout, bill_sglang_kv, bill_vllm_kv

# The one definition of the memory roles: the runtime ledger (switch/memory.py) imports it
# from here, because this module is torch-free and the ledger is not.
ROLES = (
    "policy_weights",
    "grads",
    "optimizer",
    "engine_weights",
    "kv_cache",
    "ref",
    "reward_model",
    "critic",
    "critic_optimizer",
)
PHASES = ("train", "rollout", "reward", "score")
OFFLOAD_FLAGS = ("optimizer", "ref", "reward_model", "params", "critic_optimizer", "critic")  # the suggestion order
GB = 10**9
GIB = 2**30
MARGIN_FIXED_GIB = 2.0  # CUDA context + NCCL buffers per GPU (module docstring: why)
MARGIN_FRACTION = HEADROOM  # fragmentation: the share of the device the native engine leaves unplanned


def margin_bytes(cap: int) -> int:
    """Bytes of a GPU of `cap` bytes that no plan uses (module docstring: why these numbers)."""
    return int(MARGIN_FIXED_GIB * GIB + MARGIN_FRACTION * cap)


CRITIC_ROLES = ("critic", "critic_optimizer")

# role -> (phases that use it, offload flag that parks it on CPU otherwise; None = freed)
RESIDENCY: dict[str, tuple[frozenset, str | None]] = {
    "policy_weights": (frozenset({"train", "score"}), "params"),
    "grads": (frozenset({"train"}), None),
    "optimizer": (frozenset({"train"}), "optimizer"),
    "engine_weights": (frozenset({"rollout", "reward"}), None),
    "kv_cache": (frozenset({"rollout"}), None),
    "ref": (frozenset({"score"}), "ref"),
    "reward_model": (frozenset({"reward"}), "reward_model"),
    # PPO's critic (issue 36): its weights in SCORE (values) and TRAIN, its Adam state in TRAIN.
    "critic": (frozenset({"score", "train"}), "critic"),
    "critic_optimizer": (frozenset({"train"}), "critic_optimizer"),
}


def kv_cache_bytes(arch: ModelArch, dtype: str, batch: int, context: int, n_gpus: int = 1, tp_size: int = 1) -> int:
    """KV-cache bytes per GPU: 2*L*K*d*b per token, ceil(batch/R)*context tokens per
    rollout DP rank (R = n_gpus/tp), KV heads split over tp (replicated when tp > K)."""
    _positive(batch=batch, context=context, n_gpus=n_gpus, tp_size=tp_size)
    if not arch.has_kv_dims:
        return 0
    dp = n_gpus // tp_size
    tokens = math.ceil(batch / dp) * context
    return 2 * arch.num_hidden_layers * math.ceil(arch.kv_heads / tp_size) * arch.head_dim * tokens * dtype_bytes(dtype)


# The chunked LM head's sizes (kernels/lm_head.py, which imports torch; a test keeps these equal to its own).
_HEAD_CHUNK_BYTES = 256 * 2**20  # at most one fp32 (C, V) chunk of logits
_HEAD_ONE_CHUNK_BYTES = 32 * 2**20  # below this, all rows in one chunk
_HEAD_MIN_CHUNKS = 4


def activation_parts(
    arch: ModelArch, dtype: str, micro_batch: int, context: int, checkpointing: bool = True
) -> dict[str, int]:
    """ESTIMATE of training activations per GPU for `micro_batch` sequences of `context` tokens, by part.

    saved: what the forward keeps for the backward. Per token, without checkpointing each
      layer keeps (4+b)*h*2 for its two RMSNorms (fp32 input copy and the normed output)
      plus b*(6q + 2kv + 4I) (q = H*d, kv = K*d: rotary inputs, attention inputs with the
      KV heads repeated, its output twice, four I-wide MLP tensors); with checkpointing
      each layer keeps its input only (b*h). The final norm and the head's input add
      (4+2b)*h. Measured on CPU in tests/unit/models/test_gradient_checkpointing.py.
    recompute: with checkpointing, one layer's activations exist again during its backward.
    head: the chunked LM head's logits (about 2.25 fp32 chunks, kernels/lm_head.py); never
      the whole (tokens, V) logits.
    All 0 when micro_batch is 0 or dims are unknown.
    """
    if micro_batch <= 0 or not arch.hidden_size:
        return {"saved": 0, "recompute": 0, "head": 0}
    b, h, n_layers = dtype_bytes(dtype), arch.hidden_size, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.kv_heads * arch.head_dim
    tokens = micro_batch * context
    layer = 2 * (4 + b) * h + b * (6 * q + 2 * kv + 4 * arch.intermediate_size)
    per_token = n_layers * (b * h if checkpointing else layer) + (4 + 2 * b) * h
    logits = 4 * arch.vocab_size * tokens
    chunk = logits if logits <= _HEAD_ONE_CHUNK_BYTES else min(_HEAD_CHUNK_BYTES, logits // _HEAD_MIN_CHUNKS)
    return {"saved": tokens * per_token, "recompute": tokens * layer if checkpointing else 0, "head": 9 * chunk // 4}


def activation_estimate(arch: ModelArch, dtype: str, micro_batch: int, context: int, checkpointing: bool = True) -> int:
    """ESTIMATE of the peak training activations per GPU (gradient checkpointing assumed unless
    told otherwise): the sum of `activation_parts`. 0 when micro_batch is 0 or dims are unknown."""
    return sum(activation_parts(arch, dtype, micro_batch, context, checkpointing).values())


def phase_residency(per_gpu: Mapping[str, int], offload: Mapping[str, bool]) -> dict[str, dict[str, int]]:
    """phase -> {role: bytes} of the roles on the GPU in that phase (RESIDENCY rules); a run without PPO's critic
    has no critic roles at all."""
    out: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        out[phase] = {}
        for role in ROLES:
            if role in CRITIC_ROLES and not per_gpu.get(role):
                continue
            used_in, flag = RESIDENCY[role]
            if phase in used_in or (flag is not None and not offload.get(flag, False)):
                out[phase][role] = int(per_gpu.get(role, 0))
    return out


def _positive(**kw: float) -> None:
    for k, v in kw.items():
        if v is None or v <= 0:
            raise ValueError(f"{k} must be a positive number, got {v!r}")


def normalize_offload(offload: Mapping[str, bool] | None) -> dict[str, bool]:
    offload = dict(offload or {})
    unknown = sorted(set(offload) - set(OFFLOAD_FLAGS))
    if unknown:
        raise ValueError(f"unknown offload flag(s) {', '.join(unknown)}; valid: {', '.join(OFFLOAD_FLAGS)}")
    return {k: bool(offload.get(k, False)) for k in OFFLOAD_FLAGS}


@dataclass
class MemoryPlan:
    model: str
    n_params: int
    reward_params: int
    n_gpus: int
    tp_size: int
    dtype: str
    batch: int
    context: int
    gpu_mem_bytes: int
    offload: dict[str, bool]
    per_gpu: dict[str, int]  # role -> bytes on each GPU
    total: dict[str, int]  # role -> bytes summed over all GPUs
    phases: dict[str, dict[str, int]]  # phase -> role -> resident bytes per GPU
    phase_totals: dict[str, int]
    fits: dict[str, bool]
    shortfall: dict[str, int]  # phase -> bytes missing (0 if it fits)
    bill: dict[str, int]  # whole-model view: learner, ref, engine_copy, reward_model, engine_replicas
    activations_estimate: int = 0
    gradient_checkpointing: bool = True  # what activations_estimate assumed
    notes: list[str] = field(default_factory=list)
    # Native engine only: rows (decode batch), rows_wanted (a rank's share), prefill_rows and each part's bytes.
    native_rollout: dict[str, int] = field(default_factory=dict)
    lora_params: int = 0  # adapter parameters of a LoRA run (0: the whole policy trains)
    margin_bytes: int = 0  # of gpu_mem_bytes no phase may use (margin_bytes())
    engine: str = "native"
    mem_fraction: float | None = None  # sglang / vllm: rollout.mem_fraction as planned

    @property
    def usable_bytes(self) -> int:
        """What a phase may use per GPU: the capacity less the margin."""
        return self.gpu_mem_bytes - self.margin_bytes

    @property
    def fits_all(self) -> bool:
        return all(self.fits.values())

    def worst_phase(self) -> str:
        return max(PHASES, key=lambda p: self.phase_totals[p] - self.usable_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits_all"] = self.fits_all
        return d


def plan_memory(
    arch: ModelArch,
    n_gpus: int,
    dtype: str,
    batch: int,
    context: int,
    offload: Mapping[str, bool] | None = None,
    tp_size: int = 1,
    reward_arch: ModelArch | None = None,
    gpu_mem_gib: float = 80.0,
    train_micro_batch: int = 0,
    native_prompt_tokens: int = 0,
    native_top_p: bool = True,
    native_graphs: bool = True,
    native_samples_per_prompt: int = 1,
    gradient_checkpointing: bool = True,
    engine: str = "native",
    kv_cache_budget: int | None = None,
    mem_fraction: float | None = None,
    lora_params: int = 0,
    critic_arch: ModelArch | None = None,
) -> MemoryPlan:
    """Per-role bytes per GPU, per-phase residency and fit flags (module docstring). native_*: the
    native engine's rollout: prompt tokens, sampler, decode path, samples sharing a prefill (`rollout_memory.py`).
    gradient_checkpointing: model.gradient_checkpointing (the activation estimate without it is several times larger).
    engine: rollout.engine; "vllm" bills the KV cache vLLM allocates, from kv_cache_budget (rollout.kv_cache_bytes,
    per GPU) or mem_fraction (rollout.mem_fraction, its gpu_memory_utilization), else from batch and context;
    "sglang" with mem_fraction bills the pool SGLang sizes at start-up (module docstring).
    lora_params: the adapter parameters of a LoRA run (plan.arch.lora_param_count; 0 = the whole policy trains).
    critic_arch: PPO's critic (algorithm.advantage=gae): a second learner, 16N_c like the policy's, its weights
    in SCORE and TRAIN, its Adam state in TRAIN, its gradients in the grads row."""
    _check_plan_args(
        n_gpus=n_gpus,
        batch=batch,
        context=context,
        gpu_mem_gib=gpu_mem_gib,
        tp_size=tp_size,
        train_micro_batch=train_micro_batch,
        engine=engine,
        kv_cache_budget=kv_cache_budget,
        mem_fraction=mem_fraction,
        native_prompt_tokens=native_prompt_tokens,
    )
    off = normalize_offload(offload)
    b = dtype_bytes(dtype)
    n = count_parameters(arch)
    n_rm = count_parameters(reward_arch) if reward_arch is not None else 0
    n_c = critic_param_count(critic_arch) if critic_arch is not None else 0
    cap = int(gpu_mem_gib * GIB)
    margin = margin_bytes(cap)
    per_gpu, notes = _role_bytes_per_gpu(
        arch,
        dtype,
        n,
        n_rm,
        batch,
        context,
        n_gpus,
        tp_size,
        cap,
        engine,
        kv_cache_budget,
        mem_fraction,
        lora_params,
        n_c,
    )
    phases = phase_residency(per_gpu, off)
    if reward_arch is None:
        phases["reward"] = {}  # rule rewards: the run never enters the REWARD stage
    if engine == "sglang" and arch.has_kv_dims:
        notes += bill_sglang_kv(per_gpu["kv_cache"], cap - margin, mem_fraction, per_gpu, phases["rollout"])
    act = activation_estimate(arch, dtype, train_micro_batch, context, checkpointing=gradient_checkpointing)
    if act:
        phases["train"]["activations_estimate"] = act
    native = {}
    if native_prompt_tokens:
        native = bill_native_rollout(
            arch,
            dtype,
            math.ceil(batch * tp_size / n_gpus),
            native_prompt_tokens,
            context - native_prompt_tokens,
            phases["rollout"],
            cap - margin,
            native_top_p,
            native_graphs,
            native_samples_per_prompt,
        )
        per_gpu["kv_cache"] = native["kv_cache"]
    totals = {p: sum(phases[p].values()) for p in PHASES}
    notes += _arch_notes(arch, context, tp_size)
    return MemoryPlan(
        model=arch.name,
        n_params=n,
        reward_params=n_rm,
        n_gpus=n_gpus,
        tp_size=tp_size,
        dtype=dtype,
        batch=batch,
        context=context,
        gpu_mem_bytes=cap,
        offload=off,
        per_gpu=per_gpu,
        gradient_checkpointing=gradient_checkpointing,
        total={r: v * n_gpus for r, v in per_gpu.items()},
        phases=phases,
        phase_totals=totals,
        fits={p: totals[p] <= cap - margin for p in PHASES},
        shortfall={p: max(0, totals[p] - (cap - margin)) for p in PHASES},
        bill={
            "learner": b * n + 16 * lora_params if lora_params else 16 * n,
            "ref": 0 if lora_params else b * n,
            "engine_copy": b * (n + lora_params),
            "reward_model": b * n_rm,
            **({"critic": 16 * n_c} if n_c else {}),
            "engine_replicas": n_gpus // tp_size,
        },
        activations_estimate=act,
        notes=notes,
        native_rollout=native,
        lora_params=lora_params,
        margin_bytes=margin,
        engine=engine,
        mem_fraction=mem_fraction,
    )


def _check_plan_args(
    *,
    n_gpus: int,
    batch: int,
    context: int,
    gpu_mem_gib: float,
    tp_size: int,
    train_micro_batch: int,
    engine: str,
    kv_cache_budget: int | None,
    mem_fraction: float | None,
    native_prompt_tokens: int,
) -> None:
    """Raise ValueError naming the first `plan_memory` argument out of range or at odds with `engine`."""
    _positive(n_gpus=n_gpus, batch=batch, context=context, gpu_mem_gib=gpu_mem_gib, tp_size=tp_size)
    for k, v in (("n_gpus", n_gpus), ("batch", batch), ("context", context), ("tp_size", tp_size)):
        if int(v) != v:
            raise ValueError(f"{k} must be an integer, got {v!r}")
    if n_gpus % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide n_gpus={n_gpus}")
    if train_micro_batch < 0:
        raise ValueError(f"train_micro_batch must be >= 0, got {train_micro_batch}")
    if engine not in ("native", "sglang", "vllm"):
        raise ValueError(f"engine must be native, sglang or vllm, got {engine!r}")
    if engine != "vllm" and kv_cache_budget is not None:
        raise ValueError("kv_cache_budget sizes vLLM's KV cache; pass engine='vllm' with it")
    if engine == "native" and mem_fraction is not None:
        raise ValueError("mem_fraction sizes SGLang's or vLLM's KV cache; the native engine decodes what fits")
    if native_prompt_tokens and engine != "native":
        raise ValueError(f"native_prompt_tokens bills the native engine's rollout, not engine={engine!r}")


def _role_bytes_per_gpu(
    arch: ModelArch,
    dtype: str,
    n: int,
    n_rm: int,
    batch: int,
    context: int,
    n_gpus: int,
    tp_size: int,
    cap: int,
    engine: str,
    kv_cache_budget: int | None,
    mem_fraction: float | None,
    lora_params: int = 0,
    n_critic: int = 0,
) -> tuple[dict[str, int], list[str]]:
    """Bytes per GPU of each role in ROLES order (the module docstring's table), for a policy of n and
    a reward model of n_rm parameters; and vLLM's note on how its KV cache was sized, if any.

    The learner's roles, the reference and the reward model are sharded over all n_gpus; the engine's
    weights over tp_size. The KV cache is one batch of `context` tokens (`kv_cache_bytes`), or what
    vLLM allocates (`bill_vllm_kv`, with cap the GPU's bytes)."""
    b = dtype_bytes(dtype)
    mixed = b == 2
    whole = {
        "policy_weights": (6 if mixed else 4) * n,
        "grads": b * n,
        "optimizer": 8 * n,
        "ref": b * n,
        "reward_model": b * n_rm,
        "critic": (6 if mixed else 4) * n_critic,
        "critic_optimizer": 8 * n_critic,
    }
    if lora_params:  # the module docstring's LoRA line
        whole.update(policy_weights=b * n + 4 * lora_params, grads=4 * lora_params, optimizer=8 * lora_params, ref=0)
    whole["grads"] += b * n_critic  # the critic's gradients live (and are freed) with the policy's
    per_gpu = {r: math.ceil(v / n_gpus) for r, v in whole.items()}
    per_gpu["engine_weights"] = math.ceil(b * (n + lora_params) / tp_size)
    per_gpu["kv_cache"] = kv_cache_bytes(arch, dtype, batch, context, n_gpus, tp_size)
    notes = []
    if engine == "vllm" and arch.has_kv_dims:
        per_gpu["kv_cache"], note = bill_vllm_kv(
            arch, dtype, batch, context, n_gpus, tp_size, kv_cache_budget, mem_fraction, cap, per_gpu["engine_weights"]
        )
        notes += [note] if note else []
    return {r: per_gpu[r] for r in ROLES}, notes


def _arch_notes(arch: ModelArch, context: int, tp_size: int) -> list[str]:
    """Warnings about the architecture: KV dims unknown, context past its positions, more TP ranks than KV heads."""
    notes = []
    if not arch.has_kv_dims:
        notes.append(
            "kv_cache not computed: give the layer count, KV heads and head_dim (--layers --kv-heads --head-dim)"
        )
    if arch.max_position_embeddings and context > arch.max_position_embeddings:
        notes.append(f"context {context} exceeds max_position_embeddings {arch.max_position_embeddings}")
    if tp_size > arch.kv_heads > 0:
        notes.append(f"tp_size {tp_size} > {arch.kv_heads} KV heads: KV heads are replicated across TP ranks")
    return notes


def suggest_offload(
    arch: ModelArch,
    n_gpus: int,
    dtype: str,
    batch: int,
    context: int,
    offload: Mapping[str, bool] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Smallest set of extra offload flags (ties broken in the order optimizer, ref,
    reward_model, params) on top of `offload` that makes every phase fit.

    Returns {"fits", "offload" (full flags), "added" (list), "phase", "shortfall_bytes",
    "message"}; when nothing fits, "phase"/"shortfall_bytes" name the worst phase
    with every flag set."""
    base = normalize_offload(offload)
    absent = {"reward_model"} if kw.get("reward_arch") is None else set()
    absent |= {"critic", "critic_optimizer"} if kw.get("critic_arch") is None else set()
    cands = [f for f in OFFLOAD_FLAGS if not base[f] and f not in absent]
    subsets = sorted(
        (tuple(f for j, f in enumerate(cands) if m >> j & 1) for m in range(1 << len(cands))),
        key=lambda s: (len(s), [OFFLOAD_FLAGS.index(f) for f in s]),
    )
    plan = None
    for s in subsets:
        flags = {**base, **{f: True for f in s}}
        plan = plan_memory(arch, n_gpus, dtype, batch, context, flags, **kw)
        if plan.fits_all:
            msg = (
                "no offload needed"
                if not s and not any(base.values())
                else ("offload " + ", ".join(f for f in OFFLOAD_FLAGS if flags[f]))
            )
            return {
                "fits": True,
                "offload": flags,
                "added": list(s),
                "phase": None,
                "shortfall_bytes": 0,
                "message": msg,
            }
    assert plan is not None  # the last subset sets every flag
    phase = plan.worst_phase()
    short = plan.shortfall[phase]
    return {
        "fits": False,
        "offload": plan.offload,
        "added": [],
        "phase": phase,
        "shortfall_bytes": short,
        "message": f"nothing fits: {phase} is short by {short / GB:.2f} GB per GPU even with every "
        "offload flag set; use more GPUs, a larger tp_size, a smaller batch or context",
    }
