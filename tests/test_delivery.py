"""At-least-once delivery (docs/architecture.md, Faults): a lost task is offered again, a result stream that
ends early is sent again, a copy of a taken result is dropped, a restarted process gets the tasks
its predecessor held, and every one of these is bounded by ``server.delivery_attempts``.

The board-level cases drive an in-process coordinator; the transport cases drive its gRPC
service with raw stubs written against the proto, cutting streams the way a broken connection
does (the client cancels the call, or half-closes before the last byte)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from conftest import poll_task, small_config
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.plans import HostedClient, JoinInfo, ResultInfo, TaskKind
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.tensors import decode_chunks, encode_chunks, make_spec
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.main import start_grpc
from fedpart.server.engine.task_board import Task

BOUND = 60.0  # seconds: every wait here is bounded


def _coordinator(**server) -> Coordinator:
    config = small_config(clients=1, server={"heartbeat_timeout": 30, "round_timeout": 120, **server})
    return Coordinator(config_from_dict(config), log=lambda message: None)


def _join(coordinator: Coordinator) -> str:
    return coordinator.join(JoinInfo(protocol=PROTOCOL_VERSION, process_name="p", clients=(HostedClient(0),)))


def _poll(coordinator: Coordinator, session: str, held: tuple[int, ...] = (), wait: float = BOUND,
          crash: bool = False) -> Task | None:
    return poll_task(coordinator, session, held, wait, crash)


def _round_in_background(coordinator: Coordinator) -> tuple[threading.Thread, list[dict]]:
    records: list[dict] = []
    worker = threading.Thread(target=lambda: records.append(coordinator.run_round(1).to_json()), daemon=True)
    worker.start()
    return worker, records


def _zero_result(coordinator: Coordinator, task: Task, session: str) -> tuple[ResultInfo, dict[str, torch.Tensor]]:
    tensors = {n: torch.zeros_like(coordinator.global_state[n]) for n in task.train.upload_deltas}
    return ResultInfo(session, task.task_id, task.client_id, task.round, num_samples=10, metrics={"loss": 1.0}), tensors


# ------------------------------------------------------------------------- the task board


def test_a_task_the_process_does_not_hold_is_offered_again_and_a_held_one_is_not(one_torch_thread) -> None:
    coordinator = _coordinator()
    session = _join(coordinator)
    worker, records = _round_in_background(coordinator)
    taken = _poll(coordinator, session)
    assert taken is not None and taken.kind == TaskKind.TRAIN
    assert _poll(coordinator, session, held=(taken.task_id,), wait=0.5) is None  # it holds it: nothing new
    again = _poll(coordinator, session)  # its stream was lost: the poll does not list it
    assert again is taken and taken.sent == 2
    coordinator.accept(taken, *_zero_result(coordinator, taken, session))
    worker.join(BOUND)
    assert records[0]["completed"] == [0] and coordinator.failures == []
    assert records[0]["delivery"]["tasks_sent_again"] == 1


def test_a_task_sent_delivery_attempts_times_is_dropped_and_the_round_goes_on(one_torch_thread) -> None:
    """A process that never receives its task (or says so forever) costs the round at most
    ``delivery_attempts`` sends, not ``server.round_timeout``."""
    coordinator = _coordinator(delivery_attempts=3)
    session = _join(coordinator)
    started = time.monotonic()
    worker, records = _round_in_background(coordinator)
    sends = [_poll(coordinator, session) for _ in range(3)]
    assert len({id(task) for task in sends}) == 1 and sends[0].sent == 3
    assert _poll(coordinator, session, wait=0.5) is None  # dropped: nothing more to send
    worker.join(BOUND)
    assert time.monotonic() - started < 30  # round_timeout is 120 s
    assert records[0]["completed"] == [] and records[0]["delivery"]["given_up"] == 1
    assert any("sent 3 times, never received" in line for line in coordinator.failures)


def test_a_training_task_held_by_a_process_that_restarts_goes_to_its_restart(one_torch_thread) -> None:
    """A process killed in the middle of a round (its poll ends with its connection) is replaced
    by its restart: the restart is offered the very task, trains it again, and the round folds the
    client with no failure recorded."""
    coordinator = _coordinator()
    first = _join(coordinator)
    worker, records = _round_in_background(coordinator)
    taken = _poll(coordinator, first)
    assert _poll(coordinator, first, held=(taken.task_id,), wait=0.1, crash=True) is None
    second = _join(coordinator)
    task = _poll(coordinator, second)
    assert task is taken and task.session == second
    coordinator.accept(task, *_zero_result(coordinator, task, second))
    worker.join(BOUND)
    assert records[0]["completed"] == [0] and coordinator.failures == []
    assert records[0]["delivery"]["tasks_sent_again"] == 1


# ------------------------------------------------------------------------- the transport


class Service:
    """The coordinator's gRPC service on 127.0.0.1, one round driven on a thread, raw stubs."""

    def __init__(self, **server) -> None:
        config = small_config(clients=1, rounds=1, server={"heartbeat_timeout": 30, "round_timeout": 120, **server})
        self.coordinator = Coordinator(config_from_dict(config), log=lambda message: None)
        self.server = start_grpc(self.coordinator, "127.0.0.1:0")
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.session = self.stub.Join(pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name="raw",
                                                     clients=[pb.HostedClient(id=0)]), timeout=BOUND).session
        self.worker, self.records = _round_in_background(self.coordinator)

    def task_request(self, held: tuple[int, ...] = ()) -> pb.TaskRequest:
        return pb.TaskRequest(session=self.session, wait_seconds=BOUND / 2, held_tasks=held)

    def next_task(self) -> tuple[pb.TaskHeader, dict[str, torch.Tensor]]:
        while True:
            header, tensors = decode_chunks(self.stub.GetTask(self.task_request(), timeout=BOUND))
            if header.kind != pb.IDLE:
                return header, tensors

    def result_chunks(self, header: pb.TaskHeader, value: float = 0.0) -> list[pb.ResultChunk]:
        uploads = {n: torch.full_like(self.coordinator.global_state[n], value) for n in header.train.upload_deltas}
        result = pb.ResultHeader(session=self.session, task_id=header.task_id, client_id=header.client_id,
                                 round=header.round, num_samples=10, metrics={"loss": 1.0},
                                 tensors=[make_spec(n, t) for n, t in uploads.items()])
        chunks = [pb.ResultChunk(header=result)]
        chunks += encode_chunks(pb.ResultChunk, None, list(uploads.values()), chunk_bytes=2048)
        return chunks

    def finish_round(self) -> dict:
        self.worker.join(BOUND)
        assert not self.worker.is_alive(), "the round did not end"
        return self.records[0]

    def close(self) -> None:
        self.coordinator.finish()
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def service():
    made: list[Service] = []

    def make(**server) -> Service:
        made.append(Service(**server))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_a_result_stream_cut_off_is_sent_again_and_folded(service) -> None:
    """Seen behind a relay that resets connections: the server took the rest of a cut stream as
    a malformed result (``got 0 of 51200 bytes``), dropped the client, and refused its retry. Now
    a stream that breaks off (the call is cancelled mid-stream) or ends short (half-closed before
    the last byte) leaves the task outstanding; the complete copy is folded and nothing is recorded
    as a failure."""
    run = service()
    header, _ = run.next_task()
    chunks = run.result_chunks(header)
    assert len(chunks) > 4
    gate = threading.Event()

    def stops_midway() -> Iterator[pb.ResultChunk]:
        yield from chunks[:3]
        gate.wait(BOUND)

    cut = run.stub.SubmitResult.future(stops_midway(), timeout=BOUND)
    task = run.coordinator.board._outstanding[header.task_id]
    deadline = time.monotonic() + BOUND
    while task.streams < 1:
        assert time.monotonic() < deadline, "the server never read the first stream"
        time.sleep(0.01)
    cut.cancel()  # what a reset connection does to the call
    gate.set()
    with pytest.raises(grpc.RpcError) as error:
        run.stub.SubmitResult(iter(chunks[:-1]), timeout=BOUND)  # half-closed one chunk early
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "send it again" in error.value.details()
    reply = run.stub.SubmitResult(iter(chunks), timeout=BOUND)
    assert reply.accepted and not reply.duplicate
    record = run.finish_round()
    assert record["completed"] == [0]
    assert run.coordinator.failures == []
    delivery = run.coordinator.board.delivery_counts(1)
    assert delivery.streams_cut == 2 and delivery.results_sent_again == 2 and delivery.cut_bytes > 0


