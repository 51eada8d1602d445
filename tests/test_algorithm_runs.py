"""Every algorithm end to end in real server and client processes, with its byte pattern.

The model is digits' ``mlp`` (body units ``fc1``, ``fc2``; head). Two client processes host four
clients; every client takes part in every round, so per-round byte counts are exact multiples of
the tensor sizes below plus framing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
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

HIDDEN = 32
SIZES = {"fc1": (64 * HIDDEN + HIDDEN) * 4, "fc2": (HIDDEN * HIDDEN + HIDDEN) * 4, "head": (HIDDEN * 10 + 10) * 4}
PROCESSES = 2
CLIENTS = 4
FRAMING = 64  # generous bound of piece framing per tensor and message
WEIGHT = {"fc1": "body.fc1.1.weight", "fc2": "body.fc2.0.weight"}  # mlp state-dict names


def _run(tmp_path: Path, algorithm: dict, rounds: int = 3, **overrides):
    config = small_config(algorithm=algorithm, rounds=rounds, clients=CLIENTS, processes=PROCESSES, **overrides)
    tmp_path.mkdir(parents=True, exist_ok=True)
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(out), read_summary(out), out


@pytest.fixture(scope="module")
def fedavg_two_rounds(tmp_path_factory: pytest.TempPathFactory):
    """FedAvg for two rounds: the baseline that FedProx, FedBug and LG-FedAvg's warm start are
    held against (one run read by each, not one run each)."""
    return _run(tmp_path_factory.mktemp("fedavg"), {"name": "fedavg"}, rounds=2)


def _tensor_bytes(record: dict, part: str, direction: str) -> int:
    return record["bytes_by_part"][part][direction]


def _about(value: int, expected: int, pieces: int = 8) -> bool:
    return expected <= value <= expected + FRAMING * pieces


def test_fedprox_differs_from_fedavg_only_by_the_proximal_term(tmp_path: Path, fedavg_two_rounds) -> None:
    _, fedavg, fedavg_out = fedavg_two_rounds
    metrics, fedprox, out = _run(tmp_path / "b", {"name": "fedprox", "mu": 1.0}, rounds=2)
    assert all(_tensor_bytes(r, "head", "up") > 0 for r in metrics)
    a = load_tensors(fedavg_out / "checkpoints/round_0002.safetensors")
    b = load_tensors(out / "checkpoints/round_0002.safetensors")
    start = load_tensors(out / "checkpoints/round_0000.safetensors")
    distance = {k: float(torch.norm(v - start[k])) for k, v in b.items()}
    distance_avg = {k: float(torch.norm(v - start[k])) for k, v in a.items()}
    assert sum(distance.values()) < sum(distance_avg.values()), "the proximal term pulls towards the global model"
    assert "global" in fedprox["accuracy"]


def test_fedprox_babu_keeps_the_head_fixed(tmp_path: Path) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "fedprox_babu", "mu": 0.1}, rounds=2)
    first = load_tensors(out / "checkpoints/round_0000.safetensors")
    last = load_tensors(out / "checkpoints/round_0002.safetensors")
    assert torch.equal(first["head.weight"], last["head.weight"])
    assert all(_tensor_bytes(r, "head", "up") == 0 for r in metrics)
    assert summary["accuracy"]["global"]["acc"] > 0


def test_fedbug_unfreezes_bottom_up_and_saves_backward_compute(tmp_path: Path, fedavg_two_rounds) -> None:
    fedavg, _, _ = fedavg_two_rounds
    fedbug, summary, _ = _run(tmp_path / "b", {"name": "fedbug", "gu_ratio": 0.5}, rounds=2,
                              train={"epochs": 1, "batch_size": 20, "lr": 0.05},
                              server_optimizer={"lr": 1.5})
    for avg, bug in zip(fedavg, fedbug):
        assert bug["completed"] == avg["completed"] == [0, 1, 2, 3]
        assert _tensor_bytes(bug, "head", "up") == _tensor_bytes(avg, "head", "up"), "the whole model is uploaded"
        assert bug["train_flops"] < avg["train_flops"], "frozen units skip their backward during the GU stage"
        assert bug["trainable_parameters"] == avg["trainable_parameters"]
    assert summary["accuracy"]["initial"]["mean"] > 0


@pytest.mark.parametrize("order, first", [("vanilla", "fc1"), ("anti", "fc2")])
def test_layer_expansion_sends_only_unfrozen_units(tmp_path: Path, order: str, first: str) -> None:
    metrics, summary, out = _run(tmp_path, {"name": f"layer_expansion_{order}", "unfreeze_rounds": [0, 1]}, rounds=3)
    round1, round2, round3 = metrics
    up1 = _tensor_bytes(round1, "body", "up")
    assert _about(up1, CLIENTS * SIZES[first], pieces=CLIENTS * 2), "round 1 uploads only the first unit"
    assert _tensor_bytes(round1, "head", "up") == 0
    assert _about(_tensor_bytes(round2, "body", "up"), CLIENTS * (SIZES["fc1"] + SIZES["fc2"]), pieces=CLIENTS * 4)
    assert _about(_tensor_bytes(round2, "body", "down"), PROCESSES * SIZES[first], pieces=PROCESSES * 2), \
        "after round 1 only the unit that trained is re-sent"
    assert _about(_tensor_bytes(round3, "body", "down"), PROCESSES * (SIZES["fc1"] + SIZES["fc2"]), pieces=PROCESSES * 4)
    assert all(_tensor_bytes(r, "head", "down") == 0 for r in (round2, round3))
    first_state = load_tensors(out / "checkpoints/round_0000.safetensors")
    after1 = load_tensors(out / "checkpoints/round_0001.safetensors")
    other = "fc2" if first == "fc1" else "fc1"
    assert torch.equal(first_state[WEIGHT[other]], after1[WEIGHT[other]]), "a frozen unit stays unchanged"
    assert not torch.equal(first_state[WEIGHT[first]], after1[WEIGHT[first]])
    assert round1["trainable_parameters"] < round2["trainable_parameters"]
    assert summary["accuracy"]["personalized"]["2"]["mean"] > 0


@pytest.mark.parametrize("name, options", [("fedper", {}), ("fedrep", {"head_epochs": 2, "body_epochs": 1})])
def test_personal_heads_never_travel(tmp_path: Path, name: str, options: dict) -> None:
    metrics, summary, out = _run(tmp_path, {"name": name, **options})
    assert all(_tensor_bytes(r, "head", "up") == 0 for r in metrics)
    assert _about(_tensor_bytes(metrics[0], "head", "down"), PROCESSES * SIZES["head"], pieces=PROCESSES * 2), \
        "the head's initial value reaches each process once"
    assert all(_tensor_bytes(r, "head", "down") == 0 for r in metrics[1:])
    assert all(_tensor_bytes(r, "body", "up") > 0 for r in metrics)
    heads = [load_tensors(p)["head.weight"] for p in sorted(out.glob("state/process_*/*/client_*/personal.safetensors"))]
    assert len(heads) == CLIENTS
    assert not torch.equal(heads[0], heads[1]), "each client trained its own head"
    assert "global" not in summary["accuracy"], "no global head, no global accuracy"


def test_lg_fedavg_shares_only_heads(tmp_path: Path) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "lg_fedavg"})
    assert all(_tensor_bytes(r, "body", "up") == 0 for r in metrics)
    assert all(_tensor_bytes(r, "head", "up") > 0 for r in metrics)
    assert all(_tensor_bytes(r, "body", "down") == 0 for r in metrics[1:])
    assert all(_tensor_bytes(r, "head", "down") > 0 for r in metrics[1:])
    first = load_tensors(out / "checkpoints/round_0000.safetensors")
    last = load_tensors(out / "checkpoints/round_0003.safetensors")
    assert torch.equal(first[WEIGHT["fc1"]], last[WEIGHT["fc1"]]), "the server's body is never updated"
    assert not torch.equal(first["head.weight"], last["head.weight"])


def test_lg_fedavg_warm_starts_from_a_checkpoint(tmp_path: Path, fedavg_two_rounds) -> None:
    _, _, fedavg_out = fedavg_two_rounds
    checkpoint = fedavg_out / "checkpoints/round_0002.safetensors"
    _, _, out = _run(tmp_path / "lg", {"name": "lg_fedavg"}, rounds=1,
                     model={"name": "mlp", "hidden": HIDDEN, "init_checkpoint": str(checkpoint)})
    start = load_tensors(out / "checkpoints/round_0000.safetensors")
    warm = load_tensors(checkpoint)
    assert all(torch.equal(start[k], warm[k]) for k in warm)


def test_fedftha_collects_heads_into_a_global_head(tmp_path: Path) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "fedftha", "tau_sync": 1, "tau_head": 1},
                                 train={"epochs": 1, "batch_size": 20, "lr": 0.05, "weighting": "uniform"})
    for record in metrics:
        assert _about(_tensor_bytes(record, "head", "up"), CLIENTS * SIZES["head"], pieces=CLIENTS * 2), \
            "every client uploads its whole head"
        assert _tensor_bytes(record, "body", "up") > 0
    assert all(_tensor_bytes(r, "head", "down") == 0 for r in metrics[1:]), "personal heads are not re-sent"
    first = load_tensors(out / "checkpoints/round_0000.safetensors")
    last = load_tensors(out / "checkpoints/round_0003.safetensors")
    assert not torch.equal(first["head.weight"], last["head.weight"]), "the global head is the dictionary mean"
    assert 0 < summary["accuracy"]["global"]["acc"] <= 1
    heads = [load_tensors(p)["head.weight"] for p in sorted(out.glob("state/process_*/*/client_*/personal.safetensors"))]
    mean = torch.stack(heads).mean(dim=0)
    assert torch.allclose(mean, last["head.weight"], atol=1e-5), "uniform weighting: the global head is the plain mean"


def test_independent_participation_probability(tmp_path: Path) -> None:
    """FedBug's setting: each client joins a round independently; nobody-picked rounds redraw."""
    metrics, _, _ = _run(tmp_path, {"name": "fedbug", "gu_ratio": 0.2}, rounds=4,
                         sampling={"probability": 0.3})
    assert all(r["sampled"] and r["completed"] == r["sampled"] for r in metrics)
    assert len({tuple(r["sampled"]) for r in metrics}) > 1


