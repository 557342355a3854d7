"""Every example in README.md and docs/*.md, read from the files themselves and run exactly as written where a CPU
can run it; every command line that cannot run here is in NOT_RUN with the reason, so a new example is either
run or explained (test_every_command_is_run_or_explained).

Examples run from a fresh directory holding this working tree's README, docs/ and recipes/ (what a user's clone
holds once this is committed) and the ready `.venv` linked in, so that `runs/` starts empty. The notebook example
(trainer.save_pretrained) runs as written in test_readme_first_screen.py, inside a git clone.

Catches: an example that crashes as written (the multi-turn Guess example once did: str.isdigit() accepts
superscripts that int() refuses), an example that needs a step the page omits (a file it does not create, a
placeholder such as `model.path=...`), a documented command whose flags or keys no longer parse, and an
example added to the docs that no test runs.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
RUN_ELSEWHERE = ("trainer.save_pretrained",)  # the notebook example: test_readme_first_screen.py

# Command lines that do not run here, by a piece of the line, and why. Anything else that starts with `python`
# or `make` runs as written (test_cpu_commands_run_as_written).
NOT_RUN = {
    "make install": "installs the environment these tests run in",
    "make test": "the test suite itself",
    "make demo": "run with the README's ARGS form in test_readme_first_screen.py",
    "source .venv/bin/activate": "run with the next line in test_readme_first_screen.py",
    "trainer.total_steps=3 trainer.out_dir=runs/first": "run as written in test_readme_first_screen.py",
    "--dry-run --gpus 1 model.path=models/Qwen2.5-1.5B-Instruct": "run as written in test_readme_first_screen.py",
    "huggingface-cli download": "needs the network",
    "torchrun": "GPU, several nodes or long runs; the tiny 2-rank runs are tests/recipes/test_grpo_tiny*.py",
    "python recipes/grpo_tiny.py  ": "the demo's 40 steps in one process (tests/recipes/test_grpo_tiny.py)",
    "algorithm.preset=dapo trainer.total_steps=150": "150 steps (tests/recipes/test_presets_e2e.py runs the preset)",
    "pip install": "installs GPU packages",
    "model.path=/models/": "a 7B model on GPUs",
    "model.path=runs/tiny_text trainer.device=cpu": "250 steps of GSM8K (tests/recipes/test_grpo_7b_cpu.py)",
    "--from-run": "needs the metrics of two earlier runs (tests/unit/plan/test_split_rates.py)",
    "python -m hybrid_rl.rewards.tiny_model": "trains a reward model for a minute (tests/unit/rewards/)",
    "make gpu-": "GPU session kit (benchmarks/gpu_session.sh; its dry run is tested with it)",
}


def _blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            out += [(page, b) for b in re.findall(rf"```{lang}\n(.*?)```", f.read(), flags=re.S)]
    return out


COMMAND_STARTS = ("python", "torchrun", "make", "pip", "huggingface-cli", "source", "OMP_NUM_THREADS")


def _commands() -> list[tuple[str, str]]:
    """(page, command) of every command line in a bash block, and of each line that starts like a command in an
    unlabelled one (continuation lines joined, comments cut)."""
    out = []
    for lang in ("bash", ""):
        for page, block in _blocks(lang):
            for line in block.replace("\\\n", " ").splitlines():
                cmd = re.split(r"\s+#", line)[0].strip()
                if cmd and not cmd.startswith("#") and (lang == "bash" or cmd.startswith(COMMAND_STARTS)):
                    out.append((page, cmd))
    return out


def _skipped(cmd: str) -> str:
    padded = cmd + "  "
    return next((why for piece, why in NOT_RUN.items() if piece in padded), "")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    venv = os.path.join(ROOT, ".venv")
    if not os.path.isfile(os.path.join(venv, ".installed")):
        pytest.skip("no ready .venv (make install) to reuse")
    path = tmp_path_factory.mktemp("examples")
    for name in ("README.md", "Makefile"):
        shutil.copy(os.path.join(ROOT, name), path / name)
    for name in ("docs", "recipes"):
        shutil.copytree(os.path.join(ROOT, name), path / name, ignore=shutil.ignore_patterns("__pycache__"))
    os.symlink(venv, path / ".venv")
    return str(path)


def _run(tree: str, script: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        ["bash", "-ec", f"source .venv/bin/activate\n{script}"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode} running:\n{script}\n--- output tail ---\n{out[-4000:]}"
    return out


PYTHON = [(p, b) for p, b in _blocks("python") if not any(k in b for k in RUN_ELSEWHERE)]


@pytest.mark.slow
@pytest.mark.parametrize("page, code", PYTHON, ids=[f"{p}:{b.splitlines()[0][:40]}" for p, b in PYTHON])
def test_python_examples_run_as_written(tree, page, code):
    name = f"example_{abs(hash(code)) % 10**8}.py"
    with open(os.path.join(tree, name), "w") as f:
        f.write(code)
    out = _run(tree, f"python {name}")
    if "class Guess" in code:  # the multi-turn example: two steps of episodes, each logged
        assert re.search(r"^step=2 .*truncated=", out, flags=re.M), out[-3000:]
        assert os.path.isfile(os.path.join(tree, "runs", "guess", "dashboard.png"))
    if "register_reward(" in code:  # registering: the name is taken, a second registration raises
        check = code + "\nprint(exact_match(['p'], [' 7 '], [{'answer': '7'}]))\n"
        with open(os.path.join(tree, "check_" + name), "w") as f:
            f.write(check)
        assert _run(tree, f"python check_{name}").strip().endswith("[1.0]")


@pytest.mark.slow
def test_cpu_commands_run_as_written(tree):
    """Each command that runs on a CPU in seconds, in page order; export runs after a short run made checkpoints."""
    ran = []
    for page, cmd in _commands():
        if _skipped(cmd) or not cmd.startswith(("python", "make")):
            continue
        if "hybrid_rl.export runs/grpo_tiny/checkpoints" in cmd:
            _run(
                tree, "python recipes/grpo_tiny.py trainer.total_steps=2 data.batch_size=16 trainer.progress_bar=false"
            )
        out = _run(tree, cmd, timeout=240)
        ran.append(cmd)
        if "--dry-run" in cmd:
            assert re.search(r"^train\s+[\d.]+ / [\d.]+ GB", out, flags=re.M), out[-2000:]
    assert any("hybrid_rl.export" in c for c in ran) and any("hybrid_rl.plan" in c for c in ran), ran
    assert os.path.isfile(os.path.join(tree, "runs", "grpo_tiny", "hf", "config.json"))


def test_every_command_is_run_or_explained():
    """A command line that neither runs here nor has its reason in NOT_RUN fails (so a new one gets a test)."""
    unexplained = [
        (page, cmd) for page, cmd in _commands() if not _skipped(cmd) and not cmd.startswith(("python", "make"))
    ]
    assert not unexplained, unexplained


def test_the_guess_environment_reads_only_ascii_digits():
    """The README's Guess class, as written, on what a model may write: digits int() refuses (superscripts,
    circled digits, other scripts' digits) are not read as a guess; a random tiny model writes them only now
    and then, so the run above cannot be relied on to meet one."""
    code = next(b for _, b in _blocks("python") if "class Guess" in b)
    namespace: dict = {}
    exec(code.split("register_env(")[0], namespace)  # the imports and the class, nothing run
    guess = namespace["Guess"]({"answer": "7"})
    for text in ("\u00b2", "\u2460 7", "\u0667", "x\u00b37"):
        step = guess.step(text)
        assert not step.done or text.endswith("7"), text
    assert guess.step("it is 7").done and guess.step("5").observation[0]["content"] == "higher"
