"""The round engine: the plan of every round, the tensors a task carries, validating and folding
results into the aggregate, the new global model, the final evaluation, and the run state a
resumed server continues from.

A :class:`Coordinator` composes the three parts of the server's state machine:

- the :class:`~fedpart.server.engine.registry.ProcessRegistry` (client processes: join, leave,
  liveness, take-over, readiness, release at the end),
- the :class:`~fedpart.server.engine.task_board.TaskBoard` (tasks queued per process, long polls,
  the wait for dispatched tasks),
- and itself: the global model, sampling, plans, the fold, snapshot and restore; with
  the server's policy (:mod:`fedpart.server.policy`: screen, combine, step, in the layers the
  config turns on, which the engine does not know), the run's records
  (:mod:`fedpart.server.output.run_recorder`) and the final evaluation
  (:mod:`fedpart.server.engine.final_evaluation`) in modules of their own.

They share one condition variable: one lock over the whole state machine, only ever held for
bookkeeping (never while sending, receiving or folding), re-entrant so that the engine can make
several registry and board calls one atomic step. The gRPC service (``fedpart.server.transport.service``)
calls them from its event loop and counts bytes into the :class:`~fedpart.server.output.accounting.ByteLedger`;
results are validated (``fedpart.server.policy.validation``) and folded on its event loop, or by
``server.fold_workers`` threads, several at once. The round loop (:meth:`Coordinator.run_round`)
runs in the server's main thread and waits on the condition variable with a deadline on every wait.

Nothing is rescanned per event: a waiting long poll waits on its own process's mailbox and only
that process is woken when a task is queued for it; the round loop waits on the set of its open
tasks and is woken when that set empties; readiness is a running count. Work per join, poll,
result or heartbeat is O(1) in the number of clients and processes.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterable, Mapping

import torch
from fedpart.common.config.experiment import Experiment, build_experiment
from fedpart.common.config.run_config import RunConfig
from fedpart.common.ml.algorithms import Algorithm, Role, RoundContext, learning_rate
from fedpart.common.ml.split_model import SplitModel, tensor_part
from fedpart.common.process.console import Log, RunProgress
from fedpart.common.process.exit_codes import StoppableCondition, Stopped
from fedpart.common.process.records import RoundRecord
from fedpart.common.wire.plans import (
    EvalPlan,
    JoinInfo,
    ResultInfo,
    RunOutcome,
    TaskKind,
    TrainPlan,
)
from fedpart.common.wire.protocol import Rejected
from fedpart.common.wire.security import Principal
from fedpart.common.wire.tensors import TensorSpec, named_specs
from fedpart.server.engine.final_evaluation import FinalEvaluation
from fedpart.server.engine.registry import REAP_INTERVAL_SECONDS, ProcessRegistry
from fedpart.server.engine.run_state import EARLIER_ROUNDS, ResumeError, RunState
from fedpart.server.engine.sampling import round_target, sample_clients
from fedpart.server.engine.task_board import Task, TaskBoard
from fedpart.server.engine.virtual_clock import VirtualClock
from fedpart.server.output.accounting import DIRECTIONS, PROCESS, ByteLedger
from fedpart.server.output.run_recorder import RunRecorder
from fedpart.server.policy import (
    Folding,
    Policy,
    RoundFailed,
    RoundResults,
    Screened,
    build_policy,
)
from fedpart.server.policy.aggregation import HeadDictionary
from fedpart.server.policy.robust import ResultRefused
from fedpart.server.policy.validation import all_finite, check_result
from fedpart.server.transport.transfers import result_chunk_bytes

MODEL_TASKS = (TaskKind.TRAIN, TaskKind.EVALUATE)
"""The tasks that carry global tensors (a policy layer's own steps carry none)."""


class Coordinator:
    """The round engine: owns the global model and runs the rounds over the registry's
    processes and the board's tasks."""

    def __init__(self, config: RunConfig, log: Callable[[str], None] = print,
                 experiment: Experiment | None = None) -> None:
        """``experiment``: the run's, as the process built it once (where None, built here)."""
        self.config = config
        self.log = Log.of(log)
        self.experiment = experiment or build_experiment(config)
        self.algorithm: Algorithm = self.experiment.algorithm
        self.model: SplitModel = self.experiment.new_model()
        self.global_state: dict[str, torch.Tensor] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.versions: dict[str, int] = {name: 0 for name in self.global_state}
        self.shared_names = self.algorithm.shared_names(self.global_state)
        self.personal_names = self.algorithm.personal_names(self.global_state)
        self.run_id = uuid.uuid4().hex[:12]
        self.ledger = ByteLedger(self.model.schedule_units)  # the service records into it; rounds and resume read it
        self.heads = HeadDictionary()
        self.policy: Policy = build_policy(config, log, self.experiment, run_id=lambda: self.run_id, blame=self._blame,
                                           round_uploads=lambda r: self.round_plan(r, 0).upload_deltas)

        # the lock of the whole state machine; the round loop waits on it, and a stop ends its waits
        self._cond = StoppableCondition()
        self.registry = ProcessRegistry(config.clients, config.server, self._cond, log)
        self.board = TaskBoard(self.registry, self._cond, log, self._record_failure, config.server.delivery_attempts,
                               dropped=lambda task: self.evaluation.dropped(task))
        self._personal: dict[int, set[str]] = {}  # personal parts each client holds, as the server knows
        self._folding = 0                        # results being folded right now
        self._draining = False                   # the round loop waits for the folds under way
        self._task_ids = itertools.count(1)
        self._round = 0
        self.clock = VirtualClock(config, self.round_plan) if config.heterogeneity.clock == "virtual" else None
        self.recorder = RunRecorder(config.rounds, config.train, self.ledger, self.board, self.policy, self.clock)
        self._results: RoundResults | None = None
        self.evaluation = FinalEvaluation(config.clients, config.server, self.registry, self.board, self._cond, log,
                                          self._evaluation_task)
        self._failures: list[str] = []
        self._train_samples: dict[int, int] = {}  # last training sample count each client reported
        # how the run is served, for the run state: transport, credentials_sha256, the resume command
        self.security: dict[str, str] = {}
        self.round_plan(1, 0)  # a schedule that does not fit the model fails now, not in round 1

    # ------------------------------------------------------------------ service-side calls

    @property
    def current_round(self) -> int:
        """The round in progress (or last run); ``rounds + 1`` during the final evaluation."""
        return self._round

    @property
    def last_round(self) -> int:
        """The last round the run trains: ``rounds``, or fewer where a layer of the policy ends it
        early (a privacy budget, docs/privacy.md)."""
        return self.policy.last_round(self.config.rounds)

    def stop_note(self) -> str | None:
        """Why the run trains fewer than ``rounds`` rounds (None: it trains them all)."""
        return self.policy.stop_note()

    def join(self, request: JoinInfo, principal: Principal | None = None, peer: str = "") -> str:
        """Register a client process with the registry (see :meth:`ProcessRegistry.join`) and
        note which personal parts its clients still hold; returns its session."""
        with self._cond:
            process = self.registry.join(request, principal, peer)
            for hosted in request.clients:
                # what the server recorded, less what the process no longer holds (a lost state dir):
                # a part trained only in a round the server lost is initialised again
                held = set(hosted.personal_parts) if request.state_run_id == self.run_id else set()
                self._personal[hosted.id] = self._personal.get(hosted.id, set()) & held
            self.evaluation.rehosted(process.clients)
        return process.session

    def credentials_changed(self, removed: list[Principal], added: list[Principal], fingerprint: str) -> None:
        """The server took a changed credentials file: the processes of the ``removed``
        credentials are dropped, and the run state records the new file's ``fingerprint``."""
        with self._cond:
            self.security["credentials_sha256"] = fingerprint
        self.log.warning(f"the credentials file changed: {len(removed)} credential(s) revoked "
                         f"({', '.join(p.name for p in removed) or 'none'}), {len(added)} added "
                         f"({', '.join(p.name for p in added) or 'none'})")
        self.registry.revoke(set(removed))

    def task_tensors(self, task: Task, held: Mapping[str, int]) -> tuple[list[TensorSpec], list[torch.Tensor]]:
        """Global tensors a task carries: shared ones newer than what the process holds, plus
        the parts the client initialises its personal copy from (none with a step of a policy
        layer's own: it works on what the client kept)."""
        if task.kind not in MODEL_TASKS:
            return [], []
        with self._cond:
            global_state, versions = self._model_for(task)
            names = [n for n in self.shared_names if held.get(n, -1) != versions[n]]
            if task.personal_init:
                names += [n for n in self.personal_names
                          if tensor_part(n) in task.personal_init and held.get(n, -1) != versions[n]]
            state = {n: global_state[n] for n in names}
            specs = named_specs(state, versions)
        return specs, list(state.values())

    def _model_for(self, task: Task) -> tuple[Mapping[str, torch.Tensor], Mapping[str, int]]:
        """The global tensors ``task`` trains on, and their versions (holds the lock): the
        current ones."""
        return self.global_state, self.versions

    def named_versions(self, task: Task) -> tuple[tuple[str, int], ...]:
        """Names and versions of every global tensor ``task`` names, whatever its process holds
        (what its logical bytes count), in the order of :meth:`task_tensors`."""
        if task.kind not in MODEL_TASKS:
            return ()
        names = self.shared_names
        if task.personal_init:
            names = names + [n for n in self.personal_names if tensor_part(n) in task.personal_init]
        with self._cond:
            versions = self._model_for(task)[1]
            return tuple((n, versions[n]) for n in names)

    def expected_uploads(self, task: Task) -> list[TensorSpec]:
        """Specs (names, dtypes, shapes) of the tensors a result of ``task`` must carry: those a
        layer of the policy decides for its own steps, else the task's uploads of the global model."""
        tensors = self.policy.expected_uploads(task)
        if tensors is None:
            tensors = {n: self.global_state[n] for n in task.uploads()}
        return named_specs(tensors)

    def accept(self, task: Task, result: ResultInfo, tensors: dict[str, torch.Tensor],
               commit: Callable[[], None] = lambda: None) -> None:
        """Validate a complete result (:func:`~fedpart.server.policy.validation.check_result`) and fold
        it in; raises Rejected and changes nothing if bad, and
        :class:`~fedpart.server.engine.task_board.DuplicateResult` for a copy of a result that was folded
        (or is being folded). ``commit`` (the result's byte accounting) runs just before the task
        is closed.

        Safe to call from several threads at once: folds of different results run in parallel
        and a round closes only after the folds it admitted are done. ``tensors`` are only read
        while this call runs (the caller may reuse their buffers afterwards).
        """
        metrics = dict(result.metrics)
        trained_samples = None
        if task.kind == TaskKind.EVALUATE:
            with self._cond:
                trained_samples = self._train_samples.get(task.client_id)
        check_result(task, result, tensors, trained_samples)
        if task.kind == TaskKind.EVALUATE:
            counted, notes = self.policy.screen_evaluation(task.client_id, metrics)
            with self._cond:
                self.board.claim(task)
                self.evaluation.reports[task.client_id] = counted
                commit()
                self._finish(task)
            for note in notes:
                self.log.warning(f"client {task.client_id}: {note}")
            return
        if task.kind == TaskKind.TRAIN:
            self._accept_training(task, result, tensors, commit)
        else:  # a step of a policy layer's own
            self.policy.accept(task, result, tensors, TaskFolding(self, task, commit))

    def _accept_training(self, task: Task, result: ResultInfo, tensors: dict[str, torch.Tensor],
                         commit: Callable[[], None]) -> None:
        """Take a training result into the round (see :meth:`accept`)."""
        self._take_training(task, result, tensors, TaskFolding(self, task, commit))

    def _take_training(self, task: Task, result: ResultInfo, tensors: Mapping[str, torch.Tensor],
                       folding: Folding) -> None:
        """Screen a training result and fold it through ``folding``, unless a layer of the policy
        takes it."""
        if self.policy.owns(task):
            self.policy.accept(task, result, tensors, folding)
            return
        screened = self._screen(task, result, {n: tensors[n] for n in task.train.upload_deltas})
        values = {n: tensors[n] for n in task.train.upload_values}
        folding.fold(lambda results: self._fold_training(results, task, screened, values),
                     lambda results: folding.record_training(results, result, screened))
        for note in screened.notes:
            self.log.warning(f"round {task.round} client {task.client_id}: {note}")

    def _screen(self, task: Task, result: ResultInfo, deltas: dict[str, torch.Tensor]) -> Screened:
        """The policy's screening of a training result with ``deltas``; :class:`Rejected` (counted
        in the round's results while the task is outstanding) for one it refuses."""
        try:
            return self.policy.screen(task.client_id, deltas, int(result.num_samples))
        except ResultRefused as error:
            with self._cond:
                if self._results is not None and self.board.is_outstanding(task):
                    self._results.robust.rejected += 1
                    self._results.deltas.refused(task.client_id, error.observation)
            raise Rejected(str(error)) from error

    def _fold_training(self, results: RoundResults, task: Task, screened: Screened,
                       values: Mapping[str, torch.Tensor]) -> None:
        """Fold a screened training result's deltas into ``results``, its values (FedHA's heads)
        into the head dictionary."""
        if screened.deltas:
            results.deltas.add(screened.deltas, screened.weight, task.client_id)
        if values:
            self.heads.store(task.client_id, values, screened.weight)

    def _fold(self, task: Task, fold: Callable[[RoundResults], None], record: Callable[[RoundResults], None],
              commit: Callable[[], None]) -> None:
        """Claim ``task`` (from then on its round waits for this fold), ``fold`` its result into the
        round's results outside the lock, then under it ``record`` what the result says, count its
        bytes (``commit``) and close the task."""
        with self._cond:
            self.board.claim(task)
            results = self._results
            self._folding += 1
        try:
            fold(results)
        finally:
            with self._cond:
                self._folding -= 1
                record(results)
                commit()
                self._finish(task)
                if self._draining and not self._folding:
                    self._cond.notify_all()

    def _record_training(self, results: RoundResults, client: int, metrics: dict[str, float], screened: Screened,
                         reported_samples: int) -> None:
        """What a training result says: its metrics, its counted samples, whether it was clipped
        (holds the lock)."""
        results.metrics[client] = metrics
        results.samples[client] = screened.samples
        results.robust.samples_capped += screened.samples_capped
        results.robust.clipped += screened.clipped
        self._train_samples[client] = reported_samples

    # ------------------------------------------------------------------ helpers

    def _record_failure(self, line: str) -> None:
        with self._cond:
            self._failures.append(line)

    def _blame(self, line: str) -> None:
        """A client named for what it sent (a policy layer's checks): a failure of the run."""
        self._record_failure(line)
        self.log.warning(line)

    def _finish(self, task: Task) -> None:
        """Close an answered task (it may already be closed when its result was folded as the
        round closed); the client now holds the personal parts it initialised."""
        self.board.answered(task)
        if task.personal_init:
            self._personal.setdefault(task.client_id, set()).update(task.personal_init)

    def _await(self, task_ids: set[int], timeout: float, enough: int | None = None,
               deadline_factor: float = 0.0) -> set[int]:
        """Wait for the dispatched tasks (see :meth:`TaskBoard.await_tasks`), then for the folds
        already under way. Returns the ids that did not finish."""
        with self._cond:
            unfinished = self.board.await_tasks(task_ids, timeout, enough, deadline_factor)
            self._draining = True  # only now does the end of a fold wake this loop
            try:
                while self._folding:
                    self._cond.wait(REAP_INTERVAL_SECONDS)
            finally:
                self._draining = False
            return unfinished

    # ------------------------------------------------------------------ the run

    def round_plan(self, round_number: int, client_id: int) -> TrainPlan:
        """The training plan of one client in one round."""
        train = self.config.train
        ctx = RoundContext(round=round_number, rounds=self.config.rounds,
                           units=tuple(self.model.unit_names), epochs=train.epochs)
        phases = self.algorithm.schedule(ctx)
        deltas, values = self.algorithm.uploads(self.global_state, phases)
        return TrainPlan(
            phases=tuple(phases),
            lr=learning_rate(train.lr, round_number - 1, self.config.rounds, train.lr_milestones, train.lr_gamma),
            momentum=train.momentum, weight_decay=train.weight_decay, batch_size=train.batch_size,
            grad_clip=train.grad_clip,
            upload_deltas=tuple(deltas), upload_values=tuple(values),
            seed=(self.config.training_seed * 1_000_003 + round_number) * 1_000_003 + client_id,
        )

    def _personal_init(self, client_id: int) -> tuple[str, ...]:
        have = self._personal.get(client_id, set())
        return tuple(p for p in self.algorithm.personal_parts if p not in have)

    def run_round(self, round_number: int) -> RoundRecord:
        """Sample, dispatch, collect and aggregate one round; returns its metrics record."""
        started = time.monotonic()
        sampling = self.config.sampling
        sampled = sample_clients(self.config.clients, round_number, self.config.sampling_seed,
                                 sampling.fraction, sampling.probability, sampling.over_selection, sampling.scheme)
        uploads = self.round_plan(round_number, 0).upload_deltas  # every client's plan of a round uploads the same
        with self._cond:
            self._round = round_number
            self.recorder.start_round(started, len(sampled))
            self._results = RoundResults(self.policy.open_round(round_number, {n: self.global_state[n] for n in uploads}))
            hosts = {c: host for c in sampled if (host := self.registry.host(c)) is not None}
            steps = EngineSteps(self, round_number)
            dispatched = self.board.dispatch([self._train_task(round_number, c, host.session, steps.chunk_bytes)
                                              for c, host in hosts.items()])
        # over-selection closes the round once the clients it needs have answered
        enough = round_target(self.config.clients, sampling.fraction) if sampling.over_selection else None
        self._await(dispatched, self.config.server.round_timeout, enough, self.config.server.round_deadline_factor)
        failed = self.policy.close_round(steps)
        with self._cond:
            results, self._results = self._results, None
        self._step_global(round_number, results, failed)
        seconds = time.monotonic() - started
        with self._cond:
            self.recorder.end_round(round_number, seconds)
        processes = {c: host.name for c, host in hosts.items()}
        return self.recorder.record(round_number, sampled, sorted(results.metrics), results, processes, seconds)

    def _train_task(self, round_number: int, client: int, session: str, chunk_bytes: int) -> Task:
        """A client's training task of a round, with what every training task of the round carries
        for the policy's layers."""
        return Task(TaskKind.TRAIN, next(self._task_ids), round_number, client,
                    train=self.round_plan(round_number, client), personal_init=self._personal_init(client),
                    session=session, result_chunk_bytes=chunk_bytes, **self.policy.task_fields())

    def chunk_bytes(self) -> int:
        """The largest message a result may come in, the connected processes sharing the bytes
        waiting uploads may hold (holds the lock)."""
        server = self.config.server
        return result_chunk_bytes(server.result_chunk_bytes, server.waiting_upload_bytes, self.registry.live_processes)

    def _step_global(self, round_number: int, results: RoundResults, failed: str | None) -> None:
        """Move the global model by the round's folded ``results`` (the policy's step, FedHA's
        heads), unless the round ``failed``; install what came out finite and bump the versions of
        the tensors that changed to ``round_number``. Only the clients the round's aggregate holds
        count as completed."""
        refusals = []
        counted = self.policy.counted(results.metrics)
        results.metrics = {c: m for c, m in results.metrics.items() if c in counted}
        results.samples = {c: n for c, n in results.samples.items() if c in counted}
        heads = self.heads if self.algorithm.head is Role.COLLECTED else None
        try:
            updated = self.policy.new_global(self.global_state, results.deltas, heads) if failed is None else {}
        except RoundFailed as error:
            failed, updated = str(error), {}
        if failed is not None:
            results.metrics = {}
            refusals.append(f"round {round_number}: {failed}; the global model is kept")
            self.log.error(refusals[-1])
        results.robust.non_finite = sorted(name for name, tensor in updated.items() if not all_finite(tensor))
        for name in results.robust.non_finite:  # never installed: the previous value stays
            del updated[name]
            refusals.append(f"round {round_number}: the aggregated {name!r} is not finite; its previous value is kept")
            self.log.error(refusals[-1])
        with self._cond:
            self._failures.extend(refusals)
            for name, tensor in updated.items():
                if not torch.equal(tensor, self.global_state[name]):
                    self.versions[name] = round_number
                self.global_state[name] = tensor

    def evaluate_all(self) -> dict[int, dict[str, float]]:
        """Every client evaluates and personalises the final model on its own data
        (:meth:`FinalEvaluation.run`); returns each client's report."""
        ev = self.config.evaluate
        plan = EvalPlan(finetune_epochs=tuple(sorted(set(ev.finetune_epochs))), part=ev.part, lr=ev.lr,
                        momentum=ev.momentum, batch_size=ev.batch_size, headless=ev.headless, seed=self.config.training_seed)
        with self._cond:
            self._round = self.config.rounds + 1
        return self.evaluation.run(plan, self._round)

    def _evaluation_task(self, client: int, session: str, plan: EvalPlan) -> Task:
        return Task(TaskKind.EVALUATE, next(self._task_ids), self._round, client, evaluate=plan,
                    personal_init=self._personal_init(client), session=session)

    def stop(self, stop: Stopped) -> None:
        """SIGINT or SIGTERM (from the signal thread, :func:`~fedpart.common.process.exit_codes.signals_to`):
        the round loop's next wait raises ``stop``."""
        self._cond.stop(stop)

    def finish(self, outcome: RunOutcome = RunOutcome.COMPLETED) -> None:
        """Tell every process the run is over and how it ended (their next poll returns DONE);
        then ``registry.wait_until_released`` waits until they heard it. A stop from now on
        has nothing left to stop."""
        self._cond.request.settle()
        with self._cond:
            self.registry.finish(outcome)
            self.board.wake_all()

    def progress(self) -> RunProgress:
        """Where the run stands, for the live display: the stage, the round, clients done of
        those sampled (or ready, or evaluated), the bytes so far, and the ETA: the mean time of
        the rounds this server completed times the rounds left, less the current round's time."""
        totals = self.ledger.totals()
        clients = self.config.clients
        with self._cond:
            if self.evaluation.active:
                stage, done, total = "evaluating", len(self.evaluation.reports), clients
            elif self.recorder.training(self._round):
                stage, total = "training", self.recorder.sampled
                done = len(self._results.metrics) if self._results is not None else total
            else:
                stage, done, total = "joining", self.registry.ready_clients, clients
            eta = self.recorder.eta(self._results is not None) if stage == "training" else None
            return RunProgress(stage, self._round, self.config.rounds, done, total, totals["down"], totals["up"], eta)

    # ------------------------------------------------------------------ resume

    def snapshot(self, round_number: int, seconds: float) -> RunState:
        """The run state after ``round_number`` (call between rounds), for :meth:`restore`."""
        with self._cond:
            next_task_id = next(self._task_ids)  # a peek: the counter goes on from the same id
            self._task_ids = itertools.count(next_task_id)
            personal = {c: sorted(parts) for c, parts in self._personal.items() if parts}
            failures = self._failures + self.registry.left
            global_state = dict(self.global_state)
            versions = dict(self.versions)
            security = dict(self.security)
        return RunState(
            run_id=self.run_id, round=round_number, global_state=global_state, versions=versions,
            next_task_id=next_task_id, personal=personal,
            heads=self.heads.entries(),
            failures=failures,
            bytes_by_client={c: self.ledger.by_part(client=c) for c in [PROCESS, *range(self.config.clients)]},
            seconds=seconds, config=self.config.to_dict(),
            server_optimizer=self.policy.state(), security=security,
            engine={"virtual_seconds": self.clock.now} if self.clock is not None else {},
        )

    def restore(self, state: RunState) -> None:
        """Continue the run saved in ``state`` (before any process joins)."""
        expected = {n: (t.dtype, tuple(t.shape)) for n, t in self.global_state.items()}
        saved = {n: (t.dtype, tuple(t.shape)) for n, t in state.global_state.items()}
        if saved != expected:
            differing = sorted(n for n in set(saved) | set(expected) if saved.get(n) != expected.get(n))
            raise ResumeError(f"the saved global tensors do not fit the model of the config: {differing[:5]}")
        with self._cond:
            self.run_id = state.run_id
            self._round = state.round
            self.recorder.completed_rounds = state.round
            self.global_state = {n: t.clone() for n, t in state.global_state.items()}
            self.versions = dict(state.versions)
            self._task_ids = itertools.count(state.next_task_id)
            self._personal = {c: set(parts) for c, parts in state.personal.items()}
            self._failures = list(state.failures)
        if self.clock is not None:
            self.clock.now = state.engine.get("virtual_seconds", 0.0)
        for client, (tensors, weight) in sorted(state.heads.items()):
            self.heads.store(client, tensors, weight)
        try:
            self.policy.load_state(state.server_optimizer)
        except ValueError as error:
            raise ResumeError(f"the saved server optimizer state does not fit the config: {error}") from error
        for client, by_part in state.bytes_by_client.items():
            for direction in DIRECTIONS:
                self.ledger.add(EARLIER_ROUNDS, client, direction, {p: n[direction] for p, n in by_part.items()})

    @property
    def failures(self) -> list[str]:
        with self._cond:
            return self._failures + self.registry.left


class TaskFolding:
    """How a policy layer folds the result of one task it takes (:class:`~fedpart.server.policy.Folding`):
    through the engine's fold, which claims the task, counts its bytes (``commit``) and answers it."""

    def __init__(self, engine: Coordinator, task: Task, commit: Callable[[], None]) -> None:
        self.engine = engine
        self.task = task
        self.commit = commit

    def fold(self, fold: Callable[[RoundResults], None], record: Callable[[RoundResults], None]) -> None:
        self.engine._fold(self.task, fold, record, self.commit)

    def record_training(self, results: RoundResults, result: ResultInfo, screened: Screened) -> None:
        self.engine._record_training(results, self.task.client_id, dict(result.metrics), screened,
                                     int(result.num_samples))


class EngineSteps:
    """The round's tasks of a policy layer's own (:class:`~fedpart.server.policy.RoundSteps`):
    dispatched to the clients' processes and awaited like the round's training (``chunk_bytes``:
    the largest message their results may come in, the round's)."""

    def __init__(self, engine: Coordinator, round_number: int) -> None:
        self.engine = engine
        self.round_number = round_number
        self.chunk_bytes = engine.chunk_bytes()

    def run(self, make: Callable[[int, int, str, int], Task], clients: Iterable[int]) -> None:
        engine = self.engine
        with engine._cond:
            tasks = [make(client, next(engine._task_ids), host.session, self.chunk_bytes)
                     for client in clients if (host := engine.registry.host(client)) is not None]
            dispatched = engine.board.dispatch(tasks)
        server = engine.config.server
        engine._await(dispatched, server.round_timeout, None, server.round_deadline_factor)
