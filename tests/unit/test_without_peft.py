"""A run without LoRA (model.lora.rank=0) never needs peft: the `lora` extra is optional, and the `gpu` extra
does not install it. Each run is the tiny recipe (`recipes/grpo_tiny.py`, one step) in a subprocess where peft
cannot be imported (`sys.modules["peft"] = None`: `find_spec` answers None, as for a package that is not
installed, and an import raises ModuleNotFoundError), once per engine: the native engine, the SGLang stand-in
(its engine start asks the policy for adapters) and the real vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import FAKE_SGLANG

pytestmark = pytest.mark.slow  # a recipe start per engine, in its own process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = r"""
import json, runpy, sys
sys.modules["peft"] = None  # as if peft were not installed
engine, out = sys.argv[1], sys.argv[2]
recipe = runpy.run_path(sys.argv[3], run_name="recipe")
summary = recipe["main"](["--create-model", f"trainer.out_dir={out}", f"model.path={out}/model",
    "trainer.total_steps=1", "data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.device=cpu",
    "trainer.progress_bar=false",
    "trainer.save_every=0", "trainer.val_every=0", "trainer.val_before_train=false", f"rollout.engine={engine}"])
loaded = [m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] == "peft"]
print(json.dumps({"peft_loaded": loaded, "out_dir": summary["out_dir"]}))
"""


def _run_without_peft(engine: str, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, FAKE_SGLANG]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, engine, out, os.path.join(ROOT, "recipes", "grpo_tiny.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"rollout.engine={engine} without peft:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["native", "sglang"])
def test_the_recipe_runs_without_peft(engine, tmp_path):
    """Catches: `models.lora.lora_layers` importing peft to look for adapters, which SGLang's engine start does
    for every policy (ModuleNotFoundError at engine start), and any other import of peft on a LoRA-free path."""
    got = _run_without_peft(engine, str(tmp_path / engine))
    assert got["peft_loaded"] == []
    assert os.path.isfile(os.path.join(got["out_dir"], "final_model", "config.json"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable")
def test_the_recipe_runs_on_vllm_without_peft(tmp_path):
    """Catches: the vLLM engine's start or sync importing peft for a policy without adapters."""
    got = _run_without_peft("vllm", str(tmp_path / "vllm"))
    assert got["peft_loaded"] == []
