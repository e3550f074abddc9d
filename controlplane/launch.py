"""Starting a node's stage once it is wired: the hand-over from control to data plane.

The control plane only decides *what* runs *where*; a ``StageLauncher`` turns a
``StageAssignment`` into a running data-plane worker and returns a ``StageHandle`` (``stop()``,
``kv_slots()``). The default launcher builds the stage's runtime (dataplane.runtime.load) on
the cached shard directory and a ``dataplane.worker.stage_worker.StageWorker`` around it;
tests and embedders pass their own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from controlplane.messages import AssignStage
from dataplane.runtime.config import RuntimeSpec

if TYPE_CHECKING:
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.base import StageRuntime

log = logging.getLogger("zctl.controlplane")


class LaunchError(RuntimeError):
    """A stage could not be started on this node."""


@dataclass(frozen=True)
class StageAssignment:
    """Everything a node needs to run its stage."""

    runner_dir: Path  # holds manifest.json and the stage's xml/bin
    stage_index: int
    num_stages: int
    bind: str  # where this stage's inbound pipe binds
    send_to: str  # the next stage's inbound pipe (the coordinator's for the last stage)
    runtime: RuntimeSpec
    epoch: int
    shard_hash: str
    # CURVE data pipes (see dataplane.wire.transport.PipeCurve): the next hop's public key, the
    # keys admitted inbound, and this node's (public, secret) key pair; empty: plain pipes
    peer_key: str = ""
    admit_keys: tuple[str, ...] = ()
    keys: tuple[bytes, bytes] | None = field(default=None, repr=False)
    # stages after ``stage_index`` run here with it as one (dataplane.runtime.stage_chain), and the
    # runner directory of each
    more_stages: tuple[int, ...] = ()
    more_dirs: tuple[Path, ...] = ()

    @property
    def stages(self) -> list[int]:
        return [self.stage_index, *self.more_stages]

    def same_wiring(self, other: StageAssignment | None) -> bool:
        """Equal in everything but the epoch (so a running stage can be kept)."""
        return other is not None and replace(other, epoch=self.epoch) == self

    @classmethod
    def from_message(cls, msg: AssignStage, runner_dir: Path,
                     keys: tuple[bytes, bytes] | None = None,
                     more_dirs: tuple[Path, ...] | None = None) -> StageAssignment:
        """``more_dirs``: the runner directory of each of ``msg.more_stages`` (default: all
        in ``runner_dir``, as an export directory holds every stage)."""
        more = tuple(s.index for s in msg.more_stages)
        dirs = (runner_dir,) * len(more) if more_dirs is None else tuple(more_dirs)
        return cls(runner_dir, msg.stage.index, msg.num_stages, msg.bind, msg.send_to,
                   msg.runtime, msg.epoch, msg.shard_hash, msg.peer_key,
                   tuple(msg.admit_keys), keys, more, dirs)

    def pipe_options(self, base: Any = None) -> Any:
        """``base`` PipeOptions (or the defaults) with this assignment's CURVE, if any."""
        if not self.peer_key:
            return base
        from dataplane.wire.transport import PipeCurve, PipeOptions

        if self.keys is None:
            raise LaunchError("the cluster encrypts its data pipes (CURVE) but this node has "
                              "no key pair: join with the coordinator's key "
                              "(--curve-server-key)")
        curve = PipeCurve(self.keys[0], self.keys[1], self.peer_key.encode(),
                          frozenset(k.encode() for k in self.admit_keys))
        return replace(base or PipeOptions(), curve=curve)


class StageHandle(Protocol):
    """A stage a launcher started."""

    def stop(self) -> None: ...

    def kv_slots(self) -> int:
        """KV slots the stage holds now (any thread; -1 if it cannot say): what its node
        reports in its heartbeats."""


@runtime_checkable
class RewirableStage(StageHandle, Protocol):
    """A stage that can point its outbound pipe at a new next hop without restarting
    (a ``StageWorker``); other stages are relaunched when their next hop moves."""

    def rewire(self, send_to: str, peer_key: str = "") -> None: ...


StageLauncher = Callable[[StageAssignment], StageHandle]


