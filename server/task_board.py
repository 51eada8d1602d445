"""The task board: tasks queued at each client process, the long polls that wait for them, and
the round loop's wait for the tasks it dispatched.

Each live process has a :class:`Mailbox`: its queued tasks, the ids of those it took and has not
answered, and at most one waiting long poll (a newer poll of the same process supersedes the
older one). Queueing a task wakes exactly the poll of its process; nothing rescans the processes.
A task is *open* from dispatch until it is answered, dropped, or closed with its round (a late
result is then refused); *outstanding* once its process took it; *claimed* while one result
stream for it is being received (a second stream for the same task is refused, so a result is
never folded twice, and a stream the server never saw leaves the task outstanding for the
client's retry); *awaited* while the round loop waits for it, and the round loop is woken when
the last awaited task closes.

The board shares the round engine's condition variable; every method takes it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from fedpart.common.plans import ResultInfo, TaskInfo, TaskKind
from fedpart.common.protocol import Rejected, UnknownSession
from fedpart.common.security import Principal
from fedpart.server.registry import REAP_INTERVAL_SECONDS, ProcessRegistry, ProcessState
from fedpart.server.validation import printable


@dataclass(eq=False)
class Task(TaskInfo):
    """Work for one client in one round (training) or at the end (evaluation), queued at the
    process of ``session``."""

    session: str = field(kw_only=True)
    closed: bool = field(default=False, kw_only=True)  # answered, dropped or closed with its round


class Waiter(Protocol):
    """A long poll waiting for its process's next task; woken from any thread."""

    superseded: bool

    def wake(self) -> None: ...


@dataclass(eq=False)
class Mailbox:
    """The tasks of one process and its waiting long poll."""

    process: ProcessState
    pending: deque[Task] = field(default_factory=deque)  # queued (closed ones are skipped)
    taken: set[int] = field(default_factory=set)          # ids of tasks it took and has not answered
    waiter: Waiter | None = None


