"""``fedpart client``: one process hosting one or more clients on one device.

The process connects out to the coordinator, joins, loads its clients' data, then long-polls for
tasks until the run is over. It keeps one cache of global tensors (with their versions) for all
of its clients, on its device, so that an unchanged tensor crosses the wire, and the bus to a
GPU, once per process (:mod:`fedpart.client.placement`), and each client's personal parts in its
:class:`ClientStore`. It keeps trying to reach a server that does not answer yet
(``--connect-timeout``) or went away (``--reconnect-timeout``), with capped exponential backoff and
a log line per attempt, and joins a resumed server of the same run again with its cache and
personal parts. Stopped by SIGINT or SIGTERM it tells the server (``Leave``) before it exits.
Exit codes: :mod:`fedpart.common.exit_codes`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from fedpart.client.evaluation import evaluate_and_personalize
from fedpart.client.local_data import ClientData, load_client_data
from fedpart.client.placement import DeviceError, PeakMemory, Transfers, describe, resolve_device
from fedpart.client.speed import SpeedError, TrainingSpeed
from fedpart.client.store import ClientStore
from fedpart.client.training import train_local
from fedpart.common.codecs import build_codec, encode, encode_with_feedback, seeded_generator
from fedpart.common.config import RunConfig, config_from_dict
from fedpart.common.console import ClientActivity, Display, render_client
from fedpart.common.data.augment import build_augment
from fedpart.common.exit_codes import ExitCode, Stopped
from fedpart.common.experiment import LocalData, build_run_model, check_experiment, dataset_dims, run_algorithm
from fedpart.common.losses import build_loss
from fedpart.common.models.zoo import unit_forward_flops
from fedpart.common.plans import ResultInfo, RunOutcome, TaskInfo, TaskKind
from fedpart.common.protocol import PROTOCOL_VERSION, RETRY_LATER_CODES, UNKNOWN_SESSION
from fedpart.common.security import ClientSecurity, format_id_ranges
from fedpart.common.serde import result_header, task_info
from fedpart.common.split_model import tensor_part
from fedpart.common.wire import decode_chunks, header_then_pieces, wire_form
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc

POLL_SECONDS = 20.0
TRANSFER_SECONDS = 600.0   # deadline for moving one task or result, on top of the poll
CONNECT_SECONDS = 120.0    # default --connect-timeout: how long to keep trying a server that is not up yet
RECONNECT_SECONDS = 300.0  # default --reconnect-timeout: how long to keep trying a server that went away
JOIN_SECONDS = 60.0        # deadline of one join call
LEAVE_SECONDS = 5.0        # deadline of the goodbye of a process that stops
FIRST_RETRY_SECONDS = 0.5  # while the server is unreachable, attempts are this far apart at first,
MAX_RETRY_SECONDS = 5.0    # doubling up to this (the channel's own reconnect backoff is the same)
HEARTBEAT_SECONDS = 5.0    # at most; shorter when server.heartbeat_timeout is short
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.keepalive_time_ms", 30_000),  # keeps NAT mappings alive while a client trains for minutes
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", int(FIRST_RETRY_SECONDS * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(MAX_RETRY_SECONDS * 1000)),
]


class ClientError(RuntimeError):
    """The client process cannot go on (message says why)."""

    code = ExitCode.ERROR


class ServerNotReached(ClientError):
    """No server answered within ``--connect-timeout``, or it stayed away for ``--reconnect-timeout``."""

    code = ExitCode.UNREACHABLE


class ServerUnreachable(Exception):
    """The server did not answer (it is down, restarting or cut off) or was too busy to."""

    def __init__(self, error: grpc.RpcError) -> None:
        super().__init__(error.details())
        self.error = error


@dataclass
class Backoff:
    """Capped exponential backoff between attempts to reach a lost server, bounded in total."""

    deadline: float
    delay: float = FIRST_RETRY_SECONDS
    attempts: int = 0

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt; None once the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        delay = min(self.delay, remaining)
        self.delay = min(2 * self.delay, MAX_RETRY_SECONDS)
        self.attempts += 1
        return delay


def _unreachable(error: grpc.RpcError) -> bool:
    return error.code() in RETRY_LATER_CODES


def _why(error: grpc.RpcError) -> str:
    """A gRPC error in one short line for the log."""
    details = (error.details() or "").splitlines()
    return f"{error.code().name}: {details[0][:200] if details else 'no details'}"


def heartbeat_interval(config: RunConfig) -> float:
    """Seconds between heartbeats: a few per ``server.heartbeat_timeout``, at most
    :data:`HEARTBEAT_SECONDS`."""
    return max(0.2, min(HEARTBEAT_SECONDS, config.server.heartbeat_timeout / 4))


class ClientProcess:
    """The loop of one client process."""

    def __init__(self, server: str, client_ids: list[int], device: str = "cpu", data_root: str | None = None,
                 state_dir: str | Path = "fedpart-state", threads: int | None = None,
                 security: ClientSecurity | None = None, reconnect_timeout: float | None = None,
                 connect_timeout: float | None = None) -> None:
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
        if threads:
            torch.set_num_threads(threads)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.cache: dict[str, torch.Tensor] = {}  # global tensors, on the device
        self.versions: dict[str, int] = {}
        self._stop = threading.Event()
        self._outage: Backoff | None = None  # set while the server is unreachable
        self._poll_waiting = False  # a long poll is open and unanswered: the server counts it alive
        self.activity = ClientActivity()
        self.display = Display(lambda: render_client(self.activity))

    def log(self, message: str) -> None:
        self.display.log(f"[client {self.name}] {message}")

    # ------------------------------------------------------------------ connection

    def _join(self, timeout: float = JOIN_SECONDS) -> pb.JoinReply:
        """Join, announcing the personal state an earlier process of the same run left on disk."""
        previous = ClientStore.latest_run(self.state_dir)
        earlier = ClientStore(self.state_dir, previous) if previous else None
        hosted = [pb.HostedClient(id=c, personal_parts=earlier.personal_parts(c) if earlier else [])
                  for c in self.client_ids]
        instance = f"{socket.gethostname()}:{self.state_dir.resolve()}:{','.join(map(str, self.client_ids))}"
        request = pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=self.name, clients=hosted,
                                 state_run_id=previous, instance=instance)
        try:
            return self.stub.Join(request, timeout=timeout)
        except grpc.RpcError as error:
            raise ClientError(f"join refused ({error.code().name}): {error.details()}") from error

    def _first_join(self) -> pb.JoinReply:
        """Connect and join, trying again with backoff while no server answers (not up yet, a
        wrong address, a TLS mismatch) or it cannot take the join now, for ``connect_timeout``
        seconds; raises :class:`ServerNotReached` after that."""
        self.log(f"connecting to {self.server} ({self.security.describe()}); trying for up to "
                 f"{self.connect_timeout:.0f} s (--connect-timeout)")
        deadline = time.monotonic() + self.connect_timeout
        backoff = Backoff(deadline)
        while True:
            try:
                return self._join(timeout=max(1.0, min(JOIN_SECONDS, deadline - time.monotonic())))
            except ClientError as error:
                cause = error.__cause__
                if not (isinstance(cause, grpc.RpcError) and _unreachable(cause)):
                    raise
                delay = backoff.next_delay()
                if delay is None:
                    raise ServerNotReached(f"no server answered at {self.server} within {self.connect_timeout:.0f} s "
                                           f"(--connect-timeout); last error: {_why(cause)}") from cause
                self.log(f"attempt {backoff.attempts}: {self.server} did not take the join ({_why(cause)}); "
                         f"next attempt in {delay:.1f} s")
                self._stop.wait(delay)

    def _heartbeats(self, interval: float) -> None:
        """A sign of life every ``interval`` while no long poll waits: the server counts a waiting
        poll as one, so thousands of idle processes do not send thousands of heartbeats."""
        while not self._stop.wait(interval):
            if self._poll_waiting:
                continue
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(session=self.session), timeout=max(interval, 1.0))
            except grpc.RpcError:
                continue

    # ------------------------------------------------------------------ setup

    def _setup(self, reply: pb.JoinReply) -> None:
        """Check the run's config against what is on this machine, build the model, load the data."""
        local = LocalData(self.data_root, "--data-root") if self.data_root is not None else \
            LocalData(self.config.data.root)
        check_experiment(self.config, clients_data=local)
        self.algorithm = run_algorithm(self.config)
        self.model = build_run_model(self.config).to(self.device)
        # objective state (FedDyn's g_k, Ditto's personal model), kept like the personal parts
        self.objective_store = ClientStore(self.store.root, "objective")
        input_shape, num_classes = dataset_dims(self.config)
        self.classification = num_classes > 0
        self.loss_fn = build_loss(self.config.train.loss, self.classification)
        self.unit_flops = unit_forward_flops(self.model, input_shape)
        train = self.config.train
        try:
            self.speed = TrainingSpeed.configure(self.model, self.device, input_shape, train.amp, train.channels_last,
                                                 train.compile)
        except SpeedError as error:
            raise ClientError(str(error)) from error
        torch.optim.SGD(self.model.parameters(), lr=0.0)  # pays torch's one-off optimizer import (~1 s) now
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
        completed, 5: the server ended it early). A :class:`~fedpart.common.exit_codes.Stopped`
        (SIGINT, SIGTERM) or an error is told to the server (``Leave``) and raised again."""
        self.channel = self.security.channel(self.server, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        try:
            with self.display:
                return self._joined(self._first_join())
        finally:
            self.channel.close()

    def _joined(self, reply: pb.JoinReply) -> int:
        self.session = reply.session
        self.config = config_from_dict(json.loads(reply.run_config_json))
        self.log(f"joined run {reply.run_id} hosting clients {format_id_ranges(self.client_ids)}")
        # from before the (possibly long) data loading on
        beat = threading.Thread(target=self._heartbeats, args=(heartbeat_interval(self.config),), daemon=True)
        beat.start()
        try:
            self.store = ClientStore(self.state_dir, reply.run_id)
            self.store.mark_latest()
            restored = [c for c in self.client_ids if self.store.personal_parts(c)]
            if restored:
                self.log(f"restored personal parts of clients {restored} from {self.store.root}")
            self._setup(reply)
            return self._serve()
        except Stopped as stop:
            self.log(f"{stop.reason}: leaving the run")
            self._leave(stop.reason)
            raise
        except Exception as error:
            self._leave(f"{type(error).__name__}: {error}")
            raise
        finally:
            self._stop.set()
            beat.join(timeout=HEARTBEAT_SECONDS + 1)

    def _leave(self, reason: str) -> None:
        """Tell the server why this process stops (best effort: the server may be gone)."""
        try:
            self.stub.Leave(pb.LeaveRequest(session=self.session, reason=reason), timeout=LEAVE_SECONDS)
        except grpc.RpcError:
            pass

    def _serve(self) -> int:
        while True:
            request = pb.TaskRequest(session=self.session, held_versions=self.versions, wait_seconds=POLL_SECONDS)
            try:
                header, tensors = self._next_task(request)
            except ServerUnreachable as lost:
                self._wait_for_server(lost.error)
                continue
            if header is None:
                continue
            task = task_info(header)
            if task.kind == TaskKind.IDLE:
                continue
            if task.kind == TaskKind.DONE:
                if task.outcome == RunOutcome.ABORTED:
                    self.log("the server ended the run early (it was interrupted or gave up; see its log)")
                    return ExitCode.ENDED_EARLY
                self.log("run finished")
                return ExitCode.COMPLETED
            self.log(f"task {task.task_id}: {task.kind.name.lower()} client {task.client_id} round {task.round} "
                     f"({len(header.tensors)} tensors received)")
            self._absorb(header, tensors)
            result, uploads = self._execute(task)
            self._submit(result, uploads, task.train.upload_deltas if task.train is not None else (),
                         self.config.server.largest_result_message(task.result_chunk_bytes))
            self.activity.task("waiting for a task")

    def _next_task(self, request: pb.TaskRequest) -> tuple[pb.TaskHeader | None, dict[str, torch.Tensor]]:
        """One long poll; (None, {}) after joining again. Raises ServerUnreachable."""
        self._poll_waiting = True
        try:
            stream = self.stub.GetTask(request, timeout=POLL_SECONDS + TRANSFER_SECONDS)
            reply = decode_chunks(self._answered(stream), into=self.transfers.staging)
        except grpc.RpcError as error:
            if _unreachable(error):
                raise ServerUnreachable(error) from error
            if error.code() == UNKNOWN_SESSION:
                self._rejoin()
                return None, {}
            raise ClientError(f"server refused the task request: {error.details()}") from error
        finally:
            self._poll_waiting = False
        self._server_back()
        return reply

    def _answered(self, chunks: Iterator[pb.TaskChunk]) -> Iterator[pb.TaskChunk]:
        """The task stream; the poll stops waiting at its first chunk (heartbeats resume while
        the rest arrives)."""
        for chunk in chunks:
            self._poll_waiting = False
            yield chunk

    def _wait_for_server(self, error: grpc.RpcError) -> None:
        """The server did not answer: wait before the next attempt (capped exponential backoff),
        and give up once it has been unreachable for ``reconnect_timeout``."""
        if self._outage is None:
            self._outage = Backoff(time.monotonic() + self.reconnect_timeout)
            self.log(f"lost the server at {self.server} ({error.code().name}); trying to reconnect for up to "
                     f"{self.reconnect_timeout:.0f} s")
        delay = self._outage.next_delay()
        if delay is None:
            raise ServerNotReached(f"the server at {self.server} was unreachable for {self.reconnect_timeout:.0f} s "
                                   f"(--reconnect-timeout); last error: {_why(error)}")
        self.log(f"server unreachable; attempt {self._outage.attempts} in {delay:.1f} s")
        self._stop.wait(delay)

    def _server_back(self) -> None:
        if self._outage is not None:
            self.log(f"the server answers again after {self._outage.attempts} attempts")
            self._outage = None

    def _rejoin(self) -> None:
        """The server does not know this session (it dropped the process after missed heartbeats,
        or it is a resumed server): join the same run again, keeping the cached tensors and the
        personal parts. Raises ServerUnreachable, or ClientError for another run."""
        try:
            reply = self._join()
        except ClientError as error:
            if isinstance(error.__cause__, grpc.RpcError) and _unreachable(error.__cause__):
                raise ServerUnreachable(error.__cause__) from error
            raise
        self._server_back()
        if reply.run_id != self.store.root.name:
            raise ClientError(f"the server at {self.server} now runs another run ({reply.run_id}, this process "
                              f"served {self.store.root.name}); stopping")
        self.session = reply.session
        self.log(f"joined run {reply.run_id} again (the server had dropped this process or was restarted)")

    def _absorb(self, header: pb.TaskHeader, tensors: dict[str, torch.Tensor]) -> None:
        """Store the received global tensors (decoded on arrival when the server encodes its
        downloads) in the process cache, on the device (copied there once per version): deltas
        are taken against what the client received."""
        received = self.transfers.to_device({spec.name: tensors[spec.name] for spec in header.tensors})
        for spec in header.tensors:
            self.cache[spec.name] = received[spec.name]
            self.versions[spec.name] = spec.version

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

    def _execute(self, task: TaskInfo) -> tuple[ResultInfo, dict[str, torch.Tensor]]:
        client = task.client_id
        if client not in self.data:
            raise ClientError(f"the server sent a task for client {client}, which this process does not host")
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
            return ResultInfo(self.session, task.task_id, client, task.round, metrics=metrics), {}
        plan = task.train
        reference = {n: self.cache[n] for n in plan.upload_deltas}
        self.activity.task(f"client {client} round {task.round}: training")
        outcome = train_local(self.model, data, plan, self.loss_fn, reference, self.unit_flops, objective, state,
                              build_augment(self.config.train.augment, plan.seed), self.speed,
                              on_steps=self.activity.advance)
        self.log(f"client {client} round {task.round}: trained {outcome.steps} steps in "
                 f"{outcome.compute_seconds:.2f} s, loss {outcome.loss:.4f}")
        trained = {k: v.detach() for k, v in self.model.state_dict().items()}
        uploads = {n: trained[n] - self.cache[n] for n in plan.upload_deltas}
        uploads.update({n: trained[n] for n in plan.upload_values})
        uploads, kept, state = self.transfers.to_host(uploads, {n: trained[n] for n in personal}, state)
        if kept:
            self.store.save_personal(client, task.round, kept)
        if state:
            self.objective_store.save_personal(client, task.round, state)
        metrics = {"loss": outcome.loss, "steps": outcome.steps, "compute_seconds": outcome.compute_seconds,
                   "trainable_parameters": outcome.trainable_parameters, "train_flops": outcome.flops,
                   **peak.metrics()}
        return ResultInfo(self.session, task.task_id, client, task.round, num_samples=outcome.samples,
                          metrics=metrics), uploads

    def _submit(self, result: ResultInfo, uploads: dict[str, torch.Tensor], deltas: Collection[str],
                chunk_bytes: int) -> None:
        """Send the result in messages of at most ``chunk_bytes``, its tensors encoded by
        ``compression.up``; the error-feedback residuals it leaves are kept once the server took
        it. A send the server could not take now (unreachable, busy, or its transport reset the
        stream before the server read it) is tried again as a task request is; the server takes
        one result per task, so a copy that did arrive is refused, not counted twice."""
        specs, tensors, residuals = self._wire_forms(result, uploads, deltas)
        self.activity.task(f"client {result.client_id} round {result.round}: sending the result")
        header = result_header(result, specs)
        sent = [0]  # bytes of the last attempt

        def counted(chunks: Iterator[pb.ResultChunk]) -> Iterator[pb.ResultChunk]:
            for chunk in chunks:
                sent[0] += chunk.ByteSize()
                yield chunk

        while True:
            sent[0] = 0
            chunks = header_then_pieces(pb.ResultChunk, header, tensors, chunk_bytes)
            try:
                self.stub.SubmitResult(counted(chunks), timeout=TRANSFER_SECONDS)
                break
            except grpc.RpcError as error:
                if not _unreachable(error):
                    self.log(f"warning: result for client {result.client_id} round {result.round} not taken: "
                             f"{error.details()}")
                    return
                self._wait_for_server(error)
        self._server_back()
        self.log(f"client {result.client_id} round {result.round}: result sent ({sent[0]:,} bytes)")
        if residuals is not None:
            self.store.save_residuals(result.client_id, result.round, residuals)

    def _wire_forms(self, result: ResultInfo, uploads: dict[str, torch.Tensor], deltas: Collection[str]
                    ) -> tuple[list[pb.TensorSpec], list[torch.Tensor], dict[str, torch.Tensor] | None]:
        """The uploads' specs, the tensors to send and the new residuals (None without error
        feedback). Deltas go through the codec (adding the residual first with error feedback),
        values only through a codec that keeps every element."""
        section = self.config.compression.up
        codec = build_codec(section.codec, section.options)
        generator = seeded_generator(self.config.seed, result.client_id, result.round)
        feedback = codec is not None and codec.error_feedback
        previous = self.store.residuals(result.client_id, result.round) if feedback else {}
        residuals: dict[str, torch.Tensor] = {}
        specs = []
        tensors = []
        for name, tensor in uploads.items():
            if name in deltas and feedback and tensor.is_floating_point():
                encoded, residuals[name] = encode_with_feedback(codec, tensor, previous.get(name), generator)
            else:
                values_too = codec is not None and not codec.sparse
                encoded = encode(codec, tensor, generator) if name in deltas or values_too else None
            spec, sent = wire_form(name, tensor, encoded)
            specs.append(spec)
            tensors.append(sent)
        return specs, tensors, residuals if feedback else None