class CompiledStages:
    """The compiled runners of the stages each node of this process ran last (by its data
    address), so that a relaunch that still runs one of them (a node taking a lost
    neighbour's stage beside its own) reuses it, emptied of streams and prefixes, instead
    of compiling it again (~1 s a stage of SmolLM2). Only ``build_runner`` takes them, and
    only after the node's last stage was stopped (``StageSlot`` stops before it launches)."""

    def __init__(self) -> None:
        self._by_node: dict[str, dict[tuple[str, int, RuntimeSpec], StageRuntime]] = {}
        self._lock = threading.Lock()

    def take(self, node: str, key: tuple[str, int, RuntimeSpec]) -> StageRuntime | None:
        with self._lock:
            runner = self._by_node.get(node, {}).pop(key, None)
        if runner is not None:
            for stream_id in [*runner.groups, *runner.streams]:
                runner.close_stream(stream_id)
            runner.drop_all_prefixes()
        return runner

    def keep(self, node: str, runners: dict[tuple[str, int, RuntimeSpec], StageRuntime]) -> None:
        with self._lock:
            self._by_node[node] = dict(runners)

    def forget(self, node: str) -> None:
        with self._lock:
            self._by_node.pop(node, None)


COMPILED = CompiledStages()


def build_runner(assignment: StageAssignment, reuse: bool = True) -> StageRuntime:
    """Compile the assigned stage from its runner directory (verifies the IR hashes); with
    more stages, each from its own directory, chained into one (dataplane.runtime.stage_chain).
    With ``reuse``, a stage this node ran in its last assignment is reused (``COMPILED``),
    as it was warmed up: nothing steps the old one any more (a StageWorker's thread has
    ended, a ClusterHead is retired, before ``StageSlot`` launches the next). A stage
    compiled now is warmed up (a paged one measures its padding limit: ~1 s a stage of
    SmolLM2), which a re-wiring's pause then no longer pays for the stages kept."""
    from dataplane.runtime.base import StageError
    from dataplane.runtime.load import load_runner
    from zctl.manifest import ManifestError

    dirs = [assignment.runner_dir, *assignment.more_dirs]
    keys = [(str(d), i, assignment.runtime) for d, i in zip(dirs, assignment.stages, strict=True)]
    try:
        runners, fresh = [], []
        for key in keys:
            runner = COMPILED.take(assignment.bind, key) if reuse else None
            if runner is None:
                runner = load_runner(key[0], key[1], assignment.runtime)
                fresh.append(runner)
            runners.append(runner)
        if reuse:
            COMPILED.keep(assignment.bind, dict(zip(keys, runners, strict=True)))
        for runner in fresh:  # a reused one was warmed (and its padding measured) when built
            runner.warm_up()
        if len(runners) == 1:
            return runners[0]
        from dataplane.runtime.stage_chain import StageChain

        return StageChain(runners)
    except (StageError, ManifestError, OSError) as exc:
        first, last = assignment.stages[0], assignment.stages[-1]
        what = str(first) if first == last else f"{first}-{last}"
        raise LaunchError(f"cannot load stage {what}: {exc}") from None


def default_launcher(assignment: StageAssignment, options: Any = None) -> StageHandle:
    """The stage's runtime + dataplane.worker.stage_worker.StageWorker(runner, bind, send_to),
    started.

    ``options`` (a dataplane.wire.transport.PipeOptions, e.g. with an emulated link delay on
    what this node sends) replace the default pipe options; bind it with functools.partial.
    """
    try:
        from dataplane.worker.stage_worker import StageWorker
    except ImportError as exc:
        raise LaunchError(f"the data-plane worker is not available ({exc}); pass a launcher "
                          "to the coordinator or agent") from None
    runner = build_runner(assignment)
    options = assignment.pipe_options(options)
    worker = StageWorker(runner, assignment.bind, assignment.send_to,
                         **({"options": options} if options is not None else {}))
    worker.start()
    return worker


