"""The README's first screen, typed as a user types it, in a fresh clone (issue 30 part 5).

The commands are read from README.md itself (the clone's copy), so the test follows the README when it
changes: the activate-and-run block of "Start here", `make demo` with overrides passed the way the README
says (`ARGS="..."`), the notebook example's code, and the one-GPU quickstart's dry run. Each runs from the
clone's root with bash, and the checks are the README's own claims: the files the run directory gets, the
time-split line, per-step metrics with val/* where validation ran, a saved HF directory, a plan in which
every phase fits one 80 GiB GPU.

What differs from a user's first hour, to keep the cost near two minutes on 2 CPU cores:
  * nothing is installed: the clone's `.venv` is a symlink to this checkout's ready environment, and
    `make` is told not to remake `.venv/.installed` (`make -o`), so `make demo` runs its recipe line only.
    That environment holds this package in editable mode, so the library code under test is this working
    tree's; the clone supplies the README, the Makefile, the recipes and a fresh `runs/`.
  * step counts and batch sizes are lowered with the overrides the README itself documents (the demo's
    ARGS, the notebook's override list); the quickstart dry run runs exactly as written.

Catches: a first-screen command that fails from the repository root of a fresh clone (a missing file, a
path that only resolves in the developer's tree, a recipe that needs an install step the README omits), a
README command that no longer parses, the demo not writing what the README lists, the notebook example
not training or saving, and a quickstart that the planner says does not fit one GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def _fences(readme: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", readme, flags=re.S)


def _block_with(readme: str, lang: str, needle: str) -> str:
    blocks = [b for b in _fences(readme, lang) if needle in b]
    assert blocks, f"README.md has no ```{lang} block containing {needle!r}"
    return blocks[0]


def _bash(clone: str, script: str, timeout: int = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(["bash", "-ec", script], cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode} running:\n{script}\n--- output tail ---\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A `git clone` of this repository's HEAD with `.venv` linked to the ready environment."""
    venv = os.path.join(ROOT, ".venv")
    if not os.path.isfile(os.path.join(venv, ".installed")):
        pytest.skip("no ready .venv (make install) to reuse")
    path = str(tmp_path_factory.mktemp("fresh") / "hybrid_rl")
    subprocess.run(["git", "clone", "-q", ROOT, path], check=True)
    os.symlink(venv, os.path.join(path, ".venv"))
    return path


@pytest.fixture(scope="module")
def readme(clone):
    with open(os.path.join(clone, "README.md")) as f:
        return f.read()


def _metrics(clone: str, out_dir: str) -> list[dict]:
    with open(os.path.join(clone, out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_activate_then_a_short_run(clone, readme):
    block = _block_with(readme, "bash", "source .venv/bin/activate")
    out_dir = re.search(r"trainer\.out_dir=(\S+)", block).group(1)
    steps = int(re.search(r"trainer\.total_steps=(\d+)", block).group(1))
    _bash(clone, block)
    rows = _metrics(clone, out_dir)
    assert len(rows) == steps and all("reward/mean" in r for r in rows)


def test_make_demo_with_args_writes_what_the_readme_lists(clone, readme):
    assert "make demo" in _block_with(readme, "bash", "make install")
    args_form = re.search(r'make demo ARGS="[^"]*"', readme)
    assert args_form, "README no longer shows how to pass overrides to make demo"
    out = _bash(clone, 'make -o .venv/.installed demo ARGS="trainer.total_steps=2 data.batch_size=16"')
    run = os.path.join(clone, "runs", "grpo_tiny")  # the run directory the README names
    for name in ("metrics.jsonl", "reward_curve.png", "memory_timeline.png"):
        assert name in readme and os.path.isfile(os.path.join(run, name)), name
    assert len(_metrics(clone, "runs/grpo_tiny")) == 2
    assert re.search(r"rollout \d+% \| scoring \d+% \| training \d+% \| switching \d+%", out), out[-2000:]


def test_the_notebook_example(clone, readme):
    """Exactly as written (issue 39: a lowered copy once hid that the example's 100 held-out prompts did not fill
    its default validation batch of 128); only a line printing what it returned is added after it."""
    code = _block_with(readme, "python", "trainer.save_pretrained")
    code += "\nimport json; print('HISTORY', json.dumps([sorted(h) for h in history]))\n"
    script_path = os.path.join(clone, "notebook_example.py")
    with open(script_path, "w") as f:
        f.write(code)
    out = _bash(clone, "source .venv/bin/activate && python notebook_example.py", timeout=480)
    history = json.loads(out.split("HISTORY ", 1)[1].splitlines()[0])
    steps = int(re.search(r'"trainer\.total_steps=(\d+)"', code).group(1))
    every = int(re.search(r'"trainer\.val_every=(\d+)"', code).group(1))
    assert len(history) == steps and all("reward/mean" in keys for keys in history)
    assert [i + 1 for i, keys in enumerate(history) if "val/pass@1" in keys] == list(range(every, steps + 1, every))
    assert os.path.isfile(os.path.join(clone, "runs", "notebook", "model", "config.json"))


def test_the_one_gpu_quickstart_dry_run_fits(clone, readme):
    block = _block_with(readme, "bash", "--dry-run --gpus 1")
    line = next(l for l in block.splitlines() if "--dry-run --gpus 1" in l)
    out = _bash(clone, "source .venv/bin/activate && " + line, timeout=120)
    for phase in ("train", "rollout", "score"):
        assert re.search(rf"^{phase}\s+[\d.]+ / [\d.]+ GB( usable)? per GPU: fits", out, flags=re.M), (
            phase,
            out[-3000:],
        )
    assert "Qwen2.5-1.5B" in out
