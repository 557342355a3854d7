"""The end of benchmarks/gpu_session.sh: its summary and its results archive, from the session's work folder.

The work folder holds `parts.tsv` (one line per part: name, exit code, seconds, its time limit; written by the
script), `preflight.json`, each part's log (`<part>.log`, whose last line is the part's JSON where it has one),
and `quickstart/` (quickstart.json and the run's metrics.jsonl and memory.txt; never the model). Written to
`--out`, two files (the device tool brings back at most 8):

  summary.txt                        its first line says what ran and what could not (a failed or timed-out part,
                                     an engine this machine lacks); then a line per part with its numbers
  gpu_session_<date>_<device>.tar.gz the work folder, files over MAX_FILE_BYTES left out (and named in the summary)

docs/gpu_session.md says how to read both.

    python benchmarks/gpu_session_report.py --work WORK --out OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tarfile
from typing import Optional

MAX_FILE_BYTES = 8 << 20
ENGINES = {"sglang": "SGLang", "vllm": "vLLM"}  # what no part runs here when it is absent (tests skip)
TIMEOUT_CODES = (124, 137)  # timeout(1): its limit, then its KILL


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, default=400.0, help="the session's wall-clock budget in seconds")
    return p.parse_args(argv)


def read_parts(work: str) -> list[dict]:
    """parts.tsv's lines: name, exit code ('skipped' when the budget had no time left), seconds, limit."""
    path = os.path.join(work, "parts.tsv")
    if not os.path.isfile(path):
        return []
    parts = []
    with open(path) as f:
        for line in f:
            name, code, seconds, limit = line.rstrip("\n").split("\t")
            parts.append({"name": name, "code": code, "seconds": float(seconds), "limit": float(limit)})
    return parts


def last_json(path: str) -> Optional[dict]:
    """The JSON object on a log's last line that holds one (benchmarks print theirs last), or None."""
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def load(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def status(part: dict) -> str:
    code = part["code"]
    if code == "0":
        return "ok"
    if code == "skipped":
        return "skipped (no time left in the budget)"
    if code.isdigit() and int(code) in TIMEOUT_CODES:
        return f"timed out at its {part['limit']:.0f} s limit"
    return f"failed (exit {code})"


def pytest_counts(log: str) -> str:
    """pytest's closing counts ('40 passed, 3 skipped'), and its slowest test from --durations."""
    if not os.path.isfile(log):
        return "no log"
    with open(log, errors="replace") as f:
        text = f.read()
    counts = re.findall(r"=+ (\d+ \w+.*?) in [\d.]+s", text)
    slow = re.search(r"slowest \d+ durations =+\n([\d.]+)s (\w+)\s+(\S+)", text)
    out = counts[-1] if counts else "no pytest summary (stopped before it)"
    if slow:
        out += f"; slowest {slow.group(3)} ({slow.group(2)} {float(slow.group(1)):.1f} s)"
    return out


def gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.1f} GB"


def quickstart_line(work: str) -> str:
    q = load(os.path.join(work, "quickstart", "quickstart.json"))
    if q is None:
        return "no quickstart.json"
    if q.get("refused"):
        return f"the recipe's memory gate refused: {q['refused']}"
    steps = []
    for i, m in enumerate(q.get("steps", []), 1):
        steps.append(
            f"step {i} {m.get('wall_s', 0):.1f} s (rollout {m.get('time/rollout', 0):.1f}, score "
            f"{m.get('time/score', 0):.1f}, train {m.get('time/train', 0):.1f}, switch {m.get('time/switch', 0):.1f})"
        )
    ledger = q.get("ledger") or []
    reserved = max((s.get("reserved_peak") or 0 for s in ledger), default=0) or None
    allocated = max((s.get("peak") or 0 for s in ledger), default=0) or None
    plan = q.get("plan_gb") or {}
    planned = max(plan.values()) if plan else None
    out = "; ".join(steps) or "no step finished"
    out += f"; decode {q.get('decode_path')}; ref {q.get('ref_dtype')}; last step's peaks: allocated {gb(allocated)}"
    out += f", reserved {gb(reserved)}" + (f"; planner's largest phase {planned:.1f} GB" if planned else "")
    return out + f"; model built in {q.get('model_build_s')} s, trainer in {q.get('trainer_init_s')} s"


def rollout_line(work: str) -> str:
    r = last_json(os.path.join(work, "rollout.log"))
    if r is None:
        return "no result"
    rows = {(x["model"], x["batch"], x["T"], x["path"]): x for x in r.get("results", [])}
    cases = sorted({k[:3] for k in rows})
    out = []
    for model, batch, T in cases:
        graph, lean = rows.get((model, batch, T, "new")), rows.get((model, batch, T, "lean"))
        text = f"{model} N={batch} T={T}:"
        if graph:
            text += f" graphs {graph['decode_tokens_per_s']:.0f} tok/s ({graph['decode_path']}"
            text += f", capture {graph['capture_s']:.1f} s)"
        if lean:
            text += f" lean {lean['decode_tokens_per_s']:.0f} tok/s"
        if graph and lean:
            text += f", graphs/lean {graph['decode_tokens_per_s'] / lean['decode_tokens_per_s']:.2f}x"
        out.append(text)
    return "; ".join(out) or "no case"


