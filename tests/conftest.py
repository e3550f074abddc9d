"""Shared fixtures: tiny random models and their exports, built once per test session."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.scheduling import SMOL_MODULES, ModuleScheduling, module_of
from tests.helpers.tiny_models import build_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama with llama3 rope scaling, tied embeddings and a tokenizer."""
    return build_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )


class ExportCache:
    """Exports of the tiny model keyed by (layers, weights, beam_idx), made on first use."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.model_dir, self.root = model_dir, root
        self.done: dict[tuple, Path] = {}

    def get(self, ranges: list[tuple[int, int]], weights: str = "fp32",
            beam_idx: bool = True, static: tuple | None = None) -> Path:
        """``static``: (context, chunk[, kv_dtype]) of a static export (the NPU path)."""
        from exporter.export import export_model
        from exporter.sources import open_source
        from zctl.manifest import StaticKV

        key = (tuple(ranges), weights, beam_idx, static)
        if key not in self.done:
            name = "-".join(f"{a}_{b}" for a, b in ranges) + f"-{weights}-{int(beam_idx)}"
            if static:
                name += "-static" + "x".join(map(str, static))
            out = self.root / name
            export_model(open_source(str(self.model_dir)), ranges, weights, out, beam_idx=beam_idx,
                         static_kv=StaticKV(*static) if static else None)
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="session")
def tiny_exports(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportCache:
    return ExportCache(tiny_llama_dir, tmp_path_factory.mktemp("tiny-exports"))


# -- the real default model (SmolLM2-135M-Instruct from its GGUF): minutes ---------------

@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory):
    """The default model's source and a directory for its exports (shared by the session;
    each test asks for what it needs, so any one of them can run alone)."""
    from exporter.sources import DEFAULT_MODEL, open_source

    cache = tmp_path_factory.mktemp("smol-sources")
    return open_source(DEFAULT_MODEL, cache), tmp_path_factory.mktemp("smol-exports")


@pytest.fixture(scope="session")
def smol_int4_exports(smol) -> tuple[Path, Path]:
    """The INT4 model as one stage and as three (made once, whichever test asks first)."""
    from exporter.export import export_model

    source, root = smol
    single, three = root / "int4-1", root / "int4-3"
    export_model(source, [(0, 30)], "int4", single)
    export_model(source, [(0, 7), (7, 19), (19, 30)], "int4", three)
    return single, three


# -- zctl's home ---------------------------------------------------------------------------

@pytest.fixture
def zctl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ZCTL_HOME of the test's own (where zctl keeps its exports and cluster record)."""
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# -- data plane (dp_ fixtures) ------------------------------------------------------------

@pytest.fixture(scope="session")
def dp_export2(tiny_exports: ExportCache) -> Path:
    """The tiny model cut into 2 fp32 stages (layers 0-1 | 2-3)."""
    return tiny_exports.get([(0, 2), (2, 4)])


@pytest.fixture(scope="session")
def dp_export3(tiny_exports: ExportCache) -> Path:
    """The tiny model cut into 3 fp32 stages (layers 0-1 | 2 | 3)."""
    return tiny_exports.get([(0, 2), (2, 3), (3, 4)])


@pytest.fixture(scope="session")
def dp_hosts() -> tuple[str, str]:
    """Two extra loopback addresses for stages on 'other nodes' (skip where unusable)."""
    import zmq

    ctx = zmq.Context.instance()
    hosts = ("127.0.0.2", "127.0.0.3")
    for host in hosts:
        sock = ctx.socket(zmq.PULL)
        try:
            sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            pytest.skip(f"cannot bind {host}: {exc}")
        finally:
            sock.close(0)
    return hosts


@pytest.fixture
def dp_threaded2(dp_export2: Path):
    """A 2-stage cluster with the last stage in a thread (fast to set up, easy to poke):
    yields (ClusterHead, StageWorker)."""
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.stateful import StageRunner
    from dataplane.worker.stage_worker import StageWorker

    pipe = ClusterHead(StageRunner(dp_export2, 0), "tcp://127.0.0.1:1", "tcp://127.0.0.1:*",
                       timeout_s=10)
    worker = StageWorker(StageRunner(dp_export2, 1), "tcp://127.0.0.1:*", pipe.reply_endpoint)
    pipe.rewire(worker.endpoint)
    worker.start()
    yield pipe, worker
    worker.stop()
    pipe.close()


