"""The coordinator's gRPC protocol against hand-driven clients: validation, version cache,
liveness and large models. The server runs in-process on 127.0.0.1; the clients are raw stubs."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from conftest import FIXTURES, small_config
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.plans import RunOutcome
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.tensors import ReceivedChunk, decode_chunks, encode_chunks, make_spec
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.transport import service as service_module
from fedpart.server.main import start_grpc

BOUND = 60.0  # seconds: every wait in these tests is bounded


class Harness:
    """An in-process coordinator with its gRPC server, driving rounds on a thread."""

    def __init__(self, **overrides) -> None:
        overrides.setdefault("server", {"round_timeout": 30, "heartbeat_timeout": 30})
        config = small_config(**{"clients": 1, "rounds": 2, **overrides})
        self.config = config_from_dict(config)
        self.logs: list[str] = []
        self.coordinator = Coordinator(self.config, log=self.logs.append)
        self.initial = {k: v.clone() for k, v in self.coordinator.global_state.items()}
        self.server = start_grpc(self.coordinator, "127.0.0.1:0")
        address = self.server.address
        self.server_port = int(address.rpartition(":")[2])
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.records: list[dict] = []  # each round's metrics.jsonl line
        self._thread: threading.Thread | None = None

    def join(self, clients: list[int]) -> str:
        reply = self.stub.Join(pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name="test",
                                              clients=[pb.HostedClient(id=c) for c in clients]), timeout=BOUND)
        return reply.session

    def start_rounds(self, rounds: int) -> None:
        self.start_rounds_from(1, rounds)

    def start_rounds_from(self, first: int, last: int) -> None:
        def drive() -> None:
            self.coordinator.registry.wait_for_clients()
            for r in range(first, last + 1):
                self.records.append(self.coordinator.run_round(r).to_json())

        self._thread = threading.Thread(target=drive, daemon=True)
        self._thread.start()

    def wait_rounds(self) -> None:
        self._thread.join(timeout=BOUND)
        assert not self._thread.is_alive(), "rounds did not finish in time"

    def get_task(self, session: str, held: dict[str, int] | None = None):
        request = pb.TaskRequest(session=session, held_versions=held or {}, wait_seconds=BOUND / 2)
        while True:
            header, tensors = decode_chunks(self.stub.GetTask(request, timeout=BOUND))
            if header.kind != pb.IDLE:
                return header, tensors

    def submit(self, session: str, header: pb.TaskHeader, uploads: dict[str, torch.Tensor], samples: int = 10):
        result = pb.ResultHeader(session=session, task_id=header.task_id, client_id=header.client_id,
                                 round=header.round, num_samples=samples, metrics={"loss": 1.0},
                                 tensors=[make_spec(n, t) for n, t in uploads.items()])
        chunks: Iterator = encode_chunks(pb.ResultChunk, result, list(uploads.values()))
        return self.stub.SubmitResult(chunks, timeout=BOUND)

    def start_client(self, state_dir: Path) -> tuple[threading.Thread, list[int]]:
        """fedpart client's runtime for client 0 on a thread; its exit code lands in the list."""
        from fedpart.client.runtime import ClientProcess

        client = ClientProcess(f"127.0.0.1:{self.server_port}", [0], state_dir=state_dir, threads=1)
        codes: list[int] = []
        worker = threading.Thread(target=lambda: codes.append(client.run()), daemon=True)
        worker.start()
        return worker, codes

    def close(self) -> None:
        self.coordinator.finish()
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def harness_factory():
    made: list[Harness] = []

    def make(**overrides) -> Harness:
        harness = Harness(**overrides)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def _zero_deltas(header: pb.TaskHeader, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(state[n]) for n in header.train.upload_deltas}


