"""Bounded transfers and per-process wake-ups: upload slots (back-pressure and reused staging
tensors), shared task payloads, and long polls that wake only the process whose task is ready."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import small_config
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.plans import HostedClient, JoinInfo, TaskKind
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.tensors import decode_chunks, make_spec
from fedpart.proto import fedpart_pb2 as pb
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.engine.task_board import Task
from fedpart.server.transport.transfers import (MAX_RECEIVE_WINDOW, MIN_RECEIVE_WINDOW, MIN_RESULT_CHUNK_BYTES,
                                     RECEIVE_WINDOWS_BYTES, TaskPayloads, UploadSlots, receive_window,
                                     result_chunk_bytes)

BOUND = 60.0


def _specs(**shapes: tuple[int, ...]) -> list[pb.TensorSpec]:
    return [make_spec(name, torch.zeros(shape)) for name, shape in shapes.items()]


def test_an_upload_waits_for_a_free_slot_and_reuses_its_staging_tensors() -> None:
    async def scenario() -> None:
        slots = UploadSlots(1)
        specs = _specs(w=(3, 4), b=(4,))
        order: list[str] = []
        first_in = asyncio.Event()
        release_first = asyncio.Event()

        async def upload(name: str, hold: asyncio.Event | None) -> dict[str, torch.Tensor]:
            async with slots.staging(specs) as staging:
                order.append(f"{name} in")
                if hold is not None:
                    first_in.set()
                    await hold.wait()
                order.append(f"{name} out")
                return staging

        first = asyncio.create_task(upload("first", release_first))
        await asyncio.wait_for(first_in.wait(), BOUND)
        second = asyncio.create_task(upload("second", None))
        for _ in range(20):  # the second upload gets the loop many times and still cannot start
            await asyncio.sleep(0)
        assert order == ["first in"]
        release_first.set()
        staged_first, staged_second = await asyncio.wait_for(asyncio.gather(first, second), BOUND)
        assert order == ["first in", "first out", "second in", "second out"]
        assert all(staged_second[n] is staged_first[n] for n in ("w", "b")), "same layout, same tensors"
        assert staged_first["w"].shape == (3, 4) and staged_first["w"].dtype == torch.float32

    asyncio.run(scenario())


def test_idle_staging_tensors_stay_within_the_slot_count() -> None:
    async def scenario() -> None:
        slots = UploadSlots(2)
        layouts = [_specs(w=(n,)) for n in (5, 6, 7)]
        for specs in layouts:
            async with slots.staging(specs):
                pass
        assert len(slots._idle) == 2
        async with slots.staging(layouts[0]) as staging:  # the oldest layout was let go
            assert staging["w"].shape == (5,)
        assert len(slots._idle) == 2

    asyncio.run(scenario())


def test_task_payloads_are_encoded_once_per_tensor_versions_and_decode_to_the_tensors() -> None:
    payloads = TaskPayloads(chunk_bytes=4096)
    tensors = {"body.w": torch.arange(3000, dtype=torch.float32), "head.b": torch.ones(10)}
    specs = [make_spec(n, t, version=2) for n, t in tensors.items()]
    parts = ["body", "head"]
    encoded = payloads.chunks(specs, list(tensors.values()), parts)
    assert payloads.chunks(specs, list(tensors.values()), parts) is encoded
    assert len(encoded) > 2, "several chunks of at most chunk_bytes"
    messages = [pb.TaskChunk.FromString(serialized) for serialized, _ in encoded]
    assert all(len(serialized) <= 4096 for serialized, _ in encoded)
    assert not any(message.HasField("header") for message in messages)
    assert sum(sum(by_part.values()) for _, by_part in encoded) == sum(len(serialized) for serialized, _ in encoded)
    assert sum(by_part.get("head", 0) for _, by_part in encoded) > 40
    header = pb.TaskChunk(header=pb.TaskHeader(kind=pb.TRAIN, tensors=specs))
    _, decoded = decode_chunks([header, *messages])
    assert all(torch.equal(decoded[n], t) for n, t in tensors.items())
    newer = [make_spec(n, t, version=3) for n, t in tensors.items()]
    assert payloads.chunks(newer, list(tensors.values()), parts) is not encoded


class CountingWaiter:
    """A waiter that counts its wake-ups."""

    def __init__(self) -> None:
        self.superseded = False
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1


def _join(coordinator: Coordinator, clients: list[int], name: str) -> str:
    request = JoinInfo(protocol=PROTOCOL_VERSION, process_name=name, clients=tuple(HostedClient(c) for c in clients))
    return coordinator.join(request)


def test_results_come_in_messages_of_each_process_share_of_the_waiting_upload_bytes() -> None:
    mib, budget = 1 << 20, 512 << 20
    assert result_chunk_bytes(mib, budget, processes=100) == mib  # a share of 5 MiB: chunk_bytes caps it
    assert result_chunk_bytes(mib, budget, processes=512) == mib
    assert result_chunk_bytes(mib, budget, processes=2000) == budget // 2000  # 262 KiB
    assert result_chunk_bytes(mib, budget, processes=100_000) == MIN_RESULT_CHUNK_BYTES == 64 << 10
    assert result_chunk_bytes(mib, 0, processes=100_000) == mib  # no bound
    assert result_chunk_bytes(mib, budget, processes=0) == mib
    assert result_chunk_bytes(4096, budget, processes=100_000) == 4096  # never above the largest


def test_each_connection_window_is_a_client_share_of_a_fixed_total() -> None:
    assert receive_window(None, clients=8) == MAX_RECEIVE_WINDOW == 4 << 20  # a whole cnn2 result
    assert receive_window(None, clients=10) == RECEIVE_WINDOWS_BYTES // 10 == 3355443
    assert receive_window(None, clients=128) == receive_window(None, clients=10_000) == MIN_RECEIVE_WINDOW == 256 << 10
    assert receive_window(65536, clients=10) == 65536  # as configured
    assert receive_window(0, clients=10) == 0  # gRPC's adaptive window
    for clients in (1, 2, 10, 100, 128):  # together within the total while above the minimum
        assert receive_window(None, clients) * clients <= RECEIVE_WINDOWS_BYTES
    assert config_from_dict(small_config()).server.receive_window is None
    with pytest.raises(ValueError, match="server.receive_window must be 0"):
        config_from_dict(small_config(server={"receive_window": 4096}))


def test_the_share_is_of_the_processes_still_connected() -> None:
    coordinator = Coordinator(config_from_dict(small_config(clients=4)), log=lambda message: None)
    sessions = [_join(coordinator, [0, 1], "a"), _join(coordinator, [2, 3], "b")]
    assert coordinator.registry.live_processes == 2
    coordinator.registry.leave(sessions[0], "test")
    assert coordinator.registry.live_processes == 1


def test_a_queued_task_wakes_only_the_poll_of_its_process() -> None:
    coordinator = Coordinator(config_from_dict(small_config(clients=4)), log=lambda message: None)
    sessions = [_join(coordinator, [0, 1], "a"), _join(coordinator, [2, 3], "b")]
    waiters = [CountingWaiter(), CountingWaiter()]
    for session, waiter in zip(sessions, waiters):
        assert coordinator.board.poll(session, waiter) is None  # nothing yet: the poll waits
    task = Task(task_id=101, kind=TaskKind.TRAIN, round=1, client_id=2, session=sessions[1],
                train=coordinator.round_plan(1, 2))
    coordinator.board.dispatch([task])
    assert [w.wakes for w in waiters] == [0, 1]
    assert coordinator.board.poll(sessions[1], waiters[1]) is task
    assert coordinator.board.poll(sessions[0], waiters[0]) is None


def test_a_newer_poll_supersedes_the_waiting_one() -> None:
    coordinator = Coordinator(config_from_dict(small_config(clients=2)), log=lambda message: None)
    session = _join(coordinator, [0, 1], "a")
    older, newer = CountingWaiter(), CountingWaiter()
    assert coordinator.board.poll(session, older) is None
    assert coordinator.board.poll(session, newer) is None
    assert older.superseded and older.wakes == 1 and not newer.superseded
    task = Task(task_id=7, kind=TaskKind.TRAIN, round=1, client_id=0, session=session,
                train=coordinator.round_plan(1, 0))
    coordinator.board.dispatch([task])
    assert coordinator.board.poll(session, older) is None, "a superseded poll never takes a task"
    assert coordinator.board.poll(session, newer) is task
