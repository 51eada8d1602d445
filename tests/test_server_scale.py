"""The coordinator serves more client processes than the 512 worker threads the server once had:
a real ``fedpart server`` against virtual client processes (``fedpart.client.virtual``), all
multiplexed in one OS process on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import LineReader, Processes, read_metrics, read_summary, small_config, start_server, write_config

VIRTUAL_PROCESSES = 640  # above the old limit of 512 worker threads, one per waiting poll
CLIENTS = 1280
FRACTION = 0.05          # 64 results per round
ROUNDS = 2
BOUND = 240.0            # seconds: every wait is bounded, generously for a busy 2-core machine
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
        server={"join_timeout": JOIN_SECONDS, "round_timeout": BOUND, "evaluation_timeout": BOUND,
                "heartbeat_timeout": 60},
    )


def test_rounds_complete_with_more_client_processes_than_the_old_thread_limit(processes: Processes,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "run"
    server, server_output, address = start_server(processes, write_config(tmp_path / "scale.yaml", scale_config()), out)
    stats_path = tmp_path / "load.json"
    load = processes.start([sys.executable, "-m", "fedpart.client.virtual", "--server", address,
                            "--clients", f"0-{CLIENTS - 1}", "--processes", str(VIRTUAL_PROCESSES),
                            "--reconnect-timeout", str(RECONNECT_SECONDS), "--stats", str(stats_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    load_reader = LineReader(load)
    log = server_output.rest(timeout=BOUND)  # the server prints while it works and exits at the end
    server_exit = server.wait(timeout=BOUND)
    load.wait(timeout=BOUND)  # told DONE, or gives up RECONNECT_SECONDS after the server went away
    load_output = load_reader.rest(timeout=BOUND)
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
