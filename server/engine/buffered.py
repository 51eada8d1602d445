"""The buffered round engine (``server.engine: buffered``): asynchronous buffered aggregation,
FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022),
beside the synchronous engine of :mod:`fedpart.server.engine.coordinator`, whose state machine (registry,
task board, screening, fold, byte ledger, snapshot) it shares.

A *round* of this engine is one server version: :meth:`BufferedCoordinator.run_round` ``t``

1. hands new tasks to idle clients until ``concurrency`` clients train (fewer near the end: no
   more than the versions left can fold), each chosen uniformly among the idle clients by the
   seeded draw of ``(sampling seed, t)``, each training on version ``t - 1`` (its task's round is
   ``t``, so a schedule keyed to rounds is keyed to the version a task trains on);
2. folds ``buffer_size`` results with the same order-independent fold as a synchronous round, each
   result's deltas scaled by its staleness weight s(t - tau), tau being its task's round
   (:func:`staleness_weight`): the version's combined delta is sum_i s_i w_i delta_i / sum_i w_i
   (w_i its sample count, or 1 under ``train.weighting: uniform``: the paper's
   sum_i s_i delta_i / K), so that a constant weight gives the synchronous mean;
3. applies the server optimizer and bumps the version (``_step_global``, shared with the
   synchronous engine).

Which results a version folds: on the wall clock, the first ``buffer_size`` to arrive; with the
virtual clock (:mod:`fedpart.server.engine.virtual_clock`) the ``buffer_size`` tasks in flight that finish
first in virtual time (ties by round, then client), whatever order their results arrive in, so a
run is deterministic for its seeds. A result that arrives before its version is held (copied,
its task answered; at most ``concurrency`` of them) and screened and folded when its version
opens. A client trains one task at a time: it is idle again once its result is folded (or its
task was dropped), and a version's results come from distinct clients.

Tasks of one process may train on different versions: the server keeps every global version a
task in flight trains on (only the tensors that differ from the current ones) and sends a task
the tensors of its own version that its process does not hold. Bytes are counted by the same
service and ledger as in a synchronous round, per task; a version's record carries the bytes that
moved while it was open, and for each client it folded that task's bytes.

With ``concurrency = buffer_size`` = the clients of a synchronous round and a constant staleness
weight, every version dispatches the clients the synchronous round samples, folds all of them and
steps as that round does: the same model, bit for bit.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from fedpart.common.config.experiment import Experiment
from fedpart.common.config.run_config import BufferedConfig, RunConfig
from fedpart.common.ml.algorithms import learning_rate
from fedpart.common.process.records import BufferedVersion, DeliveryCounts, RoundRecord
from fedpart.common.wire.plans import ResultInfo, TaskKind
from fedpart.common.wire.protocol import Rejected
from fedpart.server.engine.coordinator import Coordinator, EngineSteps, TaskFolding
from fedpart.server.engine.registry import REAP_INTERVAL_SECONDS
from fedpart.server.engine.run_state import RunState
from fedpart.server.engine.task_board import Task
from fedpart.server.engine.virtual_clock import VirtualClock
from fedpart.server.output.accounting import DIRECTIONS, ByteLedger
from fedpart.server.output.run_recorder import VersionNotes
from fedpart.server.policy import RoundResults, Screened
from fedpart.server.policy.robust import ResultRefused, scaled


def staleness_weight(section: BufferedConfig) -> Callable[[int], float]:
    """s(staleness) of the ``buffered`` section: ``constant`` 1; ``polynomial`` (1 + s)**-a
    (FedBuff's choice, a = 0.5); ``hinge`` 1 up to ``hinge_cutoff`` b and 1 / (a (s - b) + 1)
    beyond, a = ``hinge_slope`` (Xie et al., "Asynchronous Federated Optimization", 2019)."""
    if section.staleness == "polynomial":
        exponent = section.staleness_exponent
        return lambda staleness: (1.0 + staleness) ** -exponent
    if section.staleness == "hinge":
        slope, cutoff = section.hinge_slope, section.hinge_cutoff
        return lambda staleness: 1.0 if staleness <= cutoff else 1.0 / (slope * (staleness - cutoff) + 1.0)
    return lambda staleness: 1.0


def stale_scaled(deltas: Mapping[str, torch.Tensor], weight: float) -> Mapping[str, torch.Tensor]:
    """``weight * deltas`` (floating tensors; :func:`~fedpart.server.policy.robust.scaled`), keeping what
    screening measured of them (the norm before scaling, the clip): the adaptive bound and adaptive
    clipping judge the result as it was sent."""
    out = copy.copy(deltas)
    out.update(scaled({n: t for n, t in deltas.items() if t.is_floating_point()}, weight))
    return out


@dataclass
class Flight:
    """A client's task from dispatch until its result is folded (or the task is dropped): it was
    dispatched in round ``round`` (trains on version ``round - 1``), reached its client at virtual
    time ``start`` and is done at ``finish`` (both 0 on the wall clock). ``task`` is None for a
    flight restored from the run state until it is dispatched again."""

    client: int
    round: int
    start: float = 0.0
    finish: float = 0.0
    task: Task | None = None

    @property
    def order(self) -> tuple[float, int, int]:
        """Its place in virtual time: finish, then round, then client."""
        return self.finish, self.round, self.client


class Schedule:
    """Which clients train and which results a version folds, FedBuff's bookkeeping without tasks,
    threads or tensors: the engine's, and a dry run's of a run's virtual timeline (a schedule
    does not depend on what the clients learn). ``flights`` by client; ``clock`` the virtual
    clock (None: the wall clock, where arrival decides)."""

    def __init__(self, clients: int, concurrency: int, buffer_size: int, seed: int,
                 clock: VirtualClock | None = None) -> None:
        self.clients = clients
        self.concurrency = concurrency
        self.buffer_size = buffer_size
        self.seed = seed
        self.clock = clock
        self.flights: dict[int, Flight] = {}

    def start(self, version: int, last: int) -> list[Flight]:
        """New flights at the start of ``version``: idle clients until ``concurrency`` train, and
        no more than the versions up to ``last`` can fold; each drawn uniformly among the idle
        clients by the seeded draw of (seed, version), which is the synchronous round's sample when
        every client is idle."""
        wanted = min(self.concurrency, self.buffer_size * (last - version + 1)) - len(self.flights)
        idle = [c for c in range(self.clients) if c not in self.flights]
        count = max(0, min(wanted, len(idle)))
        if not count:
            return []
        rng = np.random.default_rng([self.seed, version])
        now = self.clock.now if self.clock is not None else 0.0
        started = []
        for client in sorted(idle[i] for i in rng.choice(len(idle), size=count, replace=False)):
            finish = self.clock.finish(client, version, now) if self.clock is not None else 0.0
            started.append(self.flights.setdefault(client, Flight(client, version, now, finish)))
        return started

    def members(self, kept: set[int] = frozenset()) -> set[int]:
        """``kept`` and the flights that finish first in virtual time, ``buffer_size`` in all."""
        kept = kept & set(self.flights)
        waiting = sorted((f for c, f in self.flights.items() if c not in kept), key=lambda f: f.order)
        return kept | {f.client for f in waiting[:max(0, self.buffer_size - len(kept))]}

    def close(self, folded: Iterable[int]) -> tuple[list[Flight], tuple[float, float] | None]:
        """End the flights of the ``folded`` clients; with the virtual clock move it to the last
        one's finish. Returns those flights and (virtual time, their device seconds), or None."""
        done = [self.flights.pop(c) for c in sorted(folded)]
        if self.clock is None:
            return done, None
        self.clock.now = max([self.clock.now, *(f.finish for f in done)])
        return done, (self.clock.now, sum(self.clock.busy(f.client, f.round) for f in done))


