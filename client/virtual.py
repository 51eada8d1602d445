"""Virtual client processes: fedpart's client protocol without training, for load tests.

One OS process stands in for thousands of client processes. Each :class:`VirtualProcess` hosts a
slice of the client ids (split as ``fedpart.deploy.launcher.split_clients`` splits them) over its
own gRPC channel and TCP connection and behaves on the wire like ``fedpart client``
(``client/runtime.py``): it joins, heartbeats at the same interval while no poll of its waits,
long-polls ``GetTask`` with the versions of the global tensors it has received, reads every task
stream to its end (checking its size, discarding the bytes) and answers each task without
computing anything: a training task with exactly the tensors its plan asks for, shaped like the
global model (small seeded deltas), an evaluation with the metrics a real client reports.
Failures are handled as the real client handles them: an unreachable server is retried with
capped backoff (a result the server could not take now is sent again), a lost session joins
again, a refused join or task request ends the virtual process, a refused result or heartbeat is
counted and the process goes on.

Every virtual process of an OS process shares one asyncio event loop, one model built from the
run config of the join reply, and one pre-encoded set of result chunks per upload list, serialized
once: from one result to the next only the header differs. Task streams are read with
:func:`~fedpart.common.wire.read_chunk`, which measures pieces without copying them, so a load
generator sharing the server's cores takes little of them. :class:`LoadStats` counts what
happened (joins, heartbeats, results, evaluations, errors by RPC and status code, join times) for
tests and ``benchmarks/server_scale.py``.

    python -m fedpart.client.virtual --server 127.0.0.1:50051 --clients 0-999 --processes 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import torch
import yaml

from fedpart.client.runtime import CHANNEL_OPTIONS as CLIENT_CHANNEL_OPTIONS
from fedpart.client.runtime import (
    CONNECT_SECONDS,
    POLL_SECONDS,
    RECONNECT_SECONDS,
    TRANSFER_SECONDS,
    Backoff,
    heartbeat_interval,
)
from fedpart.common.config import config_from_dict
from fedpart.common.experiment import build_run_model, dataset_dims
from fedpart.common.limits import raise_open_file_limit
from fedpart.common.plans import EvalPlan, ResultInfo, TaskInfo, TaskKind, TrainPlan
from fedpart.common.protocol import PROTOCOL_VERSION, RETRY_LATER_CODES, UNKNOWN_SESSION, method_path
from fedpart.common.security import ClientSecurity, SecurityError, parse_id_ranges
from fedpart.common.serde import result_header, task_info
from fedpart.common.wire import ReceivedChunk, WireError, encode_chunks, named_specs, read_chunk, spec_nbytes
from fedpart.deploy.launcher import split_clients
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc

JOIN_SECONDS = 60.0   # deadline of a join, as fedpart client's
LEAVE_SECONDS = 10.0  # deadline of a leave, as fedpart client's
DELTA_SCALE = 1e-3    # standard deviation of the seeded deltas a virtual client uploads
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    *CLIENT_CHANNEL_OPTIONS,
    # without it gRPC shares one TCP connection between channels with equal arguments
    ("grpc.use_local_subchannel_pool", 1),
]


class VirtualClientError(RuntimeError):
    """A virtual process cannot go on (the message says why)."""


def train_sample_count(client_id: int) -> int:
    """The training-set size a virtual client reports: deterministic, 10 to 20 samples (a
    cross-device client holds little data); its evaluation reports the same count."""
    return 10 + client_id % 11


def test_sample_count(client_id: int) -> int:
    """The test-set size a virtual client reports in its evaluation."""
    return 2 + client_id % 3


def train_metrics(plan: TrainPlan, client_id: int, trainable_parameters: int) -> dict[str, float]:
    """The metrics fedpart client reports with a training result; no compute was spent."""
    batches = math.ceil(train_sample_count(client_id) / max(plan.batch_size, 1))
    steps = sum(phase.epochs for phase in plan.phases if phase.trainable) * batches
    return {"loss": 1.0 + (client_id % 10) / 10, "steps": float(steps), "compute_seconds": 0.0,
            "trainable_parameters": float(trainable_parameters), "train_flops": 0.0}


def evaluation_metrics(plan: EvalPlan, client_id: int, classification: bool) -> dict[str, float]:
    """The metrics fedpart client reports with an evaluation (see ``client/evaluation.py``);
    they pass the server's ``check_evaluation``."""
    kinds = ("loss", "acc") if classification else ("loss",)
    metrics = {"train_samples": float(train_sample_count(client_id)),
               "test_samples": float(test_sample_count(client_id))}
    metrics.update({f"initial_{kind}": 0.5 for kind in kinds})
    if plan.headless and classification:
        metrics.update({"headless_acc": 0.5, "headless_cosine_acc": 0.5})
    for epochs in sorted(set(plan.finetune_epochs)):
        metrics.update({f"finetune_{epochs}_{kind}": 0.6 for kind in kinds})
    return metrics


