"""docs/ARCHITECTURE.md and the README name what exists: every path they give under the
project's folders, every `module.Name` in such a path, and every `Class.attribute` of a class
the project defines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/ARCHITECTURE.md", "README.md")
FOLDERS = ("engine", "connector", "deployments", "pdserve", "protos", "tests", "k8s", "docs")
_SPAN = re.compile(r"`([^`\n]+)`")


def _spans(doc: str) -> set[str]:
    return {span.strip() for span in _SPAN.findall((ROOT / doc).read_text())}


def _class_attributes() -> dict[str, set[str]]:
    """Each project class's methods, class attributes and `self.` attributes (a name defined
    by two classes counts both's)."""
    found: dict[str, set[str]] = {}
    for folder in ("engine", "connector", "deployments", "pdserve"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, set()).update(_attributes(node))
    return found


def _attributes(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif _self_attribute_set(node):
            names.add(node.attr)  # type: ignore[attr-defined]
    return names


def _self_attribute_set(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    )


@pytest.mark.parametrize("doc", DOCS)
def test_paths_the_docs_name_exist(doc: str) -> None:
    missing = []
    for span in _spans(doc):
        if not re.fullmatch(r"[\w./-]+", span) or "/" not in span:
            continue
        if span.split("/")[0] in FOLDERS and not _exists(span.rstrip("/")):
            missing.append(span)
    assert sorted(missing) == []


def _exists(span: str) -> bool:
    """A file or folder, or `folder/module.name` (a class or function of that module)."""
    if (ROOT / span).exists():
        return True
    path, _, name = span.rpartition(".")
    module = ROOT / f"{path}.py"
    return module.is_file() and bool(re.search(rf"\b(class|def) {name}\b", module.read_text()))


@pytest.mark.parametrize("doc", DOCS)
def test_class_attributes_the_docs_name_exist(doc: str) -> None:
    classes = _class_attributes()
    missing = []
    for span in _spans(doc):
        match = re.fullmatch(r"([A-Z]\w+)\.(\w+)(\(\))?", span)
        if match and match.group(1) in classes and match.group(2) not in classes[match.group(1)]:
            missing.append(span)
    assert sorted(missing) == []