def test_a_task_stream_cut_off_is_sent_again(service) -> None:
    """Seen at 2,000 processes: a long poll ended UNAVAILABLE after the server had written a
    whole evaluation task, the server counted it delivered, and the evaluation waited for it for
    over 200 s. Now the next poll does not list the task, and the server sends it again at once."""
    run = service()
    stream = run.stub.GetTask(run.task_request(), timeout=BOUND)
    first = next(stream)
    while first.header.kind == pb.IDLE:
        stream = run.stub.GetTask(run.task_request(), timeout=BOUND)
        first = next(stream)
    stream.cancel()  # lost after the header: the client never got the tensors
    header, _ = decode_chunks(run.stub.GetTask(run.task_request(), timeout=BOUND))
    assert header.task_id == first.header.task_id
    reply = run.stub.SubmitResult(iter(run.result_chunks(header)), timeout=BOUND)
    assert reply.accepted
    assert run.finish_round()["completed"] == [0]
    assert run.coordinator.board.delivery_counts(1).tasks_sent_again == 1


def test_a_client_that_never_completes_a_result_cannot_make_the_server_read_forever(service) -> None:
    """The retry is bounded: a hostile client that opens result streams and cuts them short
    gets ``delivery_attempts`` of them read; then its task is dropped and the round goes on."""
    run = service(delivery_attempts=3)
    header, _ = run.next_task()
    chunks = run.result_chunks(header)
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as error:
            run.stub.SubmitResult(iter(chunks[:2]), timeout=BOUND)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as error:
        run.stub.SubmitResult(iter(chunks), timeout=BOUND)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "delivery_attempts" in error.value.details()
    record = run.finish_round()
    assert record["completed"] == [] and record["delivery"]["given_up"] == 1


