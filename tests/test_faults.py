"""Faults cost time, never a result (docs/architecture.md, Faults): the quickstart with TLS and tokens, its
two client processes behind a relay (``lab.relay``) that resets connections at random
byte offsets, black-holes one, or delays every byte while a client process is SIGKILLed in the
middle of an upload and started again. Every round folds every sampled client, the final
evaluation covers every client, and the last checkpoint is bit-identical to the same run without
faults; only the time differs, within a stated bound."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO, WAIT, LineReader, read_metrics, read_summary, write_config
from fedpart.common.wire.protocol import KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS
from fedpart.deploy.certs import write_run_credentials
from fedpart.common.wire.client_ids import split_clients
from lab.relay import FaultPlan, RelayCounts, RelayThread

ROUNDS = 8
CLI = [sys.executable, "-m", "fedpart"]
# What a fault may cost the run, stated: a reset costs the calls on the connection and one
# reconnection (backoff from 0.5 s); a black hole costs the keepalive bound, 10 + 20 s, first.
RESET_BOUND_SECONDS = 60.0
BLACK_HOLE_BOUND_SECONDS = KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT_SECONDS + 60.0


@dataclass
class Outcome:
    out: Path
    seconds: float
    counts: RelayCounts | None
    client_logs: list[str]


# The quickstart asynchronous: FedBuff on the virtual clock, devices heavy-tailed and intermittent
BUFFERED = {"server": {"engine": "buffered"}, "buffered": {"concurrency": 6, "buffer_size": 3, "staleness": "polynomial"},
            "heterogeneity": {"speed": "lognormal", "offline_share": 0.2, "offline_period": 5.0, "clock": "virtual"}}


def _quickstart(tmp_path: Path, overrides: dict | None = None) -> Path:
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["rounds"] = ROUNDS
    overrides = overrides or {}
    config["server"] = {"round_timeout": 600, "join_timeout": 120, "heartbeat_timeout": 60,
                        **overrides.get("server", {})}
    config.update({key: value for key, value in overrides.items() if key != "server"})
    return write_config(tmp_path / "quickstart.yaml", config)


def _run(processes, tmp_path: Path, name: str, plan: FaultPlan | None = None,
         kill_during_upload: int | None = None, overrides: dict | None = None) -> Outcome:
    """The quickstart with TLS and per-process tokens (its settings replaced by ``overrides``);
    with ``plan`` the clients connect through a relay; with ``kill_during_upload`` the first
    client process is SIGKILLed once it trained its first client in that round (its upload is
    under way), and started again."""
    config = _quickstart(tmp_path, overrides)
    secrets = tmp_path / f"{name}-secrets"
    write_run_credentials(secrets, ["127.0.0.1"], clients=10, processes=2)
    out = tmp_path / name
    started = time.monotonic()
    server = processes.start(CLI + [
        "server", str(config), "--address", "127.0.0.1:0", "--out", str(out),
        "--tls-cert", str(secrets / "server.pem"), "--tls-key", str(secrets / "server.key"),
        "--credentials", str(secrets / "credentials.yaml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    reader = LineReader(server)
    address = reader.wait_for(r"listening on (\S+):(\d+)", timeout=WAIT)
    target = f"{address.group(1)}:{address.group(2)}"
    relay = RelayThread((address.group(1), int(address.group(2))), plan) if plan is not None else None
    if relay is not None:
        host, port = relay.start()
        target = f"{host}:{port}"

    def client(index: int, ids: str) -> subprocess.Popen:
        return processes.start(CLI + [
            "client", "--server", target, "--clients", ids, "--ca", str(secrets / "ca.pem"),
            "--token-file", str(secrets / f"process_{index}.token"), "--threads", "1",
            "--state-dir", str(out / "state" / f"process_{index}")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        clients = [client(index, ids) for index, ids in enumerate(split_clients(10, 2))]
        readers = [LineReader(c) for c in clients]
        logs = []
        if kill_during_upload is not None:
            readers[0].wait_for(rf"client \d+ round {kill_during_upload}: trained", timeout=WAIT)
            clients[0].kill()
            clients[0].wait(timeout=WAIT)
            logs.append(readers[0].rest(timeout=WAIT))
            clients[0] = client(0, split_clients(10, 2)[0])
            readers[0] = LineReader(clients[0])
        output = reader.rest(timeout=WAIT)
        assert server.wait(timeout=WAIT) == 0, output
        for process, lines in zip(clients, readers):
            logs.append(lines.rest(timeout=WAIT))
            assert process.wait(timeout=WAIT) == 0, logs[-1]
        seconds = time.monotonic() - started
    finally:
        counts = relay.counts() if relay is not None else None
        if relay is not None:
            relay.stop()
    return Outcome(out, seconds, counts, logs)


def _final_checkpoint(out: Path) -> str:
    return hashlib.sha256((out / "checkpoints" / f"round_{ROUNDS:04d}.safetensors").read_bytes()).hexdigest()


def _assert_same_result(faulted: Outcome, clean: Outcome) -> None:
    records = read_metrics(faulted.out)
    assert len(records) == ROUNDS
    for record in records:
        assert record["completed"] == record["sampled"] == list(range(10)), record["round"]
    summary = read_summary(faulted.out)
    assert summary["failures"] == []
    assert summary["delivery"]["rounds"] == {key: sum(r["delivery"][key] for r in records)
                                             for key in records[0]["delivery"]}
    assert summary["accuracy"] == read_summary(clean.out)["accuracy"]
    assert _final_checkpoint(faulted.out) == _final_checkpoint(clean.out)
    delivery = {key: sum(r["delivery"][key] for r in records) for key in records[0]["delivery"]}
    print(f"clean {clean.seconds:.1f} s, faulted {faulted.seconds:.1f} s; relay {faulted.counts}; "
          f"delivery {delivery}; final checkpoint sha256 {_final_checkpoint(faulted.out)[:16]} in both")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    from conftest import Processes

    made = Processes()
    try:
        yield _run(made, tmp_path_factory.mktemp("clean"), "clean")
    finally:
        made.stop_all()


def test_connections_reset_mid_stream_cost_time_not_a_result(processes, tmp_path, clean) -> None:
    """Seen before at-least-once delivery: 9 connections cut in 5 s, 7 results dropped as bad
    input, rounds of 8-9 of 10 clients, then no progress for minutes. Here 9 connections are
    reset after 0.3-3 MB each, and the run ends as the clean one did."""
    faulted = _run(processes, tmp_path, "resets", FaultPlan(reset_bytes=(300_000, 3_000_000), cuts=9, seed=1))
    assert faulted.counts.resets == 9, faulted.counts
    _assert_same_result(faulted, clean)
    retried = sum(r["delivery"]["streams_cut"] + r["delivery"]["tasks_sent_again"] for r in read_metrics(faulted.out))
    assert retried >= 1
    assert faulted.seconds <= clean.seconds + RESET_BOUND_SECONDS, (faulted.seconds, clean.seconds)


def test_a_black_holed_connection_is_found_by_keepalive(processes, tmp_path, clean) -> None:
    """A connection that goes silent without a reset (a NAT or a route that drops it): the
    keepalive pings find it within 10 + 20 s, the calls on it are made again on a new connection."""
    faulted = _run(processes, tmp_path, "black-hole", FaultPlan(blackhole_bytes=400_000, cuts=1, seed=2))
    assert faulted.counts.black_holes == 1, faulted.counts
    _assert_same_result(faulted, clean)
    assert faulted.seconds <= clean.seconds + BLACK_HOLE_BOUND_SECONDS, (faulted.seconds, clean.seconds)


def test_a_client_process_killed_during_an_upload_and_restarted(processes, tmp_path, clean) -> None:
    """SIGKILL while the process's result is on the wire (the relay delays every chunk, so an
    upload takes a while); the restarted process is given the task its predecessor held, trains
    it again from the same start, and the run ends as the clean one did."""
    faulted = _run(processes, tmp_path, "killed", FaultPlan(delay_ms=100), kill_during_upload=3)
    assert re.search(r"round 3: trained", faulted.client_logs[0])
    _assert_same_result(faulted, clean)
    assert sum(r["delivery"]["tasks_sent_again"] for r in read_metrics(faulted.out)) >= 1


@pytest.fixture(scope="module")
def clean_buffered(tmp_path_factory):
    from conftest import Processes

    made = Processes()
    try:
        yield _run(made, tmp_path_factory.mktemp("clean-buffered"), "clean-buffered", overrides=BUFFERED)
    finally:
        made.stop_all()


def test_an_asynchronous_run_on_the_virtual_clock_through_resets_ends_bit_identical(processes, tmp_path,
                                                                                     clean_buffered) -> None:
    """FedBuff on the virtual clock through the relay that resets connections: results arrive
    late, again or out of order, and every version still folds the tasks that finish first in
    virtual time: the same versions, the same final model, only later."""
    faulted = _run(processes, tmp_path, "resets-buffered", FaultPlan(reset_bytes=(100_000, 1_000_000), cuts=9, seed=1),
                   overrides=BUFFERED)
    assert faulted.counts.resets == 9, faulted.counts
    records, clean_records = read_metrics(faulted.out), read_metrics(clean_buffered.out)
    keys = ("sampled", "completed", "virtual_seconds")
    assert [[r[k] for k in keys] for r in records] == [[r[k] for k in keys] for r in clean_records]
    assert all(len(r["completed"]) == 3 for r in records)
    assert read_summary(faulted.out)["failures"] == []
    assert read_summary(faulted.out)["accuracy"] == read_summary(clean_buffered.out)["accuracy"]
    assert _final_checkpoint(faulted.out) == _final_checkpoint(clean_buffered.out)
    assert sum(r["delivery"]["streams_cut"] + r["delivery"]["tasks_sent_again"] for r in records) >= 1
    assert faulted.seconds <= clean_buffered.seconds + RESET_BOUND_SECONDS, (faulted.seconds, clean_buffered.seconds)
