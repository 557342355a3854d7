"""The folders are the architecture (issue 35): imports run downward through DESIGN.md's layers, the only
cycles are registries importing their built-ins, no mixins, and the torch-free parts stay torch-free.

The graph and the layer table are tools/import_graph.py's (`python tools/import_graph.py` prints them).
Catches: a lower folder importing a higher one (models/ reaching into switch/, config/ into an engine), a new
cycle between files, a folder missing from the layer table, a `*Mixin` class, torch pulled into the schema.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)


def test_every_folder_is_on_a_layer():
    assert not G.unplaced(G.module_files())


def test_no_import_runs_upward():
    graph = G.imports(G.module_files())
    assert len(graph) > 100 and sum(map(len, graph.values())) > 250, "the graph was not read"
    assert G.upward(graph) == []


def test_the_only_cycles_are_registries():
    found = [frozenset(c) for c in G.cycles(G.imports(G.module_files()))]
    assert [sorted(c) for c in found if c not in G.REGISTRIES] == []
    for cycle in found:  # a registry's cycle stays inside its folder
        assert len({G.unit_of(m) for m in cycle}) == 1


def test_the_checker_sees_what_it_must():
    """The graph reads lazy imports (inside a function), relative imports and `from pkg import module`; a
    planted upward import and a planted cycle are reported."""
    graph = G.imports(G.module_files())
    assert "hybrid_rl.algorithms.advantages" in graph["hybrid_rl.config.schema"]  # lazy, in __post_init__
    assert "hybrid_rl.runtime.distributed" in graph["hybrid_rl.batch"]  # from hybrid_rl.runtime import distributed
    planted = {k: set(v) for k, v in graph.items()}
    planted["hybrid_rl.models.lora"].add("hybrid_rl.switch.phases")
    assert ("hybrid_rl.models.lora", "hybrid_rl.switch.phases") in G.upward(planted)
    planted["hybrid_rl.plan.fixes"].add("hybrid_rl.plan.report")
    assert any({"hybrid_rl.plan.fixes", "hybrid_rl.plan.report"} <= c for c in G.cycles(planted))


def test_no_mixins():
    mixins = [
        f"{p.relative_to(ROOT)}:{node.name}"
        for p in (ROOT / "hybrid_rl").rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")
    ]
    assert mixins == [], "give the engine plain methods or an object it holds (CONTRIBUTING.md)"


def test_schema_and_planner_import_without_torch():
    """config/ and the planner's arithmetic are read by tools that have no torch (DESIGN.md)."""
    code = (
        "import sys; import hybrid_rl.config.schema, hybrid_rl.config.load, hybrid_rl.plan.memory, "
        "hybrid_rl.plan.report, hybrid_rl.plan.fixes; "
        "bad = [m for m in ('torch', 'transformers', 'vllm', 'sglang') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
