"""The recipes as a user meets them on the command line (config/checks.py `command_line` and `RecipeParser`):
`--help` says what the recipe does, its flags, how `key.sub=value` overrides are written and where the keys
are documented; every mistake is one line starting `error:` and exit status 2; a model.path that holds no
model is refused unless --create-model is given (the recipe's own default path is created, saying so).

Most run `main` in this process through `command_line`, as `__main__` does (no interpreter start per case);
one runs the script for real, for the exit status and the exact stderr.

Catches: --help printing no help (or no word on overrides), an unknown flag taken for an override, an
override without '=' or a refused resume ending in a traceback, a typo'd model.path filled with a random model,
and the recipe's own first run (`make demo` on a fresh clone) no longer creating its model.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybrid_rl.config.checks import command_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def recipes():
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    try:
        import grpo_7b
        import grpo_tiny

        yield {"grpo_tiny": grpo_tiny, "grpo_7b": grpo_7b}
    finally:
        sys.path.remove(os.path.join(ROOT, "recipes"))


class _FakeTrainer:
    def __init__(self, cfg):
        pass

    def fit(self):
        return []

    def save_pretrained(self, path):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("name", ["grpo_tiny", "grpo_7b"])
def test_help_says_what_the_recipe_does_its_flags_and_how_to_set_keys(recipes, name, capsys):
    with pytest.raises(SystemExit) as stop:
        recipes[name].main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    first_doc_line = recipes[name].__doc__.strip().splitlines()[0]
    assert out.startswith("usage: ") and first_doc_line in out
    assert "key.sub=value" in out and "docs/configuration.md" in out and f"recipes/{name}.yaml" in out
    flag = "--create-model" if name == "grpo_tiny" else "--dry-run"
    assert flag in out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["trainer.total_steps", "3"], "command-line override 'trainer.total_steps' is not of the form key.sub=value"),
        (["trainer.total_step=3"], "config key 'trainer.total_step': Key 'total_step' not in 'TrainerConfig'"),
        (["model.lora=3"], "config key 'model.lora': Merge error: int is not a subclass of LoraSettings"),
    ],
)
def test_each_mistake_is_one_line_and_exit_status_2(recipes, capsys, argv, says):
    """(A model.path with no model: test_only_the_recipes_own_model_path_is_created_unasked.)"""
    assert command_line(recipes["grpo_tiny"].main, argv) == 2
    assert says in _one_line_error(capsys)


@pytest.mark.parametrize("name", ["grpo_tiny", "grpo_7b"])
def test_an_unknown_flag_is_one_line_not_an_override(recipes, name, capsys):
    with pytest.raises(SystemExit) as stop:
        command_line(recipes[name].main, ["--dry_run"])
    assert stop.value.code == 2
    assert _one_line_error(capsys) == "error: unrecognized flag '--dry_run' (see --help)"


def test_a_refused_resume_is_one_line(recipes, tmp_path, tiny_model_dir, capsys):
    """A fresh run (trainer.resume=none) in a directory that holds checkpoints: the refusal, not a traceback."""
    os.makedirs(tmp_path / "run" / "checkpoints" / "step_00000002")
    argv = [f"model.path={tiny_model_dir}", f"trainer.out_dir={tmp_path / 'run'}", "trainer.resume=none"]
    assert command_line(recipes["grpo_tiny"].main, argv) == 2
    assert "holds checkpoints (steps 2) that a fresh run" in _one_line_error(capsys)


def test_a_bad_data_row_is_one_line(recipes, tmp_path, tiny_model_dir, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 2 3 ="}\n{"question": "no prompt here"}\n')
    argv = [f"model.path={tiny_model_dir}", "data.task=jsonl", f"data.path={rows}", f"trainer.out_dir={tmp_path}"]
    assert command_line(recipes["grpo_tiny"].main, argv) == 2
    assert f"{rows}: row 1 has neither a non-empty string nor a list of chat messages" in _one_line_error(capsys)


def test_only_the_recipes_own_model_path_is_created_unasked(recipes, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recipes["grpo_tiny"], "Trainer", _FakeTrainer)
    recipes["grpo_tiny"].main([f"trainer.out_dir={tmp_path / 'run'}"])  # the YAML's runs/tiny_qwen2
    assert "NOTE: creating a RANDOM-weight tiny Qwen2 at model.path=runs/tiny_qwen2" in capsys.readouterr().out
    assert (tmp_path / "runs" / "tiny_qwen2" / "config.json").is_file()
    typo = ["model.path=runs/tiny_qwn2", f"trainer.out_dir={tmp_path / 'run'}"]
    assert command_line(recipes["grpo_tiny"].main, typo) == 2 and not (tmp_path / "runs" / "tiny_qwn2").exists()
    assert "config key 'model.path': 'runs/tiny_qwn2' holds no model" in _one_line_error(capsys)
    recipes["grpo_tiny"].main(["--create-model", *typo])
    assert (tmp_path / "runs" / "tiny_qwn2" / "config.json").is_file()


def test_the_script_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "recipes", "grpo_tiny.py"), "trainer.total_steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: command-line override 'trainer.total_steps' is not of the form key.sub=value (no spaces around "
        "'='; a flag of the recipe starts with --, see --help)"
    ], proc.stderr[-2000:]