# ------------------------------------------------------------------------- stragglers


def _processes(coordinator: Coordinator, clients: int) -> dict[int, str]:
    """One process per client: client id -> session."""
    return {c: coordinator.join(JoinInfo(protocol=PROTOCOL_VERSION, process_name=f"p{c}",
                                         clients=(HostedClient(c),))) for c in range(clients)}


def test_over_selection_closes_the_round_once_the_clients_it_needs_answered(one_torch_thread) -> None:
    """``sampling.over_selection`` 1.0 with ``fraction`` 0.5 of 4 clients samples all 4 and
    closes the round after the first 2 answers; the stragglers' results come too late."""
    config = small_config(clients=4, sampling={"fraction": 0.5, "over_selection": 1.0},
                          server={"heartbeat_timeout": 30, "round_timeout": 120})
    coordinator = Coordinator(config_from_dict(config), log=lambda message: None)
    sessions = _processes(coordinator, 4)
    started = time.monotonic()
    worker, records = _round_in_background(coordinator)
    tasks = {c: _poll(coordinator, s) for c, s in sessions.items()}
    for c in (3, 1):
        coordinator.accept(tasks[c], *_zero_result(coordinator, tasks[c], sessions[c]))
    worker.join(BOUND)
    assert time.monotonic() - started < 30  # not round_timeout
    assert records[0]["sampled"] == [0, 1, 2, 3] and records[0]["completed"] == [1, 3]
    with pytest.raises(Exception, match="closed|not outstanding"):
        coordinator.accept(tasks[0], *_zero_result(coordinator, tasks[0], sessions[0]))


def test_a_derived_round_deadline_leaves_a_straggler_behind(one_torch_thread) -> None:
    """``server.round_deadline_factor`` 3: the first of 2 clients answers after about 0.5 s, the
    second sits on its task; the round closes about 1.5 s in, not at ``round_timeout``."""
    config = small_config(clients=2, server={"heartbeat_timeout": 30, "round_timeout": 120,
                                             "round_deadline_factor": 3})
    coordinator = Coordinator(config_from_dict(config), log=lambda message: None)
    sessions = _processes(coordinator, 2)
    worker, records = _round_in_background(coordinator)
    tasks = {c: _poll(coordinator, s) for c, s in sessions.items()}
    threading.Event().wait(0.5)  # the first client's training
    coordinator.accept(tasks[0], *_zero_result(coordinator, tasks[0], sessions[0]))
    worker.join(BOUND)
    assert not worker.is_alive()
    assert records[0]["completed"] == [0]
    assert 1.4 <= records[0]["seconds"] < 30
