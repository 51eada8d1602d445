"""The final evaluation over the task board: every client evaluates and personalises the final
model on its own data (FedBABU's protocol, Oh et al. ICLR 2022), and a client whose process is
lost before it answers is asked again once a process hosts it again.

It shares the round engine's condition variable (:class:`~fedpart.server.coordinator.Coordinator`):
the coordinator tells it of processes that joined (:meth:`FinalEvaluation.rehosted`) and stores
the reports its results bring (:attr:`FinalEvaluation.reports`), both under that lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from fedpart.common.config import RunConfig
from fedpart.common.plans import EvalPlan
from fedpart.server.registry import REAP_INTERVAL_SECONDS, ProcessRegistry
from fedpart.server.task_board import Task, TaskBoard

NewTask = Callable[[int, str, EvalPlan], Task]  # (client, session of its process, plan) -> its evaluation task


class FinalEvaluation:
    """The evaluation after the last round, asked of every client over the task board."""

    def __init__(self, config: RunConfig, registry: ProcessRegistry, board: TaskBoard, cond: threading.Condition,
                 log: Callable[[str], None], new_task: NewTask) -> None:
        self.config = config
        self.registry = registry
        self.board = board
        self.log = log
        self.new_task = new_task
        self.reports: dict[int, dict[str, float]] = {}  # each evaluated client's report
        self.active = False
        self._cond = cond
        self._rehosted: set[int] = set()  # clients hosted anew while it runs

    def rehosted(self, clients: Iterable[int]) -> None:
        """A process that joined hosts ``clients``: ask them again if the evaluation runs (holds
        the lock)."""
        if self.active:
            self._rehosted.update(clients)
            self._cond.notify_all()

    def run(self, plan: EvalPlan, round_number: int) -> dict[int, dict[str, float]]:
        """Ask every client to evaluate as ``plan`` says and wait for their reports, until
        ``server.evaluation_timeout``. A client whose process is lost is asked again once a process
        hosts it again; while no evaluation is open, the wait for lost clients to be hosted again is
        at most ``server.join_timeout``. Returns the reports by client."""
        server, clients = self.config.server, self.config.clients
        deadline = time.monotonic() + server.evaluation_timeout
        asked: dict[int, Task] = {}  # the latest evaluation task of each client
        unhosted_since: float | None = None
        with self._cond:
            self.reports = {}
            self.active = True
            self._rehosted = set(range(clients))
            while True:
                self.registry.reap_silent()
                if self._rehosted:
                    self._ask(plan, asked, sorted(self._rehosted))
                    self._rehosted = set()
                now = time.monotonic()
                if len(self.reports) >= clients or now >= deadline:
                    break
                if self.board.awaiting:
                    unhosted_since = None
                elif all(self.registry.host(c) for c in range(clients) if c not in self.reports):
                    break  # their processes answered what they could; nobody else will
                else:
                    unhosted_since = unhosted_since or now
                    if now - unhosted_since >= server.join_timeout:
                        break
                self._cond.wait(min(deadline - now, REAP_INTERVAL_SECONDS))
            self.active = False
            self.board.close({t.task_id for t in asked.values()})
            return dict(self.reports)

    def _ask(self, plan: EvalPlan, asked: dict[int, Task], clients: list[int]) -> None:
        """Queue an evaluation for each of ``clients`` not yet evaluated whose current process
        has not been asked (holds the lock)."""
        tasks = []
        for client in clients:
            host = self.registry.host(client)
            if client in self.reports or host is None:
                continue
            previous = asked.get(client)
            if previous is not None and previous.session == host.session:
                continue
            task = self.new_task(client, host.session, plan)
            asked[client] = task
            tasks.append(task)
            if previous is not None:
                self.log(f"client {client}: its process was lost during the evaluation; asking {host.name} again")
        self.board.dispatch(tasks)
