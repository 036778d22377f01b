"""Every project import in bench/ resolves: the benches run outside the suite, so a module moved by a
re-layout (service.engine.request -> service.core.request) broke one unseen."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("service", "features", "zerogap")


def _project_imports() -> list[tuple[str, str, str | None]]:
    """(bench file, module, name or None) for each `from <project> import name` / `import <project>...`."""
    out = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in PROJECT:
                    out += [(path.name, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                out += [(path.name, a.name, None) for a in node.names if a.name.split(".")[0] in PROJECT]
    return out


@pytest.mark.parametrize("bench", sorted({b for b, _, _ in _project_imports()}))
def test_bench_imports_resolve(bench):
    missing = []
    for b, module, name in _project_imports():
        if b != bench:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module}: {e}")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, missing
