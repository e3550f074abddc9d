"""The import graph of the product packages and tools, read with ``ast`` (nothing imported).

The rules of the package layout (docs/design.md; the layers, lowest first: common, engine,
dataplane, controlplane, exporter, console; tools on top, not part of the product):

- no import circles between modules (imports inside functions count: a lazy import is still
  a dependency, and a circle through one is still a tangle);
- ``engine`` imports neither openvino nor zmq, directly or through any product module in
  its import closure;
- nothing in common/engine/dataplane/controlplane/exporter imports console or tools;
- no product package imports tools; console may, but only lazily (inside a function that
  module-level code does not call), so ``zctl`` starts without importing the benchmarks.

Each failure names the files and lines that break the rule. The checker itself is tested on
small synthetic trees in tmp_path, so that it cannot silently pass.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOWER = ("common", "engine", "dataplane", "controlplane", "exporter", "serve")  # below console
PRODUCT = (*LOWER, "console")
TOOLS = "tools"
SCANNED = (*PRODUCT, TOOLS)
HEAVY = ("openvino", "zmq")  # what engine must not pull in (openvino_tokenizers etc. count)


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` at ``path:line``; ``target`` is a scanned module, or
    the top-level name of anything else (``zmq``, ``numpy``)."""

    source: str
    target: str
    path: str
    line: int
    eager: bool  # runs when ``source`` is imported (module level, or a function it calls)
    scope: str = "module"  # "module", "main" (the __main__ guard) or the top function

    def where(self) -> str:
        if not self.eager:
            how = " (lazily)"
        elif self.scope != "module":
            how = f" (in {self.scope}(), which runs at import)"
        else:
            how = ""
        return f"{self.path}:{self.line} imports {self.target}{how}"