@dataclass
class Held:
    """A result that arrived before its version: its task is answered, its tensors copied."""

    task: Task
    result: ResultInfo
    tensors: dict[str, torch.Tensor]


@dataclass(eq=False)
class Buffer:
    """One version's buffer. ``members``: with the virtual clock, the clients whose results it
    folds (None on the wall clock: the first ``buffer_size`` that arrive); ``admitted``: those
    whose result is being folded or was; ``folded``; ``refused``: refused by screening."""

    version: int
    results: RoundResults
    members: set[int] | None
    admitted: set[int] = field(default_factory=set)
    folded: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    staleness: Counter = field(default_factory=Counter)


@dataclass
class LedgerTotals:
    """The byte ledger's totals over the run at one moment: physical and logical by part, logical
    by unit."""

    physical: dict[str, dict[str, int]]
    logical: dict[str, dict[str, int]]
    units: dict[str, dict[str, int]]

    @classmethod
    def of(cls, ledger: ByteLedger) -> LedgerTotals:
        return cls(ledger.by_part(), ledger.logical()["by_part"], ledger.by_unit())


def _minus(now: Mapping[str, Mapping[str, int]], since: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    return {key: {d: counts[d] - since.get(key, {}).get(d, 0) for d in DIRECTIONS} for key, counts in now.items()}


def _sums(by_key: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    return {d: sum(counts[d] for counts in by_key.values()) for d in DIRECTIONS}


class VersionTraffic:
    """A version's bytes in the shape of the ledger's answers (:class:`~fedpart.server.output.run_recorder.Traffic`):
    the run's bytes counted since the previous version closed, and for each client the bytes of
    its task this version folded (``tasks``: client -> its task's round)."""

    def __init__(self, ledger: ByteLedger, since: LedgerTotals, tasks: Mapping[int, int]) -> None:
        self.ledger = ledger
        self.now = LedgerTotals.of(ledger)
        self.since = since
        self.tasks = tasks

    def by_part(self, round_number: int | None = None) -> dict[str, dict[str, int]]:
        return _minus(self.now.physical, self.since.physical)

    def totals(self, round_number: int | None = None, client: int | None = None) -> dict[str, int]:
        if client is None:
            return _sums(self.by_part())
        task_round = self.tasks.get(client)
        return self.ledger.totals(task_round, client) if task_round is not None else dict.fromkeys(DIRECTIONS, 0)

    def logical(self, round_number: int | None = None) -> dict:
        by_part = _minus(self.now.logical, self.since.logical)
        return {**_sums(by_part), "by_part": by_part}

    def logical_totals(self, round_number: int, client: int) -> dict[str, int]:
        task_round = self.tasks.get(client)
        return (self.ledger.logical_totals(task_round, client) if task_round is not None
                else dict.fromkeys(DIRECTIONS, 0))

    def by_unit(self, round_number: int | None = None) -> dict[str, dict[str, int]]:
        return _minus(self.now.units, self.since.units)


class HeldFolding(TaskFolding):
    """Folds a held result (its task answered when it was held) into its version's ``results``."""

    def __init__(self, engine: Coordinator, task: Task, results: RoundResults) -> None:
        super().__init__(engine, task, lambda: None)
        self.results = results

    def fold(self, fold: Callable[[RoundResults], None], record: Callable[[RoundResults], None]) -> None:
        fold(self.results)
        with self.engine._cond:
            record(self.results)


class BufferedCoordinator(Coordinator):
    """The FedBuff round engine: one :meth:`run_round` per server version (see the module)."""

    def __init__(self, config: RunConfig, log: Callable[[str], None] = print,
                 experiment: Experiment | None = None) -> None:
        super().__init__(config, log, experiment)
        self.concurrency, self.buffer_size = config.buffered.resolved(config.clients, config.sampling.fraction)
        self.staleness_weight = staleness_weight(config.buffered)
        self.schedule = Schedule(config.clients, self.concurrency, self.buffer_size, config.sampling_seed, self.clock)
        self._flights = self.schedule.flights       # by client
        self._held: dict[int, Held] = {}            # by client
        self._models: dict[int, tuple[dict[str, torch.Tensor], dict[str, int]]] = {}  # version -> (tensors, versions)
        self._buffer: Buffer | None = None
        self._traffic_since = LedgerTotals.of(self.ledger)
        self._delivery_since = DeliveryCounts()

    # ------------------------------------------------------------------ what tasks train on

    def _model_for(self, task: Task) -> tuple[Mapping[str, torch.Tensor], Mapping[str, int]]:
        """The global version a training task was dispatched with (holds the lock)."""
        return self._models.get(task.round - 1, (self.global_state, self.versions))

    # ------------------------------------------------------------------ results

    def _accept_training(self, task: Task, result: ResultInfo, tensors: dict[str, torch.Tensor],
                         commit: Callable[[], None]) -> None:
        """Fold a result its version's buffer takes now, hold one that arrived before its version."""
        client = task.client_id
        with self._cond:
            flight = self._flights.get(client)
            if flight is None or flight.task is not task:
                raise Rejected(f"task {task.task_id} is not in flight")
            buffer = self._buffer
            admitted = buffer is not None and client not in buffer.admitted and (
                client in buffer.members if buffer.members is not None else len(buffer.admitted) < self.buffer_size)
            if admitted:
                buffer.admitted.add(client)
        if not admitted:
            self._hold(task, result, tensors, commit)
            return
        try:
            super()._accept_training(task, result, tensors, commit)
        except BaseException as error:
            with self._cond:
                buffer.admitted.discard(client)
                if isinstance(error.__cause__, ResultRefused):  # screening refused it: its task is dropped
                    buffer.refused.add(client)
            raise
        with self._cond:
            self._folded(buffer, task)

    def _hold(self, task: Task, result: ResultInfo, tensors: Mapping[str, torch.Tensor],
              commit: Callable[[], None]) -> None:
        """Keep a copy of a result whose version is not open yet; its task is answered."""
        copied = {name: tensor.clone() for name, tensor in tensors.items()}
        with self._cond:
            self.board.claim(task)
            self._held[task.client_id] = Held(task, result, copied)
            commit()
            self._finish(task)

    def _fold_held(self, buffer: Buffer, held: Held) -> None:
        """Screen and fold a held result into ``buffer`` (admitted to it already)."""
        task, client = held.task, held.task.client_id
        try:
            self._take_training(task, held.result, held.tensors, HeldFolding(self, task, buffer.results))
        except Rejected as error:
            line = f"round {task.round} client {client}: result refused when its version {buffer.version} opened: {error}"
            with self._cond:
                buffer.admitted.discard(client)
                buffer.refused.add(client)
                buffer.results.robust.rejected += 1
                self._flights.pop(client, None)
                self._refill(buffer)
                self._failures.append(line)
            self.log.warning(line)
            return
        with self._cond:
            self._folded(buffer, task)

    def _screen(self, task: Task, result: ResultInfo, deltas: dict[str, torch.Tensor]) -> Screened:
        """Screen a result as if it had trained with the current version's learning rate: one
        that trained before a decay of ``train.lr`` (``train.lr_milestones``) moved by that much
        more, which the adaptive bound would take for an attack (the bound, clipping and the
        norms the bound keeps then measure every result on one scale); the screened deltas are
        scaled back. Where the policy clips to an absolute norm, screened as it came."""
        train, rounds = self.config.train, self.config.rounds
        trained, now = (learning_rate(train.lr, r - 1, rounds, train.lr_milestones, train.lr_gamma)
                        for r in (task.round, self.current_round))
        if not deltas or trained == now or not trained or not now or not self.policy.relative_bounds():
            return super()._screen(task, result, deltas)
        screened = super()._screen(task, result, stale_scaled(deltas, now / trained))
        return replace(screened, deltas=stale_scaled(screened.deltas, trained / now))

    def _fold_training(self, results: RoundResults, task: Task, screened: Screened,
                       values: Mapping[str, torch.Tensor]) -> None:
        """Fold with the deltas scaled by the result's staleness weight."""
        weight = self.staleness_weight(self.current_round - task.round)
        if weight != 1.0:
            screened = replace(screened, deltas=stale_scaled(screened.deltas, weight))
        super()._fold_training(results, task, screened, values)

    def _folded(self, buffer: Buffer, task: Task) -> None:
        """``task``'s result is in ``buffer`` (holds the lock)."""
        buffer.folded.add(task.client_id)
        buffer.staleness[buffer.version - task.round] += 1
        self._cond.notify_all()

    # ------------------------------------------------------------------ a version

    def run_round(self, round_number: int) -> RoundRecord:
        """Dispatch to idle clients, fill the version's buffer, step; returns the version's record."""
        started = time.monotonic()
        with self._cond:
            self._round = round_number
            self.recorder.start_round(started, self.buffer_size)
            dispatched = self._dispatch(round_number)
            uploads = {n for f in self._flights.values() for n in self.round_plan(f.round, f.client).upload_deltas}
            reference = {n: self.global_state[n] for n in self.global_state if n in uploads}
            buffer = Buffer(round_number, RoundResults(self.policy.open_round(round_number, reference)),
                            self.schedule.members() if self.clock is not None else None)
            self._buffer = buffer
            self._results = buffer.results
        self._fill(buffer, started)
        with self._cond:
            steps = EngineSteps(self, round_number)
        failed = self.policy.close_round(steps)
        with self._cond:
            self._results = None
        self._step_global(round_number, buffer.results, failed)
        with self._cond:
            record = self._close(buffer, dispatched, time.monotonic() - started)
        return record

    def _dispatch(self, round_number: int) -> list[int]:
        """Tasks for the flights restored from a run state and for newly chosen idle clients
        (holds the lock); returns the clients that got one."""
        self.schedule.start(round_number, self.last_round)
        chunk_bytes = self.chunk_bytes()
        tasks = []
        for client, flight in sorted(self._flights.items()):
            if flight.task is not None:
                continue
            host = self.registry.host(client)
            if host is None:  # as a synchronous round skips a sampled client no process hosts
                del self._flights[client]
                continue
            self._models.setdefault(flight.round - 1, (dict(self.global_state), dict(self.versions)))
            flight.task = Task(TaskKind.TRAIN, next(self._task_ids), flight.round, client,
                               train=self.round_plan(flight.round, client), personal_init=self._personal_init(client),
                               session=host.session, result_chunk_bytes=chunk_bytes, **self.policy.task_fields())
            tasks.append(flight.task)
        self.board.dispatch(tasks)
        return [task.client_id for task in tasks]

    def _fill(self, buffer: Buffer, started: float) -> None:
        """Fold the held results the buffer takes (those that arrived before it opened, and with
        the virtual clock those of the members it takes in place of one that left), and wait
        until it is complete, or ``server.round_timeout`` passed (it then folds what it holds),
        and for the folds under way."""
        deadline = started + self.config.server.round_timeout
        while True:
            with self._cond:
                ready = self._admit_held(buffer)
                if not ready:
                    if self._complete(buffer):
                        break
                    self.registry.reap_silent()
                    self._drop_closed(buffer)
                    now = time.monotonic()
                    if now >= deadline:
                        self.log.warning(f"version {buffer.version} folds {len(buffer.folded)} of its "
                                         f"{self.buffer_size} results after server.round_timeout")
                        break
                    if not self._admissible(buffer):
                        self._cond.wait(min(deadline - now, REAP_INTERVAL_SECONDS))
                    continue
            for held in ready:
                self._fold_held(buffer, held)
        with self._cond:
            while buffer.admitted - buffer.folded:
                self._cond.wait(REAP_INTERVAL_SECONDS)
            self._buffer = None

    def _admissible(self, buffer: Buffer) -> list[int]:
        """The clients of held results that ``buffer`` takes, in the order they arrived (holds the lock)."""
        room = self.buffer_size - len(buffer.admitted)
        if buffer.members is not None:
            return [client for client in self._held if client in buffer.members]
        return list(self._held)[:max(room, 0)]

    def _admit_held(self, buffer: Buffer) -> list[Held]:
        """Take the held results ``buffer`` admits (holds the lock)."""
        ready = [self._held.pop(client) for client in self._admissible(buffer)]
        buffer.admitted.update(held.task.client_id for held in ready)
        return ready

    def _complete(self, buffer: Buffer) -> bool:
        """All its members folded (virtual clock), or ``buffer_size`` results, or every task in
        flight folded in it (holds the lock)."""
        if buffer.admitted - buffer.folded:
            return False
        if buffer.members is not None:
            return buffer.members <= buffer.folded
        return len(buffer.folded) >= self.buffer_size or set(self._flights) <= buffer.folded

    def _drop_closed(self, buffer: Buffer) -> None:
        """End the flights whose task was closed without a result this engine holds or folds
        (dropped, given up, its process gone): their clients are idle again; with the virtual
        clock the buffer takes the next flights to finish in their place (holds the lock)."""
        dropped = [c for c, f in self._flights.items() if f.task is not None and f.task.closed
                   and c not in buffer.admitted and c not in self._held]
        for client in dropped:
            del self._flights[client]
        if dropped:
            self._refill(buffer)

    def _refill(self, buffer: Buffer) -> None:
        """With the virtual clock, a buffer whose members left (dropped, refused) takes the next
        flights to finish in their place (holds the lock)."""
        if buffer.members is not None:
            buffer.members = self.schedule.members(buffer.members | buffer.admitted)

    def _close(self, buffer: Buffer, dispatched: list[int], seconds: float) -> RoundRecord:
        """End the folded flights, move the virtual clock, forget unneeded versions; the record
        (holds the lock)."""
        folded, virtual = self.schedule.close(buffer.folded)
        tasks = {f.client: f.round for f in folded}
        for client in buffer.refused:
            self._flights.pop(client, None)
        needed = {f.round - 1 for f in self._flights.values()}
        self._models = {v: model for v, model in self._models.items() if v in needed}
        self.recorder.end_round(buffer.version, seconds)
        delivery = self.board.delivery_counts()
        notes = VersionNotes(VersionTraffic(self.ledger, self._traffic_since, tasks),
                             delivery - self._delivery_since, virtual,
                             BufferedVersion(concurrency=self.concurrency, buffer_size=self.buffer_size,
                                             dispatched=dispatched,
                                             staleness={str(s): n for s, n in sorted(buffer.staleness.items())},
                                             in_flight=len(self._flights), held=len(self._held)))
        self._traffic_since = notes.traffic.now
        self._delivery_since = delivery
        processes = {c: host.name for c in [*tasks, *buffer.refused] if (host := self.registry.host(c)) is not None}
        sampled = sorted([*tasks, *buffer.refused])
        return self.recorder.record(buffer.version, sampled, sorted(buffer.results.metrics), buffer.results,
                                    processes, seconds, notes)

    def evaluate_all(self) -> dict[int, dict[str, float]]:
        """Close the tasks still in flight (a late result is refused), then evaluate."""
        with self._cond:
            self.board.close({f.task.task_id for f in self._flights.values() if f.task is not None})
            self._flights.clear()
            self._held.clear()
        return super().evaluate_all()

    # ------------------------------------------------------------------ resume

    def snapshot(self, round_number: int, seconds: float) -> RunState:
        """The run state with the tasks in flight (a held result counts as in flight: it is
        trained again after a resume) and the versions they train on."""
        state = super().snapshot(round_number, seconds)
        with self._cond:
            flights = sorted(self._flights.values(), key=lambda f: f.client)
            for held in self._held.values():  # its personal parts are initialised again with it
                parts = set(state.personal.get(held.task.client_id, [])) - set(held.task.personal_init)
                state.personal[held.task.client_id] = sorted(parts)
            tensors, versions = {}, {}
            for version, (model, model_versions) in sorted(self._models.items()):
                versions[str(version)] = model_versions
                tensors.update({f"{version}/{name}": tensor for name, tensor in model.items()
                                if model_versions[name] != self.versions[name]})
        state.engine = {**state.engine, "flights": [[f.client, f.round, f.start, f.finish] for f in flights],
                        "models": versions}
        state.engine_tensors = tensors
        return state

    def restore(self, state: RunState) -> None:
        """Continue with the saved tasks in flight: each is dispatched again, as it was, at the
        next version (its client trains it again from the same start)."""
        super().restore(state)
        with self._cond:
            self._flights.clear()
            self._flights.update({client: Flight(client, task_round, start, finish)
                                  for client, task_round, start, finish in state.engine.get("flights", [])})
            self._models = {}
            for version, model_versions in state.engine.get("models", {}).items():
                model = {name: state.engine_tensors.get(f"{version}/{name}", self.global_state[name])
                         for name in self.global_state}
                self._models[int(version)] = (model, {name: int(v) for name, v in model_versions.items()})
            self._traffic_since = LedgerTotals.of(self.ledger)