@dataclass
class LoadStats:
    """What the virtual processes of one OS process did, counted as it happens."""

    processes: int = 0
    joins: int = 0              # first joins of a virtual process
    rejoins: int = 0            # joins again after the server lost the session
    heartbeats: int = 0         # answered heartbeats
    heartbeats_unknown: int = 0  # of those, the server did not know the session
    polls: int = 0              # answered task requests (IDLE included)
    idle_polls: int = 0
    train_results: int = 0      # training results the server accepted
    evaluations: int = 0        # evaluation results the server accepted
    done: int = 0               # virtual processes told the run is over
    bytes_down: int = 0         # tensor bytes of the task streams
    bytes_up: int = 0           # tensor bytes of the accepted results
    errors: Counter = field(default_factory=Counter)  # "Rpc STATUS" -> count
    started_at: float = 0.0     # time.monotonic() when the virtual processes started connecting
    join_times: list[float] = field(default_factory=list)  # time.monotonic() of every first join
    failures: list[str] = field(default_factory=list)      # why virtual processes ended before DONE

    def error(self, rpc: str, code: grpc.StatusCode) -> None:
        self.errors[f"{rpc} {code.name}"] += 1

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["errors"] = dict(self.errors)
        return out

    def summary(self) -> str:
        """A few lines for the terminal."""
        joined = f"{max(self.join_times) - self.started_at:.2f} s" if self.join_times else "-"
        errors = ", ".join(f"{key} x{count}" for key, count in sorted(self.errors.items())) or "none"
        return (f"virtual processes {self.processes}: joined {self.joins} (all in {joined}), rejoined "
                f"{self.rejoins}, told DONE {self.done}\n"
                f"tasks answered: {self.train_results} training results, {self.evaluations} evaluations; "
                f"polls {self.polls} ({self.idle_polls} idle); heartbeats {self.heartbeats} "
                f"({self.heartbeats_unknown} unknown session)\n"
                f"tensor bytes down {self.bytes_down:,}, up {self.bytes_up:,}\n"
                f"errors by status code: {errors}")


@dataclass(frozen=True)
class EncodedUpload:
    """The tensors of a training result, encoded and serialized once, and their specs."""

    specs: list[pb.TensorSpec]
    chunks: list[bytes]  # serialized ResultChunk messages of pieces
    tensor_bytes: int
    parameters: int

    def stream(self, header: pb.ResultHeader) -> list[bytes]:
        """The serialized chunk stream of one result: ``header`` with the specs alone (as
        :func:`~fedpart.common.wire.header_then_pieces` sends it), then the shared chunks."""
        first = pb.ResultChunk(header=header)
        first.header.tensors.extend(self.specs)
        return [first.SerializeToString(), *self.chunks]