class Graph(dict):
    """Module -> its imports; a short repr keeps failure reports readable."""

    def __repr__(self) -> str:
        return f"<import graph of {len(self)} modules>"


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every .py file under root/<package>."""
    found: dict[str, Path] = {}
    for package in packages:
        base = root / package
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


class _Collector(ast.NodeVisitor):
    """Every import statement of one module (and ``importlib.import_module("literal")``),
    with whether it runs at import time. ``if TYPE_CHECKING:`` blocks are skipped."""

    def __init__(self) -> None:
        self.found: list[tuple[str, int, int, str | None, str]] = []  # name, line, level,
        # from-name (or None), scope: "module", "main" or the enclosing top function's name
        self.scope = "module"
        self.called_at_module_level: set[str] = set()

    def _add(self, name: str, line: int, level: int = 0, member: str | None = None) -> None:
        self.found.append((name, line, level, member, self.scope))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self._add(node.module or "", node.lineno, node.level, alias.name)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        if self.scope == "module" and _is_main_guard(node.test):
            self.scope = "main"
            for child in node.body:
                self.visit(child)
            self.scope = "module"
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        outer = self.scope
        if outer in ("module", "main"):
            self.scope = getattr(node, "name", "<lambda>")
        self.generic_visit(node)
        self.scope = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.generic_visit(node)  # a class body runs at import; its methods are functions

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__") and node.args and isinstance(
                node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node.lineno)
        if self.scope == "module" and isinstance(func, ast.Name):
            self.called_at_module_level.add(func.id)
        self.generic_visit(node)


def _resolve(name: str, level: int, member: str | None, source: str, is_package: bool,
             modules: dict[str, Path]) -> tuple[str, list[str]]:
    """What one import statement loads: the deepest scanned module it names (else the
    top-level name of a library), and the scanned packages on the way whose __init__ runs."""
    if level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[:len(base) - (level - 1)]
        name = ".".join([*base, name] if name else base)
    if member is not None and f"{name}.{member}" in modules:
        name = f"{name}.{member}"
    parts = name.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    scanned = [m for m in chain if m in modules]
    if not scanned:
        return parts[0], []
    # the importer's own packages are already loading: their __init__ adds nothing
    own = {".".join(source.split(".")[:i]) for i in range(1, source.count(".") + 1)}
    return scanned[-1], [m for m in scanned[:-1] if m not in own]


def scan(root: Path, packages: tuple[str, ...] = SCANNED) -> dict[str, list[Import]]:
    """Module -> its imports, for every module of ``packages`` under ``root``. A package
    whose __init__ imports anything counts as imported too by an import of its modules."""
    modules = module_files(root, packages)
    graph: dict[str, list[Import]] = {}
    inits: dict[str, list[tuple[str, Import]]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        collector = _Collector()
        collector.visit(tree)
        rel = str(path.relative_to(root))
        imports: list[Import] = []
        for name, line, level, member, scope in collector.found:
            eager = scope == "module" or scope in collector.called_at_module_level
            target, packages_on_the_way = _resolve(name, level, member, module,
                                                   path.name == "__init__.py", modules)
            if target != module:
                imports.append(Import(module, target, rel, line, eager, scope))
            for package in packages_on_the_way:
                inits.setdefault(module, []).append(
                    (package, Import(module, package, rel, line, eager, scope)))
        graph[module] = imports
    for module, via in inits.items():
        graph[module] += [imp for package, imp in via if graph.get(package)]
    return Graph({m: list(dict.fromkeys(imps)) for m, imps in graph.items()})  # one per line


def _package(module: str) -> str:
    return module.split(".")[0]


def import_cycles(graph: dict[str, list[Import]]) -> list[list[Import]]:
    """One concrete circle (as its import edges) per strongly connected set of modules."""
    edges = {m: sorted({i.target for i in imports if i.target in graph})
             for m, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(start: str) -> None:  # Tarjan, iteratively (no recursion limit)
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for module in sorted(graph):
        if module not in index:
            connect(module)
    cycles = []
    for component in sorted(components):
        members, start = set(component), component[0]
        came: dict[str, Import] = {}
        queue = deque([start])
        while queue and start not in came:  # shortest way back to start inside the set
            node = queue.popleft()
            for imp in graph[node]:
                if imp.target in members and imp.target not in came:
                    came[imp.target] = imp
                    queue.append(imp.target)
        path, node = [], start
        while True:
            path.append(came[node])
            node = came[node].source
            if node == start:
                break
        cycles.append(path[::-1])
    return cycles


def heavy_imports(graph: dict[str, list[Import]], package: str,
                  forbidden: tuple[str, ...] = HEAVY) -> list[list[Import]]:
    """For each module of ``package`` that reaches a forbidden library through the product
    import closure, the shortest chain of imports that gets there."""
    found = []
    for start in sorted(m for m in graph if _package(m) == package):
        came: dict[str, Import] = {}
        queue, seen = deque([start]), {start}
        hit: Import | None = None
        while queue and hit is None:
            node = queue.popleft()
            for imp in graph[node]:
                if imp.target not in graph and imp.target.startswith(forbidden):
                    hit = imp
                    break
                if imp.target in graph and imp.target not in seen:
                    seen.add(imp.target)
                    came[imp.target] = imp
                    queue.append(imp.target)
        if hit is not None:
            chain, node = [hit], hit.source
            while node != start:
                chain.append(came[node])
                node = came[node].source
            found.append(chain[::-1])
    return found


def upward_imports(graph: dict[str, list[Import]]) -> list[Import]:
    """Imports that run against the layers: a lower package importing console or tools, or
    console importing tools at import time."""
    bad = []
    for imports in graph.values():
        for imp in imports:
            src, dst = _package(imp.source), _package(imp.target)
            if src in LOWER and dst in ("console", TOOLS):
                bad.append(imp)
            elif src == "console" and dst == TOOLS and imp.eager:
                bad.append(imp)
    return bad


def describe_cycle(cycle: list[Import], graph: dict[str, list[Import]]) -> str:
    """The circle with its import lines; when more modules are tangled with it (all of
    them reach each other), those and the other imports among them too."""
    names = " -> ".join([cycle[0].source, *(i.target for i in cycle)])
    text = "import circle: " + names + "".join(f"\n    {i.where()}" for i in cycle)
    members = tangle(cycle[0].source, graph)
    if len(members) > len(cycle):
        others = [i for m in sorted(members) for i in graph[m]
                  if i.target in members and i not in cycle]
        text += (f"\n  tangled with it, {len(members)} modules in all: "
                 + ", ".join(sorted(members)) + "; their other imports of each other:"
                 + "".join(f"\n    {i.where()}" for i in others))
    return text


def tangle(module: str, graph: dict[str, list[Import]]) -> set[str]:
    """The modules that ``module`` reaches and that reach it back (its circle set)."""
    def reach(start: str, forward: bool) -> set[str]:
        seen, queue = {start}, deque([start])
        while queue:
            node = queue.popleft()
            nxt = ([i.target for i in graph[node] if i.target in graph] if forward else
                   [m for m, imps in graph.items() if any(i.target == node for i in imps)])
            for other in nxt:
                if other not in seen:
                    seen.add(other)
                    queue.append(other)
        return seen

    return reach(module, True) & reach(module, False)


def describe_chain(chain: list[Import]) -> str:
    names = " -> ".join([chain[0].source, *(i.target for i in chain)])
    return names + "".join(f"\n    {i.where()}" for i in chain)


def report(problems: list[str], rule: str) -> str:
    return f"{len(problems)} violation(s) of: {rule}\n" + "\n".join(problems)


# -- the real tree -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return scan(ROOT)


def test_the_product_packages_exist() -> None:
    missing = [p for p in SCANNED if not (ROOT / p / "__init__.py").is_file()]
    assert not missing, f"packages of the target layout missing: {', '.join(missing)}"


def test_no_import_circles(graph) -> None:
    cycles = [describe_cycle(c, graph) for c in import_cycles(graph)]
    assert not cycles, report(cycles, "no import circles between modules")


def test_engine_imports_neither_openvino_nor_zmq(graph) -> None:
    assert any(_package(m) == "engine" for m in graph), \
        "there is no engine package to check (engine/ with the generation engine)"
    chains = [describe_chain(c) for c in heavy_imports(graph, "engine")]
    assert not chains, report(chains, "engine imports neither openvino nor zmq, not even "
                                      "through another product module")


def test_lower_packages_import_neither_console_nor_tools(graph) -> None:
    bad = [i.where() for i in upward_imports(graph) if _package(i.source) in LOWER]
    assert not bad, report(bad, "nothing in common/engine/dataplane/controlplane/exporter "
                                "imports console or tools")


def test_console_loads_tools_only_lazily(graph) -> None:
    bad = [i.where() for i in upward_imports(graph) if _package(i.source) == "console"]
    assert not bad, report(bad, "console imports tools only inside functions that run on "
                                "demand (zctl bench), never when it is imported")


@pytest.mark.slow
def test_zctl_starts_without_importing_tools() -> None:
    """What the rule above is for, checked at run time in a fresh interpreter."""
    code = ("import sys, console.cli; "
            "print(sorted(m for m in sys.modules if m == 'tools' or m.startswith('tools.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing console.cli imported {out.stdout.strip()}"


# -- the checker itself, on synthetic trees --------------------------------------------------
def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in {Path(n).parts[0] for n in files}:
        (root / package / "__init__.py").touch()
    return root


CLEAN = {
    "common/paths.py": "import os\n",
    "engine/service.py": "from common import paths\nfrom engine.sessions import Session\n",
    "engine/sessions.py": "import numpy as np\nfrom . import sampling\n",
    "engine/sampling.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    import zmq\n",
    "dataplane/worker.py": "import openvino as ov\nimport zmq\nfrom engine import sessions\n"
                           "if __name__ == '__main__':\n    from engine import service\n",
    "console/cli.py": "import typer\nfrom console import view\n\n"
                      "def bench():\n    from tools import bench_x\n",
    "console/view.py": "import rich\n",
    "tools/bench_x.py": "from console import view\nfrom dataplane.worker import run\n",
}


def check(root: Path) -> list[str]:
    """Every rule on the tree under ``root``: the problems, described."""
    graph = scan(root)
    return ([describe_cycle(c, graph) for c in import_cycles(graph)]
            + [describe_chain(c) for c in heavy_imports(graph, "engine")]
            + [i.where() for i in upward_imports(graph)])


def test_a_clean_tree_passes_and_is_read_right(tmp_path: Path) -> None:
    graph = scan(write_tree(tmp_path, CLEAN))
    assert check(tmp_path) == []
    assert {"engine.sessions", "tools.bench_x", "console", "common.paths"} <= set(graph)
    targets = {i.target for i in graph["engine.service"]}
    assert {"common.paths", "engine.sessions"} <= targets  # `from pkg import module`
    assert "engine.sampling" in {i.target for i in graph["engine.sessions"]}  # relative
    assert not any(i.target == "zmq" for i in graph["engine.sampling"])  # TYPE_CHECKING
    lazy = [i for i in graph["console.cli"] if i.target == "tools.bench_x"]
    assert len(lazy) == 1 and not lazy[0].eager and lazy[0].line == 5
    guarded = [i for i in graph["dataplane.worker"] if i.target == "engine.service"]
    assert len(guarded) == 1 and not guarded[0].eager  # under `if __name__ == "__main__"`
    assert {"openvino", "zmq"} <= {i.target for i in graph["dataplane.worker"]}


def test_a_circle_is_found_and_named(tmp_path: Path) -> None:
    tree = {**CLEAN, "dataplane/link.py": "from dataplane.transport import send\n",
            "dataplane/transport.py": "import zmq\n\ndef shaped():\n"
                                      "    from dataplane.link import Delayed\n"}
    problems = check(write_tree(tmp_path, tree))
    assert len(problems) == 1, problems
    assert problems[0].startswith("import circle: dataplane.link -> dataplane.transport -> "
                                  "dataplane.link")
    assert "dataplane/link.py:1 imports dataplane.transport\n" in problems[0]
    assert "dataplane/transport.py:4 imports dataplane.link (lazily)" in problems[0]


def test_a_longer_circle_through_packages_is_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "console/view.py": "from tools import bench_x\n"}  # view -> tools -> view
    problems = check(write_tree(tmp_path, tree))
    circles = [p for p in problems if p.startswith("import circle")]
    assert len(circles) == 1 and "console.view -> tools.bench_x -> console.view" in circles[0]
    # and the eager import of tools from console is its own violation
    assert "console/view.py:1 imports tools.bench_x" in problems


def test_an_indirect_openvino_import_of_engine_is_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "common/devices.py": "def probe():\n    import openvino\n",
            "engine/service.py": "from engine import sessions\n\n"
                                 "def start():\n    from common.devices import probe\n"}
    problems = check(write_tree(tmp_path, tree))
    assert problems == ["engine.service -> common.devices -> openvino"
                        "\n    engine/service.py:4 imports common.devices (lazily)"
                        "\n    common/devices.py:2 imports openvino (lazily)"], problems


def test_zmq_through_a_lower_package_is_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "engine/sessions.py": "from dataplane.worker import StageWorker\n"}
    chains = heavy_imports(scan(write_tree(tmp_path, tree)), "engine")
    assert [[c[0].source, *(i.target for i in c)] for c in chains] == [
        ["engine.service", "engine.sessions", "dataplane.worker", "openvino"],
        ["engine.sessions", "dataplane.worker", "openvino"]]


def test_a_package_init_that_imports_is_followed(tmp_path: Path) -> None:
    tree = {**CLEAN, "dataplane/__init__.py": "from dataplane.worker import StageWorker\n",
            "engine/sessions.py": "from dataplane.frames import Frame\n",
            "dataplane/frames.py": "import struct\n"}
    chains = heavy_imports(scan(write_tree(tmp_path, tree)), "engine")
    assert [[c[0].source, *(i.target for i in c)] for c in chains][-1] == [
        "engine.sessions", "dataplane", "dataplane.worker", "openvino"]


def test_upward_imports_are_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "controlplane/coordinator.py": "from console.paths import home\n",
            "exporter/export.py": "def f():\n    import tools.bench_x\n",
            "console/cli.py": "import typer\n\ndef _register():\n"
                              "    from tools import bench_x\n\n_register()\n"}
    problems = check(write_tree(tmp_path, tree))
    assert sorted(problems) == [
        "console/cli.py:4 imports tools.bench_x (in _register(), which runs at import)",
        "controlplane/coordinator.py:1 imports console",  # console/paths.py does not exist
        "exporter/export.py:2 imports tools.bench_x (lazily)"], problems