@pytest.fixture
def last_stage(dp_export2: Path):
    """A running worker for stage 1 (the last) of 2, the coordinator end, and references."""
    import zmq

    from dataplane.runtime.stateful import StageRunner
    from dataplane.wire.transport import push_socket
    from dataplane.worker.stage_worker import StageWorker
    from tests.helpers.worker import Coordinator

    coord = Coordinator("")
    worker = StageWorker(StageRunner(dp_export2, 1), "tcp://127.0.0.1:*", coord.reply_addr)
    coord.push = push_socket(zmq.Context.instance(), worker.endpoint)
    worker.start()
    first, ref = StageRunner(dp_export2, 0), StageRunner(dp_export2, 1)
    first.open_stream(0)
    ref.open_stream(0)
    yield worker, coord, first, ref
    worker.stop()
    coord.close()


@pytest.fixture
def dp_threaded3(dp_export3: Path):
    """A 3-stage cluster (stages 1 and 2 in threads, exact numerics) compacting past 2 masked
    slots: yields (ClusterHead, middle StageWorker, last StageWorker)."""
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.config import RuntimeSpec
    from dataplane.runtime.stateful import StageRunner
    from dataplane.worker.stage_worker import StageWorker

    exact = RuntimeSpec(precision="f32", kv_cache_precision="f32")
    pipe = ClusterHead(StageRunner(dp_export3, 0, exact), "tcp://127.0.0.1:1",
                       "tcp://127.0.0.1:*", timeout_s=10, compact_threshold=2)
    last = StageWorker(StageRunner(dp_export3, 2, exact), "tcp://127.0.0.1:*",
                       pipe.reply_endpoint).start()
    middle = StageWorker(StageRunner(dp_export3, 1, exact), "tcp://127.0.0.1:*",
                         last.endpoint).start()
    pipe.rewire(middle.endpoint)
    yield pipe, middle, last
    middle.stop()
    last.stop()
    pipe.close()


# -- control plane (cp_ fixtures) ---------------------------------------------------------

@pytest.fixture(scope="session")
def cp_export(tiny_exports: ExportCache) -> Path:
    """The tiny model in two fp32 stages (layers 0-1 | 2-3), served by test coordinators."""
    return tiny_exports.get([(0, 2), (2, 4)])


@pytest.fixture
def cp_cluster(tmp_path: Path, cp_export: Path):
    """Builds coordinators and agents for one test (tests/helpers/control.py) and stops them all."""
    from tests.helpers.control import Cluster, FakeStage

    FakeStage.launched = []
    cluster = Cluster(tmp_path, cp_export)
    yield cluster
    cluster.close()


# -- end-to-end tests apart (e2e), the quick suite single-process (make test-quick) ------

E2E = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/e2e/ is marked e2e, and every e2e test (there or beside a
    benchmark) slow too: ``-m "not slow"`` leaves them all out. A test of the real default
    model must live in one of SMOL_MODULES (``make test``'s workers keep those together)."""
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.slow)
        module = module_of(item.nodeid)
        if SMOL_FIXTURES.intersection(item.fixturenames) and module not in SMOL_MODULES:
            raise pytest.UsageError(f"{item.nodeid} uses the real default model: add "
                                    f"{module} to SMOL_MODULES in tests/helpers/scheduling.py")


# -- two workers (make test: pytest-xdist) -------------------------------------------------

SMOL_FIXTURES = {"smol", "smol_int4_exports"}


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist's: -p no:xdist has none)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ModuleScheduling:
    """Modules whole on one worker, and a dead worker's leftovers given out again
    (tests/helpers/scheduling.py)."""
    return ModuleScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker keeps zctl's state in a ZCTL_HOME of its own (under the run's),
    so two workers never share a cluster record or write one export at once. (The modules
    that make network namespaces name theirs apart.) A worker starts with
    COLUMNS=80 and LINES set, which would fix the width of every Console made at import;
    they are dropped, so tests size output as a serial run does."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)
        from zctl.paths import zctl_home

        os.environ["ZCTL_HOME"] = str(zctl_home() / "workers" / worker)


