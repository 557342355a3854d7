"""The house rules of CONTRIBUTING.md that a machine can check here: a Trainer that other modules do not reach
into (issue 26's "Done when"). The layers and the no-mixin rule are tests/unit/test_layers.py; the line-count caps
were withdrawn (issue 35: one idea per file, one job per function, whatever the length).

Catches: trainer.py importing a private (underscore) name of another module, and a module taking the whole
Trainer as an argument. benchmarks/ and tests/ are outside the rules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "hybrid_rl").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")])


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_sources_found():
    assert len(SOURCES) > 50 and any(p.name == "trainer.py" for p in SOURCES)


def test_trainer_imports_no_private_names():
    private = []
    for node in ast.walk(_tree(ROOT / "hybrid_rl" / "trainer.py")):
        if isinstance(node, ast.ImportFrom):
            private += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.value.id not in ("self", "cls")
        ):
            private.append(f"{node.value.id}.{node.attr}")
    assert not private, f"trainer.py reaches into other modules' private names: {private}"


def _takes_trainer(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
        hint = ast.unparse(a.annotation) if a.annotation is not None else ""
        if a.arg == "trainer" or "Trainer" in hint.replace("TrainerConfig", ""):
            return True
    return False


def test_no_module_takes_the_trainer():
    offenders = []
    for p in SOURCES:
        if p.name == "trainer.py" and p.parent.name == "hybrid_rl":
            continue
        for node in ast.walk(_tree(p)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_trainer(node):
                offenders.append(f"{_rel(p)}:{node.lineno} {node.name}")
    assert not offenders, f"give these the parts they use, not the Trainer: {offenders}"


@pytest.mark.parametrize(
    "src, expect",
    [
        ("def f(trainer): pass", True),
        ("def f(x: 'Trainer'): pass", True),
        ("def f(cfg: TrainerConfig): pass", False),
        ("def f(batch, step): pass", False),
    ],
)
def test_takes_trainer_detector(src, expect):
    """The detector itself: a planted `trainer` parameter is found, a TrainerConfig is not."""
    fn = ast.parse(src).body[0]
    assert _takes_trainer(fn) is expect
