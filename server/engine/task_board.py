"""The task board: tasks queued at each client process, the long polls that wait for them, and
the round loop's wait for the tasks it dispatched.

Each live process has a :class:`Mailbox`: its queued tasks, the ids of those it took and has not
answered, and at most one waiting long poll (a newer poll of the same process supersedes the
older one). Queueing a task wakes exactly the poll of its process; nothing rescans the processes.
A task is *open* from dispatch until it is answered, dropped, or closed with its round (a late
result is then refused); *outstanding* once its process took it; *claimed* while its result is
being folded (a copy of the result that arrives meanwhile, or after the task was answered, is a
*duplicate*: acknowledged and dropped, so a result is never folded twice); *awaited* while the
round loop waits for it, and the round loop is woken when the last awaited task closes.

Delivery is at least once (docs/architecture.md, Faults): a lost message costs time, never a result. A poll
lists the tasks its process holds; an outstanding task of the process that the list lacks was
lost on the way and is offered again at once. A result stream that ends early leaves its task
outstanding for the client's next attempt. A restarted process is offered the tasks its
predecessor held. Each task is sent at most ``server.delivery_attempts`` times and takes at most
as many result streams, so a client that never completes a stream cannot make the server work
forever; what had to be sent again is counted per round
(:class:`~fedpart.common.process.records.DeliveryCounts`).

The board shares the round engine's condition variable; every method takes it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from fedpart.common.process.console import Log
from fedpart.common.wire.client_ids import format_id_ranges
from fedpart.common.wire.plans import ResultInfo, TaskInfo, TaskKind
from fedpart.common.wire.protocol import Rejected, UnknownSession
from fedpart.common.process.records import DeliveryCounts
from fedpart.common.wire.security import Principal
from fedpart.server.engine.registry import REAP_INTERVAL_SECONDS, ProcessRegistry, ProcessState
from fedpart.server.policy.validation import printable

# While a round (or a step of one) waits for clients, the server says every this often which
# clients it waits for and where they are.
STRAGGLER_REPORT_SECONDS = 30.0


@dataclass(eq=False)
class Task(TaskInfo):
    """Work for one client in one round (training) or at the end (evaluation), queued at the
    process of ``session``."""

    session: str = field(kw_only=True)
    closed: bool = field(default=False, kw_only=True)  # answered, dropped or closed with its round
    sent: int = field(default=0, kw_only=True)     # times it was given to its process
    streams: int = field(default=0, kw_only=True)  # result streams taken for it
    logical_counted: bool = field(default=False, kw_only=True)  # its logical bytes are in the ledger


class DuplicateResult(Exception):
    """A copy of a result whose task was answered, or whose first copy is being folded: it is
    acknowledged and dropped."""


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
                 record_failure: Callable[[str], None], attempts: int = 8,
                 dropped: Callable[[Task], None] = lambda task: None) -> None:
        """``dropped`` is told (under the lock) of every task :meth:`fail_task` drops: its result
        was refused or its sending failed."""
        self.registry = registry
        self.log = Log.of(log)
        self.attempts = attempts
        self._record_failure = record_failure
        self._dropped = dropped
        self._cond = cond
        self._mailboxes: dict[str, Mailbox] = {}  # by session, live processes only
        self._open: dict[int, Task] = {}          # queued or taken, on a live process
        self._outstanding: dict[int, Task] = {}   # taken and not yet answered
        self._claimed: set[int] = set()           # outstanding tasks whose result is being folded
        self._answered: dict[int, Task] = {}      # answered tasks of the last two rounds (duplicates)
        self._awaited: set[int] = set()           # open tasks the round loop waits for
        self._delivery: dict[int, DeliveryCounts] = {}  # by round
        self._answered_now = 0          # awaited tasks answered since await_tasks began
        self._wake_on_answer = False    # await_tasks counts answers (a target or a derived deadline)
        self.waiting_since: float | None = None  # when the current await_tasks began (monotonic), if one waits
        registry.events = self

    # ------------------------------------------------------------------ long polls

    def poll(self, session: str, waiter: Waiter, principal: Principal | None = None,
             held: Collection[int] = ()) -> Task | None:
        """One look for this process's next task, without blocking; ``held`` lists the tasks the
        process holds (received and not yet answered).

        Returns a task the process took and does not hold (it was lost on the way: sent again),
        else its next queued task (it is now outstanding), a DONE task at the end of the run, or
        None: then ``waiter`` is registered and woken when something changes for this process, and
        the caller polls again. A newer poll of the same process supersedes an older waiting one
        (its waiter is woken with ``superseded`` set, and its poll returns None). Raises
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
            lost = self._lost_task(mailbox, set(held))
            if lost is not None:
                return lost
            while mailbox.pending:
                task = mailbox.pending.popleft()
                if not task.closed:
                    mailbox.taken.add(task.task_id)
                    self._outstanding[task.task_id] = task
                    task.sent += 1
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

    def end_poll(self, session: str, waiter: Waiter, cancelled: bool = False) -> None:
        """A long poll is over: answered, expired, or ``cancelled`` (its connection closed)."""
        with self._cond:
            mailbox = self._mailboxes.get(session)
            if mailbox is not None and mailbox.waiter is waiter:
                mailbox.waiter = None
                self.registry.waiting(mailbox.process, False, cancelled)

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
            tasks = list(tasks)
            if tasks:  # copies of results are recognised for the round before the oldest still open
                oldest = min(task.round for task in [*tasks, *self._open.values()])
                self._answered = {i: t for i, t in self._answered.items() if t.round >= oldest - 1}
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

    def await_tasks(self, task_ids: set[int], timeout: float, enough: int | None = None,
                    deadline_factor: float = 0.0) -> set[int]:
        """Wait until every awaited task is answered, dropped or its process gone, or ``enough``
        of them were answered, or the deadline: ``timeout``, or sooner ``deadline_factor`` times
        the time half of ``task_ids`` took to be answered. Then close those of ``task_ids`` still
        open. Returns their ids."""
        started = time.monotonic()
        deadline = started + timeout
        report = started + STRAGGLER_REPORT_SECONDS
        half = math.ceil(len(task_ids) / 2)
        with self._cond:
            self._answered_now = 0
            self._wake_on_answer = enough is not None or deadline_factor > 0
            self.waiting_since = started
            try:
                while True:
                    self.registry.reap_silent()
                    now = time.monotonic()
                    if deadline_factor and half and self._answered_now >= half:
                        deadline = min(deadline, started + deadline_factor * (now - started))
                        half = 0  # the deadline is set once
                    if not self._awaited or now >= deadline or (enough is not None and self._answered_now >= enough):
                        break
                    if now >= report:
                        self._report_stragglers(task_ids, now - started, deadline - now)
                        report = now + STRAGGLER_REPORT_SECONDS
                    self._cond.wait(min(deadline - now, report - now, REAP_INTERVAL_SECONDS))
            finally:
                self._wake_on_answer = False
                self.waiting_since = None
            return self.close(task_ids)

    def waiting_for(self) -> list[int]:
        """The clients whose awaited tasks are still open (the stragglers of the current wait)."""
        with self._cond:
            return sorted({self._open[t].client_id for t in self._awaited if t in self._open})

    def _report_stragglers(self, task_ids: set[int], waited: float, left: float) -> None:
        """Say which clients the wait is for, on which processes, and how long it may still take
        (holds the lock)."""
        open_tasks = sorted((self._open[t] for t in self._awaited if t in self._open), key=lambda t: t.client_id)
        if not open_tasks:
            return
        by_process: dict[str, list[int]] = {}
        for task in open_tasks:
            process = self.registry.process(task.session)
            where = f"{process.name} at {process.peer or 'an unknown address'}" if process is not None else "no process"
            by_process.setdefault(where, []).append(task.client_id)
        hosts = "; ".join(f"{format_id_ranges(ids)} on {where}" for where, ids in by_process.items())
        self.log.warning(f"round {open_tasks[0].round} has waited {waited:.0f} s for {len(open_tasks)} of "
                         f"{len(task_ids)} clients: {hosts}; it closes in at most {left:.0f} s "
                         "(server.round_timeout; remedies: sampling.over_selection, "
                         "server.round_deadline_factor, server.engine: buffered, docs/operating-a-run.md)")

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
        """The outstanding task a result stream answers, counting the stream against the task's
        ``delivery_attempts``. Raises :class:`UnknownSession` for a session the caller does not
        hold, :class:`DuplicateResult` for a copy of a result already taken or being folded, and
        :class:`Rejected` if it answers no outstanding task of the caller or the task took its
        last stream (the task is then dropped)."""
        with self._cond:
            if self.registry.session(result.session, principal) is None:
                raise UnknownSession("unknown or expired session: join again")
            task = self._outstanding.get(result.task_id)
            if task is None:
                task = self._answered.get(result.task_id)
                if task is not None and task.session == result.session and self._same_task(result, task):
                    self._counts(task).duplicates += 1
                    raise DuplicateResult(f"task {task.task_id} was answered already")
                raise Rejected(f"task {result.task_id} is not outstanding for this process (late or unknown)")
            if task.session != result.session:
                raise Rejected(f"task {result.task_id} is not outstanding for this process (late or unknown)")
            if not self._same_task(result, task):
                raise Rejected(f"result names client {result.client_id} round {result.round}, "
                               f"task {result.task_id} is client {task.client_id} round {task.round}")
            if task.task_id in self._claimed:
                self._counts(task).duplicates += 1
                raise DuplicateResult(f"a result for task {task.task_id} is being folded")
            if task.streams >= self.attempts:
                self._give_up(task, f"{task.streams} result streams, none complete "
                                    "(server.delivery_attempts)")
                raise Rejected(f"task {task.task_id} took {task.streams} result streams, the most "
                               "server.delivery_attempts allows")
            task.streams += 1
            if task.streams > 1:
                self._counts(task).results_sent_again += 1
            return task

    def claim(self, task: Task) -> None:
        """Claim ``task`` for folding its result, once: raises :class:`DuplicateResult` when
        another copy of its result was folded or is being folded, :class:`Rejected` when the task
        was closed before its result arrived."""
        with self._cond:
            if task.task_id in self._claimed or task.task_id in self._answered:
                self._counts(task).duplicates += 1
                raise DuplicateResult(f"a result for task {task.task_id} was folded already")
            if task.task_id not in self._outstanding:
                raise Rejected(f"task {task.task_id} was closed before its result arrived")
            self._claimed.add(task.task_id)

    def stream_cut(self, task: Task, reason: str, received_bytes: int = 0) -> None:
        """A task or result stream of ``task`` ended early (the connection broke, or the peer
        cancelled): a transport failure, not a bad result. The task stays outstanding; its process
        asks for it again or sends its result again."""
        with self._cond:
            counts = self._counts(task)
            counts.streams_cut += 1
            counts.cut_bytes += received_bytes
            if task.task_id not in self._outstanding:
                return
        self.log(f"round {task.round} client {task.client_id}: {printable(reason, 200)}; it is sent again")

    def delivery_counts(self, round_number: int | None = None) -> DeliveryCounts:
        """What the tasks of round ``round_number`` had to send again so far (of every round when None)."""
        with self._cond:
            if round_number is not None:
                return dataclasses.replace(self._delivery.get(round_number, DeliveryCounts()))
            return DeliveryCounts.total(self._delivery.values())

    def is_outstanding(self, task: Task) -> bool:
        with self._cond:
            return task.task_id in self._outstanding

    def answered(self, task: Task) -> None:
        """Close an answered task (it may already be closed when its result was folded as the
        round closed); later copies of its result are duplicates."""
        with self._cond:
            if task.task_id in self._awaited:
                self._answered_now += 1
                if self._wake_on_answer:
                    self._cond.notify_all()
            self._close_task(task)
            self._answered[task.task_id] = task

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
            self._dropped(task)
        self.log.warning(f"round {task.round} client {task.client_id} dropped: {reason}")
        return True

    # ------------------------------------------------------------------ what the registry reports

    def process_restarted(self, old: ProcessState, new: ProcessState) -> None:
        """A restarted process replaces ``old``: the tasks the old process held and had queued,
        of clients the new one hosts, move over (those it held first, offered again); the rest
        close. A task whose result is being folded stays with its fold."""
        mailbox = self._mailboxes.pop(old.session, None)
        if mailbox is None:
            return
        moved = []
        for task_id in sorted(mailbox.taken):
            task = self._outstanding[task_id]
            if task_id in self._claimed:
                continue
            if task.client_id in new.clients:
                del self._outstanding[task_id]
                self._counts(task).tasks_sent_again += 1
                moved.append(task)
            else:
                self._close_task(task)
        for task in mailbox.pending:
            if task.client_id in new.clients and not task.closed:
                moved.append(task)
            else:
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

    def _lost_task(self, mailbox: Mailbox, held: set[int]) -> Task | None:
        """The first task ``mailbox``'s process took, does not hold and whose result is not being
        folded: it was lost on the way, and is sent again unless it was sent
        ``delivery_attempts`` times (then it is dropped)."""
        for task_id in sorted(mailbox.taken - held - self._claimed):
            task = self._outstanding[task_id]
            if task.sent >= self.attempts:
                self._give_up(task, f"sent {task.sent} times, never received (server.delivery_attempts)")
                continue
            task.sent += 1
            self._counts(task).tasks_sent_again += 1
            return task
        return None

    def _give_up(self, task: Task, reason: str) -> None:
        """Drop a task whose delivery failed too often."""
        self._counts(task).given_up += 1
        self._close_task(task)
        self._record_failure(f"round {task.round} client {task.client_id}: {reason}")
        self.log.warning(f"round {task.round} client {task.client_id} dropped: {reason}")

    def _counts(self, task: Task) -> DeliveryCounts:
        counts = self._delivery.get(task.round)
        if counts is None:
            counts = self._delivery[task.round] = DeliveryCounts()
        return counts

    @staticmethod
    def _same_task(result: ResultInfo, task: Task) -> bool:
        return result.client_id == task.client_id and result.round == task.round

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
