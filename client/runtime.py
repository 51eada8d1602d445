"""``fedpart client``: one process hosting one or more clients on one device.

The process connects out to the coordinator, joins, loads its clients' data, then asks for tasks
until the run is over, trains or evaluates each on its main thread and sends the result. The
protocol, delivery and reconnection are :class:`~fedpart.client.session.Session`'s, on an event
loop of its own thread; this module is the worker: it keeps one cache of global tensors (with
their versions) for all of its clients, on its device, so that an unchanged tensor crosses the
wire, and the bus to a GPU, once per process (:mod:`fedpart.client.placement`), and each client's
personal parts in its :class:`ClientStore`. Its ``execute`` trains or evaluates one client and
replies with the plain update and metrics; what the run adds beside training (clipping, secure
aggregation, DP-SGD's ledger, compression) are mods around it (:mod:`fedpart.client.mods`). A task
sent again (its first delivery was lost, or the process restarted) trains again from the same start
and gives the same result. Stopped by SIGINT
or SIGTERM it tells the server (``Leave``) before it exits. Exit codes:
:mod:`fedpart.common.process.exit_codes`.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from fedpart.client.evaluation import evaluate_and_personalize
from fedpart.client.local_data import ClientData, load_client_data
from fedpart.client.mods import (
    Reply,
    WorkerContext,
    build_mods,
    compose,
    pack,
    train_options,
)
from fedpart.client.placement import (
    DeviceError,
    PeakMemory,
    Transfers,
    describe,
    resolve_device,
)
from fedpart.client.session import (
    CONNECT_SECONDS,
    RECONNECT_SECONDS,
    ReceivedTask,
    Sent,
    Session,
    SessionError,
    SessionEvents,
    SessionThread,
)
from fedpart.client.speed import SpeedError, TrainingSpeed
from fedpart.client.store import ClientStore
from fedpart.client.training import train_local
from fedpart.common.config.experiment import LocalData, check_experiment
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.process.console import ClientActivity, Display, Log, render_client
from fedpart.common.data.augment import build_augment
from fedpart.common.ml.losses import build_loss
from fedpart.common.ml.split_model import tensor_part
from fedpart.common.models.zoo import unit_forward_flops
from fedpart.common.process.exit_codes import ExitCode, Stopped, signals_to
from fedpart.common.process.limits import HostShare
from fedpart.common.wire.client_ids import format_id_ranges
from fedpart.common.wire.plans import RunOutcome, TaskInfo, TaskKind
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.security import ClientSecurity
from fedpart.common.wire.tensors import TensorAssembler
from fedpart.proto import fedpart_pb2 as pb

T = TypeVar("T")

RESULTS_IN_FLIGHT = 2  # results a process may still be sending while it works on its next task


class ClientError(SessionError):
    """The client process cannot go on (message says why)."""


class _ClientEvents(SessionEvents):
    """What the session reports, in the process's log."""

    def __init__(self, process: ClientProcess) -> None:
        self.process = process

    def log(self, message: str, level: int = logging.INFO) -> None:
        self.process.log(message, level)

    def answered(self, task: TaskInfo, sent: Sent, nbytes: int) -> None:
        if sent is not Sent.REFUSED:
            note = " (a copy: the server had it already)" if sent is Sent.DUPLICATE else ""
            self.process.log(f"client {task.client_id} round {task.round}: result sent ({nbytes:,} bytes){note}")


