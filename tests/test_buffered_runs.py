"""The buffered engine (FedBuff) end to end: real ``fedpart run`` and hand-started processes on
127.0.0.1. With concurrency = buffer size = the clients of a round and a constant staleness weight
it is synchronous FedAvg, bit for bit; on the virtual clock a run is deterministic, and a wall-clock
run whose client processes wait out their devices' time, arriving in the same order, ends with the
same model; a killed server resumes its buffer state with identical results; secure aggregation
runs over each buffer and DP-FedAvg accounts each fold."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from conftest import (WAIT, LineReader, fedpart_command, read_metrics, read_summary, run_fedpart, small_config,
                      start_server, write_config)
from fedpart.common.config.run_config import config_from_dict
from fedpart.server.engine.buffered import Schedule
from fedpart.server.engine.coordinator import Coordinator

pytestmark = pytest.mark.slow

DIGITS = {"dataset": "digits", "partition": {"scheme": "iid"}}


def _checkpoint(out: Path) -> str:
    last = sorted((out / "checkpoints").glob("round_*.safetensors"))[-1]
    return hashlib.sha256(last.read_bytes()).hexdigest()


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_with_the_round_as_its_buffer_the_buffered_engine_is_synchronous_fedavg(tmp_path: Path) -> None:
    """concurrency = buffer_size = the clients a round samples (the defaults), constant staleness
    weight, no heterogeneity: every version dispatches the round's sample, folds all of it and
    steps as the round does. Same model bit for bit, same bytes per update (logical)."""
    config = small_config(rounds=4, clients=6, sampling={"fraction": 0.5}, data=DIGITS)
    sync, sync_out = run_fedpart(config, tmp_path, name="sync")
    _ok(sync)
    buffered, buffered_out = run_fedpart(config, tmp_path, "server.engine=buffered", name="buffered")
    _ok(buffered)
    assert _checkpoint(sync_out) == _checkpoint(buffered_out)
    sync_records, buffered_records = read_metrics(sync_out), read_metrics(buffered_out)
    assert [r["sampled"] for r in sync_records] == [r["sampled"] for r in buffered_records]
    assert [r["buffered"]["dispatched"] for r in buffered_records] == [r["sampled"] for r in sync_records]
    assert all(r["buffered"]["staleness"] == {"0": 3} for r in buffered_records)
    assert [r["logical"] for r in sync_records] == [r["logical"] for r in buffered_records]
    assert [r["clients"][c]["logical_up"] for r in sync_records for c in r["clients"]] == \
        [r["clients"][c]["logical_up"] for r in buffered_records for c in r["clients"]]
    assert read_summary(sync_out)["accuracy"] == read_summary(buffered_out)["accuracy"]


def _separated_devices(config: dict, margin: float) -> int:
    """A heterogeneity seed whose virtual schedule leaves ``margin`` seconds between the first
    two tasks to finish at every version: a wall-clock run keeps that order on a busy machine."""
    for seed in range(100):
        chosen = config_from_dict({**config, "heterogeneity": {**config["heterogeneity"], "seed": seed}})
        clock = Coordinator(chosen, log=lambda line: None).clock
        concurrency, buffer_size = chosen.buffered.resolved(chosen.clients, chosen.sampling.fraction)
        schedule = Schedule(chosen.clients, concurrency, buffer_size, chosen.sampling_seed, clock)
        gaps = []
        for version in range(1, chosen.rounds + 1):
            schedule.start(version, chosen.rounds)
            finishes = sorted(f.finish for f in schedule.flights.values())
            gaps += [finishes[1] - finishes[0]] if len(finishes) > 1 else []
            schedule.close(schedule.members())
        if min(gaps) >= margin:
            return seed
    raise AssertionError("no seed separates the devices")


def _heterogeneous(**overrides) -> dict:
    config = small_config(rounds=4, clients=4, processes=4, data=DIGITS,
                          evaluate={"finetune_epochs": [1, 2], "batch_size": 50, "global_every": 1},
                          server={"engine": "buffered", "round_timeout": 120, "join_timeout": 120,
                                  "heartbeat_timeout": 30},
                          buffered={"concurrency": 3, "buffer_size": 1, "staleness": "polynomial"},
                          heterogeneity={"speed": "lognormal", "speed_sigma": 1.0, "step_seconds": 0.1,
                                         "clock": "virtual"})
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def virtual_run(tmp_path_factory) -> tuple[dict, Path]:
    """A buffered run on the virtual clock whose devices finish well apart."""
    config = _heterogeneous()
    config["heterogeneity"]["seed"] = _separated_devices(config, margin=1.5)
    tmp_path = tmp_path_factory.mktemp("virtual")
    result, out = run_fedpart(config, tmp_path, name="virtual")
    _ok(result)
    return config, out


def test_a_virtual_run_is_deterministic_and_a_timed_run_in_the_same_order_matches_it(virtual_run,
                                                                                      tmp_path: Path) -> None:
    """The same seed on the virtual clock twice: the same versions, clock and model. Then the wall
    clock: every client process waits out its device's time (heterogeneity mod), the results arrive
    in the order the virtual clock computed, and the model is the same, bit for bit."""
    config, out = virtual_run
    again, again_out = run_fedpart(config, tmp_path, name="again")
    _ok(again)
    assert _checkpoint(again_out) == _checkpoint(out)
    records = read_metrics(out)
    keys = ("sampled", "completed", "virtual_seconds", "virtual_busy")
    assert [[r[k] for k in keys] for r in read_metrics(again_out)] == [[r[k] for k in keys] for r in records]
    assert any(s != "0" for r in records for s in r["buffered"]["staleness"])

    timed = {**config, "heterogeneity": {**config["heterogeneity"], "clock": "wall"}}
    result, timed_out = run_fedpart(timed, tmp_path, name="timed")
    _ok(result)
    timed_records = read_metrics(timed_out)
    assert [r["completed"] for r in timed_records] == [r["completed"] for r in records], \
        "the wall-clock run's arrival order is not the virtual clock's"
    assert _checkpoint(timed_out) == _checkpoint(out)
    assert all(r.get("virtual_seconds") is None for r in timed_records)
    logs = "".join(p.read_text() for p in (timed_out / "logs").glob("client_*.log"))
    assert "its device takes" in logs  # the processes waited

    from fedpart.report.runs import read_runs
    from fedpart.report.tables import table_rows

    rows = {row["run"]: row for row in table_rows(read_runs([out, timed_out], ["virtual", "wall"]), target=0.0)
            if row["row"] == "run"}
    assert rows["virtual"]["engine"] == "buffered" and rows["virtual"]["clock"] == "virtual"
    assert rows["virtual"]["clock_seconds"] == records[-1]["virtual_seconds"]
    assert 0 < rows["virtual"]["utilization"] < 1 and rows["virtual"]["mean_staleness"] > 0
    assert rows["virtual"]["clock_time_to_target"] == records[0]["virtual_seconds"]  # any accuracy reaches 0
    assert rows["wall"]["clock"] == "wall" and rows["wall"]["utilization"] is None
    assert rows["wall"]["bytes_per_update"] == rows["virtual"]["bytes_per_update"]


def test_a_killed_server_resumes_its_buffer_with_identical_results(virtual_run, processes, tmp_path: Path) -> None:
    """SIGKILL the server after version 2 (or 3) with tasks in flight (and results held), resume:
    the tasks in flight are dispatched again on the versions they trained on, the clients train
    them again from the same start, and the run ends as the uninterrupted one did."""
    config, baseline = virtual_run
    config_path = write_config(tmp_path / "config.yaml", {**config, "processes": 2})
    out = tmp_path / "out"
    server, reader, address = start_server(processes, config_path, out)
    clients = [processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", ids,
                                               "--threads", "1", "--state-dir", str(tmp_path / f"state_{i}"),
                                               "--reconnect-timeout", "120"),
                               stdout=(tmp_path / f"client_{i}.log").open("w"), stderr=subprocess.STDOUT)
               for i, ids in enumerate(("0-1", "2-3"))]
    reader.wait_for(r"round\s+2/4", timeout=WAIT)
    server.kill()
    server.wait(timeout=WAIT)
    state = read_metrics(out)  # versions take milliseconds: the kill may land after version 3
    assert 2 <= len(state) < 4 and state[-1]["buffered"]["in_flight"] > 0
    resumed = processes.start(fedpart_command("server", "--resume", str(out), "--address", address, "--insecure"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = LineReader(resumed).rest(timeout=WAIT)
    assert resumed.wait(timeout=WAIT) == 0, output
    for client in clients:
        assert client.wait(timeout=WAIT) == 0
    resumed_after = re.search(r"resuming run \w+ after round (\d)/4", output)
    assert resumed_after, output
    # a round's metrics line is written before its checkpoint: a kill between them redoes that round
    assert len(state) - 1 <= int(resumed_after.group(1)) <= len(state)
    assert [r["round"] for r in read_metrics(out)] == [1, 2, 3, 4]
    keys = ("sampled", "completed", "virtual_seconds")
    assert [[r[k] for k in keys] for r in read_metrics(out)] == [[r[k] for k in keys] for r in read_metrics(baseline)]
    assert _checkpoint(out) == _checkpoint(baseline)
    assert read_summary(out)["failures"] == []


def test_secure_aggregation_over_each_buffer_and_dp_accounting_per_fold(tmp_path: Path) -> None:
    """Secure aggregation: every version's buffer is summed under masks bound to that version,
    stale results included, and the model follows the plain buffered run's within the
    quantization. DP-FedAvg: each fold is an accounted round of fixed-size sampling."""
    config = _heterogeneous(rounds=3, clients=6, processes=2, sampling={"fraction": 0.5},
                            buffered={"concurrency": 5, "buffer_size": 3})
    secure, secure_out = run_fedpart(config, tmp_path, "privacy.secure_aggregation=true", name="secure")
    _ok(secure)
    records = read_metrics(secure_out)
    assert all(r["completed"] == r["sampled"] and len(r["sampled"]) == 3 for r in records)
    assert all(r["bytes_by_part"]["secagg"]["up"] > 0 for r in records)
    assert any(s != "0" for r in records for s in r["buffered"]["staleness"])
    plain, plain_out = run_fedpart(config, tmp_path, name="plain")
    _ok(plain)
    assert [r["completed"] for r in read_metrics(plain_out)] == [r["completed"] for r in records]
    accuracy = read_summary(secure_out)["accuracy"]["global"]["acc"]
    assert accuracy == pytest.approx(read_summary(plain_out)["accuracy"]["global"]["acc"], abs=0.02)

    private, private_out = run_fedpart(config, tmp_path, "privacy.dp.enabled=true", "train.weighting=uniform",
                                       "buffered.staleness=polynomial", name="private")
    _ok(private)
    epsilons = [r["privacy"]["epsilon"] for r in read_metrics(private_out)]
    assert len(epsilons) == 3 and epsilons == sorted(epsilons) and epsilons[0] > 0
