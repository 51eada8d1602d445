"""The final evaluation over the task board: every client evaluates and personalises the final
model on its own data (FedBABU's protocol, Oh et al. ICLR 2022); a client whose process is lost
before it answers is asked again once a process hosts it again, and a client whose report was
refused (or whose task could not be sent) is asked again at once, at least once and at most
``server.delivery_attempts`` times in all.

It shares the round engine's condition variable (:class:`~fedpart.server.engine.coordinator.Coordinator`):
the coordinator tells it of processes that joined (:meth:`FinalEvaluation.rehosted`), the task
board of evaluation tasks it dropped (:meth:`FinalEvaluation.dropped`), and the coordinator stores
the reports its results bring (:attr:`FinalEvaluation.reports`), all under that lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from fedpart.common.config.run_config import ServerConfig
from fedpart.common.process.console import Log
from fedpart.common.wire.plans import EvalPlan
from fedpart.server.engine.registry import REAP_INTERVAL_SECONDS, ProcessRegistry
from fedpart.server.engine.task_board import Task, TaskBoard

NewTask = Callable[[int, str, EvalPlan], Task]  # (client, session of its process, plan) -> its evaluation task


class FinalEvaluation:
    """The evaluation after the last round, asked of every client over the task board."""

    def __init__(self, clients: int, server: ServerConfig, registry: ProcessRegistry, board: TaskBoard,
                 cond: threading.Condition, log: Callable[[str], None], new_task: NewTask) -> None:
        """The evaluation of ``clients`` clients under ``server``'s timeouts and delivery attempts."""
        self.clients = clients
        self.server = server
        self.registry = registry
        self.board = board
        self.log = Log.of(log)
        self.new_task = new_task
        self.reports: dict[int, dict[str, float]] = {}  # each evaluated client's report
        self.active = False
        self._cond = cond
        self._rehosted: set[int] = set()  # clients hosted anew while it runs
        self._asked: dict[int, Task] = {}  # the latest evaluation task of each client
        self._tries: dict[int, int] = {}  # evaluation tasks asked of each client
        self._again: dict[int, str] = {}  # clients to ask again, and why

    def rehosted(self, clients: Iterable[int]) -> None:
        """A process that joined hosts ``clients``: ask them again if the evaluation runs (holds
        the lock)."""
        if self.active:
            self._rehosted.update(clients)
            self._cond.notify_all()

    def dropped(self, task: Task) -> None:
        """The task board dropped ``task`` (its report was refused, or sending it failed): if it is
        a client's latest evaluation task while the evaluation runs, that client is asked again,
        unless it was asked ``server.delivery_attempts`` times (holds the lock)."""
        if not self.active or self._asked.get(task.client_id) is not task or task.client_id in self.reports:
            return
        tries = self._tries[task.client_id]
        if tries < self.server.delivery_attempts:
            self._again[task.client_id] = f"asked {tries} of at most {self.server.delivery_attempts} times"
        else:
            self.log.warning(f"client {task.client_id}: no evaluation report after {tries} tasks "
                             "(server.delivery_attempts); it is not asked again")
        self._cond.notify_all()

    def run(self, plan: EvalPlan, round_number: int) -> dict[int, dict[str, float]]:
        """Ask every client to evaluate as ``plan`` says and wait for their reports, until
        ``server.evaluation_timeout``. A client whose process is lost is asked again once a process
        hosts it again, one whose task was dropped (:meth:`dropped`) at once; while no evaluation is
        open, the wait for lost clients to be hosted again is at most ``server.join_timeout``.
        Returns the reports by client."""
        server, clients = self.server, self.clients
        deadline = time.monotonic() + server.evaluation_timeout
        unhosted_since: float | None = None
        with self._cond:
            self.reports = {}
            self.active = True
            self._asked, self._tries, self._again = {}, {}, {}
            self._rehosted = set(range(clients))
            while True:
                self.registry.reap_silent()
                if self._rehosted or self._again:
                    self._ask(plan, sorted(self._rehosted | set(self._again)))
                    self._rehosted, self._again = set(), {}
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
            self.board.close({t.task_id for t in self._asked.values()})
            return dict(self.reports)

    def _ask(self, plan: EvalPlan, clients: list[int]) -> None:
        """Queue an evaluation for each of ``clients`` not yet evaluated whose current process
        has not been asked, or whose task was dropped (holds the lock)."""
        tasks = []
        for client in clients:
            host = self.registry.host(client)
            if client in self.reports or host is None:
                continue
            previous = self._asked.get(client)
            again = self._again.get(client)
            if previous is not None and previous.session == host.session and again is None:
                continue
            task = self.new_task(client, host.session, plan)
            self._asked[client] = task
            self._tries[client] = self._tries.get(client, 0) + 1
            tasks.append(task)
            if again is not None:
                self.log(f"client {client}: its evaluation task was dropped ({again}); asking {host.name} again")
            elif previous is not None:
                self.log(f"client {client}: its process was lost during the evaluation; asking {host.name} again")
        self.board.dispatch(tasks)
