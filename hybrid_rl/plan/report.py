"""The printed plan: the run's header, the roles x phases table, each phase's fit, the native engine's decode
batch, the notes and the suggested offload (torch-free; `python -m hybrid_rl.plan`, the recipes' --dry-run and
the trainer's start-up print it)."""

from __future__ import annotations

from hybrid_rl.plan.arch import DTYPE_BYTES
from hybrid_rl.plan.fixes import Fix
from hybrid_rl.plan.memory import CRITIC_ROLES, GB, OFFLOAD_FLAGS, PHASES, RESIDENCY, ROLES, MemoryPlan


def _gb(x: int) -> str:
    return f"{x / GB:,.2f}"


def shown_phases(plan: MemoryPlan) -> tuple[str, ...]:
    """The phases a run goes through: REWARD only with a reward model (rule rewards need no device memory)."""
    return PHASES if plan.reward_params else tuple(p for p in PHASES if p != "reward")


def format_plan(plan: MemoryPlan, suggestion: dict, fixes: list | None = None) -> str:
    """The printed report: the run's header, the roles x phases table, each phase's fit, the native
    engine's decode batch, the notes, the suggested offload (`suggest_offload`'s result) and, when a
    phase does not fit, the ranked `fixes` (plan.fixes.search_fixes) if given."""
    phases = shown_phases(plan)
    lines = _header_lines(plan) + [""] + _table_lines(plan, phases) + [""] + _fit_lines(plan, phases)
    lines += native_rollout_lines(plan) + _note_lines(plan)
    lines.append(_suggestion_line(plan, suggestion))
    if fixes is not None and not plan.fits_all:
        lines += fix_lines(fixes, short_by(plan))
    return "\n".join(lines)


def short_by(plan: MemoryPlan) -> str:
    """'train short by 48.08 GB, rollout ...': the phases that do not fit, per GPU."""
    return ", ".join(f"{p} short by {_gb(plan.shortfall[p])} GB" for p in PHASES if not plan.fits[p]) + " per GPU"


def _header_lines(plan: MemoryPlan) -> list[str]:
    """The model and its size, the GPUs and batch, the offload flags, and the whole-model bill."""
    n = plan.n_params
    dp = plan.n_gpus // plan.tp_size
    b = plan.bill
    return [
        f"model {plan.model}: N = {n:,} params ({n / 1e9:.2f} B), dtype {plan.dtype}"
        + (f"; reward model N = {plan.reward_params:,}" if plan.reward_params else ""),
        f"GPUs {plan.n_gpus}, rollout tp {plan.tp_size} x dp {dp}; batch {plan.batch} seqs x context "
        f"{plan.context} tokens; GPU memory {plan.gpu_mem_bytes / 2**30:g} GiB = {_gb(plan.gpu_mem_bytes)} GB",
        "offload: " + (", ".join(f for f in _flags(plan, plan.offload)) or "none"),
        f"bill (whole model): learner {_learner(plan)} = {_gb(b['learner'])} GB, reference = {_gb(b['ref'])} GB, "
        f"inference copy = {_gb(b['engine_copy'])} GB (x{b['engine_replicas']} replicas on the GPUs = "
        f"{_gb(plan.total['engine_weights'])} GB)"
        + (f", reward model = {_gb(b['reward_model'])} GB" if plan.reward_params else "")
        + (f", critic 16N_c = {_gb(b['critic'])} GB (PPO)" if b.get("critic") else ""),
    ]


_ROLE_COLUMN = 22  # width of the table's first column


def _table_lines(plan: MemoryPlan, phases: tuple[str, ...]) -> list[str]:
    """One row per role (plus the activation estimate and the native engine's working set and
    headroom when billed): GB per GPU, in total, and resident in each phase; then the phase totals."""
    w = _ROLE_COLUMN
    head = f"{'role':<{w}}{'per GPU':>10}{'total':>11} |" + "".join(f"{p:>10}" for p in phases)
    lines = [head + "   (GB)", "-" * len(head)]
    # PPO's critic rows only in a plan that has one (GRPO and its relatives train no critic)
    rows = [r for r in ROLES if r not in CRITIC_ROLES or plan.per_gpu.get(r)]
    rows += ["activations_estimate"] if plan.activations_estimate else []
    rows += ["rollout_working"] if plan.native_rollout else []
    for role in rows:
        pg, tot = _role_bytes(plan, role)
        cells = [_phase_cell(plan, role, p) for p in phases]
        lines.append(f"{role:<{w}}{_gb(pg):>10}{_gb(tot):>11} |" + "".join(f"{c:>10}" for c in cells))
    lines.append("-" * len(head))
    lines.append(f"{'phase total per GPU':<{w + 21}} |" + "".join(f"{_gb(plan.phase_totals[p]):>10}" for p in phases))
    lines.append(f"{'usable (less margin)':<{w + 21}} |" + f"{_gb(plan.usable_bytes):>10}" * len(phases))
    return lines


def _role_bytes(plan: MemoryPlan, role: str) -> tuple[int, int]:
    """(bytes per GPU, bytes over all GPUs) of a table row."""
    if role == "activations_estimate":
        return plan.activations_estimate, plan.activations_estimate * plan.n_gpus
    if role == "rollout_working":
        pg = plan.native_rollout["working"]
        return pg, pg * plan.n_gpus
    return plan.per_gpu[role], plan.total[role]


