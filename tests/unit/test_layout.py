"""The layers of docs/ARCHITECTURE.md, checked on the source: who may import whom, no import
cycles, no long file without a reason at its top."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each layer may import itself and the layers listed (docs/ARCHITECTURE.md, "Layers").
ALLOWED = {
    "protos": {"protos"},
    "engine": {"engine"},
    "connector": {"connector", "engine", "protos"},
    "deployments": {"deployments", "connector", "engine", "protos"},
    "pdserve": {"pdserve", "deployments", "connector", "engine", "protos"},
}
MAX_LINES = 450
LONG_FILE_MARK = "Why this file is long:"


def _sources() -> Iterator[tuple[str, Path]]:
    for layer in ALLOWED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield layer, path


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, top_level_only: bool) -> set[str]:
    """Project modules imported; with `top_level_only`, those that run on import (not inside
    a function nor under `if TYPE_CHECKING:`)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in ALLOWED}


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for layer, path in _sources():
        tree = ast.parse(path.read_text())
        for name in sorted(_imports(tree, top_level_only=False)):
            if name.split(".")[0] not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_no_import_cycles_at_import_time() -> None:
    modules = {_module_name(path): path for _, path in _sources()}
    graph = {
        name: {m for m in _imports(ast.parse(path.read_text()), True) if m in modules} - {name}
        for name, path in modules.items()
    }
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("folder", ["engine", "connector", "deployments", "pdserve", "tests"])
def test_long_files_say_why_at_their_top(folder: str) -> None:
    unexplained = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_LINES and LONG_FILE_MARK not in (
            ast.get_docstring(ast.parse(text)) or ""
        ):
            unexplained.append(str(path.relative_to(ROOT)))
    assert unexplained == []


def _packages() -> set[str]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}


def test_every_installed_package_is_a_layer_and_ships_in_the_image() -> None:
    assert _packages() == set(ALLOWED)
    dockerfile = (ROOT / "Dockerfile").read_text()
    missing = [p for p in sorted(_packages()) if f" {p} ./{p}\n" not in dockerfile]
    assert missing == []
