"""Client placement on CPU-only machines: device specs (``auto`` included), ``fedpart run --devices``
(one process per device, even split of the client ids), host/device transfers and peak memory
being the identity / absent on the CPU, and the round records' per-process GPU peaks."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest
import torch

from conftest import WAIT, child_env, fedpart_command, read_metrics, read_summary, small_config, write_config
from fedpart.client.placement import DeviceError, PeakMemory, Transfers, resolve_device, resolve_devices
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.tensors import make_spec
from fedpart.common.wire.client_ids import split_clients
from fedpart.deploy.launcher import client_processes
from fedpart.server.output.run_directory import build_summary
from test_robust import RawClient, InProcessServer


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    """Device specs resolved as on a machine with two visible GPUs (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


# ------------------------------------------------------------------------------- device specs


def test_cpu_and_auto_without_a_gpu_resolve_to_the_cpu(no_gpu):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_devices("auto") == []


def test_auto_is_the_first_visible_gpu(two_gpus):
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(" cuda:1 ") == torch.device("cuda", 1)
    assert resolve_devices("auto") == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("spec, message", [
    ("cuda:0", "CUDA is not available on this machine"),
    ("gpu", "is not cpu, cuda:N or auto"),
    ("meta", "only cpu and cuda devices are supported"),
])
def test_unusable_devices_are_refused_with_the_reason(no_gpu, spec, message):
    with pytest.raises(DeviceError, match=message):
        resolve_device(spec)


def test_a_gpu_index_beyond_the_visible_ones_is_refused(two_gpus):
    with pytest.raises(DeviceError, match=r"2 visible GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_a_device_list_keeps_its_order_and_repeats(two_gpus):
    assert resolve_devices("cuda:0, cuda:0,cuda:1,cpu") == ["cuda:0", "cuda:0", "cuda:1", "cpu"]


@pytest.mark.parametrize("spec, message", [("cpu,,cpu", "an empty entry"), ("auto,cuda:0", "auto stands alone")])
def test_malformed_device_lists_are_refused(two_gpus, spec, message):
    with pytest.raises(DeviceError, match=message):
        resolve_devices(spec)


# ---------------------------------------------------------------------------- fedpart run --devices


def _config(clients: int = 10, processes: int = 2):
    return config_from_dict(small_config(clients=clients, processes=processes))


def test_without_devices_processes_run_on_the_cpu():
    placed, notes = client_processes(_config(processes=3), None)
    assert placed == [(ids, "cpu") for ids in split_clients(10, 3)] and notes == []


def test_one_process_per_device_with_an_even_share_of_the_clients(two_gpus):
    placed, notes = client_processes(_config(processes=4), "cuda:0,cuda:1,cuda:0,cuda:1")
    assert placed == [("0-1", "cuda:0"), ("2-4", "cuda:1"), ("5-7", "cuda:0"), ("8-9", "cuda:1")]
    assert notes == []  # four devices, processes 4: nothing to say


def test_devices_replace_processes_and_say_so(two_gpus):
    placed, notes = client_processes(_config(processes=2), "auto")
    assert placed == [("0-4", "cuda:0"), ("5-9", "cuda:1")] and notes == []
    placed, notes = client_processes(_config(processes=2), "cpu,cpu,cpu")
    assert placed == [("0-2", "cpu"), ("3-6", "cpu"), ("7-9", "cpu")]
    assert notes == ["--devices: 3 client process(es), one per device (processes: 2 of the config is not used)"]


def test_more_devices_than_clients_use_the_first_ones(two_gpus):
    placed, notes = client_processes(_config(clients=1, processes=1), "cuda:1,cuda:0")
    assert placed == [("0-0", "cuda:1")]
    assert notes == ["--devices: 2 devices for 1 client(s); using cuda:1"]


def test_auto_without_a_gpu_falls_back_to_processes_on_the_cpu(no_gpu):
    placed, notes = client_processes(_config(processes=2), "auto")
    assert placed == [("0-4", "cpu"), ("5-9", "cpu")]
    assert notes == ["--devices auto: no GPU is visible; 2 client process(es) on the CPU"]


def _run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(fedpart_command(*args), capture_output=True, text=True, env=child_env(), cwd=tmp_path,
                          timeout=WAIT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_run_refuses_a_gpu_it_does_not_have_before_anything_starts(tmp_path):
    config = write_config(tmp_path / "c.yaml", small_config())
    done = _run_cli(tmp_path, "run", str(config), "--out", str(tmp_path / "out"), "--devices", "cpu,cuda:0")
    assert done.returncode == 2
    assert "fedpart run: error: device 'cuda:0': CUDA is not available on this machine" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_client_refuses_a_gpu_it_does_not_have(tmp_path):
    done = _run_cli(tmp_path, "client", "--server", "127.0.0.1:1", "--clients", "0", "--device", "cuda:1",
                    "--insecure")
    assert done.returncode == 2  # a bad option, said before anything connects
    assert "fedpart client: error: device 'cuda:1': CUDA is not available on this machine" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of a machine without CUDA")
def test_run_on_cpu_devices_starts_one_process_per_device_and_reports_no_gpu_memory(tmp_path):
    config = write_config(tmp_path / "c.yaml", small_config(rounds=2, processes=2))
    out = tmp_path / "out"
    done = _run_cli(tmp_path, "run", str(config), "--out", str(out), "--devices", "cpu,cpu,cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: --devices: 3 client process(es), one per device (processes: 2 of the config is not used)" \
        in done.stdout
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["client_0.log", "client_1.log", "client_2.log"]
    for log in logs:
        assert ": fedavg on cpu, data (train/test)" in (out / "logs" / log).read_text()
    records = read_metrics(out)
    assert all("gpu_peak_bytes" not in r for r in records)
    assert all("gpu_peak_bytes" not in entry for r in records for entry in r["clients"].values())
    assert "gpu_peak_bytes" not in read_summary(out)["compute"]


# ------------------------------------------------------------------------------ transfers on the CPU


def test_on_the_cpu_transfers_copy_nothing():
    transfers = Transfers(torch.device("cpu"))
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    assert transfers.staging([make_spec(n, t) for n, t in tensors.items()]) == {}
    moved = transfers.to_device(tensors)
    assert all(moved[n] is tensors[n] for n in tensors)
    (back, empty) = transfers.to_host(tensors, {})
    assert all(back[n] is tensors[n] for n in tensors) and empty == {}


def test_no_peak_memory_on_the_cpu():
    assert PeakMemory(torch.device("cpu")).metrics() == {}


# ------------------------------------------------------------------- peak memory in the round records


def test_round_records_keep_each_processs_highest_peak(tmp_path):
    """Two processes report peaks per task; the round keeps each one's highest, the summary the
    highest of all."""
    server = InProcessServer(clients=4, rounds=1, server={"round_timeout": 60, "heartbeat_timeout": 30})
    first = RawClient(server.address, [0, 1], name="site-a")
    second = RawClient(server.address, [2, 3], name="site-b")
    peaks = {0: 5e6, 1: 7e6, 2: 1e6, 3: 2e6}
    accepted = []

    def serve_two_tasks(process: RawClient) -> None:
        for _ in range(2):
            header = process.next_task()
            uploads = {n: torch.zeros_like(process.state[n]) for n in header.train.upload_deltas}
            metrics = {"loss": 1.0, "compute_seconds": 0.1, "gpu_peak_bytes": peaks[header.client_id]}
            accepted.append(process.submit(header, uploads, 10, metrics).accepted)

    try:
        server.start()
        threads = [threading.Thread(target=serve_two_tasks, args=(p,), daemon=True) for p in (first, second)]
        for thread in threads:
            thread.start()
        server.wait()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        first.close()
        second.close()
        server.close()
    assert accepted == [True] * 4
    record = server.records[0]
    assert record.gpu_peak_bytes == {"site-a": 7_000_000, "site-b": 2_000_000}
    json.dumps(record.to_json())  # a metrics.jsonl line
    coordinator = server.coordinator
    summary = build_summary(server.config, coordinator.model, server.records, {}, None, coordinator.ledger, [], 1.0)
    assert summary.compute.gpu_peak_bytes == 7_000_000