class ClientProcess:
    """The worker of one client process, on a :class:`~fedpart.client.session.Session`."""

    def __init__(self, server: str, client_ids: list[int], device: str = "cpu", data_root: str | None = None,
                 state_dir: str | Path = "fedpart-state", threads: int | None = None,
                 security: ClientSecurity | None = None, reconnect_timeout: float | None = None,
                 connect_timeout: float | None = None, host_share: HostShare | None = None) -> None:
        """``threads``: torch threads to train with (None: torch's default); with ``host_share``
        they follow this process's share of the host's cores, looked at again before each task."""
        self.server = server
        self.security = security or ClientSecurity(insecure=True)
        self.reconnect_timeout = RECONNECT_SECONDS if reconnect_timeout is None else reconnect_timeout
        self.connect_timeout = CONNECT_SECONDS if connect_timeout is None else connect_timeout
        self.client_ids = client_ids
        try:
            self.device = resolve_device(device)
        except DeviceError as error:
            raise ClientError(str(error)) from error
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.transfers = Transfers(self.device)
        self.data_root = data_root
        self.state_dir = Path(state_dir)
        self.threads = threads
        if threads:
            torch.set_num_threads(threads)
        self.host_share = host_share
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.cache: dict[str, torch.Tensor] = {}  # global tensors, on the device
        self.activity = ClientActivity()
        self.display = Display(lambda: render_client(self.activity), logger="fedpart.client")
        self.log = Log(self.display, source=f"[client {self.name}] ")

    def _join_request(self) -> pb.JoinRequest:
        """The join, announcing the personal state an earlier process of the same run left on disk."""
        previous = ClientStore.latest_run(self.state_dir)
        earlier = ClientStore(self.state_dir, previous) if previous else None
        hosted = [pb.HostedClient(id=c, personal_parts=earlier.personal_parts(c) if earlier else [])
                  for c in self.client_ids]
        return pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=self.name, clients=hosted,
                              state_run_id=previous)

    # ------------------------------------------------------------------ setup

    def _setup(self, reply: pb.JoinReply) -> None:
        """Check the run's config against what is on this machine, build the model, load the data."""
        local = LocalData(self.data_root, "--data-root") if self.data_root is not None else \
            LocalData(self.config.data.root)
        experiment = check_experiment(self.config, clients_data=local)
        self.algorithm = experiment.algorithm
        self.model = experiment.model.to(self.device)
        # objective state (FedDyn's g_k, Ditto's personal model), kept like the personal parts
        self.objective_store = ClientStore(self.store.root, "objective")
        self.classification = experiment.classification
        self.loss_fn = build_loss(self.config.train.loss, self.classification)
        self.unit_flops = unit_forward_flops(self.model, experiment.input_shape)
        train = self.config.train
        try:
            self.speed = TrainingSpeed.configure(self.model, self.device, experiment.input_shape, train.amp, train.channels_last,
                                                 train.compile)
        except SpeedError as error:
            raise ClientError(str(error)) from error
        self.speed.sgd(list(self.model.parameters()), 0.0, 0.0, 0.0)  # torch's optimizer import, where it is used, now
        self.activity.task(f"loading {self.config.data.dataset}")
        self.log(f"loading {self.config.data.dataset} for clients {format_id_ranges(self.client_ids)} "
                 f"onto {self.device}")
        loaded = load_client_data(self.config, self.client_ids, self.data_root, self.device)
        self.data: dict[int, ClientData] = {c: self.speed.place(d) for c, d in loaded.items()}
        sizes = ", ".join(f"{c}: {d.train_size}/{d.test_size}" for c, d in self.data.items())
        self.log(f"run {reply.run_id}: {self.config.algorithm.name} on {describe(self.device)}, "
                 f"data (train/test) {sizes}")

    def run(self) -> int:
        """Serve tasks until the server says the run is over; returns the exit code (0: the run
        completed, 5: the server ended it early). A :class:`~fedpart.common.process.exit_codes.Stopped`
        (SIGINT, SIGTERM; in the main thread they are taken at the next wait for the session or
        within a few training steps) or an error is told to the server (``Leave``) and raised
        again."""
        from fedpart.client.diagnose import permanent_problem

        self._loop = SessionThread()
        self.session = Session(self.server, self.security, self._join_request, _ClientEvents(self),
                               self.connect_timeout, self.reconnect_timeout,
                               diagnose=partial(permanent_problem, self.server, self.security))
        try:
            with signals_to(self._loop.stops.stop), self.display:  # a stop is taken at a wait or a training step
                self._call(self.session.__aenter__())
                try:
                    return self._joined(self._call(self.session.join()))
                finally:
                    self._call(self.session.__aexit__(None, None, None))
        finally:
            self._loop.close()

    def _call(self, coroutine: Awaitable[T]) -> T:
        return self._loop.call(coroutine)

    def _joined(self, reply: pb.JoinReply) -> int:
        self.config = config_from_dict(json.loads(reply.run_config_json), server_parts=False)
        self.log(f"joined run {reply.run_id} hosting clients {format_id_ranges(self.client_ids)}")
        server = self.config.server
        self._call(self.session.joined_run(server.call_timeout, server.heartbeat_timeout))  # beats while data loads
        try:
            self.store = ClientStore(self.state_dir, reply.run_id)
            mods = build_mods(WorkerContext(self.config, self.store, reply.run_id, self.log, self._pause))
            self.train_options = train_options(mods)
            self._execute_with_mods = compose(mods, self._execute)
            self.store.mark_latest()
            restored = [c for c in self.client_ids if self.store.personal_parts(c)]
            if restored:
                self.log(f"restored personal parts of clients {restored} from {self.store.root}")
            self._setup(reply)
            return self._serve()
        except Stopped as stop:
            self.log(f"{stop.reason}: leaving the run")
            self._call(self.session.leave(stop.reason))
            raise
        except Exception as error:
            self._call(self.session.leave(f"{type(error).__name__}: {error}"))
            raise

    def _serve(self) -> int:
        """Work through tasks until DONE. The session fetches the next task while one runs, and
        sends a result while the next runs (at most :data:`RESULTS_IN_FLIGHT` at once), so
        the transfers of a process's tasks overlap its training instead of adding to it."""
        upcoming = self._loop.submit(self.session.next_task(self._reader))
        sending: deque[Future[Sent]] = deque()
        try:
            while True:
                task = self._loop.wait(upcoming)
                info = task.info
                if info.kind == TaskKind.DONE:
                    if info.outcome == RunOutcome.ABORTED:
                        self.log("the server ended the run early (it was interrupted or gave up; see its log)")
                        return ExitCode.ENDED_EARLY
                    self._settle(sending, 0)
                    self.log("run finished")
                    return ExitCode.COMPLETED
                self.log(f"task {info.task_id}: {info.kind.name.lower()} client {info.client_id} round {info.round} "
                         f"({len(task.header.tensors)} tensors received)")
                self._share_cores()
                self._absorb(task)
                upcoming = self._loop.submit(self.session.next_task(self._reader))
                reply = self._execute_with_mods(info)
                answer = pack(info, reply, self.config.server.largest_result_message(info.result_chunk_bytes))
                sending.append(self._loop.submit(self.session.answer(task, answer)))
                self._settle(sending, RESULTS_IN_FLIGHT)
                self.activity.task("waiting for a task")
        finally:
            for future in (upcoming, *sending):
                future.cancel()

    def _share_cores(self) -> None:
        """Take this process's share of the host's cores, which changes when client processes
        start or stop beside it (:class:`~fedpart.common.process.limits.HostShare`)."""
        if self.host_share is None:
            return
        threads, sharing = self.host_share.threads()
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.log(f"now {threads} torch thread{'s' if threads > 1 else ''}: {sharing} client "
                     f"process{'es' if sharing > 1 else ''} share this host's {self.host_share.budget.cores} cores")
            self.threads = threads

    def _settle(self, sending: deque[Future[Sent]], at_most: int) -> None:
        """Wait until at most ``at_most`` results are still on their way; an upload that failed
        (the server stayed away past ``--reconnect-timeout``) raises here."""
        while sending and (len(sending) > at_most or sending[0].done()):
            if not sending[0].done():
                self.activity.task("sending results")
            self._loop.wait(sending.popleft())

    def _reader(self, header: pb.TaskHeader) -> TensorAssembler:
        """Where a task's tensors are assembled: pinned staging buffers on a GPU."""
        return _Assembler(header.tensors, into=self.transfers.staging(header.tensors))

    def _absorb(self, task: ReceivedTask) -> None:
        """Store the received global tensors (decoded on arrival when the server encodes its
        downloads) in the process cache, on the device (copied there once per version): deltas
        are taken against what the client received."""
        self.cache.update(self.transfers.to_device(task.payload))

    # ------------------------------------------------------------------ one task

    def _load_client_model(self, client: int, task: TaskInfo) -> dict[str, torch.Tensor]:
        """Put global + personal tensors into the model; returns the client's personal tensors."""
        personal = dict(self.store.personal(client, task.round))
        init_parts = set(task.personal_init)
        for name in self.algorithm.personal_names(self.model.state_dict()):
            if name not in personal and tensor_part(name) in init_parts:
                if name not in self.cache:
                    raise ClientError(f"the server asked to initialise {name!r} but did not send it")
                personal[name] = self.cache[name]
        state = {name: self.cache[name] for name in self.algorithm.shared_names(self.cache)}
        state.update(personal)
        missing = set(self.model.state_dict()) - set(state)
        if missing:
            raise ClientError(f"client {client}: no value for {sorted(missing)[:5]} (server sent too little)")
        self.model.load_state_dict(state)
        return personal

    def _execute(self, task: TaskInfo) -> Reply:
        """Evaluate or train one client as ``task`` asks; returns its reply (the mods around it
        turn it into what the server gets)."""
        client = task.client_id
        if client not in self.data:
            raise ClientError(f"the server sent a task for client {client}, which this process does not host")
        if task.kind not in (TaskKind.TRAIN, TaskKind.EVALUATE):
            raise ClientError(f"the server sent a {task.kind.name} task, which nothing in this process answers")
        data = self.data[client]
        peak = PeakMemory(self.device)
        personal = self._load_client_model(client, task)
        objective = self.algorithm.objective.build()
        state = {k: v.to(self.device, copy=True) for k, v in self.objective_store.personal(client, task.round).items()}
        if task.kind == TaskKind.EVALUATE:
            self.activity.task(f"evaluating and personalising client {client}")
            self.log(f"evaluating and personalising client {client} (fine-tune epochs "
                     f"{list(task.evaluate.finetune_epochs)})")
            self.model.load_state_dict(objective.step_rule.evaluation_state(state), strict=False)
            metrics = evaluate_and_personalize(self.model, data, task.evaluate, self.loss_fn, self.classification,
                                               build_augment(self.config.train.augment, task.evaluate.seed))
            self.store.save_personalized(client, self.model.state_dict())
            return Reply(metrics=metrics)
        plan = task.train
        reference = {n: self.cache[n] for n in plan.upload_deltas}
        self.activity.task(f"client {client} round {task.round}: training")
        outcome = train_local(self.model, data, plan, self.loss_fn, reference, self.unit_flops, objective, state,
                              build_augment(self.config.train.augment, plan.seed), self.speed,
                              on_steps=self._trained, unit_schedule=self.algorithm.unit_schedule,
                              **self.train_options)
        self.log(f"client {client} round {task.round}: trained {outcome.steps} steps in "
                 f"{outcome.compute_seconds:.2f} s, loss {outcome.loss:.4f}")
        trained = {k: v.detach() for k, v in self.model.state_dict().items()}
        uploads = {n: trained[n] - self.cache[n] for n in plan.upload_deltas}
        uploads.update({n: trained[n].clone() for n in plan.upload_values})  # sent while the model trains on
        uploads, kept, state = self.transfers.to_host(uploads, {n: trained[n] for n in personal}, state)
        if kept:
            self.store.save_personal(client, task.round, kept)
        if state:
            self.objective_store.save_personal(client, task.round, state)
        metrics = {"loss": outcome.loss, "steps": outcome.steps, "compute_seconds": outcome.compute_seconds,
                   "trainable_parameters": outcome.trainable_parameters, "train_flops": outcome.flops,
                   **peak.metrics()}
        return Reply(outcome.samples, metrics, uploads, train_report=outcome)

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` (an emulated device's time), ended early by a stop (SIGINT, SIGTERM)."""
        self.activity.task(f"waiting {seconds:.1f} s: an emulated slower device")
        concurrent.futures.wait([self._loop.stops.arrived], timeout=seconds)
        self._loop.stops.take()

    def _trained(self, steps: int, all_steps: int) -> None:
        """Training progress: shown, and a point where a stop (SIGINT, SIGTERM) is taken."""
        self._loop.stops.take()
        self.activity.advance(steps, all_steps)


class _Assembler(TensorAssembler):
    """A :class:`~fedpart.common.wire.tensors.TensorAssembler` as the session's task reader."""

    def finish(self) -> dict[str, torch.Tensor]:
        return self.tensors()
