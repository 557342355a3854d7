"""`make gpu-kit`: the folder a GPU call carries beside the repository (`.gpu_kit`, git-ignored), built here.

The GPU image has no network and lacks a few pure-Python packages the library needs (omegaconf and its antlr4
runtime); the GSM8K files beside the repository (../shared/data/gsm8k) do not travel with it either. So:

  wheels/      pure-Python wheels (py3-none-any: they install on the image's Python 3.12 whatever this machine
               runs), downloaded with pip (--no-deps: each one is named), or copied from --wheels-from
  data/gsm8k/  train.jsonl, test.jsonl (and LICENSE) from --data, else hybrid_rl.data.gsm8k's default place
  MANIFEST.json  each file's size and SHA-256, and the sizes that travel

A call carries at most 64 MiB: the repository's working tree (tracked and untracked files git does not ignore)
plus the carried paths. The kit is refused, naming the sizes, when the two together exceed --limit-mib.
benchmarks/gpu_preflight.py installs the wheels on the GPU machine; benchmarks/gpu_session.sh's header says how
to carry the kit.

    python benchmarks/gpu_kit.py --out .gpu_kit omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, ".gpu_kit"))
    p.add_argument("--data", default="", help="a GSM8K directory (train.jsonl, test.jsonl); default: the library's")
    p.add_argument("--wheels-from", default="", help="copy *.whl from here instead of downloading")
    p.add_argument("--limit-mib", type=float, default=64.0, help="what one device call may carry, tree included")
    p.add_argument("requirements", nargs="*", help="name==version of each wheel to download")
    return p.parse_args(argv)


def fetch_wheels(requirements: list[str], wheels_from: str, dest: str) -> list[str]:
    if wheels_from:
        for w in glob.glob(os.path.join(wheels_from, "*.whl")):
            shutil.copy2(w, dest)
    if requirements:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-d", dest, *requirements]
        subprocess.run(cmd, check=True)
    wheels = sorted(os.path.basename(w) for w in glob.glob(os.path.join(dest, "*.whl")))
    impure = [w for w in wheels if not w.endswith("-none-any.whl")]
    if impure:
        raise SystemExit(
            f"gpu-kit: {impure} are not pure-Python wheels: built for this machine, they may not install on the "
            "GPU image (Python 3.12, x86-64); stage those as the device tool's README says"
        )
    return wheels


def copy_gsm8k(data: str, dest: str) -> str:
    if not data:
        from hybrid_rl.data.gsm8k import default_dirs

        data = default_dirs()[0]
    files = [f for f in ("train.jsonl", "test.jsonl") if os.path.isfile(os.path.join(data, f))]
    if len(files) != 2:
        raise SystemExit(f"gpu-kit: no GSM8K train.jsonl and test.jsonl in {data!r} (docs/gsm8k.md); pass --data")
    for f in files + (["LICENSE"] if os.path.isfile(os.path.join(data, "LICENSE")) else []):
        shutil.copy2(os.path.join(data, f), dest)
    return data


def tree_bytes() -> int:
    """Bytes of what a device call sends of the repository: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    paths = [os.path.join(ROOT, p) for p in out.split("\0") if p]
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p))


def manifest(kit: str) -> dict[str, dict]:
    files = {}
    for folder, _, names in os.walk(kit):
        for name in sorted(names):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, kit)
            if rel == "MANIFEST.json":
                continue
            with open(path, "rb") as f:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": hashlib.sha256(f.read()).hexdigest()}
    return files


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if os.path.isdir(args.out):  # a kit is rebuilt whole: no wheel of an older version stays beside the new one
        if os.listdir(args.out) and not os.path.isfile(os.path.join(args.out, "MANIFEST.json")):
            raise SystemExit(f"gpu-kit: {args.out} exists and is not a kit (no MANIFEST.json); choose another --out")
        shutil.rmtree(args.out)
    wheels_dir, data_dir = os.path.join(args.out, "wheels"), os.path.join(args.out, "data", "gsm8k")
    os.makedirs(wheels_dir)
    os.makedirs(data_dir)
    wheels = fetch_wheels(args.requirements, args.wheels_from, wheels_dir)
    source = copy_gsm8k(args.data, data_dir)
    files = manifest(args.out)
    kit = sum(f["bytes"] for f in files.values())
    tree = tree_bytes()
    report = {"wheels": wheels, "gsm8k_from": source, "kit_bytes": kit, "tree_bytes": tree, "files": files}
    with open(os.path.join(args.out, "MANIFEST.json"), "w") as f:
        json.dump(report, f, indent=1)
    line = f"{kit / MIB:.1f} MiB kit + {tree / MIB:.1f} MiB working tree of {args.limit_mib:.0f} MiB per call"
    if kit + tree > args.limit_mib * MIB:
        raise SystemExit(f"gpu-kit: too large to carry: {line}; leave data or wheels out, or shrink the tree")
    print(f"gpu-kit: {args.out}: {len(wheels)} wheel(s) {', '.join(wheels)}; GSM8K from {source}; {line}")
    return report


if __name__ == "__main__":
    main()