def phase_swap_line(work: str) -> str:
    r = last_json(os.path.join(work, "phase_swap.log"))
    if r is None:
        return "no result"
    out = []
    for mode, e in r.get("engines", {}).items():
        s = e["switch_s"]
        out.append(
            f"{mode}: to rollout {s['to_rollout']:.3f} s, score ref {s['score_ref']:.3f} s, to train "
            f"{s['to_train']:.3f} s"
        )
    return f"{r['model']['params'] / 1e9:.2f}B params; " + "; ".join(out)


DETAILS = {"quickstart": quickstart_line, "rollout": rollout_line, "phase_swap": phase_swap_line}


def first_line(pre: Optional[dict], parts: list[dict], total_s: float, budget: float) -> str:
    """What ran and what could not, in one line."""
    dry = bool(pre and pre.get("dry"))
    device = ((pre or {}).get("device") or {}).get("name", "?")
    if pre is None or not pre.get("ok"):
        why = (pre or {}).get("error") or "it wrote no report"
        return f"gpu_session{' --dry' if dry else ''} on {device}: ran nothing, the pre-flight failed: {why}"
    ran = [p["name"] for p in parts if p["code"] == "0"]
    bad = [f"{p['name']} ({status(p)})" for p in parts if p["code"] != "0"]
    engines = (pre or {}).get("engines") or {}
    absent = [f"{label} (not importable)" for key, label in ENGINES.items() if not engines.get(key)]
    present = [f"{label} (importable, no part runs it)" for key, label in ENGINES.items() if engines.get(key)]
    line = f"gpu_session{' --dry' if dry else ''} on {device}: ran {', '.join(ran) or 'nothing'}"
    line += f"; could not run: {', '.join(bad + absent) or 'nothing'}"
    if present:
        line += f"; {', '.join(present)}"
    return line + f"; {total_s:.0f} s of {budget:.0f}"


def archive(work: str, out: str, name: str) -> tuple[str, list[str]]:
    """The work folder as `name` (tar.gz) in `out`, files over MAX_FILE_BYTES left out; (path, what was left out)."""
    path = os.path.join(out, name)
    left_out = []
    with tarfile.open(path, "w:gz") as tar:
        for folder, _, files in os.walk(work):
            for f in sorted(files):
                full = os.path.join(folder, f)
                rel = os.path.relpath(full, work)
                if os.path.islink(full) or os.path.getsize(full) > MAX_FILE_BYTES:
                    left_out.append(rel)
                    continue
                tar.add(full, arcname=os.path.join(name.split(".tar")[0], rel))
    return path, left_out


def slug(text: str) -> str:
    """Letters, digits, '.', '_' and '-' only: the device tool brings back no other file names."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unknown"


def main(argv: Optional[list[str]] = None) -> str:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pre = load(os.path.join(args.work, "preflight.json"))
    parts = read_parts(args.work)
    total = sum(p["seconds"] for p in parts)
    lines = [first_line(pre, parts, total, args.budget)]
    if pre is not None:
        v = pre.get("versions") or {}
        lines.append(
            f"preflight: {'ok' if pre.get('ok') else 'FAILED: ' + str(pre.get('error'))}; python {pre.get('python')}, "
            f"torch {v.get('torch')}, transformers {v.get('transformers')}; wheels installed from the kit: "
            f"{', '.join(pre.get('installed') or []) or 'none'}"
        )
    for p in parts:
        if p["name"] == "preflight":
            continue
        line = f"{p['name']}: {status(p)} in {p['seconds']:.0f} s of {p['limit']:.0f}"
        if p["name"].startswith("gpu_tests") and p["code"] != "skipped":
            line += "; " + pytest_counts(os.path.join(args.work, f"{p['name']}.log"))
        elif p["name"] in DETAILS and p["code"] != "skipped":
            line += "; " + DETAILS[p["name"]](args.work)
        lines.append(line)
    device = ((pre or {}).get("device") or {}).get("name", "unknown")
    name = f"gpu_session_{datetime.date.today().isoformat()}_{slug(device)}.tar.gz"
    with open(os.path.join(args.work, "summary.txt"), "w") as f:  # the archive carries it too
        f.write("\n".join(lines) + "\n")
    path, left_out = archive(args.work, args.out, name)
    lines.append(
        f"archive: {name} ({os.path.getsize(path) / 1024:.0f} KB)"
        + (f"; left out (over {MAX_FILE_BYTES >> 20} MiB): {', '.join(left_out)}" if left_out else "")
    )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
    sys.exit(0)
