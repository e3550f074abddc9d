"""The import graph of the product and the benchmarks, read with ``ast`` (nothing imported).

The rooms (docs/design.md), lowest first; each imports only the rooms ``ALLOWED`` names:

- ``zctl`` itself (``zctl.manifest``, ``zctl.paths``): the base every room may read;
- ``zctl.engine``: the generation engine, which reaches neither openvino nor zmq;
- ``dataplane.wire`` and ``dataplane.runtime``, side by side (neither imports the other);
  ``dataplane.worker`` over both; ``dataplane.head`` (the engine's executors) over those;
- ``controlplane``; ``exporter``; ``zctl.discovery`` (LAN announcements, over the base only);
- ``zctl.service`` (the engine's front door), ``zctl.serve`` (HTTP), ``zctl.launcher``
  (processes and local clusters), ``zctl.doctor``, ``zctl.cli`` at the top;
- ``tools`` (benchmarks, not installed) over everything; no product room imports it.

Also: no import circles between modules, type-only imports (``if TYPE_CHECKING:``) and
imports inside functions included; a worker node's rooms reach neither torch nor
transformers nor nncf; no module takes a private name (``_x``) from another room; and no
capability of an executor or a stage runtime is probed with ``getattr``/``hasattr``: the
protocols declare them. Each failure names the files and lines that break the rule. The
checker itself is tested on small synthetic trees in tmp_path, so that it cannot silently
pass.
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
SCANNED = ("zctl", "controlplane", "dataplane", "exporter", "tools")
TOOLS = "tools"
BASE = "zctl"
# every room of the product, and the rooms each may import (besides itself and the base)
ROOMS = ("zctl.engine", "dataplane.wire", "dataplane.runtime", "dataplane.worker",
         "dataplane.head", "controlplane", "exporter", "zctl.discovery", "zctl.service",
         "zctl.serve", "zctl.launcher", "zctl.doctor", "zctl.cli")
DATAPLANE = ("dataplane.wire", "dataplane.runtime", "dataplane.worker", "dataplane.head")
ALLOWED: dict[str, tuple[str, ...]] = {
    BASE: (),
    "zctl.engine": (),
    "dataplane.wire": ("zctl.engine",),
    "dataplane.runtime": ("zctl.engine",),
    "dataplane.worker": ("zctl.engine", "dataplane.wire", "dataplane.runtime"),
    "dataplane.head": ("zctl.engine", "dataplane.wire", "dataplane.runtime", "dataplane.worker"),
    "controlplane": ("zctl.engine", *DATAPLANE),
    "exporter": ("zctl.engine", "dataplane.runtime", "dataplane.head"),
    "zctl.discovery": (),
    "zctl.service": ("zctl.engine", *DATAPLANE, "controlplane"),
    "zctl.serve": ("zctl.engine", "zctl.service"),
    "zctl.launcher": ("zctl.engine", *DATAPLANE, "controlplane", "zctl.discovery", "zctl.service",
                      "zctl.serve"),
    "zctl.doctor": ("zctl.engine", *DATAPLANE, "controlplane", "zctl.discovery", "zctl.service",
                    "zctl.serve", "zctl.launcher"),
    "zctl.cli": ("zctl.engine", *DATAPLANE, "controlplane", "exporter", "zctl.discovery",
                 "zctl.service", "zctl.serve", "zctl.launcher", "zctl.doctor"),
}
HEAVY = ("openvino", "zmq")  # what engine must not pull in (openvino_tokenizers etc. count)
EXPORT_ONLY = ("torch", "transformers", "nncf")  # what a worker node does not install
WORKER_ROOMS = ("zctl.engine", *DATAPLANE, "controlplane", "zctl.discovery", "zctl.service",
                "zctl.launcher")


def room_of(module: str) -> str | None:
    """The room a module belongs to (the deepest listed one), ``tools``, or None for a
    library; ``zctl``'s own modules outside every room (manifest, paths) are the base, and
    ``zctl.__main__`` belongs to the command line."""
    if module == "zctl.__main__":
        return "zctl.cli"
    for room in sorted(ROOMS, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    top = module.split(".")[0]
    if top == BASE:
        return BASE
    if top == TOOLS:
        return TOOLS
    if top == "dataplane":
        return "dataplane.wire" if module == "dataplane" else None
    return None


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` at ``path:line``; ``target`` is a scanned module, or
    the top-level name of anything else (``zmq``, ``numpy``)."""

    source: str
    target: str
    path: str
    line: int
    eager: bool  # runs when ``source`` is imported (module level, or a function it calls)
    scope: str = "module"  # "module", "main" (the __main__ guard), "types" (under ``if
    # TYPE_CHECKING:``, never run but a dependency all the same) or the top function
    member: str = ""  # the name a ``from ... import name`` takes

    def where(self) -> str:
        if self.scope == "types":
            how = " (for types only)"
        elif not self.eager:
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
    with whether it runs at import time (``if TYPE_CHECKING:`` blocks never do, but count)."""

    def __init__(self) -> None:
        self.found: list[tuple[str, int, int, str | None, str]] = []  # name, line, level,
        # from-name (or None), scope: "module", "main", "types" or the top function's name
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
        if _is_type_checking(node.test) and self.scope == "module":
            self.scope = "types"
            for child in node.body:
                self.visit(child)
            self.scope = "module"
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
            taken = "" if member is None or target.endswith(f".{member}") else member
            if target != module:
                imports.append(Import(module, target, rel, line, eager, scope, taken))
            for package in packages_on_the_way:
                inits.setdefault(module, []).append(
                    (package, Import(module, package, rel, line, eager, scope)))
        graph[module] = imports
    for module, via in inits.items():
        graph[module] += [imp for package, imp in via if graph.get(package)]
    return Graph({m: list(dict.fromkeys(imps)) for m, imps in graph.items()})  # one per line


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


def heavy_imports(graph: dict[str, list[Import]], room: str,
                  forbidden: tuple[str, ...] = HEAVY) -> list[list[Import]]:
    """For each module of ``room`` that reaches a forbidden library through the product
    import closure, the shortest chain of imports that gets there."""
    found = []
    for start in sorted(m for m in graph if room_of(m) == room):
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


def room_violations(graph: dict[str, list[Import]]) -> list[Import]:
    """Imports that run against the rooms: a room importing one ``ALLOWED`` does not name
    for it (a product room importing tools included)."""
    bad = []
    for imports in graph.values():
        for imp in imports:
            src, dst = room_of(imp.source), room_of(imp.target)
            if src in (None, TOOLS) or dst is None or src == dst or dst == BASE:
                continue
            if dst not in ALLOWED.get(src, ()):
                bad.append(imp)
    return list({(i.path, i.line, i.target): i for i in bad}.values())  # one per statement


def private_imports(graph: dict[str, list[Import]]) -> list[Import]:
    """``from X import _name`` where X is in another room (tools may reach anything)."""
    return [imp for imports in graph.values() for imp in imports
            if imp.member.startswith("_") and not imp.member.startswith("__")
            and room_of(imp.source) not in (None, TOOLS)
            and room_of(imp.target) not in (None, room_of(imp.source))]


def protocol_members(path: Path, *names: str) -> set[str]:
    """The attributes and methods the ``Protocol`` classes ``names`` in ``path`` declare."""
    members: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    members.add(item.name)
    return {m for m in members if not m.startswith("_")}


def capability_probes(root: Path, capabilities: set[str],
                      packages: tuple[str, ...] = SCANNED) -> list[str]:
    """``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` of a declared capability, in the
    product (tools and tests may probe what they like)."""
    found = []
    for module, path in module_files(root, packages).items():
        if room_of(module) in (None, TOOLS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in capabilities):
                found.append(f"{path.relative_to(root)}:{node.lineno} probes "
                             f"{node.args[1].value!r} with {node.func.id}")
    return found


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


def test_the_rooms_exist() -> None:
    missing = [room for room in (*ROOMS, TOOLS)
               if not (ROOT / room.replace(".", "/") / "__init__.py").is_file()]
    assert not missing, f"rooms of the layout missing: {', '.join(missing)}"


def test_every_product_module_is_in_a_room(graph) -> None:
    homeless = [m for m in graph if room_of(m) is None and m != "dataplane"]
    assert not homeless, f"modules outside every room: {', '.join(sorted(homeless))}"


def test_no_import_circles(graph) -> None:
    cycles = [describe_cycle(c, graph) for c in import_cycles(graph)]
    assert not cycles, report(cycles, "no import circles between modules, type-only imports "
                                      "included")


def test_engine_imports_neither_openvino_nor_zmq(graph) -> None:
    assert any(room_of(m) == "zctl.engine" for m in graph), "there is no zctl.engine to check"
    chains = [describe_chain(c) for c in heavy_imports(graph, "zctl.engine")]
    assert not chains, report(chains, "engine imports neither openvino nor zmq, not even "
                                      "through another product module")


@pytest.mark.parametrize("room", WORKER_ROOMS)
def test_a_worker_node_needs_no_export_stack(graph, room: str) -> None:
    chains = [describe_chain(c) for c in heavy_imports(graph, room, EXPORT_ONLY)]
    assert not chains, report(chains, f"{room} reaches neither torch nor transformers nor nncf "
                                      "(a worker node installs without them)")


def test_rooms_import_only_the_rooms_below_them(graph) -> None:
    bad = [f"{i.where()} ({room_of(i.source)} -> {room_of(i.target)})"
           for i in room_violations(graph)]
    assert not bad, report(bad, "a room imports only the rooms ALLOWED names for it")


def test_no_room_takes_another_rooms_private_names(graph) -> None:
    bad = [f"{i.where()}: {i.member}" for i in private_imports(graph)]
    assert not bad, report(bad, "no module imports another room's private names")


def test_no_capability_is_probed_with_getattr() -> None:
    capabilities = (protocol_members(ROOT / "zctl/engine/executor.py", "Executor")
                    | protocol_members(ROOT / "dataplane/runtime/base.py", "StageRuntime")
                    | protocol_members(ROOT / "dataplane/head/metrics.py", "MeasuredExecutor"))
    assert {"paged_attention", "overlaps_steps", "submit", "metrics", "kv_slots"} <= capabilities
    probes = capability_probes(ROOT, capabilities)
    assert not probes, report(probes, "capabilities are declared on the protocols, not probed")


@pytest.mark.slow
def test_zctl_starts_without_importing_tools() -> None:
    """The command line never imports the benchmarks (zctl bench runs them as programs)."""
    code = ("import sys, zctl.cli.app; "
            "print(sorted(m for m in sys.modules if m == 'tools' or m.startswith('tools.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing zctl.cli.app imported {out.stdout.strip()}"


# -- the checker itself, on synthetic trees --------------------------------------------------
def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in files:
        for package in Path(name).parents:
            if package != Path("."):
                (root / package / "__init__.py").touch()
    return root


CLEAN = {
    "zctl/paths.py": "import os\n",
    "zctl/engine/core.py": "from zctl import paths\nfrom zctl.engine.sessions import Session\n",
    "zctl/engine/sessions.py": "import numpy as np\nfrom . import sampling\n",
    "zctl/engine/sampling.py": "import math\n",
    "dataplane/worker/stage_worker.py": "import openvino as ov\nimport zmq\n"
                                        "from zctl.engine import sessions\n"
                                        "if __name__ == '__main__':\n"
                                        "    from zctl.engine import core\n",
    "zctl/cli/app.py": "import typer\nfrom zctl.cli import view\n\n"
                       "def bench():\n    from zctl.engine.core import run\n",
    "zctl/cli/view.py": "import rich\n",
    "tools/bench_x.py": "from zctl.cli import view\nfrom dataplane.worker.stage_worker import run\n",
}


def check(root: Path) -> list[str]:
    """Every rule on the tree under ``root``: the problems, described."""
    graph = scan(root)
    return ([describe_cycle(c, graph) for c in import_cycles(graph)]
            + [describe_chain(c) for c in heavy_imports(graph, "zctl.engine")]
            + [i.where() for i in room_violations(graph)]
            + [f"{i.where()}: {i.member}" for i in private_imports(graph)])


def test_a_clean_tree_passes_and_is_read_right(tmp_path: Path) -> None:
    graph = scan(write_tree(tmp_path, CLEAN))
    assert check(tmp_path) == []
    assert {"zctl.engine.sessions", "tools.bench_x", "zctl.cli", "zctl.paths"} <= set(graph)
    targets = {i.target for i in graph["zctl.engine.core"]}
    assert {"zctl.paths", "zctl.engine.sessions"} <= targets  # `from pkg import module`
    assert "zctl.engine.sampling" in {i.target for i in graph["zctl.engine.sessions"]}
    lazy = [i for i in graph["zctl.cli.app"] if i.target == "zctl.engine.core"]
    assert len(lazy) == 1 and not lazy[0].eager and lazy[0].line == 5
    guarded = [i for i in graph["dataplane.worker.stage_worker"] if i.target == "zctl.engine.core"]
    assert len(guarded) == 1 and not guarded[0].eager  # under `if __name__ == "__main__"`
    assert {"openvino", "zmq"} <= {i.target for i in graph["dataplane.worker.stage_worker"]}
    assert room_of("zctl.paths") == BASE and room_of("zctl.__main__") == "zctl.cli"
    assert room_of("dataplane.runtime.kv.slots") == "dataplane.runtime"
    assert room_of("numpy") is None and room_of("tools.bench_x") == TOOLS


def test_a_circle_is_found_and_named(tmp_path: Path) -> None:
    tree = {**CLEAN, "dataplane/wire/link.py": "from dataplane.wire.transport import send\n",
            "dataplane/wire/transport.py": "import zmq\n\ndef shaped():\n"
                                           "    from dataplane.wire.link import Delayed\n"}
    problems = check(write_tree(tmp_path, tree))
    assert len(problems) == 1, problems
    assert problems[0].startswith("import circle: dataplane.wire.link -> "
                                  "dataplane.wire.transport -> dataplane.wire.link")
    assert "dataplane/wire/link.py:1 imports dataplane.wire.transport\n" in problems[0]
    assert "dataplane/wire/transport.py:4 imports dataplane.wire.link (lazily)" in problems[0]


def test_a_type_only_circle_is_a_circle(tmp_path: Path) -> None:
    tree = {**CLEAN, "zctl/engine/sampling.py": "from typing import TYPE_CHECKING\n"
                                                "if TYPE_CHECKING:\n"
                                                "    from zctl.engine.sessions import Session\n"}
    problems = check(write_tree(tmp_path, tree))
    assert len(problems) == 1 and problems[0].startswith("import circle:"), problems
    assert "zctl/engine/sampling.py:3 imports zctl.engine.sessions (for types only)" in \
        problems[0]


def test_an_indirect_openvino_import_of_engine_is_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "zctl/devices.py": "def probe():\n    import openvino\n",
            "zctl/engine/core.py": "from zctl.engine import sessions\n\n"
                                   "def start():\n    from zctl.devices import probe\n"}
    problems = check(write_tree(tmp_path, tree))
    assert problems == ["zctl.engine.core -> zctl.devices -> openvino"
                        "\n    zctl/engine/core.py:4 imports zctl.devices (lazily)"
                        "\n    zctl/devices.py:2 imports openvino (lazily)"], problems


def test_zmq_through_another_room_is_found_and_is_a_violation(tmp_path: Path) -> None:
    tree = {**CLEAN, "zctl/engine/sessions.py":
            "from dataplane.worker.stage_worker import StageWorker\n"}
    graph = scan(write_tree(tmp_path, tree))
    chains = heavy_imports(graph, "zctl.engine")
    assert [[c[0].source, *(i.target for i in c)] for c in chains] == [
        ["zctl.engine.core", "zctl.engine.sessions", "dataplane.worker.stage_worker", "openvino"],
        ["zctl.engine.sessions", "dataplane.worker.stage_worker", "openvino"]]
    assert [i.where() for i in room_violations(graph)] == [
        "zctl/engine/sessions.py:1 imports dataplane.worker.stage_worker"]


def test_a_package_init_that_imports_is_followed(tmp_path: Path) -> None:
    tree = {**CLEAN, "dataplane/wire/__init__.py":
            "from dataplane.worker.stage_worker import StageWorker\n",
            "zctl/engine/sessions.py": "from dataplane.wire.frames import Frame\n",
            "dataplane/wire/frames.py": "import struct\n"}
    chains = heavy_imports(scan(write_tree(tmp_path, tree)), "zctl.engine")
    assert [[c[0].source, *(i.target for i in c)] for c in chains][-1] == [
        "zctl.engine.sessions", "dataplane.wire", "dataplane.worker.stage_worker", "openvino"]


def test_rooms_out_of_order_and_private_names_are_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "controlplane/coordinator.py": "from zctl.cli.view import table\n",
            "exporter/export.py": "def f():\n    import tools.bench_x\n",
            "dataplane/runtime/stateful.py": "from dataplane.wire.frames import _pack\n",
            "dataplane/wire/frames.py": "def _pack():\n    pass\n",
            "zctl/cli/app.py": "import typer\nfrom zctl.cli.view import _row\n"}
    problems = check(write_tree(tmp_path, tree))
    assert sorted(problems) == sorted([
        "controlplane/coordinator.py:1 imports zctl.cli.view",
        "dataplane/runtime/stateful.py:1 imports dataplane.wire.frames",
        "dataplane/runtime/stateful.py:1 imports dataplane.wire.frames: _pack",
        "exporter/export.py:2 imports tools.bench_x (lazily)"]), problems  # _row: same room


def test_a_capability_probe_is_found(tmp_path: Path) -> None:
    tree = {**CLEAN, "zctl/engine/executor.py": "from typing import Protocol\n\n"
                                                "class Executor(Protocol):\n"
                                                "    paged_attention: bool\n\n"
                                                "    def submit(self, step): ...\n",
            "zctl/engine/core.py": "def f(x):\n    return getattr(x, 'paged_attention', 0)"
                                   " or hasattr(x, 'other') or getattr(x, 'submit')\n",
            "tools/bench_x.py": "def g(x):\n    return getattr(x, 'paged_attention')\n"}
    write_tree(tmp_path, tree)
    members = protocol_members(tmp_path / "zctl/engine/executor.py", "Executor")
    assert members == {"paged_attention", "submit"}
    assert capability_probes(tmp_path, members) == [
        "zctl/engine/core.py:2 probes 'paged_attention' with getattr",
        "zctl/engine/core.py:2 probes 'submit' with getattr"]
