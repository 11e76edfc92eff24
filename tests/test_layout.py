"""The package layout: no import circle among nbserve's modules, no package importing one above
it, and docs/architecture.md naming every module. Read from the source (ast), nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nbserve"

# Who may import whom (a package may always import its own modules, and nbserve.types).
ALLOWED = {
    "types": set(),
    "cpu": set(),
    "text": set(),
    "execution": {"cpu"},
    "models": {"execution", "cpu", "text"},
    "loading": {"models", "execution", "text", "cpu"},
    "engine": {"models", "execution", "text", "cpu", "loading"},
    "pool": {"engine", "models", "execution", "loading", "cpu", "text"},
    "api": {"text"},
    "serving": {"api", "pool", "engine", "loading", "models", "execution", "text", "cpu"},
    "ray": {"serving", "pool", "engine", "loading", "api"},
    "server": {"serving"},
    "__init__": {"serving", "engine", "pool", "loading", "models", "api"},
    "__main__": {"serving"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """nbserve modules that `name` imports anywhere in its file (lazy imports included)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # `from pkg.mod import func` -> pkg.mod
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbserve"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("nbserve"):
                continue
            for alias in node.names:  # `from . import sampling` names a module
                sub = f"{mod}.{alias.name}"
                add(sub if sub in known else mod)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def top(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_the_import_graph_is_read() -> None:
    g = graph()
    assert "nbserve.engine.step" in g["nbserve.engine.engine"]
    assert "nbserve.models.base" in g["nbserve.loading.hf_dir"]


def test_no_import_circle_among_nbserve_modules() -> None:
    g = graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_package_imports_one_above_it() -> None:
    wrong = []
    for name, targets in graph().items():
        here = top(name)
        for target in targets:
            there = top(target)
            if there not in (here, "types") and there not in ALLOWED[here]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("name", sorted(modules()))
def test_the_architecture_doc_names_every_module(name: str) -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    path = str(modules()[name].relative_to(ROOT / "nbserve"))
    if path.endswith("__init__.py") and path != "__init__.py":
        path = path[:-len("__init__.py")]  # a package is named by its folder, `engine/`
    assert f"`{path}`" in doc, f"docs/architecture.md does not mention `{path}`"
