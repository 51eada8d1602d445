"""Separate seeds for the partition, the initial model, the client sampling and the training
randomness (issue 21): each ``seeds.*`` defaults to the run's ``seed``, and varying one leaves
the others' draws as they were."""

from __future__ import annotations

from pathlib import Path

import torch

from fedpart.common.config.run_config import RunConfig, SeedsConfig, load_config
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.config.experiment import build_run_model
from fedpart.server.engine.sampling import sample_clients

from conftest import read_metrics, read_summary, run_fedpart, small_config

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def _initial_weights(config: RunConfig) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_run_model(config).state_dict().items()}


def _partition(config: RunConfig) -> list[list[int]]:
    dataset = load_dataset(config.data.dataset, config.data.root, **config.data.options)
    splits = make_partition(dataset.y_train, dataset.y_test, config.clients, config.data.partition.scheme,
                            config.partition_seed, num_classes=dataset.num_classes, **config.data.partition.options)
    return [sorted(int(i) for i in split.train) for split in splits]


def test_every_source_defaults_to_the_run_seed():
    config = RunConfig(seed=7)
    assert config.resolved_seeds() == {"partition": 7, "init": 7, "sampling": 7, "training": 7}
    config = RunConfig(seed=7, seeds=SeedsConfig(sampling=3))
    assert config.resolved_seeds() == {"partition": 7, "init": 7, "sampling": 3, "training": 7}
    assert (config.partition_seed, config.init_seed, config.sampling_seed, config.training_seed) == (7, 7, 3, 7)


def test_init_seed_moves_the_initial_model_and_nothing_else():
    base = load_config(QUICKSTART, [])
    other_init = load_config(QUICKSTART, ["seeds.init=1"])
    other_sampling = load_config(QUICKSTART, ["seeds.sampling=1", "seeds.training=1"])
    weights = _initial_weights(base)
    assert any(not torch.equal(weights[k], v) for k, v in _initial_weights(other_init).items())
    assert all(torch.equal(weights[k], v) for k, v in _initial_weights(other_sampling).items())
    assert _partition(other_init) == _partition(base)


def test_partition_seed_moves_the_partition():
    base = load_config(QUICKSTART, [])
    assert _partition(load_config(QUICKSTART, ["seeds.partition=1"])) != _partition(base)
    assert _partition(load_config(QUICKSTART, ["seed=1", "seeds.partition=0"])) == _partition(base)


def test_a_run_samples_with_its_sampling_seed_and_records_every_seed(tmp_path):
    config = small_config(clients=6, rounds=3, sampling={"fraction": 0.5}, evaluate={"finetune_epochs": [1]})
    result, out = run_fedpart(config, tmp_path, "seeds.sampling=11")
    assert result.returncode == 0, result.stderr
    sampled = [record["sampled"] for record in read_metrics(out)]
    assert sampled == [sample_clients(6, r, 11, 0.5) for r in (1, 2, 3)]
    assert sampled != [sample_clients(6, r, 0, 0.5) for r in (1, 2, 3)]
    summary = read_summary(out)
    assert summary["seeds"] == {"partition": 0, "init": 0, "sampling": 11, "training": 0}
    loaded = load_config(out / "config.yaml", [])
    train_sizes = [client["train_samples"] for client in summary["per_client"]]
    assert train_sizes == [len(p) for p in _partition(loaded)]
