"""Virtual client processes (``lab.virtual``) answer as the server expects, and the
coordinator serves more client processes than the 512 worker threads it once had: a real
``fedpart server`` against 640 virtual client processes multiplexed in one OS process on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (WAIT, LineReader, Processes, read_metrics, read_summary, small_config,
                      start_server, write_config)
from lab.virtual import Payloads, evaluation_metrics, slice_clients, train_sample_count
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.plans import EvalPlan, TaskKind
from fedpart.common.wire.serde import result_info
from fedpart.common.wire.tensors import decode_chunks
from fedpart.common.wire.client_ids import split_clients
from fedpart.proto import fedpart_pb2 as pb
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.engine.task_board import Task
from fedpart.server.policy.validation import check_evaluation, check_header

VIRTUAL_PROCESSES = 640  # above the old limit of 512 worker threads, one per waiting poll
CLIENTS = 1280
FRACTION = 0.05          # 64 results per round
ROUNDS = 2
JOIN_SECONDS = 120.0     # for every virtual process to join and ask for work
RECONNECT_SECONDS = 10.0  # a virtual process gives up this soon after the server went away
SHUTDOWN_ERRORS = {"Heartbeat CANCELLED", "Heartbeat UNAVAILABLE"}


def scale_config() -> dict:
    """A light run: a tiny mlp on digits; the server holds no data (no global test, no partition
    caps: virtual clients report made-up sample counts)."""
    return small_config(
        clients=CLIENTS, rounds=ROUNDS, sampling={"fraction": FRACTION},
        model={"name": "mlp", "hidden": 8},
        evaluate={"finetune_epochs": [1], "global_test": False},
        robust={"partition_sizes": False},
        server={"join_timeout": JOIN_SECONDS, "round_timeout": WAIT, "evaluation_timeout": WAIT,
                "heartbeat_timeout": 60},
    )


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbabu", "fedftha"])
def test_a_virtual_result_carries_exactly_the_tensors_its_plan_asks_for(algorithm: str) -> None:
    config = config_from_dict(small_config(algorithm={"name": algorithm}))
    coordinator = Coordinator(config, log=lambda _: None)
    plan = coordinator.round_plan(1, 3)
    task = Task(task_id=7, kind=TaskKind.TRAIN, round=1, client_id=3, session="s", train=plan)
    payloads = Payloads(config.to_json())
    upload = payloads.upload(task)
    header = pb.ResultHeader(session="s", task_id=7, client_id=3, round=1, num_samples=train_sample_count(3),
                             tensors=upload.specs)
    stream = [pb.ResultChunk(header=header).SerializeToString(), *upload.chunks]  # as the session sends it
    sent, tensors = decode_chunks(pb.ResultChunk.FromString(serialized) for serialized in stream)
    check_header(result_info(sent), sent.tensors, coordinator.expected_uploads(task))  # raises when they differ
    assert tuple(tensors) == task.uploads()
    assert (sent.task_id, sent.client_id, sent.num_samples) == (7, 3, train_sample_count(3))
    assert upload.tensor_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.abs().max() < 1 for n, t in tensors.items() if n in plan.upload_deltas)


@pytest.mark.parametrize("headless", [False, True])
@pytest.mark.parametrize("classification", [False, True])
def test_virtual_evaluations_pass_the_server_checks(headless: bool, classification: bool) -> None:
    plan = EvalPlan(finetune_epochs=(0, 1, 5), lr=1e-3, momentum=0.9, batch_size=50, headless=headless)
    for client in range(30):
        metrics = evaluation_metrics(plan, client, classification)
        check_evaluation(metrics, plan, trained_samples=train_sample_count(client))
        assert ("initial_acc" in metrics) == classification
        assert ("headless_acc" in metrics) == (headless and classification)


def test_virtual_processes_split_the_clients_as_the_launcher_does() -> None:
    ids = list(range(100, 110))
    slices = slice_clients(ids, 4)
    assert [f"{s[0] - 100}-{s[-1] - 100}" for s in slices] == split_clients(10, 4)
    assert sum(slices, []) == ids
    with pytest.raises(ValueError, match="--processes 11"):
        slice_clients(ids, 11)


def test_rounds_complete_with_more_client_processes_than_the_old_thread_limit(processes: Processes,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "run"
    server, server_output, address = start_server(processes, write_config(tmp_path / "scale.yaml", scale_config()), out)
    stats_path = tmp_path / "load.json"
    load = processes.start([sys.executable, "-m", "lab.virtual", "--insecure", "--server", address,
                            "--clients", f"0-{CLIENTS - 1}", "--processes", str(VIRTUAL_PROCESSES),
                            "--reconnect-timeout", str(RECONNECT_SECONDS), "--stats", str(stats_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    load_reader = LineReader(load)
    log = server_output.rest(timeout=WAIT)  # the server prints while it works and exits at the end
    server_exit = server.wait(timeout=WAIT)
    load.wait(timeout=WAIT)  # told DONE, or gives up RECONNECT_SECONDS after the server went away
    load_output = load_reader.rest(timeout=WAIT)
    assert server_exit == 0, f"{log[-3000:]}\n{load_output}"
    assert load.returncode == 0, load_output

    stats = json.loads(stats_path.read_text())
    assert stats["processes"] == stats["joins"] == stats["done"] == VIRTUAL_PROCESSES
    assert stats["failures"] == [], load_output
    # the server stops once it has told every process DONE, so a heartbeat sent just before a
    # virtual process reads its DONE may meet a server that is gone (fedpart client ignores it too)
    assert set(stats["errors"]) <= SHUTDOWN_ERRORS, load_output
    sampled_per_round = int(FRACTION * CLIENTS)
    assert stats["train_results"] == ROUNDS * sampled_per_round
    assert stats["evaluations"] == CLIENTS

    records = read_metrics(out)
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    for record in records:
        assert len(record["sampled"]) == sampled_per_round
        assert record["completed"] == record["sampled"]
    summary = read_summary(out)
    assert summary["failures"] == []
    assert all(client["train_samples"] is not None for client in summary["per_client"])
    assert "went silent" not in log

