"""Logical bytes (DESIGN section 11, issue 21): what each sampled client would send and receive
as its own device. The ledger's logical counts, the sizes computed from tensor lengths alone
against the chunk streams fedpart really serializes, the split by schedule unit, and the same
quickstart run with 1 and with 5 client processes: equal logical bytes, different physical ones."""

from __future__ import annotations

import random

import pytest
import torch
import yaml

from conftest import REPO, read_metrics, read_summary, run_fedpart, small_config
from test_protocol import BOUND, Harness
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.config.experiment import build_run_model
from fedpart.common.models.zoo import build_model
from fedpart.common.process.records import RoundRecord
from fedpart.common.wire.plans import Phase, TaskInfo, TaskKind, TrainPlan
from fedpart.common.wire.serde import task_header
from fedpart.common.ml.split_model import tensor_unit
from fedpart.common.wire.tensors import encode_chunks, measure_chunk, named_specs
from fedpart.proto import fedpart_pb2 as pb
from fedpart.server.output.accounting import PARTS, ByteLedger
from fedpart.server.output.run_directory import build_summary
from fedpart.server.transport.transfers import LogicalTensors, logical_header_bytes, stream_tensor_bytes

DIRECTIONS = ("down", "up")


def test_ledger_counts_logical_bytes_by_round_client_part_and_unit() -> None:
    ledger = ByteLedger(["conv1", "conv2", "head"])
    ledger.add_logical(1, 0, "down", {"body": 100, "head": 10, "control": 5}, {"conv1": 40, "conv2": 60, "head": 10})
    ledger.add_logical(1, 1, "down", {"body": 100, "head": 10, "control": 6}, {"conv1": 40, "conv2": 60, "head": 10})
    ledger.add_logical(1, 0, "up", {"body": 60, "control": 3}, {"conv2": 60})
    ledger.add_logical(2, 0, "down", {"other": 8, "control": 5}, {"other": 8})
    ledger.add(1, 0, "down", {"body": 100, "control": 5})  # physical counts stay apart

    assert ledger.logical(1) == {
        "down": 231, "up": 63,
        "by_part": {"body": {"down": 200, "up": 60}, "head": {"down": 20, "up": 0},
                    "other": {"down": 0, "up": 0}, "control": {"down": 11, "up": 3}}}
    assert ledger.logical()["down"] == 231 + 13
    assert ledger.logical_totals(1, 0) == {"down": 115, "up": 63}
    assert ledger.logical_totals(1, 1) == {"down": 116, "up": 0}
    assert ledger.logical_totals(3, 0) == {"down": 0, "up": 0}
    # the model's units in order, then others once they carried bytes (here in round 2)
    assert ledger.by_unit(1) == {"conv1": {"down": 80, "up": 0}, "conv2": {"down": 120, "up": 60},
                                 "head": {"down": 20, "up": 0}, "other": {"down": 0, "up": 0}}
    assert ledger.by_unit()["other"] == {"down": 8, "up": 0}
    assert ledger.totals() == {"down": 105, "up": 0}


def test_extra_parts_join_the_logical_parts_once_they_carry_bytes() -> None:
    ledger = ByteLedger(["fc1", "head", "personal_head"])
    ledger.add_logical(1, 0, "down", {"body": 4, "personal_head": 7}, {"fc1": 4, "personal_head": 7})
    assert list(ledger.logical(1)["by_part"]) == [*PARTS, "personal_head"]
    assert ledger.logical(1)["by_part"]["personal_head"] == {"down": 7, "up": 0}


