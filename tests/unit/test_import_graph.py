"""The import graph of sgdjob_operator, sgdjob_trainer and devcluster, read from the source with `ast`:
no import cycles (but the one known below), and the layering rules of the restructure.

Every import counts: at module level, under TYPE_CHECKING, and inside functions (marked lazy: it runs
when the function is called). `import a.b` and `from a import b` where a.b is a module are edges to the
module a.b; `from a import name` where name is not a module is an edge to the package a (its
__init__). Imports of anything outside the three packages are edges to that top-level name (`torch`).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "sgdjob_operator": ROOT / "operator" / "src" / "sgdjob_operator",
    "sgdjob_trainer": ROOT / "trainer" / "src" / "sgdjob_trainer",
    "devcluster": ROOT / "devcluster",
}

SHELLS = ("k8s", "local", "sim", "workers", "cli")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # a module of the packages, or the top-level name of anything else
    lazy: bool  # inside a function


def module_files(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py under each package's folder (a package is its __init__.py)."""
    modules: dict[str, Path] = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: Mapping[str, Path]) -> str:
    """The module an imported dotted name lands in: its longest known prefix, else its top-level name."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


def _absolute(module: str, is_package: bool, name: str | None, level: int) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, name] if name else parts)


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> list[Import]:
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(module, _resolve(alias.name, modules), lazy) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, is_package, child.module, child.level)
                for alias in child.names:
                    submodule = f"{base}.{alias.name}"
                    found.append(Import(module, submodule if submodule in modules else _resolve(base, modules), lazy))
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def all_imports(modules: Mapping[str, Path]) -> list[Import]:
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def graph_of(modules: Iterable[str], imports: Iterable[Import]) -> dict[str, set[str]]:
    """Module -> the modules (and outside top-level names) it imports; every module is a node."""
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted; only those that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def shortest_path(
    graph: Mapping[str, set[str]],
    start: str,
    goal: Callable[[str], bool],
    within: set[str] | None = None,
) -> list[str] | None:
    """The shortest import chain from `start` (excluded from the goal test) to a node that meets `goal`."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if within is not None and nxt not in within:
                continue
            if goal(nxt):
                chain = [nxt, node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            if nxt not in came_from and nxt != start:
                came_from[nxt] = node
                queue.append(nxt)
    return None


def cycles(graph: Mapping[str, set[str]]) -> dict[frozenset[str], str]:
    """Every import cycle: each strongly connected component, named by its shortest cycle
    through its first member (`a -> b -> a`)."""
    named = {}
    for component in strongly_connected(graph):
        first = component[0]
        path = shortest_path(graph, first, lambda node, first=first: node == first, within=set(component))
        assert path is not None
        rest = f"  (with {', '.join(component)})" if len(component) > len(path) - 1 else ""
        named[frozenset(component)] = " -> ".join(path) + rest
    return named


def violations(graph: Mapping[str, set[str]], sources: Iterable[str], forbidden: Callable[[str], bool]) -> list[str]:
    """The import chains from any of `sources` to a forbidden module, directly or through others."""
    chains = (shortest_path(graph, source, forbidden) for source in sorted(sources))
    return [" -> ".join(chain) for chain in chains if chain is not None]


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in packages)


MODULES = module_files(PACKAGES)
IMPORTS = all_imports(MODULES)
GRAPH = graph_of(MODULES, IMPORTS)


def test_the_graph_covers_every_package_and_sees_lazy_imports() -> None:
    assert {m.split(".")[0] for m in MODULES} == set(PACKAGES)
    assert len(MODULES) > 80
    # A function-level import (the operator command loads kopf only when it runs).
    assert Import("sgdjob_operator.cli.operator", "kopf", True) in IMPORTS


def test_no_import_cycles() -> None:
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(sorted(found.values()))


def test_the_trainer_never_imports_the_operator() -> None:
    trainer = [m for m in MODULES if _in(m, "sgdjob_trainer")]
    assert not violations(GRAPH, trainer, lambda m: _in(m, "sgdjob_operator"))


def test_policy_and_api_import_none_of_the_shells() -> None:
    core = [m for m in MODULES if _in(m, "sgdjob_operator.policy", "sgdjob_operator.api")]
    shells = [f"sgdjob_operator.{shell}" for shell in SHELLS]
    assert not violations(GRAPH, core, lambda m: _in(m, *shells))


def test_the_wire_format_and_the_config_import_no_torch() -> None:
    torch_free = [m for m in MODULES if _in(m, "sgdjob_trainer.wire", "sgdjob_trainer.config")]
    assert torch_free and not violations(GRAPH, torch_free, lambda m: m == "torch")


def test_only_the_kubernetes_shell_imports_kopf() -> None:
    """sgdjob_operator.k8s, and the `operator` command inside the function that runs it."""
    importers = {imp for imp in IMPORTS if imp.target == "kopf"}
    lazy_command = {imp for imp in importers if imp.source == "sgdjob_operator.cli.operator" and imp.lazy}
    allowed = {imp for imp in importers if _in(imp.source, "sgdjob_operator.k8s")} | lazy_command
    assert importers - allowed == set()


# ---- the checker itself, on a made-up package ---------------------------------------------------------


def _package(tmp_path: Path, files: Mapping[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    modules = module_files({"pkg": tmp_path / "pkg"})
    return graph_of(modules, all_imports(modules))


def test_the_checker_finds_a_cycle_through_a_lazy_import_of_a_submodule(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "__init__.py": "VERSION = 1\n",
            "a.py": "from pkg import VERSION\n\ndef f():\n    from pkg import b\n    return b\n",
            "b.py": "from .c import g\n",
            "c.py": "import json\nimport pkg.a\n\ng = 1\n",
            "d.py": "from . import a\nfrom .sub.e import h\n",
            "sub/__init__.py": "",
            "sub/e.py": "from .. import d\nfrom ..b import g\n",
        },
    )
    assert graph["pkg.a"] == {"pkg", "pkg.b"}  # `from pkg import b` is the submodule, VERSION the package
    assert graph["pkg.c"] == {"json", "pkg.a"}
    assert graph["pkg.sub.e"] == {"pkg.d", "pkg.b"}
    assert cycles(graph) == {
        frozenset({"pkg.a", "pkg.b", "pkg.c"}): "pkg.a -> pkg.b -> pkg.c -> pkg.a",
        frozenset({"pkg.d", "pkg.sub.e"}): "pkg.d -> pkg.sub.e -> pkg.d",
    }
    assert violations(graph, ["pkg.d"], lambda m: m == "json") == ["pkg.d -> pkg.a -> pkg.b -> pkg.c -> json"]


def test_the_checker_finds_no_cycle_where_there_is_none(tmp_path: Path) -> None:
    graph = _package(tmp_path, {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "import os\n"})
    assert cycles(graph) == {}
    assert violations(graph, ["pkg.a"], lambda m: m == "pkg.a") == []