def test_local_only_sends_nothing_after_the_start(tmp_path: Path) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "local_only"},
                                 train={"epochs": 3, "batch_size": 20, "lr": 0.1, "momentum": 0.9})
    for record in metrics:
        assert _tensor_bytes(record, "body", "up") == _tensor_bytes(record, "head", "up") == 0
    for record in metrics[1:]:
        assert _tensor_bytes(record, "body", "down") == _tensor_bytes(record, "head", "down") == 0
    assert summary["accuracy"]["initial"]["mean"] > 0.5, "local models learned"
    assert "global" not in summary["accuracy"]


def test_custom_regression_model_dataset_and_loss(tmp_path: Path) -> None:
    for name in ("fedavg", "fedbug"):
        config = small_config(
            algorithm={"name": name}, rounds=2, clients=3,
            data={"dataset": "custom_components:regression_dataset", "input_shape": [8], "num_classes": 0,
                  "partition": {"scheme": "iid"}},
            model={"name": "custom_components:regression_model"},
            train={"epochs": 2, "batch_size": 10, "lr": 0.05, "loss": "custom_components:squeezed_mse"},
            evaluate={"finetune_epochs": [1], "batch_size": 10},
        )
        result, out = run_fedpart(config, tmp_path, name=name)
        assert result.returncode == 0, result.stdout + result.stderr
        summary = read_summary(out)
        assert summary["accuracy"]["metric"] == "loss"
        assert summary["accuracy"]["initial"]["mean"] > 0
        assert summary["accuracy"]["global"] == {"loss": pytest.approx(summary["accuracy"]["global"]["loss"])}
        assert all("acc" not in k for k in summary["accuracy"]["global"])
        losses = [r["train_loss"] for r in read_metrics(out)]
        assert losses[-1] < losses[0]


