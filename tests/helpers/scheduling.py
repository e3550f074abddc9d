"""How ``make test`` spreads the suite over its two pytest-xdist workers: a module's tests
on one worker (its fixtures, a cluster or network namespaces, are made once and never by
two workers at once), and the real default model's modules together on one worker, which
exports it once.

A worker that dies mid-test (a crash, a signal) is replaced, and the work it had left
goes to the workers still running, less the test it died in: that test is reported as
failed and not run again, as pytest-xdist's default scheduler does, so one test that
kills its worker cannot take the next one down too. Only modules with tests still to run
go back to the queue: xdist 3.8's LoadScopeScheduling puts back every module the dead
worker ever ran, and a module with nothing left to run, once assigned, sends a worker no
tests at all, so the run then waits forever on workers waiting for tests. A worker is
given modules until it has more than two tests to run, not one module at a time."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

SMOL_MODULES = {"tests/dataplane/runtime/test_paged_one_query.py",
                "tests/e2e/test_repeatable_api.py", "tests/e2e/test_smollm2.py",
                "tests/exporter/test_export_smollm2.py"}
SMOL_SCOPE = "smollm2"  # the scope of every module in SMOL_MODULES


def module_of(nodeid: str) -> str:
    """A test's module, as its node id names it (tests/e2e/test_x.py)."""
    return nodeid.split("::", 1)[0]


class ModuleScheduling(LoadScopeScheduling):
    """LoadScopeScheduling by module (SMOL_MODULES as one), and a dead worker's
    leftovers given out again without the test it died in."""

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return SMOL_SCOPE if module in SMOL_MODULES else module

    def remove_node(self, node: WorkerController) -> str | None:
        """Drop ``node`` (finished, or dead); for a dead one, the test it died in (the
        first it had not finished), after its unfinished modules are queued again."""
        workload = self.assigned_work.pop(node)
        unfinished = [nodeid for unit in workload.values()
                      for nodeid, done in unit.items() if not done]
        if not unfinished:
            return None
        crashed = unfinished[0]
        for scope, unit in workload.items():
            if crashed in unit:
                unit[crashed] = True  # reported as failed; never run again
            if not all(unit.values()):
                self.workqueue[scope] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node: WorkerController) -> None:
        """Give ``node`` modules until it has more than two tests to run (one at a time,
        xdist's own, leaves a replacement worker given a one-test module holding that
        test, waiting for a next that never comes); none left: ``node`` stops once done."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