@pytest.mark.parametrize("corrupt, message", [
    (lambda up: up.update({next(iter(up)): torch.full_like(next(iter(up.values())), float("nan"))}), "NaN"),
    (lambda up: up.pop(next(iter(up))), "differ from the expected"),
    (lambda up: up.update({"head.bias": torch.zeros(3)}), "expected torch.float32 [10]"),
])
def test_broken_results_are_rejected_and_change_nothing(harness_factory, corrupt, message) -> None:
    harness = harness_factory()
    session = harness.join([0])
    harness.start_rounds(1)
    header, _ = harness.get_task(session)
    assert header.kind == pb.TRAIN
    uploads = _zero_deltas(header, harness.coordinator.global_state)
    corrupt(uploads)
    with pytest.raises(grpc.RpcError) as error:
        harness.submit(session, header, uploads)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    harness.wait_rounds()
    assert harness.records[0]["completed"] == []
    assert all(torch.equal(harness.initial[k], v) for k, v in harness.coordinator.global_state.items())
    assert any(message in f for f in harness.coordinator.failures)


def test_a_copy_of_a_taken_result_is_acknowledged_and_dropped_and_unknown_tasks_are_refused(harness_factory) -> None:
    """At-least-once delivery: a client whose acknowledgement was lost sends its result again;
    the copy is answered ``duplicate`` and changes nothing. A result for a task the process was
    never given is refused."""
    harness = harness_factory()
    session = harness.join([0])
    harness.start_rounds(1)
    header, _ = harness.get_task(session)
    uploads = _zero_deltas(header, harness.coordinator.global_state)
    first = harness.submit(session, header, uploads)
    assert first.accepted and not first.duplicate
    harness.wait_rounds()
    model = {k: v.clone() for k, v in harness.coordinator.global_state.items()}
    copy = harness.submit(session, header, {n: torch.ones_like(t) for n, t in uploads.items()})
    assert copy.accepted and copy.duplicate
    assert all(torch.equal(model[k], v) for k, v in harness.coordinator.global_state.items())
    assert harness.records[0]["completed"] == [0]
    assert harness.coordinator.board.delivery_counts(1).duplicates == 1
    unknown = pb.TaskHeader()
    unknown.CopyFrom(header)
    unknown.task_id = header.task_id + 1000
    with pytest.raises(grpc.RpcError) as error:
        harness.submit(session, unknown, uploads)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as error:
        harness.stub.GetTask(pb.TaskRequest(session="forged", wait_seconds=1), timeout=BOUND).next()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_duplicate_hosting_is_refused(harness_factory) -> None:
    harness = harness_factory()
    harness.join([0])
    with pytest.raises(grpc.RpcError) as error:
        harness.join([0])
    # the first process is silent, not gone: the join may be tried again once it is (UNAVAILABLE)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "client ids 0 are held by " in error.value.details()


def test_version_cache_sends_only_changed_tensors(harness_factory) -> None:
    # a delta of 0.5 in every element is over the default first-round norm bound, which would refuse it
    harness = harness_factory(algorithm={"name": "fedbabu"}, robust={"adaptive_bound": 0})
    session = harness.join([0])
    harness.start_rounds(2)
    header, tensors = harness.get_task(session)
    assert set(tensors) == set(harness.initial), "the first task carries the whole model"
    held = {spec.name: spec.version for spec in header.tensors}
    delta = {n: torch.full_like(harness.initial[n], 0.5) for n in header.train.upload_deltas}
    assert "head.weight" not in delta
    harness.submit(session, header, delta)
    header, tensors = harness.get_task(session, held)
    assert header.round == 2
    assert set(tensors) == set(header.train.upload_deltas), "only the body changed, only the body is re-sent"
    assert all(spec.version == 1 for spec in header.tensors)
    assert torch.allclose(tensors["body.fc1.1.weight"], harness.initial["body.fc1.1.weight"] + 0.5)
    harness.submit(session, header, _zero_deltas(header, harness.coordinator.global_state))
    harness.wait_rounds()


def test_a_silent_process_does_not_hold_the_round(harness_factory) -> None:
    harness = harness_factory(server={"round_timeout": 600, "heartbeat_timeout": 1.0})
    session = harness.join([0])
    harness.stub.GetTask(pb.TaskRequest(session=session, wait_seconds=0), timeout=BOUND).next()  # ready, then silent
    harness.start_rounds(1)
    harness.wait_rounds()
    assert harness.records[0]["completed"] == []
    assert harness.records[0]["seconds"] < 20