def test_personal_parts_survive_a_client_process_restart(tmp_path: Path, processes) -> None:
    """FedPer's heads live in the state dir: a killed and restarted process continues with them."""
    config = small_config(algorithm={"name": "fedper"}, rounds=3, clients=2,
                          server={"round_timeout": 120, "join_timeout": 120, "heartbeat_timeout": 30})
    config_path = write_config(tmp_path / "config.yaml", config)
    out = tmp_path / "out"
    server, reader, address = start_server(processes, config_path, out)
    client_args = fedpart_command("client", "--insecure", "--server", address, "--clients", "0-1",
                                  "--state-dir", str(tmp_path / "state"), "--threads", "1")
    first = processes.start(client_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reader.wait_for(r"round\s+1/3", timeout=WAIT)
    first.kill()
    first.wait(timeout=WAIT)
    second = processes.start(client_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 0 or "its process restarted" in output, output
    log = second.communicate(timeout=WAIT)[0]
    assert second.returncode == 0, log
    assert "restored personal parts of clients [0, 1]" in log
    assert re.search(r"took over client ids 0-1 from \S+ at \S+, whose connection had closed", output), output
    metrics = read_metrics(out)
    assert all(_tensor_bytes(r, "head", "down") == 0 for r in metrics[1:]), "heads came from disk, not the server"
    assert len(read_summary(out)["per_client"]) == 2
