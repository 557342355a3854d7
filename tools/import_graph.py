"""The package's import graph against its layers (DESIGN.md's package map): cycles and imports that run upward.

    python tools/import_graph.py            # the layer table, each folder's imports, cycles, upward imports
    python tools/import_graph.py --dot      # the graph between folders, in Graphviz's dot language

Every `import` / `from ... import` of a hybrid_rl module counts, at the top of a file or inside a function (a lazy
import is still a dependency). A file belongs to its folder under hybrid_rl/ (a top-level file is its own unit);
`LAYERS` orders the units from the bottom up. An import may run to a lower layer or within its own unit, never
up; a cycle of files is allowed only where a registry imports its built-ins (`REGISTRIES`), inside one folder.
tests/unit/test_layers.py asserts both; exit status 1 here when either is broken.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybrid_rl"
KERNELS = ROOT / "kernels"  # installed as hybrid_rl.kernels (setup.py package_dir)

# Bottom first. A unit may import its own files and any unit of a lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("types", "runtime", "kernels"),  # the step's data types, process-level helpers, Triton kernels
    ("algorithms",),  # pure tensor functions
    ("config",),  # the schema: dataclasses, no torch, no engine
    ("batch", "data", "observability"),  # the step's batches, prompt data, metrics and loggers
    ("models",),  # HF loading, FSDP2, log-probs, LoRA, weights gathering, the tiny builders
    ("checkpoint",),  # sharded checkpoints and export
    ("plan",),  # the memory planner and placement rates
    ("rewards",),  # verifiers, reward functions, the reward model
    ("envs",),  # environments and the episode runner
    ("rollout",),  # the engines
    ("switch", "split"),  # the phase switch; the split placement
    ("loop",),  # the stages the trainer calls
    ("trainer", "export"),  # the Trainer; `python -m hybrid_rl.export`
    ("__init__",),  # the package's face: Trainer, Config, load_config
]
# Registration by import: a registry module imports its built-ins, which import it back to register.
REGISTRIES = {
    frozenset(
        {"hybrid_rl.rewards.base", "hybrid_rl.rewards.toy", "hybrid_rl.rewards.math", "hybrid_rl.rewards.latex_math"}
    ),
    # (gsm8k_calc builds on tools.ToolEnv, which takes Step from base: the same registration loop)
    frozenset({"hybrid_rl.envs.base", "hybrid_rl.envs.gsm8k_calc", "hybrid_rl.envs.tiny_ask", "hybrid_rl.envs.tools"}),
}


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for the package and the kernels folder it installs."""
    out = {}
    for base, prefix in ((PACKAGE, "hybrid_rl"), (KERNELS, "hybrid_rl.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = path
    return out


def unit_of(module: str) -> str:
    """The folder under hybrid_rl/ a module lives in, or its own name for a top-level file."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The longest known module a dotted name starts with (`a.b.Name` -> `a.b`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of the file)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module if is_pkg else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                target = _resolve(name, modules) if name.startswith("hybrid_rl") else None
                # `from pkg import submodule` names the submodule; `from pkg import name` only the package
                if target and target != module:
                    deps.add(target)
        # `from hybrid_rl.x import y` lists both hybrid_rl.x.y (when a module) and hybrid_rl.x: keep the package
        # only where no submodule of it was named by the same statement's names (its __init__ runs either way).
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of() -> dict[str, int]:
    return {unit: i for i, units in enumerate(LAYERS) for unit in units}


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module's unit sits on a higher layer, or on the same layer
    in another unit (units of one layer do not import each other)."""
    rank = layer_of()
    bad = []
    for a, deps in sorted(graph.items()):
        for b in sorted(deps):
            ua, ub = unit_of(a), unit_of(b)
            if ua != ub and rank[ub] >= rank[ua]:
                bad.append((a, b))
    return bad


def unplaced(modules: dict[str, pathlib.Path]) -> list[str]:
    rank = layer_of()
    return sorted({unit_of(m) for m in modules} - set(rank))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="the graph between units, as Graphviz dot")
    args = parser.parse_args(argv)
    modules = module_files()
    graph = imports(modules)
    edges = sorted({(unit_of(a), unit_of(b)) for a, deps in graph.items() for b in deps if unit_of(a) != unit_of(b)})
    if args.dot:
        print("digraph hybrid_rl {\n  rankdir=BT;")
        print("\n".join(f'  "{a}" -> "{b}";' for a, b in edges))
        print("}")
        return 0
    print("layers, bottom first; each unit with the units it imports:")
    for i, units in enumerate(LAYERS):
        for unit in units:
            deps = sorted(b for a, b in edges if a == unit)
            print(f"  {i:2d} {unit:<14} -> {', '.join(deps) or '-'}")
    found = cycles(graph)
    allowed = [c for c in found if frozenset(c) in REGISTRIES]
    other = [c for c in found if frozenset(c) not in REGISTRIES]
    up = upward(graph)
    missing = unplaced(modules)
    print(f"\nmodules: {len(modules)}; imports: {sum(len(d) for d in graph.values())}")
    print(f"cycles: {len(found)} ({len(allowed)} registries importing their built-ins)")
    for c in other:
        print("  NOT ALLOWED: " + " <-> ".join(sorted(c)))
    print(f"imports that run upward: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    for unit in missing:
        print(f"  unit {unit!r} is on no layer: add it to LAYERS")
    return 1 if other or up or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