def test_a_100_megabyte_model_moves_with_default_message_limits(harness_factory, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    harness = harness_factory(model={"name": "custom_components:huge_model"})
    total = sum(t.numel() * t.element_size() for t in harness.initial.values())
    assert total > 100e6
    session = harness.join([0])
    harness.start_rounds(1)
    request = pb.TaskRequest(session=session, wait_seconds=BOUND / 2)
    largest = 0
    chunks = []
    while not chunks or chunks[0].header.kind == pb.IDLE:
        chunks = list(harness.stub.GetTask(request, timeout=BOUND))
    largest = max(c.ByteSize() for c in chunks)
    assert largest < 4 * 1024 * 1024, "every message stays below gRPC's default 4 MiB limit"
    header, tensors = decode_chunks(iter(chunks))
    assert all(torch.equal(tensors[n], harness.initial[n]) for n in harness.initial)
    uploads = {n: torch.ones_like(harness.initial[n]) * 1e-3 for n in header.train.upload_deltas}
    assert harness.submit(session, header, uploads).accepted
    harness.wait_rounds()
    assert harness.records[0]["completed"] == [0]
    assert harness.records[0]["bytes_up"] > 100e6


def test_a_dropped_client_process_joins_again_and_keeps_working(harness_factory, tmp_path) -> None:
    """A process the server gave up on (e.g. a network blip longer than the heartbeat timeout)
    is told to join again on its next poll, does so, and takes part in the next round."""
    harness = harness_factory()
    worker, codes = harness.start_client(tmp_path / "state")
    harness.start_rounds(1)
    harness.wait_rounds()
    assert harness.records[0]["completed"] == [0]
    registry = harness.coordinator.registry
    with registry._cond:  # the server drops the process, as after missed heartbeats
        for process in list(registry._processes.values()):
            registry._gone(process)
    harness.coordinator.run_round(2)  # dispatches to nobody: the process is gone
    harness.start_rounds_from(3, 3)
    harness.wait_rounds()
    assert harness.records[-1]["completed"] == [0], "the process joined again and trained"
    harness.coordinator.finish()
    worker.join(timeout=BOUND)
    assert codes == [0]


def test_progress_follows_the_round_engine(harness_factory) -> None:
    """What the live display shows: clients ready while joining, then per round the clients done
    of those sampled, the bytes so far, and an ETA once a round has completed."""
    harness = harness_factory()
    progress = harness.coordinator.progress
    assert (progress().stage, progress().done, progress().total) == ("joining", 0, 1)
    session = harness.join([0])
    harness.start_rounds(2)
    header, _ = harness.get_task(session)
    first = progress()
    assert (first.stage, first.round, first.rounds, first.done, first.total) == ("training", 1, 2, 0, 1)
    assert first.bytes_down > 0 and first.eta_seconds is None
    harness.submit(session, header, _zero_deltas(header, harness.coordinator.global_state))
    header, _ = harness.get_task(session)
    second = progress()
    assert (second.round, second.done, second.total) == (2, 0, 1)
    assert second.bytes_up > 0 and second.eta_seconds is not None and second.eta_seconds >= 0
    harness.submit(session, header, _zero_deltas(header, harness.coordinator.global_state))
    harness.wait_rounds()
    last = progress()
    assert (last.round, last.done, last.eta_seconds) == (2, 1, 0.0)


@pytest.mark.parametrize("outcome", [RunOutcome.COMPLETED, RunOutcome.ABORTED])
def test_done_tells_how_the_run_ended(harness_factory, outcome) -> None:
    """DONE carries the run's outcome; a completed run's DONE is byte for byte the message it was
    before the field existed (the field at its default is not serialized)."""
    harness = harness_factory()
    session = harness.join([0])
    harness.coordinator.finish(outcome)
    header, _ = decode_chunks(harness.stub.GetTask(pb.TaskRequest(session=session, wait_seconds=0), timeout=BOUND))
    assert header.kind == pb.DONE and header.outcome == outcome
    assert (header.SerializeToString() == pb.TaskHeader(kind=pb.DONE).SerializeToString()) == \
        (outcome == RunOutcome.COMPLETED)


def test_fold_threads_give_the_model_the_event_loop_gives(harness_factory) -> None:
    """Results are folded on the server's event loop by default and on ``server.fold_workers``
    threads when set: the same results give the bit-identical model either way."""
    models = []
    for workers in (0, 2):
        harness = harness_factory(clients=3, rounds=1, server={"round_timeout": 30, "heartbeat_timeout": 30,
                                                                "fold_workers": workers})
        session = harness.join([0, 1, 2])
        harness.start_rounds(1)
        for _ in range(3):
            header, state = harness.get_task(session)
            generator = torch.Generator().manual_seed(7 + header.client_id)
            # deltas of a plausible size: the default adaptive bound refuses more than 3 x the initial norm
            uploads = {n: torch.randn(state[n].shape, generator=generator) * 0.01 for n in header.train.upload_deltas}
            assert harness.submit(session, header, uploads, samples=10 + header.client_id).accepted
        harness.wait_rounds()
        assert sorted(harness.records[0]["completed"]) == [0, 1, 2]
        models.append(harness.coordinator.global_state)
    loop, threads = models
    assert all(torch.equal(loop[name].view(-1).view(torch.uint8), threads[name].view(-1).view(torch.uint8))
               for name in loop)


def test_two_copies_of_a_result_in_flight_are_folded_once(harness_factory) -> None:
    """A client whose result stream seemed lost sends it again while the server still reads the
    first copy (a half-open connection looks like that): both streams are read, the first to
    complete is folded, the other is answered ``duplicate``; the round folds the client once."""
    harness = harness_factory()
    session = harness.join([0])
    harness.start_rounds(1)
    header, _ = harness.get_task(session)
    uploads = _zero_deltas(header, harness.coordinator.global_state)
    result = pb.ResultHeader(session=session, task_id=header.task_id, client_id=header.client_id,
                             round=header.round, num_samples=10, metrics={"loss": 1.0},
                             tensors=[make_spec(n, t) for n, t in uploads.items()])
    chunks = list(encode_chunks(pb.ResultChunk, result, list(uploads.values()), chunk_bytes=1024))
    assert len(chunks) > 2
    release = threading.Event()

    def held_after_the_header() -> Iterator[pb.ResultChunk]:
        yield chunks[0]
        release.wait(BOUND)
        yield from chunks[1:]

    first = harness.stub.SubmitResult.future(held_after_the_header(), timeout=BOUND)
    task = harness.coordinator.board._outstanding[header.task_id]
    deadline = time.monotonic() + BOUND
    while task.streams < 1:  # the server has read the first stream's header
        assert time.monotonic() < deadline and not first.done(), "the server never read the first header"
        time.sleep(0.01)
    second = harness.stub.SubmitResult(iter(chunks), timeout=BOUND)
    assert second.accepted and not second.duplicate
    release.set()
    reply = first.result(timeout=BOUND)
    assert reply.accepted and reply.duplicate
    harness.wait_rounds()
    assert harness.records[0]["completed"] == [0]
    delivery = harness.coordinator.board.delivery_counts(1)  # the copy may come after the round's record
    assert (delivery.results_sent_again, delivery.duplicates, delivery.given_up) == (1, 1, 0)


def test_no_heartbeats_while_a_long_poll_waits(harness_factory, tmp_path, monkeypatch) -> None:
    """Seen with 2,000 client processes: each sent a heartbeat every 5 s while its long poll
    waited, 400 calls a second that the server answered late (3,536 heartbeats ended
    DEADLINE_EXCEEDED in one run) and that held up the round. The server counts a waiting poll as
    a sign of life, so the client now beats only while no poll waits; with a 2 s heartbeat timeout
    (a beat every 0.5 s otherwise) the waiting client sends none and is not taken for gone."""
    from fedpart.server.transport.service import CoordinatorService

    beat, poll = CoordinatorService.Heartbeat, CoordinatorService.GetTask
    beats: list[float] = []
    polled = threading.Event()

    async def count_beat(self, request, context):
        beats.append(time.monotonic())
        return await beat(self, request, context)

    async def note_poll(self, request, context):
        polled.set()
        async for chunk in poll(self, request, context):
            yield chunk

    monkeypatch.setattr(CoordinatorService, "Heartbeat", count_beat)
    monkeypatch.setattr(CoordinatorService, "GetTask", note_poll)
    harness = harness_factory(server={"round_timeout": 30, "heartbeat_timeout": 2})
    worker, codes = harness.start_client(tmp_path / "state")
    assert polled.wait(BOUND)
    threading.Event().wait(0.5)  # a beat sent just before the poll opened has arrived
    before = len(beats)
    threading.Event().wait(3.0)  # six heartbeat intervals of a client that beats while polling
    assert len(beats) == before
    harness.start_rounds(1)
    harness.wait_rounds()
    assert harness.records[0]["completed"] == [0]
    assert not [line for line in harness.logs if "went silent" in line]
    harness.coordinator.finish()
    worker.join(timeout=BOUND)
    assert codes == [0]


def _record_result_streams(monkeypatch) -> list[list[ReceivedChunk]]:
    """The chunks of every result stream the server reads from now on, one list per stream."""
    from fedpart.server.transport.service import CoordinatorService

    serve = CoordinatorService.SubmitResult
    streams: list[list[ReceivedChunk]] = []

    async def record(self, request_iterator, context):
        seen: list[ReceivedChunk] = []
        streams.append(seen)

        async def chunks():
            async for chunk in request_iterator:
                seen.append(chunk)
                yield chunk

        return await serve(self, chunks(), context)

    monkeypatch.setattr(CoordinatorService, "SubmitResult", record)
    return streams


def _one_round_with_a_client(harness: Harness, state_dir: Path) -> None:
    worker, codes = harness.start_client(state_dir)
    harness.start_rounds(1)
    harness.wait_rounds()
    assert harness.records[0]["completed"] == [0]
    harness.coordinator.finish()
    worker.join(timeout=BOUND)
    assert codes == [0]


def test_a_result_stream_opens_with_the_header_alone(harness_factory, tmp_path, monkeypatch) -> None:
    """Seen with 2,000 client processes: the server's peak RSS reached 2.1 GB because each of up to
    1,000 result streams waiting for an upload slot held its first chunk, the header with 1 MiB of
    pieces. The client now sends the header alone first, so a waiting stream holds a few hundred
    bytes and flow control keeps its pieces at the client (1.2 GB at the same size)."""
    streams = _record_result_streams(monkeypatch)
    harness = harness_factory(server={"round_timeout": 30, "heartbeat_timeout": 30, "result_chunk_bytes": 4096})
    _one_round_with_a_client(harness, tmp_path / "state")
    training = [(chunk.header is not None, len(chunk.pieces)) for chunk in streams[0]]
    assert len(streams) == 1
    assert training[0] == (True, 0)
    assert len(training) > 2 and all(not header and pieces > 0 for header, pieces in training[1:])


def test_a_task_asks_for_its_result_in_messages_of_its_share_of_the_waiting_upload_bytes(
        harness_factory, tmp_path, monkeypatch) -> None:
    """Seen with 2,000 client processes: gRPC holds about one message of every result stream that
    waits for an upload slot, 1.15 GB with 1 MiB messages. Each task now names the largest message
    of its result, ``server.waiting_upload_bytes`` over the connected processes; the client sends
    no larger one (here 70,000 bytes for the one process, where ``server.result_chunk_bytes`` is 1 MiB)."""
    streams = _record_result_streams(monkeypatch)
    headers: list[pb.TaskHeader] = []
    monkeypatch.setattr(service_module, "task_header", _recording(service_module.task_header, headers))
    harness = harness_factory(server={"round_timeout": 30, "heartbeat_timeout": 30, "waiting_upload_bytes": 70_000},
                              model={"name": "mlp", "hidden": 256})
    assert harness.coordinator.config.server.result_chunk_bytes == 1 << 20
    _one_round_with_a_client(harness, tmp_path / "state")
    assert [h.result_chunk_bytes for h in headers if h.kind == pb.TRAIN] == [70_000]
    (training,) = streams
    sizes = [chunk.size.total for chunk in training[1:]]
    assert len(sizes) >= 3 and max(sizes) <= 70_000 and sizes[0] > 65_536, sizes


def _recording(function, calls: list):
    """``function``, keeping what each call returns in ``calls``."""
    def recorded(*args, **kwargs):
        calls.append(function(*args, **kwargs))
        return calls[-1]
    return recorded


def test_a_result_the_server_did_not_take_is_sent_again(harness_factory, tmp_path, monkeypatch) -> None:
    """Seen with 2,000 client processes evaluating at once: result streams ended CANCELLED before
    the server read them, the task stayed open and the evaluation waited for its timeout. The
    client now sends such a result again; here the server answers the first stream of each
    task's result CANCELLED without reading it, and the round and the evaluation still complete
    with the client."""
    from fedpart.server.transport.service import CoordinatorService

    serve = CoordinatorService.SubmitResult
    calls: list[bool] = []

    async def cancel_every_other(self, request_iterator, context):
        calls.append(len(calls) % 2 == 0)
        if calls[-1]:
            await context.abort(grpc.StatusCode.CANCELLED, "stream reset before the server read it (test)")
        return await serve(self, request_iterator, context)

    monkeypatch.setattr(CoordinatorService, "SubmitResult", cancel_every_other)
    harness = harness_factory()
    worker, codes = harness.start_client(tmp_path / "state")
    harness.start_rounds(1)
    harness.wait_rounds()
    assert harness.records[0]["completed"] == [0]
    evaluated = harness.coordinator.evaluate_all()
    assert list(evaluated) == [0]
    assert calls == [True, False, True, False]
    harness.coordinator.finish()
    worker.join(timeout=BOUND)
    assert codes == [0]


def test_a_burst_of_calls_the_busy_server_has_not_taken_is_not_cancelled(harness_factory, monkeypatch) -> None:
    """Seen with 2,000 client processes: 1,600-3,900 result uploads a run (and joins) ended
    CANCELLED before the server read them, because gRPC cancels calls that wait to be taken by
    the event loop beyond its default backlog. Here the loop is held up while 3,500 heartbeats
    arrive (more than gRPC's default hard limit of 3,000); every one is answered."""
    from fedpart.server.transport.service import CoordinatorService

    beat = CoordinatorService.Heartbeat
    holding = threading.Event()

    async def hold_the_loop_once(self, request, context):
        if not holding.is_set():
            holding.set()
            time.sleep(5.0)  # blocks the event loop: the calls arriving meanwhile wait untaken
        return await beat(self, request, context)

    monkeypatch.setattr(CoordinatorService, "Heartbeat", hold_the_loop_once)
    harness = harness_factory(clients=1500)

    async def burst(calls: int) -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{harness.server_port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            first = asyncio.ensure_future(stub.Heartbeat(pb.HeartbeatRequest(session="none"), timeout=BOUND))
            while not holding.is_set():
                await asyncio.sleep(0.01)
            rest = [stub.Heartbeat(pb.HeartbeatRequest(session="none"), timeout=BOUND) for _ in range(calls - 1)]
            outcomes = await asyncio.gather(first, *rest, return_exceptions=True)
        return [o.code() if isinstance(o, grpc.aio.AioRpcError) else grpc.StatusCode.OK for o in outcomes]

    codes = asyncio.run(burst(3500))
    assert collections.Counter(codes) == {grpc.StatusCode.OK: 3500}
