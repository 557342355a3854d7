"""benchmarks/phase_swap.py's report: what each switch stage is, and the summary and table of a run.

`STAGES` names every stage of a TRAIN -> ROLLOUT -> SCORE -> TRAIN cycle with its kind and
the bare copy it is measured against; `summarize` turns one engine's raw samples into
medians, GB/s and ratios to that copy; `human_table` prints them. The measuring lives in
`phase_swap.py`.
"""

from __future__ import annotations

import copy
import statistics

# stage -> (kind, reference copy direction, note), in the order they happen in a cycle.
# kind: copy (bytes copied between homes), gather (FSDP2 all-gather output), free (memory
# released), flag (bookkeeping only), compute (inside generate; not a switch stage).
STAGES = {
    "zero_grad": ("free", None, "frees the gradients (set_to_none)"),
    "offload_optimizer": ("copy", "d2h", "AdamW m, v -> host buffers"),
    "resume_weights": ("gather", "d2d", "engine.resume(['weights']): all-gather if the engine module is FSDP2-sharded"),
    "sync_weights": (
        "copy",
        "d2d",
        "policy -> engine weights, bucketed (engines with their own copy: copy, sglang, vllm)",
    ),
    "offload_params": ("copy", "d2h", "policy shards -> host"),
    "empty_cache": (
        "free",
        None,
        "gc + empty_cache before an engine with its own memory resumes, and after the sync; bytes given back (CUDA)",
    ),
    "resume_kv": (
        "flag",
        None,
        "engine.resume(['kv_cache']); a flag for the native engine (KV allocated inside generate)",
    ),
    "kv_prefill": ("compute", None, "inside generate: prompt forward + first KV alloc; bytes = final KV"),
    "release_engine": ("free", None, "engine.release(['kv_cache', 'weights'])"),
    "onload_params": ("copy", "h2d", "policy shards -> device"),
    "onload_ref": ("copy", "h2d", "reference weights host -> device"),
    "offload_ref": ("copy", "d2h", "reference weights device -> host"),
    "onload_optimizer": ("copy", "h2d", "AdamW m, v host -> device (CPU: clone into fresh memory)"),
    "offload_critic_optimizer": ("copy", "d2h", "PPO: the critic's AdamW m, v -> host (--critic)"),
    "offload_critic": ("copy", "d2h", "PPO: the critic's weights -> host (--critic)"),
    "onload_critic": ("copy", "h2d", "PPO: the critic's weights host -> device, for SCORE's values (--critic)"),
    "onload_critic_optimizer": ("copy", "h2d", "PPO: the critic's AdamW m, v host -> device (--critic)"),
}
TO_ROLLOUT = (
    "zero_grad",
    "offload_optimizer",
    "resume_weights",
    "sync_weights",
    "offload_params",
    "empty_cache",
    "resume_kv",
    "offload_critic_optimizer",
    "offload_critic",
)
TO_TRAIN = ("release_engine", "onload_params", "onload_optimizer", "onload_critic_optimizer")
SCORE = ("onload_ref", "offload_ref", "onload_critic")


def max_over_ranks(per_rank: list[dict]) -> dict:
    """Per stage and cycle, the slowest rank's seconds (a switch is as slow as its slowest rank)."""
    base = copy.deepcopy(per_rank[0])
    for other in per_rank[1:]:
        for name, s in other["samples"].items():
            for key in ("s", "bytes", "freed", "copy_s"):
                base["samples"][name][key] = [max(a, b) for a, b in zip(base["samples"][name][key], s[key])]
        for key, v in other["compute"].items():
            base["compute"][key] = [max(a, b) for a, b in zip(base["compute"][key], v)]
    return base