class TaskBoard:
    """Tasks per process, long polls, and the wait for dispatched tasks."""

    def __init__(self, registry: ProcessRegistry, cond: threading.Condition, log: Callable[[str], None],
                 record_failure: Callable[[str], None]) -> None:
        self.registry = registry
        self.log = log
        self._record_failure = record_failure
        self._cond = cond
        self._mailboxes: dict[str, Mailbox] = {}  # by session, live processes only
        self._open: dict[int, Task] = {}          # queued or taken, on a live process
        self._outstanding: dict[int, Task] = {}   # taken and not yet answered
        self._claimed: set[int] = set()           # outstanding tasks whose result is being received
        self._awaited: set[int] = set()           # open tasks the round loop waits for
        registry.events = self

    # ------------------------------------------------------------------ long polls

    def poll(self, session: str, waiter: Waiter, principal: Principal | None = None) -> Task | None:
        """One look for this process's next task, without blocking.

        Returns the task (it is now outstanding), a DONE task at the end of the run, or None: then
        ``waiter`` is registered and woken when something changes for this process, and the
        caller polls again. A newer poll of the same process supersedes an older waiting one (its
        waiter is woken with ``superseded`` set, and its poll returns None). Raises
        :class:`UnknownSession` for an unknown session.
        """
        with self._cond:
            process = self.registry.session(session, principal)
            if process is None:
                raise UnknownSession("unknown or expired session: join again")
            self.registry.polled(process)
            if waiter.superseded:
                return None
            mailbox = self._mailbox(process)
            while mailbox.pending:
                task = mailbox.pending.popleft()
                if not task.closed:
                    mailbox.taken.add(task.task_id)
                    self._outstanding[task.task_id] = task
                    return task
            if self.registry.done:
                self.registry.release(process)
                return Task(TaskKind.DONE, task_id=0, round=0, client_id=0, outcome=self.registry.outcome,
                            session=session)
            if mailbox.waiter is not None and mailbox.waiter is not waiter:
                mailbox.waiter.superseded = True
                mailbox.waiter.wake()
            mailbox.waiter = waiter
            self.registry.waiting(process, True)
            return None

    def end_poll(self, session: str, waiter: Waiter) -> None:
        """A long poll is over (answered, expired or cancelled)."""
        with self._cond:
            mailbox = self._mailboxes.get(session)
            if mailbox is not None and mailbox.waiter is waiter:
                mailbox.waiter = None
                self.registry.waiting(mailbox.process, False)

    def wake_all(self) -> None:
        """Wake every waiting poll (the run is over: they answer DONE)."""
        with self._cond:
            for mailbox in self._mailboxes.values():
                if mailbox.waiter is not None:
                    mailbox.waiter.wake()

    # ------------------------------------------------------------------ dispatch and await

    def dispatch(self, tasks: Iterable[Task]) -> set[int]:
        """Queue tasks at their hosting processes and await them; returns their ids."""
        with self._cond:
            ids = set()
            for task in tasks:
                mailbox = self._mailbox(self.registry.process(task.session))
                mailbox.pending.append(task)
                self._open[task.task_id] = task
                self._awaited.add(task.task_id)
                ids.add(task.task_id)
                if mailbox.waiter is not None:
                    mailbox.waiter.wake()
            return ids

    @property
    def awaiting(self) -> bool:
        """Whether any awaited task is still open."""
        with self._cond:
            return bool(self._awaited)

    def await_tasks(self, task_ids: set[int], timeout: float) -> set[int]:
        """Wait until every awaited task is answered, dropped or its process gone, or the
        deadline; then close those of ``task_ids`` still open. Returns their ids."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self.registry.reap_silent()
                remaining = deadline - time.monotonic()
                if not self._awaited or remaining <= 0:
                    break
                self._cond.wait(min(remaining, REAP_INTERVAL_SECONDS))
            return self.close(task_ids)

    def close(self, task_ids: set[int]) -> set[int]:
        """Close those of ``task_ids`` still queued or outstanding (a late result is refused);
        returns their ids."""
        with self._cond:
            unfinished = {t for t in task_ids if t in self._open}
            for task_id in unfinished:
                self._close_task(self._open[task_id])
            self._awaited -= task_ids
            return unfinished

    # ------------------------------------------------------------------ results

    def result_task(self, result: ResultInfo, principal: Principal | None = None) -> Task:
        """Claim the outstanding task a result answers for the calling stream (the claim ends
        when the task closes); raises :class:`UnknownSession` for a session the caller does not
        hold, :class:`Rejected` if it answers no outstanding task or another stream holds it."""
        with self._cond:
            if self.registry.session(result.session, principal) is None:
                raise UnknownSession("unknown or expired session: join again")
            task = self._outstanding.get(result.task_id)
            if task is None or task.session != result.session:
                raise Rejected(f"task {result.task_id} is not outstanding for this process (late or unknown)")
            if result.client_id != task.client_id or result.round != task.round:
                raise Rejected(f"result names client {result.client_id} round {result.round}, "
                               f"task {result.task_id} is client {task.client_id} round {task.round}")
            if task.task_id in self._claimed:
                raise Rejected(f"a result for task {task.task_id} is already being received")
            self._claimed.add(task.task_id)
            return task

    def check_current(self, task: Task) -> None:
        """Raise :class:`Rejected` unless ``task`` is still outstanding."""
        with self._cond:
            if task.task_id not in self._outstanding:
                raise Rejected(f"task {task.task_id} was closed before its result arrived")

    def is_outstanding(self, task: Task) -> bool:
        with self._cond:
            return task.task_id in self._outstanding

    def answered(self, task: Task) -> None:
        """Close an answered task (it may already be closed when its result was folded as the
        round closed)."""
        with self._cond:
            self._close_task(task)

    def fail_task(self, task: Task, reason: str) -> bool:
        """Drop a task whose delivery or result failed; the round goes on without it. A task that
        is no longer open (answered, or already dropped) is left alone. Returns whether it dropped
        the task."""
        reason = printable(reason, 500)
        with self._cond:
            if task.task_id not in self._outstanding:
                return False
            self._close_task(task)
            self._record_failure(f"round {task.round} client {task.client_id}: {reason}")
        self.log(f"warning: round {task.round} client {task.client_id} dropped: {reason}")
        return True

    # ------------------------------------------------------------------ what the registry reports

    def process_restarted(self, old: ProcessState, new: ProcessState) -> None:
        """A restarted process replaces ``old``: queued tasks of clients it hosts move over, the
        rest close; training tasks the old process had taken are lost with it (evaluations are
        asked again)."""
        mailbox = self._mailboxes.pop(old.session, None)
        if mailbox is None:
            return
        moved = []
        for task in mailbox.pending:
            if task.client_id in new.clients and not task.closed:
                moved.append(task)
            else:
                self._close_task(task)
        for task_id in sorted(mailbox.taken):
            task = self._outstanding[task_id]
            if task.kind == TaskKind.TRAIN:
                self._record_failure(f"round {task.round} client {task.client_id}: its process restarted")
            self._close_task(task)
        if mailbox.waiter is not None:
            mailbox.waiter.wake()  # its poll now finds the session gone
        if moved:
            target = self._mailbox(new)
            for task in moved:
                task.session = new.session
                target.pending.append(task)

    def process_gone(self, process: ProcessState) -> None:
        """A process is no longer there: its open tasks close."""
        mailbox = self._mailboxes.pop(process.session, None)
        if mailbox is None:
            return
        for task in [*mailbox.pending, *(self._outstanding[t] for t in list(mailbox.taken))]:
            self._close_task(task)
        if mailbox.waiter is not None:
            mailbox.waiter.wake()  # its poll now finds the session gone

    # ------------------------------------------------------------------ helpers (hold the lock)

    def _mailbox(self, process: ProcessState) -> Mailbox:
        mailbox = self._mailboxes.get(process.session)
        if mailbox is None:
            mailbox = self._mailboxes[process.session] = Mailbox(process)
        return mailbox

    def _close_task(self, task: Task) -> None:
        """Take a task out of every queue; wakes the round loop when its last awaited task closes."""
        task.closed = True
        self._open.pop(task.task_id, None)
        self._claimed.discard(task.task_id)
        if self._outstanding.pop(task.task_id, None) is not None:
            mailbox = self._mailboxes.get(task.session)
            if mailbox is not None:
                mailbox.taken.discard(task.task_id)
        if task.task_id in self._awaited:
            self._awaited.discard(task.task_id)
            if not self._awaited:
                self._cond.notify_all()
