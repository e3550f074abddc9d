"""make test's xdist scheduler (tests/helpers/scheduling.py), driven as pytest-xdist
drives it, with workers that run what they are sent: modules stay whole, and a worker that
dies mid-test neither stalls the run nor takes its replacement down with the same test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.scheduling import SMOL_MODULES, SMOL_SCOPE, ModuleScheduling

MODULES = {"tests/a/test_one.py": 3, "tests/a/test_two.py": 2, "tests/b/test_three.py": 4,
           "tests/b/test_four.py": 1, "tests/c/test_five.py": 3, "tests/c/test_six.py": 2}
COLLECTION = [f"{module}::test_{i}" for module, n in MODULES.items() for i in range(n)]


class Worker:
    """A pytest-xdist worker as its scheduler sees it: it runs the tests it is sent in
    order, holding its last one until it is sent more or told to stop (pytest runs a test
    only once it knows the next)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.ran: list[str] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.queue.extend(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True

    def runnable(self) -> bool:
        return len(self.queue) >= 2 or (len(self.queue) == 1 and self.shutting_down)

    def __repr__(self) -> str:
        return self.name


def scheduler(workers: list[Worker]) -> ModuleScheduling:
    config = SimpleNamespace(getvalue=lambda name: [f"{len(workers)}*popen"],
                             option=SimpleNamespace(loadscopereorder=True))
    sched = ModuleScheduling(config)  # type: ignore[arg-type]
    for worker in workers:
        sched.add_node(worker)  # type: ignore[arg-type]
        sched.add_node_collection(worker, COLLECTION)  # type: ignore[arg-type]
    sched.schedule()
    return sched


def run(sched: ModuleScheduling, workers: list[Worker], die: tuple[Worker, int] | None = None,
        ) -> list[str]:
    """Run until the scheduler says the tests are finished, then stop the workers;
    ``die``: that worker dies as
    it starts its n-th test (counted from 0) and a new one takes its place. The tests
    reported failed by a death. Fails if the run stalls (workers idle, tests left)."""
    crashed: list[str] = []
    for _ in range(10 * len(COLLECTION)):
        if sched.tests_finished:  # each worker is told to stop, and runs the test it held
            for worker in workers:
                worker.shutdown()
                while worker.queue:
                    worker.ran.append(COLLECTION[worker.queue.pop(0)])
            return crashed
        runnable = [w for w in workers if w.runnable()]  # in turn: the one that ran least
        worker = min(runnable, key=lambda w: len(w.ran), default=None)
        if worker is None:
            pytest.fail(f"stalled: {len(sched.workqueue)} modules queued, workers idle "
                        f"with {[w.queue for w in workers]}")
        if die is not None and worker is die[0] and len(worker.ran) == die[1]:
            workers.remove(worker)
            crashed.append(sched.remove_node(worker))  # type: ignore[arg-type]
            replacement = Worker(f"{worker.name}'")
            workers.append(replacement)
            sched.add_node(replacement)  # type: ignore[arg-type]
            sched.add_node_collection(replacement, COLLECTION)  # type: ignore[arg-type]
            sched.schedule()
            die = None
            continue
        index = worker.queue.pop(0)
        worker.ran.append(COLLECTION[index])
        sched.mark_test_complete(worker, index)  # type: ignore[arg-type]
    pytest.fail("the run did not finish")


def modules_by_worker(workers: list[Worker]) -> dict[str, set[str]]:
    return {w.name: {t.split("::")[0] for t in w.ran} for w in workers}


def test_every_test_runs_once_and_a_module_on_one_worker() -> None:
    workers = [Worker("gw0"), Worker("gw1")]
    sched = scheduler(workers)
    assert run(sched, workers) == []
    ran = [t for w in workers for t in w.ran]
    assert sorted(ran) == sorted(COLLECTION)
    by_worker = modules_by_worker(workers)
    assert not by_worker["gw0"] & by_worker["gw1"]


@pytest.mark.parametrize("at", [0, 2, 4, 5])
def test_a_dead_worker_s_test_fails_once_and_the_rest_run_to_the_end(at: int) -> None:
    """The death comes after some of the dying worker's modules finished (at 4 and 5):
    those are not queued again, whose empty assignment once left the run waiting."""
    workers = [Worker("gw0"), Worker("gw1")]
    sched = scheduler(workers)
    dying = workers[1]
    crashed = run(sched, workers, die=(dying, at))
    assert len(crashed) == 1, "the worker did not die: it ran too few tests"
    assert crashed[0] in COLLECTION
    ran = [t for w in [*workers, dying] for t in w.ran]
    assert crashed[0] not in ran  # never run again: it could kill the next worker too
    assert sorted(ran) == sorted(t for t in COLLECTION if t != crashed[0])


def test_the_default_model_s_modules_are_one_scope() -> None:
    sched = ModuleScheduling.__new__(ModuleScheduling)
    scopes = {sched._split_scope(f"{module}::test_x") for module in SMOL_MODULES}
    assert scopes == {SMOL_SCOPE}
    assert sched._split_scope("tests/a/test_one.py::TestX::test_y") == "tests/a/test_one.py"