class Payloads:
    """What the virtual processes of one OS process upload in one run, built once from its config
    (the model's shapes and dtypes); one :class:`EncodedUpload` per upload list."""

    def __init__(self, run_config_json: str) -> None:
        self.config = config_from_dict(json.loads(run_config_json))
        model = build_run_model(self.config)
        self.global_state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        self.classification = dataset_dims(self.config)[1] > 0
        self._uploads: dict[tuple[tuple[str, ...], tuple[str, ...], int], EncodedUpload] = {}

    def upload(self, task: TaskInfo) -> EncodedUpload:
        """Exactly the tensors the task's plan asks for, in messages of the size it asks for:
        seeded small deltas for ``upload_deltas``, the initial global value plus such a delta for
        ``upload_values``."""
        chunk_bytes = self.config.server.largest_result_message(task.result_chunk_bytes)
        key = (task.train.upload_deltas, task.train.upload_values, chunk_bytes)
        if key not in self._uploads:
            self._uploads[key] = self._encode(*key)
        return self._uploads[key]

    def _encode(self, deltas: tuple[str, ...], values: tuple[str, ...], chunk_bytes: int) -> EncodedUpload:
        unknown = sorted(set(deltas + values) - set(self.global_state))
        if unknown:
            raise VirtualClientError(f"the plan asks for tensors {unknown[:5]} the run's model does not have")
        generator = torch.Generator().manual_seed(self.config.seed)
        tensors: dict[str, torch.Tensor] = {}
        for name in (*deltas, *values):
            like = self.global_state[name]
            if like.is_floating_point():
                delta = (torch.randn(like.shape, generator=generator, dtype=torch.float64) * DELTA_SCALE).to(like.dtype)
            else:
                delta = torch.zeros_like(like)
            tensors[name] = delta if name in deltas else like + delta
        chunks = list(encode_chunks(pb.ResultChunk, None, list(tensors.values()), chunk_bytes))
        return EncodedUpload(specs=named_specs(tensors), chunks=[chunk.SerializeToString() for chunk in chunks],
                             tensor_bytes=sum(len(piece.data) for chunk in chunks for piece in chunk.pieces),
                             parameters=sum(t.numel() for t in tensors.values()))


class VirtualHost:
    """The state the virtual processes of one OS process share: where the server is, the run's
    payloads (built at the first join) and the counts."""

    def __init__(self, server: str, reconnect_timeout: float = RECONNECT_SECONDS) -> None:
        self.server = server
        self.reconnect_timeout = reconnect_timeout
        self.stats = LoadStats()
        self._payloads: dict[str, Payloads] = {}

    def payloads(self, run_config_json: str) -> Payloads:
        if run_config_json not in self._payloads:
            self._payloads[run_config_json] = Payloads(run_config_json)
        return self._payloads[run_config_json]