def test_summary_sums_the_rounds_records_and_the_final_evaluation() -> None:
    """A resumed server's ledger lacks the rounds an earlier server ran: the summary's logical
    bytes come from the rounds' records, the evaluation's from the ledger."""
    config = config_from_dict(small_config(rounds=2))
    ledger = ByteLedger(["fc1", "head"])
    records = []
    for round_number, body in ((1, 1000), (2, 3000)):
        split = {"body": {"down": body, "up": body // 2}, "head": {"down": 10, "up": 10},
                 "other": {"down": 0, "up": 0}, "control": {"down": 5, "up": 7}}
        records.append(RoundRecord.from_json({
            "round": round_number, "bytes_down": 1, "bytes_up": 1, "seconds": 1.0, "train_flops": 0,
            "client_compute_seconds": 0.0, "logical": {"down": body + 15, "up": body // 2 + 17, "by_part": split},
            "bytes_by_unit": {"fc1": {"down": body, "up": body // 2}, "head": {"down": 10, "up": 10}}}))
    ledger.add_logical(3, 0, "down", {"body": 400, "head": 10, "control": 9}, {"fc1": 400, "head": 10})
    ledger.add_logical(3, 0, "up", {"control": 11}, {})
    summary = build_summary(config, build_run_model(config), records, {}, None, ledger, [], 1.0)
    logical = summary.bytes.logical.to_json()
    assert logical["down"] == 1015 + 3015 + 419 and logical["up"] == 517 + 1517 + 11
    assert logical["by_part"]["body"] == {"down": 4400, "up": 2000}
    assert logical["by_part"]["control"] == {"down": 19, "up": 25}
    assert logical["by_unit"] == {"fc1": {"down": 4400, "up": 2000}, "head": {"down": 30, "up": 20}}
    assert logical["per_round_mean"] == {"down": 2015, "up": 1017}
    assert logical["evaluation"] == {"down": 419, "up": 11}


def _measured_stream(payload_bytes: list[int], chunk_bytes: int) -> list[int]:
    """Bytes per tensor of the chunk stream fedpart really serializes for tensors of these lengths."""
    tensors = [torch.zeros(n, dtype=torch.uint8) for n in payload_bytes]
    sizes = [0] * len(tensors)
    for chunk in encode_chunks(pb.TaskChunk, None, tensors, chunk_bytes):
        measured = measure_chunk(chunk)
        assert measured.control == 0 and measured.total == len(chunk.SerializeToString())
        for index, count in measured.by_tensor.items():
            sizes[index] += count
    return sizes


@pytest.mark.parametrize("seed", range(6))
def test_stream_sizes_from_lengths_alone_match_the_serialized_stream(seed: int) -> None:
    rng = random.Random(seed)
    chunk_bytes = rng.choice([1024, 1500, 4096, 65536])
    lengths = [rng.choice([0, 1, 127, 128, 1023, 16_383, 16_384, 200_000, rng.randrange(1, 300_000)])
               for _ in range(rng.randrange(1, 140))]  # past 127 tensors, indices take two varint bytes
    assert list(stream_tensor_bytes(tuple(lengths), chunk_bytes)) == _measured_stream(lengths, chunk_bytes)


def test_logical_header_size_equals_the_header_listing_every_tensor() -> None:
    model = build_model("cnn2", 10, (1, 28, 28), seed=0)
    specs = named_specs(model.state_dict(), {name: 3 for name in model.state_dict()})
    sizes = LogicalTensors.of(specs, 1 << 20, header_specs=True)
    plan = TrainPlan(phases=(Phase(2, tuple(model.schedule_units)),), lr=0.05, batch_size=50, momentum=0.9,
                     upload_deltas=tuple(s.name for s in specs), seed=123_456_789)
    task = TaskInfo(TaskKind.TRAIN, 41, 7, 3, train=plan, result_chunk_bytes=65536)
    for sent in (specs, specs[:3], specs[::2], []):
        header = task_header(task, sent)
        missing = sizes.header_spec_bytes - sum(sizes.spec_bytes[s.name] for s in sent)
        for named_chunk_bytes in (65536, 1 << 20, 1 << 30):
            whole = pb.TaskChunk(header=task_header(task, specs))
            whole.header.result_chunk_bytes = named_chunk_bytes
            assert logical_header_bytes(header, missing, named_chunk_bytes) == whole.ByteSize()


def test_unit_split_follows_the_schedule_units_and_sums_to_the_tensor_bytes() -> None:
    model = build_model("cnn2", 10, (1, 28, 28), seed=0)
    specs = named_specs(model.state_dict())
    chunk_bytes = 65536
    sizes = LogicalTensors.of(specs, chunk_bytes)
    assert list(sizes.by_unit) == model.schedule_units == ["conv1", "conv2", "fc1", "head"]
    assert sum(sizes.by_unit.values()) == sum(sizes.by_part.values())
    assert sum(sizes.by_part.values()) == sum(_measured_stream([s.nbytes for s in model.state_dict().values()],
                                                               chunk_bytes))
    per_tensor = stream_tensor_bytes(tuple(t.nbytes for t in model.state_dict().values()), chunk_bytes)
    for unit in model.schedule_units:
        assert sizes.by_unit[unit] == sum(n for name, n in zip(model.state_dict(), per_tensor)
                                          if tensor_unit(name) == unit)
    assert sizes.by_part["head"] == sizes.by_unit["head"]


def test_a_task_costs_its_logical_bytes_once_whatever_the_process_holds_or_is_sent_again() -> None:
    """FedBABU, one client: round 1 sends the whole model, physically and logically alike; in
    round 2 the process holds the frozen head and loses its first task stream, so the body
    crosses twice and the head not at all, while logically the task costs the whole model once."""
    # a delta of 0.5 in every element changes the body (over the default first-round norm bound)
    harness = Harness(algorithm={"name": "fedbabu"}, clients=1, rounds=2, robust={"adaptive_bound": 0})
    try:
        session = harness.join([0])
        harness.start_rounds(2)
        header, _ = harness.get_task(session)
        harness.submit(session, header, {n: torch.full_like(harness.initial[n], 0.5) for n in header.train.upload_deltas})
        held = {spec.name: spec.version for spec in header.tensors}
        lost, _ = harness.get_task(session, held)
        request = pb.TaskRequest(session=session, held_versions=held, held_tasks=[], wait_seconds=BOUND / 2)
        again = next(harness.stub.GetTask(request, timeout=BOUND)).header  # its stream was lost: sent again
        assert (again.task_id, again.round) == (lost.task_id, 2)
        assert harness.coordinator.board.delivery_counts(2).tasks_sent_again == 1
        harness.get_task(session, held)  # reads the rest of a third copy: the ledger counts streams as they are sent
        harness.submit(session, lost, {n: torch.zeros_like(harness.initial[n]) for n in lost.train.upload_deltas})
        harness.wait_rounds()
    finally:
        harness.close()
    first, second = harness.records
    client_1, client_2 = first["clients"]["0"], second["clients"]["0"]
    assert (client_1["down"], client_1["up"]) == (client_1["logical_down"], client_1["logical_up"])
    body, head = first["logical"]["by_part"]["body"], first["logical"]["by_part"]["head"]
    assert body["down"] > 0 and head["down"] > 0 and head["up"] == 0
    assert second["logical"]["by_part"]["body"] == body and second["logical"]["by_part"]["head"] == head
    assert second["bytes_by_part"]["body"]["down"] == 3 * body["down"]
    assert second["bytes_by_part"]["head"]["down"] == 0
    whole = pb.TaskChunk(header=lost)  # the header as if it listed the head it did not send
    whole.header.tensors.extend(spec for spec in header.tensors if spec.name.startswith("head."))
    reply = pb.SubmitReply(accepted=True).ByteSize()
    assert second["logical"]["by_part"]["control"]["down"] == whole.ByteSize() + reply
    assert client_2["logical_down"] == whole.ByteSize() + reply + body["down"] + head["down"]


def _quickstart(rounds: int) -> dict:
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config.update(rounds=rounds, algorithm={"name": "fedavg"})
    config["evaluate"]["finetune_epochs"] = [1]
    config["server"] = {"round_timeout": 300, "join_timeout": 120, "heartbeat_timeout": 60}
    return config


def _tensor_bytes(by_part: dict, direction: str) -> int:
    return sum(counts[direction] for part, counts in by_part.items() if part != "control")


def test_logical_bytes_do_not_depend_on_how_clients_are_packed_into_processes(tmp_path) -> None:
    """The quickstart (FedAvg, 10 clients, 2 rounds) with 1 and with 5 client processes."""
    runs = {}
    for processes in (1, 5):
        done, out = run_fedpart(_quickstart(rounds=2), tmp_path, f"processes={processes}", name=f"p{processes}")
        assert done.returncode == 0, done.stdout + done.stderr
        runs[processes] = (read_metrics(out), read_summary(out))
    (records_1, summary_1), (records_5, summary_5) = runs[1], runs[5]
    assert len(records_1) == len(records_5) == 2
    for one, five in zip(records_1, records_5):
        assert one["logical"] == five["logical"]
        assert one["bytes_by_unit"] == five["bytes_by_unit"]
        for client in one["clients"]:
            for direction in DIRECTIONS:
                key = f"logical_{direction}"
                assert one["clients"][client][key] == five["clients"][client][key] > 0
        assert five["bytes_down"] > 3 * one["bytes_down"]  # five processes download the model five times
        for record in (one, five):
            logical = record["logical"]
            assert list(record["bytes_by_unit"]) == ["fc1", "fc2", "head"]
            for direction in DIRECTIONS:
                assert logical[direction] == sum(c[f"logical_{direction}"] for c in record["clients"].values())
                assert logical[direction] == sum(counts[direction] for counts in logical["by_part"].values())
                assert sum(u[direction] for u in record["bytes_by_unit"].values()) == \
                    _tensor_bytes(logical["by_part"], direction)
            # every client downloads the whole model logically; physically the process's first
            model_bytes = _tensor_bytes(logical["by_part"], "down") / len(record["clients"])
            assert all(c["down"] <= c["logical_down"] and c["logical_down"] > model_bytes
                       for c in record["clients"].values())
    first_tasks = [c for c in records_5[0]["clients"].values() if c["down"] == c["logical_down"]]
    assert len(first_tasks) >= 5  # each process's first task carried everything it names, as logically

    logical_1, logical_5 = summary_1["bytes"]["logical"], summary_5["bytes"]["logical"]
    assert logical_1 == logical_5
    assert summary_5["bytes"]["down"] > 3 * summary_1["bytes"]["down"]
    assert set(logical_1) == {"down", "up", "by_part", "by_unit", "per_round_mean", "evaluation"}
    for direction in DIRECTIONS:
        rounds_total = sum(r["logical"][direction] for r in records_1)
        assert logical_1[direction] == rounds_total + logical_1["evaluation"][direction]
        assert logical_1["per_round_mean"][direction] == rounds_total / len(records_1)
        assert sum(u[direction] for u in logical_1["by_unit"].values()) == \
            _tensor_bytes(logical_1["by_part"], direction)
    # each of the 10 clients downloads the final model for the evaluation, as each did in round 1
    assert logical_1["evaluation"]["down"] > _tensor_bytes(records_1[0]["logical"]["by_part"], "down")
