"""The package's shape, read from its source: no import circle, a storage core that imports nothing
above it, and no module too long to read.

Every module of the installed package (the packages pyproject lists, found where the installation
put them) is parsed, and each of its imports counted: at the top, inside functions and under
``TYPE_CHECKING`` alike, since a type-only import ties two modules together as much as any other.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MAX_LINES = 600
"""The most lines a module may have."""

ABOVE_THE_CORE = (
    "tierstore.optimizer",
    "tierstore.activations",
    "tierstore.checkpoint",
    "tierstore.integrations",
    "tierstore.app",
)
"""The workloads, the integrations and the application: built on the core, never imported by it."""

NOT_CORE = (*ABOVE_THE_CORE, "tierstore.testing")
"""Everything of ``tierstore`` outside the storage core (the backends belong to the core)."""


@dataclass(frozen=True)
class Module:
    """One module of the package: its dotted name, its source, and whether it is a package's
    ``__init__`` (relative imports resolve against the package itself then)."""

    name: str
    path: Path
    is_package: bool


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _packages() -> list[str]:
    """The packages pyproject installs."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages: list[str] = setuptools["packages"]
    return packages


def _modules() -> dict[str, Module]:
    """Every module of the packages pyproject lists, by dotted name, where the installation put it."""
    modules: dict[str, Module] = {}
    for package in _packages():
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
        for directory in spec.submodule_search_locations:
            for path in sorted(Path(directory).glob("*.py")):
                is_package = path.name == "__init__.py"
                name = package if is_package else f"{package}.{path.stem}"
                modules[name] = Module(name, path, is_package)
    return modules


def _imported(module: Module, known: dict[str, Module]) -> Iterator[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    here = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known_prefix(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    yield submodule
                else:
                    yield from _known_prefix(source, known)


def _known_prefix(name: str, known: dict[str, Module]) -> Iterator[str]:
    """The longest of ``name`` and its parents that is a module of the package, if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            yield candidate
            return


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (its own parent packages left out: importing any
    module runs them first, whoever imports it)."""
    known = _modules()
    graph: dict[str, set[str]] = {}
    for name, module in known.items():
        graph[name] = {
            imported
            for imported in _imported(module, known)
            if imported != name and not name.startswith(imported + ".")
        }
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import one another (strongly connected
    components, Tarjan's algorithm), as the list of modules around it."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                lowest[node] = min(lowest[node], lowest[successor])
            elif successor in on_stack:
                lowest[node] = min(lowest[node], index[successor])
        if lowest[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_within(group, graph) for group in groups]


def _circle_within(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest circle from the group's first module back to itself, through the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & group):
                if successor == start:
                    return [*paths[node], start]
                if successor not in paths:
                    paths[successor] = [*paths[node], successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no circle through {sorted(group)}")


def _layer_offenders(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a workload, an integration or the application by a core module."""
    return [
        f"{name} imports {imported}"
        for name, imports in sorted(graph.items())
        if _within(name, ("tierstore",)) and not _within(name, NOT_CORE)
        for imported in sorted(imports)
        if _within(imported, ABOVE_THE_CORE)
    ]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph()


def test_every_listed_package_is_parsed(graph: dict[str, set[str]]) -> None:
    assert {*_packages(), "tierstore.store", "tierstore.activations.offload"} <= set(graph)


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    circles = [" -> ".join(circle) for circle in _circles(graph)]
    assert not circles, "import circles (one through each group of modules importing one another):\n" + (
        "\n".join(circles)
    )


def test_the_core_imports_nothing_above_it(graph: dict[str, set[str]]) -> None:
    offenders = _layer_offenders(graph)
    assert not offenders, "core modules importing a workload, an integration or the application:\n" + (
        "\n".join(offenders)
    )


def test_no_module_is_too_long() -> None:
    lengths = {name: len(module.path.read_text().splitlines()) for name, module in _modules().items()}
    offenders = [f"{name}: {lines} lines" for name, lines in sorted(lengths.items()) if lines > MAX_LINES]
    assert not offenders, f"modules over {MAX_LINES} lines:\n" + "\n".join(offenders)


def test_imports_are_read_wherever_they_are(tmp_path: Path) -> None:
    """Type-only and function-level imports count, relative ones resolve against the importing
    module's package, ``from package import module`` names the module, and imports from outside
    the package are left out."""
    source = tmp_path / "stage.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from ..errors import ConfigError\n"
        "from . import spill_policy\n"
        "if TYPE_CHECKING:\n"
        "    from ..store import TierStore\n"
        "def later() -> None:\n"
        "    import tierstore.app.cli\n"
    )
    names = ["tierstore", "tierstore.errors", "tierstore.store", "tierstore.activations"]
    names += ["tierstore.activations.spill_policy", "tierstore.app", "tierstore.app.cli"]
    known = {name: Module(name, tmp_path / "unread.py", False) for name in names}
    stage = Module("tierstore.activations.stage", source, False)
    assert set(_imported(stage, known)) == {
        "tierstore.errors",
        "tierstore.activations.spill_policy",
        "tierstore.store",
        "tierstore.app.cli",
    }


def test_circles_and_layers_are_found() -> None:
    """A circle is reported as the modules around it, once per group importing one another; a core
    module importing anything above the core is reported, the rest of the package is not."""
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    layers = {
        "tierstore.store": {"tierstore.activations.replay", "tierstore.errors"},
        "tierstore.backends.dram": {"tierstore.integrations"},
        "tierstore.app.cli": {"tierstore.optimizer"},
        "tierstore.testing.device": {"tierstore.activations"},
        "tierstore.optimizer.engine": {"tierstore.checkpoint"},
    }
    assert _layer_offenders(layers) == [
        "tierstore.backends.dram imports tierstore.integrations",
        "tierstore.store imports tierstore.activations.replay",
    ]
