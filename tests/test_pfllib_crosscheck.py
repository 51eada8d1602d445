"""benchmarks/pfllib_crosscheck.py's pure parts, without a PFLlib checkout: the partition written
into PFLlib's data layout, the state-dict mapping between cnn2 and PFLlib's FedAvgCNN (a module of
the same shape defined here), and the replay of fedpart's sampled clients."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import REPO, load_script
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.models.zoo import build_model

crosscheck = load_script(REPO / "benchmarks" / "pfllib_crosscheck.py")


class FedAvgCNNShaped(nn.Module):
    """The layout of PFLlib's ``FedAvgCNN`` (McMahan et al. 2017's MNIST CNN) for 1x28x28 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(1024, 512), nn.ReLU())
        self.fc = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1)))


class BaseHeadSplitShaped(nn.Module):
    """PFLlib's ``BaseHeadSplit``: ``base`` (the CNN with ``fc`` = Identity), then ``head``."""

    def __init__(self, model: FedAvgCNNShaped) -> None:
        super().__init__()
        self.head = copy.deepcopy(model.fc)
        model.fc = nn.Identity()
        self.base = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x))


def test_cnn2_state_loads_into_fedavgcnn_and_computes_the_same_function():
    cnn2 = build_model("cnn2", num_classes=10, input_shape=(1, 28, 28), seed=3)
    pfllib = BaseHeadSplitShaped(FedAvgCNNShaped())
    pfllib.load_state_dict(crosscheck.to_pfllib_state(cnn2.state_dict()))  # strict: every key maps
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(cnn2.eval()(x), pfllib.eval()(x))
    back = crosscheck.to_fedpart_state(pfllib.state_dict())
    assert back.keys() == cnn2.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in cnn2.state_dict().items())


def test_an_unmapped_key_is_refused():
    with pytest.raises(KeyError, match="conv3"):
        crosscheck.to_pfllib_state({"body.conv3.0.weight": torch.zeros(1)})


def _digits_config() -> object:
    return config_from_dict({
        "seed": 5, "seeds": {"partition": 2}, "clients": 5,
        "data": {"dataset": "digits", "partition": {"scheme": "shards", "shards_per_client": 2}},
        "model": {"name": "mlp"},
    })


def test_partition_export_holds_each_clients_exact_model_inputs(tmp_path: Path):
    config = _digits_config()
    clients = crosscheck.client_arrays(config)
    dataset = load_dataset("digits", None)
    splits = make_partition(dataset.y_train, dataset.y_test, 5, "shards", 2, num_classes=10, shards_per_client=2)
    crosscheck.write_pfllib_dataset(clients, tmp_path / "dataset" / "d")
    assert sorted(p.name for p in (tmp_path / "dataset" / "d" / "train").iterdir()) == [f"{i}.npz" for i in range(5)]
    for client_id, split in enumerate(splits):
        for name, indices, x_all, y_all in (("train", split.train, dataset.x_train, dataset.y_train),
                                            ("test", split.test, dataset.x_test, dataset.y_test)):
            x, y = crosscheck.read_pfllib_dataset(tmp_path / "dataset" / "d", client_id, name)
            assert x.dtype == np.float32 and y.dtype == np.int64
            np.testing.assert_array_equal(x, dataset.features(x_all[indices]).numpy())
            np.testing.assert_array_equal(y, y_all[indices])


def _write_metrics(run_dir: Path, rounds: list[tuple[list[int], list[int]]]) -> None:
    run_dir.mkdir()
    lines = [json.dumps({"round": i + 1, "sampled": s, "completed": c}) for i, (s, c) in enumerate(rounds)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_schedule_is_read_per_round_and_a_round_that_lost_clients_is_refused(tmp_path: Path):
    _write_metrics(tmp_path / "ok", [([3, 1], [1, 3]), ([0, 2], [2, 0])])
    assert crosscheck.read_schedule(tmp_path / "ok") == [[3, 1], [0, 2]]
    _write_metrics(tmp_path / "lost", [([3, 1], [3])])
    with pytest.raises(ValueError, match="round 1 folded"):
        crosscheck.read_schedule(tmp_path / "lost")


class RecordingClient:
    def __init__(self, client_id: int, log: list[str]) -> None:
        self.id = client_id
        self.log = log

    def train(self) -> None:
        self.log.append(f"train {self.id}")


class RecordingServer:
    """The methods of a PFLlib server that a replayed round calls, recording the calls."""

    def __init__(self, clients: int) -> None:
        self.log: list[str] = []
        self.clients = [RecordingClient(i, self.log) for i in range(clients)]
        self.selected_clients: list[RecordingClient] = []
        self.current_num_join_clients = 0

    def select_clients(self) -> list[RecordingClient]:
        raise AssertionError("a replay never draws clients itself")

    def send_models(self) -> None:
        self.log.append("send")

    def receive_models(self) -> None:
        self.log.append(f"receive {[c.id for c in self.selected_clients]} of {self.current_num_join_clients}")

    def aggregate_parameters(self) -> None:
        self.log.append("aggregate")


def test_replay_trains_exactly_the_scheduled_clients_each_round():
    server = RecordingServer(5)
    crosscheck.replay(server, [[4, 0], [2, 3, 1]])
    assert server.log == ["send", "train 4", "train 0", "receive [4, 0] of 2", "aggregate",
                          "send", "train 2", "train 3", "train 1", "receive [2, 3, 1] of 3", "aggregate"]


def test_table_rows_give_the_difference_and_the_largest_client_gap():
    fedpart = {"global": 0.80, "initial": {"mean": 0.78}, "initial_per_client": [0.7, 0.9]}
    pfllib = {"global": 0.81, "initial": {"mean": 0.76}, "initial_per_client": [0.75, 0.8]}
    rows = crosscheck.rows_of("fedavg", 1, fedpart, pfllib)
    assert [r.measure for r in rows] == ["global model, MNIST test set", "clients' models, own test splits (mean)"]
    assert rows[0].difference == pytest.approx(0.01)
    assert rows[1].largest_client_difference == pytest.approx(0.1)
    rendered = crosscheck.table(rows)
    assert "| fedavg (FedAvg) | 1 | global model, MNIST test set | 80.00 | 81.00 | +1.00 | - |" in rendered
    assert "- fedavg: " in rendered
