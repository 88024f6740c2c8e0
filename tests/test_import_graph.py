"""The import graph of the ``draftlab`` namespace (issue 47): no cycle, and dependencies point one
way (data -> models -> losses/inference -> train/export -> CLI).

The graph is read from the source with ``ast``, nothing imported. Both kinds of import count:
module-level ones, whose cycles break an import outright, and the ones inside functions (lazy),
whose cycles break nothing at import time but tie two modules into one that neither can be read,
tested or moved without. Imports under ``if TYPE_CHECKING:`` run never and are left out. An
``import draftlab.a.b`` or ``from draftlab.a import b`` also runs ``draftlab/a/__init__.py``: the
package is an edge too.
"""

from __future__ import annotations

import ast
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, Path]:
    """Package name -> folder, as pyproject.toml maps them (``draftlab.data`` is ``data/``)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module of the namespace: dotted name -> file."""
    found = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, name: str, is_package: bool):
    """(imported dotted name, lazy) for every import statement of a module."""
    package = name if is_package else name.rpartition(".")[0]

    def visit(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    yield from visit(ast.Module(body=[sub], type_ignores=[]), lazy)
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, lazy
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the module's package upwards
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    yield f"{base}.{alias.name}", lazy  # a submodule, or a name of module ``base``
                yield base, lazy
            yield from visit(child, inner)

    yield from visit(tree, False)


def import_graph(include_lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the namespace's modules it imports (and the packages those run first)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for target, lazy in _imports(tree, name, path.stem == "__init__"):
            if lazy and not include_lazy:
                continue
            # the longest prefix that is a module, and the packages above it
            parts = target.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            for i in range(len(parts), 0, -1):
                edges.add(".".join(parts[:i]))
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


# Dependencies point one way: data -> models -> losses/inference -> train/export -> the CLI. What
# each package may not import (data/ does import models/target.py, the one code that runs the
# target, to capture hidden states; models/ imports the losses the families train with).
CLI = ("draftlab.cli", "draftlab.cli_decode")
NOT_IMPORTED_BY = {
    "draftlab.data": ("draftlab.inference", "draftlab.train", "draftlab.export", *CLI),
    "draftlab.models": ("draftlab.inference", "draftlab.train", "draftlab.export", *CLI),
    "draftlab.losses": ("draftlab.inference", "draftlab.train", "draftlab.export", *CLI),
    "draftlab.kernels": ("draftlab.inference", "draftlab.train", "draftlab.export", *CLI),
    "draftlab.inference": ("draftlab.train", "draftlab.export", *CLI),
    "draftlab.export": ("draftlab.train", *CLI),
    "draftlab.train": CLI,
    # leaves every layer imports
    "draftlab.errors": ("draftlab.",), "draftlab.limits": ("draftlab.",),
}


def _wrong_way(graph: dict[str, set[str]], package: str, forbidden: tuple[str, ...]) -> list[str]:
    def under(name: str, prefix: str) -> bool:
        return name.startswith(prefix) if prefix.endswith(".") else name == prefix or name.startswith(prefix + ".")

    return sorted(f"{m} -> {d}" for m, deps in graph.items() if under(m, package)
                  for d in deps if d != "draftlab" and any(under(d, f) for f in forbidden) and not under(d, package))


def test_the_graph_reads_imports_of_every_kind():
    src = ast.parse(
        "import draftlab.models.target\n"
        "from draftlab.inference import decoder\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from draftlab.train import trainer\n"
        "def f():\n    from draftlab.export.formats import register\n"
        "class C:\n    def m(self):\n        from . import layers\n"
    )
    found = set(_imports(src, "draftlab.models.x", False))
    assert ("draftlab.models.target", False) in found and ("draftlab.inference.decoder", False) in found
    assert ("draftlab.export.formats.register", True) in found and ("draftlab.models.layers", True) in found
    assert not any("train" in name for name, _ in found)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()
    assert len(graph) > 50 and "draftlab.inference.decoder" in graph["draftlab.inference.evaluate"]


def test_no_import_cycle_in_the_namespace():
    """Module-level imports first (a cycle there breaks an import), then every import."""
    for lazy in (False, True):
        cycle = find_cycle(import_graph(include_lazy=lazy))
        assert cycle is None, f"import cycle ({'lazy imports included' if lazy else 'module level'}): {' -> '.join(cycle)}"


def test_models_import_neither_inference_nor_train():
    wrong = _wrong_way(import_graph(), "draftlab.models", ("draftlab.inference", "draftlab.train"))
    assert not wrong, "models/ reaches up into inference/ or train/: " + ", ".join(wrong)


def test_dependencies_point_one_way():
    """No package imports one above it (lazy imports included)."""
    graph = import_graph()
    wrong = [edge for package, forbidden in NOT_IMPORTED_BY.items() for edge in _wrong_way(graph, package, forbidden)]
    assert not wrong, "imports against data -> models -> losses/inference -> train/export -> CLI: " + ", ".join(wrong)
    assert _wrong_way({"draftlab.models.x": {"draftlab.train.y"}}, "draftlab.models", ("draftlab.train",))