class VirtualProcess:
    """One client process on the wire: its own channel, session, held tensor versions and
    heartbeats; it answers tasks for ``client_ids`` until the server says the run is over."""

    def __init__(self, host: VirtualHost, index: int, client_ids: list[int], security: ClientSecurity) -> None:
        self.host = host
        self.index = index
        self.client_ids = client_ids
        self.security = security
        self.name = f"{socket.gethostname()}:{os.getpid()}/virtual-{index}"
        self.instance = f"virtual:{self.name}:{client_ids[0]}-{client_ids[-1]}"
        self.versions: dict[str, int] = {}
        self.session = ""
        self.run_id = ""
        self._outage: Backoff | None = None
        self._poll_waiting = False  # as in fedpart client: no heartbeat while a long poll waits
        self.channel: grpc.aio.Channel
        self.stub: pb_grpc.CoordinatorStub
        self._get_task: grpc.aio.UnaryStreamMultiCallable  # chunks read by wire.read_chunk: no copies
        self._submit_result: grpc.aio.StreamUnaryMultiCallable  # chunks sent as serialized once
        self.payloads: Payloads  # the run's, from the join reply

    async def run(self) -> None:
        """Serve until told DONE; raises :class:`VirtualClientError` when the process cannot go on."""
        self.channel = self.security.aio_channel(self.host.server, CHANNEL_OPTIONS)
        try:
            self.stub = pb_grpc.CoordinatorStub(self.channel)
            self._get_task = self.channel.unary_stream(
                method_path("GetTask"), request_serializer=pb.TaskRequest.SerializeToString,
                response_deserializer=partial(read_chunk, pb.TaskHeader))
            self._submit_result = self.channel.stream_unary(
                method_path("SubmitResult"), request_serializer=None, response_deserializer=pb.SubmitReply.FromString)
            try:
                await asyncio.wait_for(self.channel.channel_ready(), CONNECT_SECONDS)
            except asyncio.TimeoutError as error:
                raise VirtualClientError(f"no server answered at {self.host.server} within "
                                         f"{CONNECT_SECONDS:.0f} s") from error
            while True:  # as fedpart client: a join the server cannot take now is tried again
                try:
                    await self._join()
                    break
                except grpc.aio.AioRpcError as error:
                    if error.code() not in RETRY_LATER_CODES:
                        raise VirtualClientError(f"join refused ({error.code().name}): {error.details()}") from error
                    await self._back_off(error)
            self._outage = None
            self.host.stats.joins += 1
            self.host.stats.join_times.append(time.monotonic())
            beats = asyncio.create_task(self._heartbeats(heartbeat_interval(self.payloads.config)))
            try:
                await self._serve()
            except VirtualClientError as error:
                await self._leave(str(error))
                raise
            finally:
                beats.cancel()
                await asyncio.gather(beats, return_exceptions=True)
        finally:
            await self.channel.close()

    def _stream_seconds(self, wanted: float) -> float:
        """A stream's deadline: what fedpart client asks for, within the server's call limit."""
        return min(wanted, self.payloads.config.server.call_timeout)

    async def _join(self) -> None:
        """Join (again): a new session, the same held versions. A refusal is counted and raised."""
        request = pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=self.name, instance=self.instance,
                                 clients=[pb.HostedClient(id=c) for c in self.client_ids])
        try:
            reply = await self.stub.Join(request, timeout=JOIN_SECONDS)
        except grpc.aio.AioRpcError as error:
            self.host.stats.error("Join", error.code())
            raise
        if self.run_id and reply.run_id != self.run_id:
            raise VirtualClientError(f"the server now runs another run ({reply.run_id}, this process "
                                     f"served {self.run_id})")
        self.session, self.run_id = reply.session, reply.run_id
        self.payloads = self.host.payloads(reply.run_config_json)

    async def _heartbeats(self, interval: float) -> None:
        # virtual processes join in a burst; a seeded phase spreads their beats as real start-ups do
        await asyncio.sleep(random.Random(self.index).uniform(0.0, interval))
        while True:
            if self._poll_waiting:
                await asyncio.sleep(interval)
                continue
            try:
                reply = await self.stub.Heartbeat(pb.HeartbeatRequest(session=self.session),
                                                  timeout=max(interval, 1.0))
            except grpc.aio.AioRpcError as error:
                self.host.stats.error("Heartbeat", error.code())
            else:
                self.host.stats.heartbeats += 1
                if not reply.known:
                    self.host.stats.heartbeats_unknown += 1
            await asyncio.sleep(interval)

    async def _leave(self, reason: str) -> None:
        """Tell the server why this process stops (best effort)."""
        try:
            await self.stub.Leave(pb.LeaveRequest(session=self.session, reason=reason), timeout=LEAVE_SECONDS)
        except grpc.aio.AioRpcError as error:
            self.host.stats.error("Leave", error.code())

    async def _serve(self) -> None:
        stats = self.host.stats
        while True:
            request = pb.TaskRequest(session=self.session, held_versions=self.versions, wait_seconds=POLL_SECONDS)
            try:
                task = await self._next_task(request)
            except grpc.aio.AioRpcError as error:
                stats.error("GetTask", error.code())
                await self._recover(error)
                continue
            self._outage = None
            stats.polls += 1
            if task.kind == TaskKind.IDLE:
                stats.idle_polls += 1
            elif task.kind == TaskKind.DONE:
                stats.done += 1
                return
            elif task.client_id not in self.client_ids:
                raise VirtualClientError(f"the server sent a task for client {task.client_id}, which this "
                                         "process does not host")
            elif task.kind == TaskKind.TRAIN:
                await self._submit_training(task)
            else:
                await self._submit_evaluation(task)

    async def _next_task(self, request: pb.TaskRequest) -> TaskInfo:
        """One long poll, read to the end; the received versions are held from then on."""
        call = self._get_task(request, timeout=self._stream_seconds(POLL_SECONDS + TRANSFER_SECONDS))
        header: pb.TaskHeader | None = None
        received = 0
        self._poll_waiting = True
        try:
            async for chunk in self._answered(call):
                if chunk.malformed:
                    raise VirtualClientError(f"task stream: {chunk.malformed}")
                if chunk.header is not None:
                    if header is not None:
                        raise VirtualClientError("a second header inside one task stream")
                    header = chunk.header
                elif header is None:
                    raise VirtualClientError("the first chunk of a task stream carries no header")
                received += sum(len(data) for _, data in chunk.pieces)
        finally:
            self._poll_waiting = False
        if header is None:
            raise VirtualClientError("an empty task stream")
        expected = sum(spec_nbytes(spec) for spec in header.tensors)
        if received != expected:
            raise VirtualClientError(f"task {header.task_id}: {received} tensor bytes, its header declares {expected}")
        try:
            task = task_info(header)
        except WireError as error:
            raise VirtualClientError(str(error)) from error
        self.versions.update({spec.name: spec.version for spec in header.tensors})
        self.host.stats.bytes_down += received
        return task

    async def _answered(self, call) -> AsyncIterator[ReceivedChunk]:
        """The task stream; the poll stops waiting at its first chunk."""
        async for chunk in call:
            self._poll_waiting = False
            yield chunk

    async def _recover(self, error: grpc.aio.AioRpcError) -> None:
        """After a failed task request: wait for an unreachable server, join again when the
        server lost the session; any other refusal ends the process, as it ends fedpart client."""
        if error.code() in RETRY_LATER_CODES:
            await self._back_off(error)
        elif error.code() == UNKNOWN_SESSION:
            try:
                await self._join()
            except grpc.aio.AioRpcError as refused:
                if refused.code() not in RETRY_LATER_CODES:
                    raise VirtualClientError(f"join refused ({refused.code().name}): {refused.details()}") from refused
                await self._back_off(refused)
            else:
                self.host.stats.rejoins += 1
        else:
            raise VirtualClientError(f"server refused the task request ({error.code().name}): {error.details()}")

    async def _back_off(self, error: grpc.aio.AioRpcError) -> None:
        """Wait before the next attempt to reach the server (capped exponential backoff); give up
        once it has been unreachable for the reconnect timeout."""
        if self._outage is None:
            self._outage = Backoff(time.monotonic() + self.host.reconnect_timeout)
        delay = self._outage.next_delay()
        if delay is None:
            raise VirtualClientError(f"the server at {self.host.server} was unreachable for "
                                     f"{self.host.reconnect_timeout:.0f} s; last error: {error.code().name} "
                                     f"{error.details()}")
        await asyncio.sleep(delay)

    async def _submit_training(self, task: TaskInfo) -> None:
        client = task.client_id
        upload = self.payloads.upload(task)
        result = ResultInfo(self.session, task.task_id, client, task.round, num_samples=train_sample_count(client),
                            metrics=train_metrics(task.train, client, upload.parameters))
        if await self._submit(upload.stream(result_header(result))):
            self.host.stats.train_results += 1
            self.host.stats.bytes_up += upload.tensor_bytes

    async def _submit_evaluation(self, task: TaskInfo) -> None:
        metrics = evaluation_metrics(task.evaluate, task.client_id, self.payloads.classification)
        result = ResultInfo(self.session, task.task_id, task.client_id, task.round, metrics=metrics)
        if await self._submit([pb.ResultChunk(header=result_header(result)).SerializeToString()]):
            self.host.stats.evaluations += 1

    async def _submit(self, chunks: list[bytes]) -> bool:
        """Send one result; False when the server did not take it (counted; the process goes on,
        as fedpart client does). A send the server could not take now is counted and tried
        again with backoff, as fedpart client tries it."""
        while True:
            try:
                reply = await self._submit_result(iter(chunks), timeout=self._stream_seconds(TRANSFER_SECONDS))
            except grpc.aio.AioRpcError as error:
                self.host.stats.error("SubmitResult", error.code())
                if error.code() not in RETRY_LATER_CODES:
                    return False
                await self._back_off(error)
                continue
            self._outage = None
            return reply.accepted