def _phase_cell(plan: MemoryPlan, role: str, phase: str) -> str:
    """GB of `role` resident in `phase`; "cpu" where its offload flag parks it, "-" where it is not held."""
    if role == "reward_model" and not plan.reward_params:
        return "-"
    if role in plan.phases[phase]:
        return _gb(plan.phases[phase][role])
    flag = RESIDENCY.get(role, (None, None))[1]
    return "cpu" if flag and plan.offload.get(flag) else "-"


def _fit_lines(plan: MemoryPlan, phases: tuple[str, ...]) -> list[str]:
    """Per phase: bytes used per GPU against the usable memory (the capacity less the margin), and the
    spare or missing GB."""
    lines = [
        f"margin: {_gb(plan.margin_bytes)} GB of the {_gb(plan.gpu_mem_bytes)} GB per GPU kept for the CUDA "
        f"context, NCCL buffers and fragmentation (hybrid_rl/plan/memory.py); a phase fits within "
        f"{_gb(plan.usable_bytes)} GB"
    ]
    for p in phases:
        used = plan.phase_totals[p]
        verdict = (
            f"fits ({_gb(plan.usable_bytes - used)} GB spare)"
            if plan.fits[p]
            else f"does NOT fit (short by {_gb(plan.shortfall[p])} GB)"
        )
        lines.append(f"{p:<8} {_gb(used):>8} / {_gb(plan.usable_bytes)} GB usable per GPU: {verdict}")
    return lines


def _note_lines(plan: MemoryPlan) -> list[str]:
    """The plan's notes, and a warning that the activation figure is an estimate."""
    lines = [f"note: {note}" for note in plan.notes]
    if plan.activations_estimate:
        how = "with" if plan.gradient_checkpointing else "WITHOUT"
        lines.append(f"note: activations_estimate is a rough estimate ({how} gradient checkpointing)")
    return lines


def _suggestion_line(plan: MemoryPlan, suggestion: dict) -> str:
    """The offload flags to add so that every phase fits: never one already set (nor one for a role the run
    lacks), or why offload alone cannot make it fit."""
    if not suggestion["fits"]:
        return "suggested offload: none is enough on its own (below: the changes that fit)"
    if not suggestion["added"]:
        given = _flags(plan, plan.offload)
        return "suggested offload: nothing to add" + (f" (already offloaded: {', '.join(given)})" if given else "")
    return f"suggested offload: add {','.join(suggestion['added'])}"


def _flags(plan: MemoryPlan, offload: dict) -> list[str]:
    """The set offload flags of roles the run has (no reward_model flag without a reward model, no critic flags
    without PPO's critic)."""
    return [
        f
        for f in OFFLOAD_FLAGS
        if offload.get(f)
        and (f != "reward_model" or plan.reward_params)
        and (f not in CRITIC_ROLES or plan.per_gpu.get(f))
    ]


def native_rollout_lines(plan: MemoryPlan) -> list[str]:
    """The native engine's decode batch, its working set by part, and the rollout margin."""
    n = plan.native_rollout
    if not n:
        return []
    margin = plan.usable_bytes - plan.phase_totals["rollout"]
    if not n["fits_one_row"]:
        return [
            f"native rollout: not even one sequence fits ({_gb(n['free'])} GB free within the margin); "
            "offload more, or shorten the prompts / max_new_tokens"
        ]
    batches = -(-n["rows_wanted"] // n["rows"])
    return [
        f"native rollout: {n['rows']} of {n['rows_wanted']} rows per GPU per decode batch ({batches} "
        f"batch{'es' if batches > 1 else ''}), prefill in chunks of {n['prefill_rows']} prompts; working set "
        f"{_gb(n['working'])} GB = max(prefill {_gb(n['prefill'])}, sampling {_gb(n['sampling'])} + decode step "
        f"{_gb(n['decode_step'])} + graph pools {_gb(n['graph_pools'])} + bookkeeping {_gb(n['bookkeeping'])})",
        f"native rollout spare: {_gb(margin)} GB per GPU at the peak, beyond the {_gb(plan.margin_bytes)} GB margin",
    ]


def _learner(plan) -> str:
    """How the learner is billed: 16N, or with LoRA the frozen base and 16 bytes per adapter parameter."""
    if not plan.lora_params:
        return "16N"
    return f"{DTYPE_BYTES[plan.dtype]}N + 16A (LoRA: frozen base, A = {plan.lora_params:,} adapter params)"


def plan_line(plan: MemoryPlan) -> str:
    """One line: each phase's GB per GPU against the usable memory, and the least spare."""
    phases = shown_phases(plan)
    used = ", ".join(f"{p} {plan.phase_totals[p] / GB:.2f}" for p in phases)
    spare = min(plan.usable_bytes - plan.phase_totals[p] for p in phases)
    verdict = f"fits, {spare / GB:.2f} GB spare" if plan.fits_all else "does NOT fit"
    return f"{used} / {plan.usable_bytes / GB:.2f} GB usable per GPU: {verdict}"


def fix_lines(fixes: list[Fix], short_by: str) -> list[str]:
    """The printed list: what does not fit, then each fix, ranked, with its plan line."""
    if not fixes:
        return [f"no single change fits ({short_by}); combine them, or plan a smaller model or context"]
    lines = [f"to fit ({short_by}), change one of (ranked: least change to the run first):"]
    for i, f in enumerate(fixes, 1):
        lines.append(f"  {i}. [{f.knob}] {f.change}")
        lines.append(f"       -> {plan_line(f.plan)}")
    return lines
