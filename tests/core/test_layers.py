"""The import graph points one way: every module imports only its own layer or those below.

Layers, bottom first (a module belongs to the longest prefix that names it):

    zerogap          the Python client (its own distribution: client/); nothing of the server
    service.core     plain carriers: requests, batch snapshots and results, device helpers,
                     the feature interface; imports nothing else of the project
    service.models   model code and attention backends
    features         request-level plugins and their registry
    service.config, service.tokenizer
                     serving options and the tokenizer (what the engine is built from)
    service.engine   the scheduler and its managers, workers, KV pools, sampler, engine mechanisms
    service          the gRPC server, its limits, interceptors, metrics, model preparation
    service.gateway  the OpenAI-compatible gateway (a client of the gRPC server)
    service.__main__ the command line

Every import counts, wherever it sits: module level, inside a function, or under
`if TYPE_CHECKING:` (a type-only import points down like any other). Within one layer imports
may go either way, but no set of modules may import each other in a circle.

`python tests/core/test_layers.py [ROOT]` prints the graph's counts (files, edges, cycles, upward edges).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS: list[tuple[str, ...]] = [
    ("zerogap",),
    ("service.core",),
    ("service.models",),
    ("features",),
    ("service.config", "service.tokenizer"),
    ("service.engine",),
    ("service",),
    ("service.gateway",),
    ("service.__main__",),
]
# Where each top-level package's source lives, relative to the repository root.
SOURCES = {"zerogap": "clients/python/zerogap", "service": "service", "features": "features"}
FALLBACK_SOURCES = {"zerogap": "zerogap"}  # where it was before it had its own distribution


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for pkg, rel in SOURCES.items():
        base = root / rel
        if not base.exists() and pkg in FALLBACK_SOURCES:
            base = root / FALLBACK_SOURCES[pkg]
        for f in sorted(base.rglob("*.py")):
            parts = [pkg, *f.relative_to(base).with_suffix("").parts]
            if "_gen" in parts or "v1" in parts:  # generated stubs
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


def edges(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) between the project's modules; `from a import b` names a.b when b is a module."""
    out = set()
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.add((name, target))
    return out


def layer(module: str) -> int:
    """Index in LAYERS of the longest prefix naming the module."""
    named = [
        (len(p), i)
        for i, prefixes in enumerate(LAYERS)
        for p in prefixes
        if module == p or module.startswith(p + ".")
    ]
    return max(named)[1]


def cycles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in graph:
        succ[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted({m for e in graph for m in e}):
        if v not in index:
            visit(v)
    return found


def upward(graph: set[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, b in graph if layer(b) > layer(a))


def test_no_import_cycles():
    assert cycles(edges(modules())) == []


def test_no_import_climbs_a_layer():
    assert upward(edges(modules())) == []


def test_core_imports_nothing_else_of_the_project():
    graph = edges(modules())
    assert (
        sorted((a, b) for a, b in graph if a.startswith("service.core") and not b.startswith("service.core"))
        == []
    )


def test_the_client_imports_nothing_of_the_server():
    graph = edges(modules())
    assert sorted((a, b) for a, b in graph if a.startswith("zerogap") and not b.startswith("zerogap")) == []


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    mods = modules(root)
    graph = edges(mods)
    loops, up = cycles(graph), upward(graph)
    print(f"files {len(mods)}  edges {len(graph)}  cycles {len(loops)}  upward edges {len(up)}")
    for comp in loops:
        print("  cycle:", " <-> ".join(comp))
    for a, b in up:
        print(f"  up: {a} (layer {layer(a)}) -> {b} (layer {layer(b)})")