def slice_clients(client_ids: list[int], processes: int) -> list[list[int]]:
    """Contiguous, even slices of ``client_ids``, one per process, as ``split_clients`` cuts them."""
    if not 1 <= processes <= len(client_ids):
        raise ValueError(f"--processes {processes}: give 1 to {len(client_ids)} (one client id at least per process)")
    slices = []
    for spec in split_clients(len(client_ids), processes):
        low, high = (int(x) for x in spec.split("-"))
        slices.append(client_ids[low:high + 1])
    return slices


def tokens_by_slice(token_dir: Path, slices: list[list[int]]) -> list[str]:
    """Each slice's bearer token from a ``fedpart certs`` directory: the process entry of its
    ``credentials.yaml`` that names exactly the slice's client ids, and that entry's token file."""
    path = token_dir / "credentials.yaml"
    try:
        entries = yaml.safe_load(path.read_text())["processes"]
        names = {tuple(parse_id_ranges(entry["clients"])): entry["name"] for entry in entries}
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as error:
        raise SecurityError(f"--token-dir: cannot read the process entries of {path}: {error}") from error
    tokens = []
    for ids in slices:
        name = names.get(tuple(ids))
        if name is None:
            raise SecurityError(f"--token-dir: {path} names no process hosting exactly clients {ids[0]}-{ids[-1]}; "
                                "make the credentials with `fedpart certs` for the same clients and processes")
        token_file = token_dir / f"{name}.token"
        try:
            tokens.append(token_file.read_text().strip())
        except OSError as error:
            raise SecurityError(f"--token-dir: cannot read {token_file}: {error.strerror or error}") from error
    return tokens