class HeadHandle:
    """Stage 0 on the coordinator: the data plane's ClusterHead, for the generator to drive.

    The head is not thread-safe: once handed over, only the generating thread uses it. A
    new wiring epoch replaces the handle (stop, then a new head), so a generator should
    fetch ``Coordinator.local_handle`` again after the epoch changes.
    """

    def __init__(self, head: ClusterHead) -> None:
        self.head = head

    def stop(self) -> None:
        self.head.retire()  # no step computes on its runner from here on
        self.head.close()

    def kv_slots(self) -> int:
        """KV slots the stages run here hold."""
        return sum(self.head.kv_slots().values())


def head_launcher(assignment: StageAssignment, options: Any = None) -> HeadHandle:
    """The coordinator's stage 0: its runtime + dataplane.head.cluster_head.ClusterHead
    (``options``: PipeOptions for its pipes, as for ``default_launcher``)."""
    try:
        from dataplane.head.cluster_head import ClusterHead
    except ImportError as exc:
        raise LaunchError(f"the data-plane head is not available ({exc})") from None
    options = assignment.pipe_options(options)
    runner = build_runner(assignment)  # the old head, retired when stopped, is not using it
    return HeadHandle(ClusterHead(runner, assignment.send_to, assignment.bind,
                                      **({"options": options} if options is not None else {})))


class StageSlot:
    """The stage a node runs: a handle kept while the wiring stays, replaced when it changes.

    ``apply`` blocks (compiling a stage takes seconds): call it off the control loop.
    """

    def __init__(self, launcher: StageLauncher) -> None:
        self.launcher = launcher
        self.handle: StageHandle | None = None
        self.assignment: StageAssignment | None = None
        self._lock = threading.Lock()

    def apply(self, assignment: StageAssignment) -> None:
        """Run ``assignment``: keep, rewire (only the next hop moved) or relaunch the stage."""
        with self._lock:
            old, handle = self.assignment, self.handle
            if handle is not None and assignment.same_wiring(old):
                if old is not None and old.epoch != assignment.epoch:
                    # a new epoch: the next hop may be a new socket at the same address (its
                    # node re-launched its stages), and frames sent on the old connection
                    # are lost: connect afresh (a head, not thread-safe, is replaced)
                    if not isinstance(handle, RewirableStage):
                        self._stop_locked()
                        self.handle = self.launcher(assignment)
                    else:
                        handle.rewire(assignment.send_to, assignment.peer_key)
                self.assignment = assignment
                return
            if isinstance(handle, RewirableStage) and old is not None and \
                    assignment.same_wiring(replace(old, send_to=assignment.send_to,
                                                   peer_key=assignment.peer_key)):
                handle.rewire(assignment.send_to, assignment.peer_key)
                self.assignment = assignment
                return
            self._stop_locked()
            self.handle = self.launcher(assignment)
            self.assignment = assignment

    def stop(self) -> None:
        """Stop the stage for good (released): its compiled runners are let go too."""
        with self._lock:
            if self.assignment is not None:
                COMPILED.forget(self.assignment.bind)
            self._stop_locked()

    def _stop_locked(self) -> None:
        if self.handle is not None:
            try:
                self.handle.stop()
            except Exception:  # noqa: BLE001 - a failing stop must not take the node down
                log.exception("stopping stage %s failed",
                              self.assignment.stage_index if self.assignment else "?")
        self.handle, self.assignment = None, None


class BackgroundStage:
    """A StageSlot applied on a worker thread, so a control loop never blocks on a compile:
    ``submit`` queues an assignment (with its wiring epoch), ``finished`` returns the
    epochs applied since the last call, in order, each with the error it raised or None."""

    def __init__(self, launcher: StageLauncher, thread_name: str) -> None:
        self.slot = StageSlot(launcher)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._jobs: list[tuple[int, Future[None]]] = []

    @property
    def handle(self) -> StageHandle | None:
        return self.slot.handle

    def submit(self, epoch: int, assignment: StageAssignment) -> None:
        self._jobs.append((epoch, self._executor.submit(self.slot.apply, assignment)))

    def finished(self) -> list[tuple[int, BaseException | None]]:
        done = []
        while self._jobs and self._jobs[0][1].done():
            epoch, job = self._jobs.pop(0)
            done.append((epoch, job.exception()))
        return done

    def stop(self) -> None:
        """Wait for a queued assignment to finish, then stop the stage."""
        self._executor.shutdown(wait=True)
        self.slot.stop()
