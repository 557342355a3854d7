"""benchmarks/gpu_session.sh on CPU: what can be checked without a GPU. Its pre-flight (fails in seconds naming what
is missing; installs the kit's wheels), its report (the summary's first line, the compact archive), its time budget,
`make gpu-kit`'s builder, and the whole session in its dry mode (the same parts at tiny sizes)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, "benchmarks")
DEVICE_TOOL_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # the only file names the device tool brings back


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(folder, name: str, body: str) -> str:
    """A minimal pure-Python wheel of module `name` (what `make gpu-kit` puts in the kit's wheels/)."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def _preflight(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "preflight.json"
    cmd = [sys.executable, os.path.join(BENCH, "gpu_preflight.py"), "--site", str(tmp_path / "site")]
    cmd += ["--report", str(report), "--dry", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, json.loads(report.read_text())


@pytest.mark.slow
def test_the_preflight_fails_naming_the_missing_module_and_installs_it_from_the_kit(tmp_path):
    """Catches: a pre-flight that lets the parts start without a module they import (the session would spend its
    minutes failing in each part), a failure that does not say what to do, and a kit that is not installed where
    the parts look (the site folder the script puts on PYTHONPATH)."""
    proc, report = _preflight(tmp_path, "--kit", str(tmp_path / "empty_kit"), "--require", "hrl_kit_probe")
    assert proc.returncode == 3 and not report["ok"]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("preflight: FAILED: cannot import hrl_kit_probe") and "make gpu-kit" in line, line
    _wheel(tmp_path / "kit" / "wheels", "hrl_kit_probe", "VALUE = 38\n")
    proc, report = _preflight(tmp_path, "--kit", str(tmp_path / "kit"), "--require", "hrl_kit_probe")
    assert proc.returncode == 0 and report["ok"], proc.stdout + proc.stderr
    assert report["installed"] == ["hrl_kit_probe-1.0-py3-none-any.whl"]
    assert report["engines"].keys() == {"sglang", "vllm"} and report["device"]["name"] == "cpu"
    assert os.path.isfile(os.path.join(report["gsm8k"], "train.jsonl"))
    probe = subprocess.run(
        [sys.executable, "-c", "import hrl_kit_probe; print(hrl_kit_probe.VALUE)"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")),
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "38"


def _fabricated_work(work) -> None:
    """A session's work folder as a GPU run leaves it: one part failed, one timed out, one skipped."""
    (work / "quickstart").mkdir(parents=True)
    pre = {
        "ok": True,
        "dry": False,
        "python": "3.12.3",
        "installed": ["omegaconf-2.4.0-py3-none-any.whl"],
        "versions": {"torch": "2.11.0+cu130", "transformers": "5.17.0"},
        "engines": {"sglang": False, "vllm": False},
        "device": {"name": "NVIDIA H100 80GB HBM3", "memory_gb": 85.0, "cuda": "13.0"},
    }
    (work / "preflight.json").write_text(json.dumps(pre))
    parts = [("preflight", "0", 6, 60), ("gpu_tests", "1", 95, 120), ("quickstart", "124", 150, 150)]
    parts += [("rollout", "0", 61, 70), ("phase_swap", "skipped", 0, 0)]
    (work / "parts.tsv").write_text("".join(f"{n}\t{c}\t{s}\t{lim}\n" for n, c, s, lim in parts))
    (work / "gpu_tests.log").write_text(
        "tests/gpu/test_trainer_cuda.py::test_one_gpu_step_in_bf16 FAILED\n"
        "============================= slowest 15 durations =============================\n"
        "31.20s call     tests/gpu/test_trainer_cuda.py::test_one_gpu_step_in_bf16\n"
        "============ 1 failed, 40 passed, 3 skipped in 95.12s (0:01:35) ============\n"
    )
    rows = [
        {
            "model": "1.5b",
            "batch": n,
            "T": 512,
            "path": p,
            "decode_tokens_per_s": tps,
            "decode_path": dp,
            "capture_s": c,
        }
        for n, p, tps, dp, c in [
            (64, "lean", 4000.0, "lean", 0.0),
            (64, "new", 6000.0, "cuda_graph", 0.4),
            (512, "lean", 30000.0, "lean", 0.0),
            (512, "new", 24000.0, "cuda_graph", 0.9),
        ]
    ]
    (work / "rollout.log").write_text("table\n" + json.dumps({"benchmark": "rollout_throughput", "results": rows}))
    (work / "quickstart.log").write_text("step 1: 52.0 s\n")
    (work / "quickstart" / "quickstart.json").write_text(
        json.dumps(
            {
                "steps": [{"wall_s": 52.0, "time/rollout": 20.0, "time/score": 5.0, "time/train": 25.0}],
                "ledger": [{"label": "rollout:generated", "peak": 40e9, "reserved_peak": 47e9}],
                "plan_gb": {"train": 30.4, "rollout": 41.2},
                "decode_path": "cuda_graph",
                "ref_dtype": "torch.bfloat16",
            }
        )
    )
    (work / "huge.bin").write_bytes(b"\0" * (9 << 20))


def test_the_report_says_what_ran_and_what_could_not_and_archives_compactly(tmp_path):
    """Catches: a summary whose first line hides a failed, timed-out or skipped part or an engine this machine
    lacks, numbers lost from the per-part lines, and an archive that would not come back (over 16 MiB, a name the
    device tool refuses, more than two files in $OUT)."""
    report = _module("gpu_session_report")
    work, out = tmp_path / "work", tmp_path / "out"
    _fabricated_work(work)
    text = report.main(["--work", str(work), "--out", str(out)])
    lines = text.splitlines()
    assert lines[0] == (
        "gpu_session on NVIDIA H100 80GB HBM3: ran preflight, rollout; could not run: gpu_tests (failed (exit 1)), "
        "quickstart (timed out at its 150 s limit), phase_swap (skipped (no time left in the budget)), SGLang (not "
        "importable), vLLM (not importable); 312 s of 400"
    )
    by_part = {line.split(":")[0]: line for line in lines[1:]}
    assert "omegaconf-2.4.0-py3-none-any.whl" in by_part["preflight"]
    assert (
        "1 failed, 40 passed, 3 skipped" in by_part["gpu_tests"] and "test_one_gpu_step_in_bf16" in by_part["gpu_tests"]
    )
    assert "step 1 52.0 s (rollout 20.0" in by_part["quickstart"] and "reserved 47.0 GB" in by_part["quickstart"]
    assert "N=64 T=512: graphs 6000 tok/s" in by_part["rollout"] and "graphs/lean 1.50x" in by_part["rollout"]
    assert "graphs/lean 0.80x" in by_part["rollout"]
    files = sorted(os.listdir(out))
    assert len(files) == 2 and "summary.txt" in files and all(DEVICE_TOOL_NAME.match(f) for f in files)
    archive = next(f for f in files if f.endswith(".tar.gz"))
    assert archive.startswith("gpu_session_") and "NVIDIA-H100-80GB-HBM3" in archive
    assert os.path.getsize(out / archive) < 16 << 20
    with tarfile.open(out / archive) as tar:
        names = {os.path.relpath(n, archive[: -len(".tar.gz")]) for n in tar.getnames()}
    assert {"parts.tsv", "preflight.json", "gpu_tests.log", "rollout.log", "summary.txt"} <= names
    assert "quickstart/quickstart.json" in names and "huge.bin" not in names
    assert "left out (over 8 MiB): huge.bin" in by_part["archive"]


def _session(tmp_path, *args: str, budget: int = 400) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OUT=str(tmp_path / "out"),
        PYTHON=sys.executable,
        GPU_KIT=str(tmp_path / "no_kit"),
        GPU_SESSION_BUDGET_S=str(budget),
        TMPDIR=str(tmp_path),
    )
    return subprocess.run(
        ["bash", os.path.join(BENCH, "gpu_session.sh"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_a_spent_budget_skips_the_parts_and_still_reports(tmp_path):
    """Catches: a part started with less time than it needs (it would run past the call's limit and take the
    summary with it), and a session that stops without its summary."""
    proc = _session(tmp_path, "--dry", budget=19)  # 19 - the 15 s kept for the report: under 5 s for a part
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "preflight: skipped" in proc.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary[0] == "gpu_session on ?: ran nothing, the pre-flight failed: it wrote no report"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu_session.")], "the scratch folder is removed"


@pytest.mark.slow
def test_the_dry_session_runs_every_part_on_cpu(tmp_path):
    """The whole script at tiny sizes (what CI runs of it). Catches: a part whose command breaks (an option a
    benchmark no longer takes), the fix-pinning GPU tests not run first, a quickstart that keeps no step or no
    ledger, a rollout part without the lean-against-graphs cases, and results that do not reach the archive."""
    proc = _session(tmp_path, "--dry")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith(
        "gpu_session --dry on cpu: ran preflight, gpu_tests, quickstart, rollout, phase_swap; could not run: "
    ), summary[0]
    assert ("SGLang (not importable)" in summary[0]) == (importlib.util.find_spec("sglang") is None)
    archive = next(f for f in os.listdir(out) if f.endswith(".tar.gz"))
    with tarfile.open(out / archive) as tar:
        root = archive[: -len(".tar.gz")]
        read = {os.path.relpath(m.name, root): m for m in tar.getmembers()}

        def text(name: str) -> str:
            return tar.extractfile(read[name]).read().decode()

        tests = [ln.split("::")[0] for ln in text("gpu_tests.log").splitlines() if ln.startswith("tests/")]
        quick = json.loads(text("quickstart/quickstart.json"))
        rollout = json.loads(text("rollout.log").strip().splitlines()[-1])
    first = ["tests/gpu/test_trainer_cuda.py", "tests/gpu/test_memory_cuda.py", "tests/gpu/test_offload_cuda.py"]
    assert [t for t in dict.fromkeys(tests)][:3] == first, "the tests that pin the fixes run first"
    assert len(quick["steps"]) == 2 and [s["label"] for s in quick["ledger"]][0] == "rollout:ready"
    assert {(r["batch"], r["path"]) for r in rollout["results"]} == {(2, "lean"), (2, "new"), (4, "lean"), (4, "new")}


def test_the_kit_holds_pure_wheels_and_gsm8k_within_what_a_call_carries(tmp_path):
    """`make gpu-kit`'s builder, offline (wheels copied, not downloaded). Catches: a platform wheel in the kit
    (it would not install on the GPU image), GSM8K left out, a kit whose size with the tree exceeds what one call
    carries, and a rebuild that deletes a folder that is not a kit."""
    kit = _module("gpu_kit")
    data = tmp_path / "gsm8k"
    data.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (data / name).write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    _wheel(tmp_path / "wheels", "hrl_kit_probe", "VALUE = 38\n")
    out = tmp_path / "kit"
    got = kit.main(["--out", str(out), "--data", str(data), "--wheels-from", str(tmp_path / "wheels")])
    assert got["wheels"] == ["hrl_kit_probe-1.0-py3-none-any.whl"]
    assert sorted(os.listdir(out / "data" / "gsm8k")) == ["test.jsonl", "train.jsonl"]
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["kit_bytes"] == sum(f["bytes"] for f in manifest["files"].values()) > 0
    assert 0 < manifest["tree_bytes"] < 64 << 20
    with pytest.raises(SystemExit, match="too large to carry"):
        kit.main(["--out", str(out), "--data", str(data), "--limit-mib", "0.001"])
    (tmp_path / "wheels" / "native-1.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"x")
    with pytest.raises(SystemExit, match="not pure-Python wheels"):
        kit.main(["--out", str(out), "--data", str(data), "--wheels-from", str(tmp_path / "wheels")])
    with pytest.raises(SystemExit, match="is not a kit"):
        kit.main(["--out", str(data), "--data", str(data)])
    assert (data / "train.jsonl").is_file()