def summarize(raw: dict) -> dict:
    med = statistics.median
    stages = {}
    order = [n for n in STAGES if n in raw["samples"]] + [n for n in raw["samples"] if n not in STAGES]
    for name in order:
        s = raw["samples"][name]
        kind, _, note = STAGES.get(name, ("copy", None, ""))
        t, b = med(s["s"]), int(med(s["bytes"]))
        row = {
            "kind": kind,
            "median_s": t,
            "min_s": min(s["s"]),
            "max_s": max(s["s"]),
            "bytes": b,
            "freed_bytes": int(med(s["freed"])),
            "gbps": None,
            "copy_gbps": None,
            "ratio": None,
            "note": note,
        }
        if s["copy_s"]:
            cb = int(med(s["copy_bytes"]))
            row["gbps"] = b / max(t, 1e-12) / 1e9
            row["copy_gbps"] = cb / max(med(s["copy_s"]), 1e-12) / 1e9
            row["copy_bytes"] = cb  # < bytes only if the device could not hold two buffers of that size
            row["copy_kind"] = s["copy_kind"]
            row["ratio"] = row["gbps"] / row["copy_gbps"]
        stages[name] = row

    def total(names):
        per_cycle = [
            sum(raw["samples"][n]["s"][i] for n in names if n in raw["samples"])
            for i in range(len(raw["samples"]["zero_grad"]["s"]))
        ]
        return med(per_cycle)

    switch_names = [n for n in stages if stages[n]["kind"] != "compute"]
    return {
        "stages": stages,
        "switch_s": {
            "to_rollout": total(TO_ROLLOUT),
            "score_ref": total(SCORE),
            "to_train": total(TO_TRAIN),
            "total": total(switch_names),
        },
        "compute": {k: med(v) for k, v in raw["compute"].items()},
        "ledger_last_cycle": raw["ledger"],
        "engine_module_bytes": raw["engine_module_bytes"],
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def human_table(res: dict, ledger_tables: dict[str, str]) -> str:
    m = res["model"]
    lines = [
        f"phase_swap: {m['params'] / 1e6:.1f}M params ({m['param_bytes'] / 1e6:.0f} MB {m['dtype']}), "
        f"device {res['device']} x{res['world_size']}, torch {res['torch']}, {res['hardware']['cpu']} "
        f"({res['hardware']['cpu_count']} cores, {res['hardware']['torch_threads']} threads)"
        + (f", GPU {res['hardware']['gpu']}" if res["hardware"]["gpu"] else ""),
        f"k={res['settings']['k']} cycles after {res['settings']['warmup']} warm-up; rollout batch "
        f"{res['settings']['batch']} x ({res['settings']['prompt_len']} + {res['settings']['new_tokens']}) tokens; "
        f"ratio = GB/s / copy GB/s (same bytes, same run; 1.0 = as fast as a bare copy)",
    ]
    for mode, e in res["engines"].items():
        lines += [
            "",
            f"== engine: {mode} ==",
            f"{'stage':<18}{'median_s':>10}{'min_s':>10}{'MB':>10}{'GB/s':>8}{'copy GB/s':>11}{'ratio':>7}  note",
        ]
        for name, r in e["stages"].items():
            note = r["note"] + (f" ({r['freed_bytes'] / 1e6:.1f} MB)" if r["freed_bytes"] else "")
            lines.append(
                f"{name:<18}{r['median_s']:>10.4f}{r['min_s']:>10.4f}{r['bytes'] / 1e6:>10.1f}"
                f"{_fmt(r['gbps'], '.2f'):>8}{_fmt(r['copy_gbps'], '.2f'):>11}{_fmt(r['ratio'], '.2f'):>7}  {note}"
            )
        sw, c = e["switch_s"], e["compute"]
        lines.append(
            f"switch seconds (median per cycle): to_rollout {sw['to_rollout']:.4f}, score ref on/off "
            f"{sw['score_ref']:.4f}, to_train {sw['to_train']:.4f}, total {sw['total']:.4f} (kv_prefill excluded)"
        )
        lines.append(
            f"phase compute for scale: generate {c['generate_s']:.3f} s (prefill {c['prefill_s']:.4f} s, "
            f"decode {c['decode_s_per_token'] * 1e3:.1f} ms/token), ref forward {c['score_s']:.3f} s, "
            f"train step {c['train_step_s']:.3f} s"
        )
        if "sync" in e and "payloads" in e["sync"]:  # SGLang: flat buckets as handles
            s, sw_stage = e["sync"], e["stages"].get("sync_weights", {})
            lines.append(
                f"weight sync: {s['bytes'] / 1e6:.1f} MB in {s['payloads']} payloads, {s['handles']} handles "
                f"(one flat bucket per TP rank per bucket); {_fmt(sw_stage.get('ratio'), '.2f')}x a bare copy"
            )
        elif "sync" in e:  # vLLM: buckets into its layer-wise reload, split by SyncSplit
            s = e["sync"]
            lines.append(
                f"weight sync: {s['bytes'] / 1e6:.1f} MB in {s['buckets']} buckets, "
                f"{_fmt(e.get('sync_over_memcpy'), '.2f')}x the time of a memcpy of the same bytes; "
                f"split (median s): begin {c.get('begin_s', 0):.4f}, load_weights {c.get('load_s', 0):.4f}, "
                f"finalize {c.get('finalize_s', 0):.4f} (of which tied-head repack {c.get('repack_head_s', 0):.4f})"
            )
        lines += ["memory ledger, last cycle (rank 0; this device):", ledger_tables[mode]]
    if res["device"] == "cpu":
        lines += [
            "",
            "ledger on CPU: offloaded roles count as absent (what the switch decided), although on CPU "
            "the host buffers are the same memory; kv_cache is the cache of the rollout in progress",
        ]
    return "\n".join(lines)
