"""End-to-end: real server and client processes over gRPC on 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
    SHARED_DATA,
    WAIT,
    fedpart_command,
    read_metrics,
    read_summary,
    run_fedpart,
    small_config,
    start_server,
    write_config,
)
from fedpart.common.process.checkpoint import load_tensors

CNN2_PARAMETERS = 582_026
CNN2_HEAD = 5_130


def _check_summary(summary: dict, config: dict) -> None:
    assert summary["algorithm"] == config["algorithm"]["name"]
    assert summary["rounds"] == config["rounds"]
    assert summary["clients"] == config["clients"]
    assert set(summary["parameters"]) == {"total", "body", "head"}
    assert summary["parameters"]["total"] == summary["parameters"]["body"] + summary["parameters"]["head"]
    accuracy = summary["accuracy"]
    for stats in [accuracy["initial"], *accuracy["personalized"].values()]:
        assert {"mean", "std", "weighted_mean"} <= set(stats)
        assert 0.0 <= stats["mean"] <= 1.0 and stats["std"] >= 0.0
    assert set(accuracy["personalized"]) == {str(e) for e in config["evaluate"]["finetune_epochs"]}
    assert summary["bytes"]["down"] > 0 and summary["bytes"]["up"] > 0
    assert set(summary["bytes"]["by_part"]) == {"body", "head", "other", "control"}
    assert summary["failures"] == []
    assert [c["id"] for c in summary["per_client"]] == list(range(config["clients"]))
    for client in summary["per_client"]:
        assert client["train_samples"] > 0 and client["test_samples"] > 0
        assert 0.0 <= client["initial"] <= 1.0
        assert set(client["personalized"]) == {str(e) for e in config["evaluate"]["finetune_epochs"]}
        assert all(0.0 <= v <= 1.0 for v in client["personalized"].values())
        assert client["bytes"]["down"] > 0


def test_fedavg_runs_end_to_end_and_is_deterministic(tmp_path: Path) -> None:
    config = small_config()
    first, out = run_fedpart(config, tmp_path, name="a")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "personalized, 2 epochs" in first.stdout and "round    3/3" in first.stdout
    summary = read_summary(out)
    _check_summary(summary, config)
    metrics = read_metrics(out)
    assert [m["round"] for m in metrics] == [1, 2, 3]
    for record in metrics:
        assert {"round", "sampled", "completed", "train_loss", "seconds", "bytes_down", "bytes_up",
                "bytes_by_part"} <= set(record)
        assert record["completed"] == record["sampled"] == [0, 1, 2, 3]
        assert set(record["bytes_by_part"]) == {"body", "head", "other", "control"}
        assert record["bytes_by_part"]["head"]["up"] > 0  # FedAvg uploads the head
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"round_{r:04d}.safetensors" for r in range(4)]
    assert (out / "config.yaml").is_file()
    personalized = sorted((out / "state").glob("process_*/*/client_*/personalized.safetensors"))
    assert len(personalized) == config["clients"]

    second, out2 = run_fedpart(config, tmp_path, name="b")
    assert second.returncode == 0, second.stdout + second.stderr
    last, last2 = load_tensors(out / "checkpoints/round_0003.safetensors"), load_tensors(out2 / "checkpoints/round_0003.safetensors")
    assert all(torch.equal(last[k], last2[k]) for k in last), "same seed must give the same global model"
    assert read_summary(out2)["accuracy"] == summary["accuracy"]


def test_fedbabu_keeps_the_head_fixed_and_sends_it_once_per_process(tmp_path: Path) -> None:
    config = small_config(algorithm={"name": "fedbabu"}, rounds=3,
                          evaluate={"finetune_epochs": [0, 1, 2, 3, 4, 5, 10], "headless": True, "batch_size": 50})
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(out)
    _check_summary(summary, config)
    accuracy = summary["accuracy"]
    assert accuracy["personalized"]["0"] == accuracy["initial"], "0 fine-tune epochs is the initial model"
    for key in ("headless", "headless_cosine"):
        assert 0.0 < accuracy[key]["mean"] <= 1.0
    assert 0.0 < accuracy["global"]["acc"] <= 1.0
    assert "head-less, cosine" in result.stdout and "global model, server test set" in result.stdout
    assert summary["compute"]["client_seconds"] > 0 and summary["compute"]["train_flops"] > 0
    first = load_tensors(out / "checkpoints/round_0000.safetensors")
    last = load_tensors(out / "checkpoints/round_0003.safetensors")
    for name in ("head.weight", "head.bias"):
        assert torch.equal(first[name], last[name]), f"{name} changed"
    assert not torch.equal(first["body.fc1.1.weight"], last["body.fc1.1.weight"])
    head_bytes = sum(first[n].numel() * 4 for n in ("head.weight", "head.bias"))
    head = summary["bytes"]["by_part"]["head"]
    assert head["up"] == 0
    processes = config["processes"]
    assert processes * head_bytes <= head["down"] <= processes * (head_bytes + 64)
    metrics = read_metrics(out)
    assert metrics[0]["bytes_by_part"]["head"]["down"] == head["down"]
    assert all(m["bytes_by_part"]["head"]["down"] == 0 for m in metrics[1:])


@pytest.mark.skipif(not (SHARED_DATA / "MNIST" / "raw").is_dir(), reason="needs ../shared/data/MNIST/raw")
@pytest.mark.parametrize("algorithm, trained", [("fedavg", CNN2_PARAMETERS), ("fedbabu", CNN2_PARAMETERS - CNN2_HEAD)])
def test_cnn2_mnist_bytes_per_client_round(tmp_path: Path, algorithm: str, trained: int) -> None:
    """FedAvg uploads 582,026 x 4 bytes of tensor data per client-round, FedBABU 576,896 x 4;
    everything the protocol adds stays under 1%."""
    config = small_config(
        rounds=2, clients=2, processes=2,
        data={"dataset": "mnist", "root": str(SHARED_DATA),
              "partition": {"scheme": "contiguous", "train_per_client": 50, "test_per_client": 20}},
        model={"name": "cnn2"}, algorithm={"name": algorithm},
        evaluate={"finetune_epochs": [1], "batch_size": 50},
    )
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    raw = trained * 4
    for record in read_metrics(out):
        clients = len(record["completed"])
        assert clients == 2
        parts = record["bytes_by_part"]
        tensor_up = parts["body"]["up"] + parts["head"]["up"]
        assert raw * clients <= tensor_up < raw * clients * 1.001
        assert record["bytes_up"] / clients < raw * 1.01
        if algorithm == "fedbabu":
            assert parts["head"]["up"] == 0
    summary = read_summary(out)
    assert summary["parameters"] == {"total": CNN2_PARAMETERS, "body": CNN2_PARAMETERS - CNN2_HEAD, "head": CNN2_HEAD}


def test_server_and_clients_started_separately(tmp_path: Path, processes) -> None:
    """The deployment path: one ``fedpart server`` and two ``fedpart client`` processes."""
    config = small_config(clients=5, rounds=2)
    config_path = write_config(tmp_path / "config.yaml", config)
    out = tmp_path / "out"
    server, reader, address = start_server(processes, config_path, out)
    clients = [processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", ids,
                                               "--state-dir", str(tmp_path / f"state{i}"), "--threads", "1"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i, ids in enumerate(["0-2", "3,4"])]
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 0, output
    for client in clients:
        log = client.communicate(timeout=WAIT)[0]
        assert client.returncode == 0, log
        assert "run finished" in log
    assert "hosts clients 0-2" in output and "hosts clients 3-4" in output
    _check_summary(read_summary(out), config)


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    result, _ = run_fedpart(small_config(train={"epochs": 1, "learning_rate": 0.1}), tmp_path)
    assert result.returncode == 2
    assert "train.learning_rate" in result.stderr


def test_client_hosting_an_unknown_client_is_refused(tmp_path: Path, processes) -> None:
    config_path = write_config(tmp_path / "config.yaml", small_config(clients=2, server={"join_timeout": 60}))
    _, _, address = start_server(processes, config_path, tmp_path / "out")
    client = processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", "0-5"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = client.communicate(timeout=WAIT)[0]
    assert client.returncode == 2  # the operator's mistake: the table's USAGE
    assert "client ids 2-5 are not in the run: it has clients 0-1" in log


def test_a_client_without_its_data_says_why_and_the_server_reports_it(tmp_path: Path, processes) -> None:
    missing_root = tmp_path / "no-data-here"
    config = small_config(clients=2, data={"dataset": "mnist", "root": str(missing_root),
                                           "partition": {"scheme": "iid"}},
                          evaluate={"finetune_epochs": [1], "global_test": False},
                          server={"join_timeout": 8, "round_timeout": 30, "heartbeat_timeout": 30})
    config_path = write_config(tmp_path / "config.yaml", config)
    server, reader, address = start_server(processes, config_path, tmp_path / "out")
    client = processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", "0-1"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = client.communicate(timeout=WAIT)[0]
    assert client.returncode == 2  # checked before loading anything: the data root does not fit the run
    expected = str(missing_root / "MNIST" / "raw" / "train-images-idx3-ubyte.gz")
    assert expected in log
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 4  # gave up waiting for its clients
    assert "left: ConfigError: data.root: dataset file" in output and expected in output
