"""Virtual client processes: fedpart's client protocol without training, for load tests.

One OS process stands in for thousands of client processes. Each :class:`VirtualProcess` hosts a
slice of the client ids (split as ``fedpart.common.wire.client_ids.split_clients`` splits them) over its
own gRPC channel and TCP connection, on the same :class:`~fedpart.client.session.Session` as
``fedpart client``: the same join, heartbeats, long polls, delivery and backoff. It is another
worker: it reads every task stream to its end (checking its size, discarding the bytes) and answers
each task without computing anything: a training task with exactly the tensors its plan asks for,
shaped like the global model (small seeded deltas), an evaluation with the metrics a real client
reports.

Every virtual process of an OS process shares one asyncio event loop, one model built from the
run config of the join reply, and one pre-encoded set of result chunks per upload list, serialized
once: from one result to the next only the header differs. Task streams are read with
:func:`~fedpart.common.wire.tensors.read_chunk`, which measures pieces without copying them, so a load
generator sharing the server's cores takes little of them. :class:`LoadStats` counts what
happened (joins, heartbeats, results, evaluations, errors by RPC and status code, join times) for
tests and ``benchmarks/server_scale.py``.

    python -m lab.virtual --server 127.0.0.1:50051 --clients 0-999 --processes 200
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
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import yaml

from fedpart.client.session import CHANNEL_OPTIONS as CLIENT_CHANNEL_OPTIONS
from fedpart.client.session import (
    RECONNECT_SECONDS,
    Answer,
    ReceivedTask,
    Sent,
    Session,
    SessionError,
    SessionEvents,
    heartbeat_interval,
)
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.config.experiment import build_run_model, dataset_dims
from fedpart.common.process.limits import raise_open_file_limit
from fedpart.common.wire.plans import EvalPlan, TaskInfo, TaskKind, TrainPlan
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.client_ids import parse_id_ranges, split_clients
from fedpart.common.wire.security import ClientSecurity, SecurityError
from fedpart.common.wire.tensors import IncompleteMessage, WireError, encode_chunks, named_specs, spec_nbytes
from fedpart.proto import fedpart_pb2 as pb

DELTA_SCALE = 1e-3    # standard deviation of the seeded deltas a virtual client uploads
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    *CLIENT_CHANNEL_OPTIONS,
    # without it gRPC shares one TCP connection between channels with equal arguments
    ("grpc.use_local_subchannel_pool", 1),
]


class VirtualClientError(SessionError):
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
    duplicates: int = 0         # of those, copies the server had taken already (its answer was lost)
    done: int = 0               # virtual processes told the run is over
    bytes_down: int = 0         # tensor bytes of the task streams
    bytes_up: int = 0           # serialized bytes of the accepted results (their last attempt)
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
                f"tasks answered: {self.train_results} training results, {self.evaluations} evaluations "
                f"({self.duplicates} duplicates); "
                f"polls {self.polls} ({self.idle_polls} idle); heartbeats {self.heartbeats} "
                f"({self.heartbeats_unknown} unknown session)\n"
                f"tensor bytes down {self.bytes_down:,}, result bytes up {self.bytes_up:,}\n"
                f"errors by status code: {errors}")


@dataclass(frozen=True)
class EncodedUpload:
    """The tensors of a training result, encoded and serialized once, and their specs."""

    specs: list[pb.TensorSpec]
    chunks: list[bytes]  # serialized ResultChunk messages of pieces
    tensor_bytes: int
    parameters: int


class Payloads:
    """What the virtual processes of one OS process upload in one run, built once from its config
    (the model's shapes and dtypes); one :class:`EncodedUpload` per upload list."""

    def __init__(self, run_config_json: str) -> None:
        self.config = config_from_dict(json.loads(run_config_json), server_parts=False)
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


class Counting(SessionEvents):
    """The sessions' events, counted in :class:`LoadStats`."""

    def __init__(self, stats: LoadStats) -> None:
        self.stats = stats

    def call_failed(self, rpc: str, error: grpc.RpcError) -> None:
        self.stats.error(rpc, error.code())

    def joined(self, again: bool) -> None:
        if again:
            self.stats.rejoins += 1
        else:
            self.stats.joins += 1
            self.stats.join_times.append(time.monotonic())

    def heartbeat(self, known: bool) -> None:
        self.stats.heartbeats += 1
        self.stats.heartbeats_unknown += not known

    def polled(self, kind: TaskKind, tensor_bytes: int) -> None:
        self.stats.polls += 1
        self.stats.idle_polls += kind == TaskKind.IDLE
        self.stats.bytes_down += tensor_bytes

    def answered(self, task: TaskInfo, sent: Sent, nbytes: int) -> None:
        if sent is Sent.REFUSED:
            return
        if task.kind == TaskKind.TRAIN:
            self.stats.train_results += 1
        else:
            self.stats.evaluations += 1
        self.stats.duplicates += sent is Sent.DUPLICATE
        self.stats.bytes_up += nbytes


class DiscardingReader:
    """A task's tensor pieces, measured and discarded: the stream must carry exactly the bytes
    its header declares."""

    def __init__(self, header: pb.TaskHeader) -> None:
        self.task_id = header.task_id
        self.expected = sum(spec_nbytes(spec) for spec in header.tensors)
        self.received = 0

    def add(self, pieces: list[tuple[int, memoryview]]) -> None:
        self.received += sum(len(data) for _, data in pieces)
        if self.received > self.expected:
            raise WireError(f"task {self.task_id}: more tensor bytes than its header declares ({self.expected})")

    def finish(self) -> None:
        if self.received != self.expected:
            raise IncompleteMessage(f"task {self.task_id}: {self.received} tensor bytes, its header declares "
                                    f"{self.expected}")


class VirtualProcess:
    """One client process on the wire: a session of its own (channel, TCP connection, held
    tensor versions, heartbeats); it answers tasks for ``client_ids`` until the server says the
    run is over."""

    def __init__(self, host: VirtualHost, index: int, client_ids: list[int], security: ClientSecurity) -> None:
        self.host = host
        self.index = index
        self.client_ids = client_ids
        self.name = f"{socket.gethostname()}:{os.getpid()}/virtual-{index}"
        self.session = Session(host.server, security, self._join_request, Counting(host.stats),
                               reconnect_timeout=host.reconnect_timeout, channel_options=CHANNEL_OPTIONS)
        self.payloads: Payloads  # the run's, from the join reply

    def _join_request(self) -> pb.JoinRequest:
        return pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=self.name,
                              clients=[pb.HostedClient(id=c) for c in self.client_ids])

    async def run(self) -> None:
        """Serve until told DONE; raises :class:`~fedpart.client.session.SessionError` when the
        process cannot go on."""
        async with self.session:
            reply = await self.session.join()
            self.payloads = self.host.payloads(reply.run_config_json)
            server = self.payloads.config.server
            # virtual processes join in a burst; a seeded phase spreads their beats as real start-ups do
            phase = random.Random(self.index).uniform(0.0, heartbeat_interval(server.heartbeat_timeout))
            await self.session.joined_run(server.call_timeout, server.heartbeat_timeout, phase)
            try:
                await self._serve()
            except SessionError as error:
                await self.session.leave(str(error))
                raise

    async def _serve(self) -> None:
        while True:
            task = await self.session.next_task(DiscardingReader)
            info = task.info
            if info.kind == TaskKind.DONE:
                self.host.stats.done += 1
                return
            if info.client_id not in self.client_ids:
                raise VirtualClientError(f"the server sent a task for client {info.client_id}, which this "
                                         "process does not host")
            await self.session.answer(task, self._answer(task))

    def _answer(self, task: ReceivedTask) -> Answer:
        info = task.info
        client = info.client_id
        if info.kind == TaskKind.EVALUATE:
            return Answer(metrics=evaluation_metrics(info.evaluate, client, self.payloads.classification))
        upload = self.payloads.upload(info)
        return Answer(train_sample_count(client), train_metrics(info.train, client, upload.parameters), upload.specs,
                      lambda: upload.chunks)


def slice_clients(client_ids: list[int], processes: int) -> list[list[int]]:
    """Contiguous, even slices of ``client_ids``, one per process, as ``split_clients`` cuts them."""
    if not 1 <= processes <= len(client_ids):
        raise ValueError(f"--processes {processes}: give 1 to {len(client_ids)} (one client id at least per process)")
    return [[client_ids[i] for i in parse_id_ranges(spec)] for spec in split_clients(len(client_ids), processes)]


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
    parser = argparse.ArgumentParser(prog="python -m lab.virtual", description=__doc__.split("\n\n")[0])
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
    base = ClientSecurity.from_options(args.ca, args.server_name, args.token_file, None, None,
                                       args.insecure, credential_required=args.token_dir is None)
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
