"""A client process's own data: the partitions of the clients it hosts, as in-memory tensors.

The process reads the dataset from its local data root, recomputes the (seeded) partition from the
settings the server sent, and keeps only its clients' slices, on the training device. Batches are
index slices of these tensors: no per-sample Python loader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedpart.common.config.run_config import RunConfig
from fedpart.common.data.datasets import load_dataset
from fedpart.common.config.experiment import dataset_dims
from fedpart.common.data.partition import make_partition


@dataclass
class ClientData:
    """One client's train and test split."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def train_size(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def test_size(self) -> int:
        return int(self.x_test.shape[0])


def load_client_data(config: RunConfig, client_ids: list[int], data_root: str | None,
                     device: torch.device) -> dict[int, ClientData]:
    """The hosted clients' splits, checked against the model dims the server uses."""
    data = config.data
    dataset = load_dataset(data.dataset, data_root if data_root is not None else data.root, **data.options)
    input_shape, num_classes = dataset_dims(config)
    if tuple(dataset.input_shape) != tuple(input_shape) or dataset.num_classes != num_classes:
        raise ValueError(f"dataset {data.dataset!r} has samples {dataset.input_shape} and {dataset.num_classes} "
                         f"classes, the run expects {tuple(input_shape)} and {num_classes}")
    splits = make_partition(dataset.y_train, dataset.y_test, config.clients, data.partition.scheme, config.partition_seed,
                            num_classes=dataset.num_classes, **data.partition.options)
    out = {}
    for client in client_ids:
        split = splits[client]
        out[client] = ClientData(
            x_train=dataset.features(dataset.x_train[split.train]).to(device),
            y_train=dataset.targets(dataset.y_train[split.train]).to(device),
            x_test=dataset.features(dataset.x_test[split.test]).to(device),
            y_test=dataset.targets(dataset.y_test[split.test]).to(device),
        )
    return out