async def run_virtual_processes(host: VirtualHost, slices: list[list[int]],
                                security: list[ClientSecurity]) -> LoadStats:
    """Run one virtual process per slice (with the matching credentials) until each is told DONE
    or fails; every failure is recorded in the returned counts."""
    stats = host.stats
    stats.processes = len(slices)
    stats.started_at = time.monotonic()

    async def run_and_report(process: VirtualProcess) -> None:
        try:
            await process.run()
        except Exception as error:  # noqa: BLE001 - recorded and reported; the other processes go on
            failure = (f"{process.name} (clients {process.client_ids[0]}-{process.client_ids[-1]}): "
                       f"{type(error).__name__}: {error}")
            stats.failures.append(failure)
            print(f"virtual process failed: {failure}", file=sys.stderr, flush=True)

    await asyncio.gather(*(run_and_report(VirtualProcess(host, index, ids, credentials))
                           for index, (ids, credentials) in enumerate(zip(slices, security))))
    return stats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedpart.client.virtual", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="coordinator HOST:PORT")
    parser.add_argument("--clients", required=True, help="client ids, e.g. 0-999 or 3,5,7")
    parser.add_argument("--processes", type=int, required=True, help="virtual client processes to split them over")
    parser.add_argument("--ca", help="CA certificate that signed the server's (PEM)")
    parser.add_argument("--server-name", help="name to expect in the server certificate (default: the host)")
    parser.add_argument("--token-file", help="one bearer token for every virtual process")
    parser.add_argument("--token-dir", type=Path,
                        help="a `fedpart certs` directory: each virtual process uses the token of the process "
                             "entry of credentials.yaml that names exactly its client ids")
    parser.add_argument("--insecure", action="store_true", help="plaintext, no TLS (the server must allow it)")
    parser.add_argument("--reconnect-timeout", type=float, default=RECONNECT_SECONDS, metavar="SECONDS",
                        help="how long a virtual process keeps retrying an unreachable server")
    parser.add_argument("--hold", action="store_true",
                        help="print 'ready' and wait for a line on stdin before connecting (a driver starts "
                             "several generators together)")
    parser.add_argument("--stats", type=Path, help="also write the counts as JSON to this file")
    return parser


def _security(args: argparse.Namespace, slices: list[list[int]]) -> list[ClientSecurity]:
    if args.token_dir is not None and args.token_file:
        raise SecurityError("--token-file and --token-dir exclude each other")
    base = ClientSecurity.from_options(args.server, args.ca, args.server_name, args.token_file, None, None,
                                       args.insecure)
    if args.token_dir is None:
        return [base] * len(slices)
    if base.insecure:
        raise SecurityError("--token-dir needs TLS (--ca): tokens never travel in clear")
    return [dataclasses.replace(base, token=token) for token in tokens_by_slice(args.token_dir, slices)]


def main(argv: list[str] | None = None) -> int:
    """Run the virtual processes; 0 only when every one of them was told the run is over."""
    args = build_parser().parse_args(argv)
    try:
        slices = slice_clients(parse_id_ranges(args.clients), args.processes)
        security = _security(args, slices)
    except (ValueError, SecurityError) as error:
        print(f"fedpart virtual clients: error: {error}", file=sys.stderr, flush=True)
        return 2
    raise_open_file_limit()
    if args.hold:
        print("ready", flush=True)
        sys.stdin.readline()
    host = VirtualHost(args.server, args.reconnect_timeout)
    stats = asyncio.run(run_virtual_processes(host, slices, security))
    print(stats.summary(), flush=True)
    if args.stats is not None:
        args.stats.write_text(json.dumps(stats.as_dict()))
    if stats.done == stats.processes:
        return 0
    shown = "; ".join(stats.failures[:5]) or "no failure recorded"
    print(f"fedpart virtual clients: error: {stats.processes - stats.done} of {stats.processes} virtual processes "
          f"were not told the run is over: {shown}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
