"""The layers of docs/ARCHITECTURE.md, checked on the source: who may import whom (layers, and
deployments/ by process), no import cycles, no file or function past the length limits."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
MAX_FUNCTION_LINES = 60
# deployments/ by process (docs/ARCHITECTURE.md, "Layers"): a package never imports those named.
PROCESS_BOUNDARIES = {
    "deployments.router": ("deployments.replica",),
    "deployments.replica": ("deployments.router",),
    "deployments.cluster": ("deployments.router", "deployments.replica"),
}
# What runs an engine: the router and the cluster services never load it (they tokenize, route
# and count; an engine replica runs the model).
ENGINE_RUNTIME = ("engine.engine_core", "engine.worker", "engine.async_engine", "engine.llm")
NO_ENGINE_RUNTIME = ("deployments.router", "deployments.cluster")


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


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_deployments_processes_keep_to_their_own_side() -> None:
    """router/ and replica/ never import each other, cluster/ imports neither, and neither the
    router nor the cluster services import what runs an engine — anywhere in a module, lazy
    imports included."""
    wrong = []
    for _, path in _sources():
        module = _module_name(path)
        forbidden = [
            banned
            for package, banned_packages in PROCESS_BOUNDARIES.items()
            if _under(module, package)
            for banned in banned_packages
        ]
        if any(_under(module, package) for package in NO_ENGINE_RUNTIME):
            forbidden += ENGINE_RUNTIME
        for name in sorted(_imports(ast.parse(path.read_text()), top_level_only=False)):
            if any(_under(name, banned) for banned in forbidden):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_router_and_cluster_load_no_engine_runtime() -> None:
    """The same, as Python sees it: importing every router and cluster module (with what they
    import in turn) loads no engine core, model runner, async engine, offline API or replica;
    nor torch (seconds of every router replica's start), not even once the router has read
    its model's config and tokenizer (from a GGUF too)."""
    packages = [*NO_ENGINE_RUNTIME]
    code = f"""
import importlib, pkgutil, sys
for name in {packages!r}:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
from engine.inputs import InputProcessor
InputProcessor.from_args("smollm2", device="cpu")  # as the Router replica starts
banned = {(*ENGINE_RUNTIME, "deployments.replica", "torch")!r}
loaded = [m for m in sys.modules if m.startswith(banned)]
print(sorted(loaded))
print(len([m for m in sys.modules if m.startswith("deployments.router.")]))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded, num_router_modules = result.stdout.splitlines()
    assert loaded == "[]"
    assert int(num_router_modules) >= 10  # the walk did import the router's modules


def _all_python_files() -> Iterator[Path]:
    for folder in ("engine", "connector", "deployments", "pdserve", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def test_no_file_over_the_line_limit() -> None:
    """A reader can hold a file in their head (STYLE.md): split by responsibility beyond it."""
    long_files = [
        f"{path.relative_to(ROOT)}: {lines}"
        for path in _all_python_files()
        if (lines := path.read_text().count("\n")) > MAX_LINES
    ]
    assert long_files == []


def test_no_function_over_the_line_limit() -> None:
    long_functions = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in _all_python_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long_functions == []


def _packages() -> set[str]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}


def test_every_installed_package_is_a_layer_and_ships_in_the_image() -> None:
    assert _packages() == set(ALLOWED)
    dockerfile = (ROOT / "Dockerfile").read_text()
    missing = [p for p in sorted(_packages()) if f" {p} ./{p}\n" not in dockerfile]
    assert missing == []