# The product's packages: ``python -m`` one of them (or of their modules) starts one of
# zctl's own processes (a coordinator or node: zctl.launcher; a stage worker:
# dataplane.worker; the command line: zctl; a benchmark: tools...).
OWN_PACKAGES = ("zctl", "dataplane", "controlplane", "exporter", "tools")
PYTHON = re.compile(r"python[0-9.]*")
PYTHON_OPTIONS_WITH_A_VALUE = ("-W", "-X", "-Q")


def mark_to_start(args: object, shell: bool = False) -> tuple[str, str] | None:
    """The mark a test needs to start the process ``subprocess.Popen(args, shell=shell)``
    starts, and the start of its command line: ``e2e`` for one of zctl's own processes
    (``python -m zctl...``, ``-m dataplane.worker``, ``-m tools...``, also wrapped, as in
    ``ip netns exec n1 python -m zctl.launcher ...``; the ``zctl`` program), ``slow`` for any
    other Python process (``python -c``, ``python -m pip``), None for other programs."""
    import os
    import shlex

    if isinstance(args, str | bytes | os.PathLike):
        argv = shlex.split(os.fsdecode(args)) if shell else [os.fsdecode(args)]
    else:
        argv = [os.fsdecode(a) for a in args]  # type: ignore[union-attr]
    if argv and Path(argv[0]).name == "zctl":
        return "e2e", " ".join(argv[:4])
    for i, arg in enumerate(argv):
        name = Path(arg).name
        if i == 0:  # the program
            runs_python = "python" in name
        else:  # or a Python that a wrapper (env, taskset, ip netns exec) runs
            runs_python = arg == sys.executable or PYTHON.fullmatch(name) is not None
        if runs_python:
            module, options = "", iter(argv[i + 1:])
            for option in options:
                if option in PYTHON_OPTIONS_WITH_A_VALUE:
                    next(options, None)
                elif option.startswith("-m"):
                    module = option[2:] or next(options, "")
                    break
                elif option == "-c" or not option.startswith("-"):
                    break
            own = module.split(".")[0] in OWN_PACKAGES
            return ("e2e" if own else "slow"), " ".join(argv[i:i + 4])
    return None


@pytest.fixture(autouse=True)
def _multi_process_tests_are_marked(request: pytest.FixtureRequest,
                                    monkeypatch: pytest.MonkeyPatch):
    """A test that starts one of zctl's own processes (a coordinator, a node, a stage
    worker, ``python -m zctl ...``, ``zctl``, ``python -m tools...``) without the e2e mark,
    or any other Python process (pip, ``python -c``) without the slow mark, fails at
    teardown, naming the mark it lacks and what it started: the multi-process end-to-end
    tests stay apart, and ``make test-quick`` single-process. (Forks are not counted:
    OpenVINO's telemetry forks a sender per event, in any test that exports; zctl itself
    never forks.)"""
    import subprocess

    marks = {mark.name for mark in request.node.iter_markers()}
    if "e2e" in marks:  # an e2e test is slow too
        yield
        return
    started: dict[str, list[str]] = {"e2e": [], "slow": []}
    popen_init = subprocess.Popen.__init__

    def recording_init(self, args, *rest, **kwargs):
        needs = mark_to_start(args, bool(kwargs.get("shell")))
        if needs is not None and needs[0] not in marks:
            started[needs[0]].append(needs[1])
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
    yield
    missing = []
    if started["e2e"]:
        missing.append(f"started {len(started['e2e'])} of zctl's own process(es) "
                       f"({started['e2e'][0]} ...) but is not marked e2e")
    if started["slow"]:
        missing.append(f"started {len(started['slow'])} process(es) ({started['slow'][0]} "
                       "...) but is not marked slow")
    if missing:
        pytest.fail(f"{request.node.nodeid} {'; and '.join(missing)}", pytrace=False)
