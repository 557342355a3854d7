"""The pre-flight of benchmarks/gpu_session.sh: in seconds, whether the session's parts can run here.

1. Python packages: each module the parts import (REQUIRED, plus any `--require`) must import. When one does not,
   every wheel of the kit (`make gpu-kit`: `.gpu_kit/wheels`, pure-Python wheels such as omegaconf the GPU image
   lacks) is installed into `--site` with pip, offline and without dependencies, and the check runs again there.
2. hybrid_rl itself, from this checkout (the parts run with it on PYTHONPATH, and pytest puts it first anyway):
   where `hybrid_rl.kernels` does not import (no editable install maps kernels/ there, as setup.py's package_dir
   does), the link `hybrid_rl/kernels -> ../kernels` is made (git ignores it), as an install would.
3. The device: CUDA with its name and memory (--dry: the CPU), the GSM8K files the quickstart reads (the kit's
   `data/gsm8k`, else hybrid_rl.data.gsm8k's default place), and which optional engines import (SGLang, vLLM).

Writes `--report` (JSON: ok, the missing modules, what was installed, versions, the engines, the GSM8K
directory) and exits 0, or prints one line saying what is missing and what to do, and exits 3.

    python benchmarks/gpu_preflight.py --kit .gpu_kit --site /tmp/site --report preflight.json [--dry]
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the parts import (the library, its tests, the benchmarks): a missing one stops the session here, not
# minutes into it. pytest_timeout: the GPU tests run with --timeout, which pytest refuses without it.
REQUIRED = (
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "yaml",
    "omegaconf",
    "numpy",
    "tqdm",
    "matplotlib",
    "pytest",
    "pytest_timeout",
)
OPTIONAL = ("triton", "peft", "flash_attn", "sglang", "vllm")  # their tests skip, or their engine is not run
EXIT_MISSING = 3


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kit", default=os.path.join(ROOT, ".gpu_kit"), help="the folder `make gpu-kit` builds")
    p.add_argument("--site", required=True, help="where the kit's wheels are installed (a PYTHONPATH entry)")
    p.add_argument("--report", required=True, help="the JSON report to write")
    p.add_argument("--require", action="append", default=[], help="one more module that must import")
    p.add_argument("--dry", action="store_true", help="a CPU run of the session: no CUDA needed")
    return p.parse_args(argv)


def missing_modules(names) -> list[str]:
    importlib.invalidate_caches()
    out = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken install counts as missing, whatever it raises
            out.append(name)
    return out


def install_kit(kit: str, site: str) -> list[str]:
    """Install every wheel of the kit into `site` (offline, no dependencies: the kit holds them all); their names."""
    wheels = sorted(glob.glob(os.path.join(kit, "wheels", "*.whl")))
    if not wheels:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--disable-pip-version-check", "--upgrade", "--target", site, *wheels]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [os.path.basename(w) for w in wheels]


def link_kernels() -> Optional[str]:
    """hybrid_rl/kernels -> ../kernels in the checkout (module docstring); the link, or None if a file is there."""
    link = os.path.join(ROOT, "hybrid_rl", "kernels")
    if os.path.lexists(link):
        return None
    os.symlink(os.path.join("..", "kernels"), link)
    return link


def gsm8k_dir(kit: str) -> Optional[str]:
    from hybrid_rl.data.gsm8k import default_dirs

    for path in [os.path.join(kit, "data", "gsm8k"), *default_dirs()]:
        if all(os.path.isfile(os.path.join(path, f)) for f in ("train.jsonl", "test.jsonl")):
            return path
    return None


def versions(names) -> dict[str, Optional[str]]:
    out = {}
    for name in names:
        mod = sys.modules.get(name)
        out[name] = getattr(mod, "__version__", "?") if mod is not None else None
    return out


def fail(report: dict, path: str, line: str) -> int:
    report.update(ok=False, error=line)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"preflight: FAILED: {line}", flush=True)
    return EXIT_MISSING


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    os.makedirs(args.site, exist_ok=True)
    sys.path[:0] = [args.site, ROOT]  # as the parts see them: PYTHONPATH=site:checkout, pytest's rootdir
    report: dict = {
        "dry": args.dry,
        "kit": os.path.abspath(args.kit),
        "installed": [],
        "python": sys.version.split()[0],
    }
    required = list(REQUIRED) + list(args.require)
    missing = missing_modules(required)
    if missing:
        try:
            report["installed"] = install_kit(args.kit, args.site)
        except subprocess.CalledProcessError as err:
            return fail(report, args.report, f"pip could not install the kit's wheels: {err.stderr.strip()[-300:]}")
        missing = missing_modules(missing)
    if missing:
        have = "its wheels do not provide them" if report["installed"] else f"no wheels in {args.kit}/wheels"
        return fail(
            report,
            args.report,
            f"cannot import {', '.join(missing)} ({have}): run `make gpu-kit` on a machine with the package index "
            "and carry .gpu_kit with the call (benchmarks/gpu_session.sh's header)",
        )
    if missing_modules(["hybrid_rl", "hybrid_rl.kernels"]):
        report["kernels_link"] = link_kernels()
        if missing_modules(["hybrid_rl", "hybrid_rl.kernels"]):
            return fail(report, args.report, f"hybrid_rl or hybrid_rl.kernels does not import from {ROOT}")
    import torch

    report["versions"] = versions(required + ["hybrid_rl"])
    report["engines"] = {name: importlib.util.find_spec(name) is not None for name in ("sglang", "vllm")}
    report["optional"] = {name: importlib.util.find_spec(name) is not None for name in OPTIONAL}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["device"] = {
            "name": props.name,
            "memory_gb": round(props.total_memory / 1e9, 1),
            "cuda": torch.version.cuda,
        }
    elif not args.dry:
        return fail(report, args.report, f"torch {torch.__version__} sees no CUDA device (a CPU check: --dry)")
    else:
        report["device"] = {"name": "cpu", "memory_gb": None, "cuda": None}
    data = gsm8k_dir(args.kit)
    if data is None:
        return fail(
            report,
            args.report,
            f"no GSM8K (train.jsonl, test.jsonl) in {args.kit}/data/gsm8k or beside the repository: "
            "run `make gpu-kit` and carry .gpu_kit",
        )
    report.update(ok=True, gsm8k=data, seconds=round(time.perf_counter() - t0, 1))
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)
    engines = ", ".join(f"{k} {'importable' if v else 'absent'}" for k, v in report["engines"].items())
    print(f"preflight: ok on {report['device']['name']} ({engines}; installed {len(report['installed'])} wheel(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
