"""The public plugin surface: an external package written against ``fedpart.api`` (a dataset, a
model and a loss) runs through ``fedpart run``; the old ``fedpart.common.dataset_types`` path
still imports, with a deprecation warning that names ``fedpart.api``."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fedpart.api
from conftest import FIXTURES, WAIT, child_env, read_summary, run_fedpart, small_config
from fedpart.cli.export import MANIFEST
from fedpart.common.process.checkpoint import load_tensors
from fedpart.common.config.run_config import ConfigError, config_from_dict

FEATURES, CLASSES, HIDDEN = 6, 3, 12

PLUGIN_DATA = '''
"""Three Gaussian blobs in six dimensions, seeded."""

import numpy as np

from fedpart.api import ArrayDataset


def blobs(root=None, samples_per_class=60, features=6, classes=3):
    rng = np.random.default_rng(5)
    centres = rng.normal(scale=3.0, size=(classes, features))
    labels = np.repeat(np.arange(classes), samples_per_class)
    x = (centres[labels] + rng.normal(size=(labels.size, features))).astype(np.float32)
    order = rng.permutation(labels.size)
    x, labels = x[order], labels[order].astype(np.int64)
    cut = labels.size * 3 // 4
    return ArrayDataset("blobs", x[:cut], labels[:cut], x[cut:], labels[cut:], num_classes=classes)
'''

PLUGIN_MODELS = '''
"""One hidden layer as the body, a linear head."""

from collections import OrderedDict

from torch import nn

from fedpart.api import SplitModel


def tiny(num_classes, input_shape, hidden=8):
    (features,) = input_shape
    body = OrderedDict(fc1=nn.Sequential(nn.Linear(features, hidden), nn.ReLU()))
    return SplitModel(body, nn.Linear(hidden, num_classes))
'''

PLUGIN_LOSSES = '''
"""Cross-entropy with label smoothing; each process that builds it leaves a mark."""

import os
from pathlib import Path

from torch import nn


def smoothed():
    Path(os.environ["PLUGIN_MARKS"], f"loss_built_by_{os.getpid()}").touch()
    return nn.CrossEntropyLoss(label_smoothing=0.1)
'''


def write_plugin_package(root: Path) -> Path:
    """The package ``myplugins`` (data, models, losses) under ``root``; returns ``root``."""
    package = root / "myplugins"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, source in (("data", PLUGIN_DATA), ("models", PLUGIN_MODELS), ("losses", PLUGIN_LOSSES)):
        (package / f"{name}.py").write_text(textwrap.dedent(source))
    return root


def test_an_external_plugin_package_runs_through_fedpart_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = write_plugin_package(tmp_path / "site")
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    monkeypatch.setenv("PLUGIN_MARKS", str(marks))
    config = small_config(
        rounds=2,
        data={"dataset": "myplugins.data:blobs", "input_shape": [FEATURES], "num_classes": CLASSES,
              "options": {"samples_per_class": 60}, "partition": {"scheme": "iid"}},
        model={"name": "myplugins.models:tiny", "hidden": HIDDEN},
        train={"epochs": 1, "batch_size": 20, "lr": 0.1, "momentum": 0.5, "loss": "myplugins.losses:smoothed"},
    )
    completed, out = run_fedpart(config, tmp_path)
    assert completed.returncode == 0, completed.stderr
    summary = read_summary(out)
    body, head = FEATURES * HIDDEN + HIDDEN, HIDDEN * CLASSES + CLASSES
    assert summary["parameters"] == {"total": body + head, "body": body, "head": head}
    assert summary["dataset"] == "myplugins.data:blobs" and summary["status"] == "completed"
    samples = CLASSES * 60  # the loader's samples_per_class option reached it: a quarter of them are test samples
    assert sum(entry["test_samples"] for entry in summary["per_client"]) == samples - samples * 3 // 4
    client_processes = config["processes"]
    assert len(list(marks.iterdir())) >= client_processes  # every client process trained with the plugin loss

    exported = tmp_path / "exported"  # and the exported model comes back through the plugin's import path
    completed = subprocess.run([sys.executable, "-m", "fedpart", "export", str(out), "--out", str(exported)],
                               capture_output=True, text=True, timeout=WAIT, env=child_env())
    assert completed.returncode == 0, completed.stderr
    first = json.loads((exported / MANIFEST).read_text())["clients"][0]["file"]
    loading = ("import sys; from fedpart.api import load_model; "
               "print(sum(p.numel() for p in load_model(sys.argv[1]).parameters()))")
    loaded = subprocess.run([sys.executable, "-c", loading, str(exported / first)], capture_output=True, text=True,
                            timeout=WAIT, env=child_env(), cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert int(loaded.stdout) == body + head


def test_a_plug_in_algorithm_with_a_schedule_parameter_of_its_own_runs_through_fedpart_run(tmp_path: Path) -> None:
    """tests/fixtures/plugin_algorithm.py, named by path: an algorithm and its schedule primitive in
    one file. Its ``head_share`` travels to the clients in the phases' ``params`` and its unit
    schedule reads it there: at 1 only the head trains, so the global body ends the run bit for
    bit where it started while the head moved (had the number not arrived, or the primitive not
    run, every unit would have trained)."""
    config = small_config(rounds=2, algorithm={"name": "plugin_algorithm:head_warmup", "head_share": 1.0})
    completed, out = run_fedpart(config, tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert read_summary(out)["status"] == "completed"
    start = load_tensors(out / "checkpoints/round_0000.safetensors")
    end = load_tensors(out / "checkpoints/round_0002.safetensors")
    body = [name for name in start if name.startswith("body.")]
    assert body and all(torch.equal(start[name], end[name]) for name in body)
    assert not torch.equal(start["head.weight"], end["head.weight"])


def test_a_plug_in_algorithm_is_checked_like_a_built_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its declared option is typed and checked by name when the config is validated, and the
    listing of fedpart's algorithms (``fedpart algorithms``) stays the built-in ones."""
    from fedpart.common.ml.algorithms import build_algorithm
    from fedpart.common.components.registry import ALGORITHMS

    monkeypatch.syspath_prepend(str(FIXTURES))
    path = "plugin_algorithm:head_warmup"
    config = config_from_dict(small_config(algorithm={"name": path, "head_share": 1}))
    assert config.algorithm.options == {"head_share": 1.0}
    with pytest.raises(ConfigError) as error:
        config_from_dict(small_config(algorithm={"name": path, "head_share": 2.0}))
    assert str(error.value) == "algorithm.head_share must be in [0, 1]"
    with pytest.raises(ConfigError, match="algorithm.warmup: not an option of algorithm 'plugin_algorithm:head_"):
        config_from_dict(small_config(algorithm={"name": path, "warmup": 1}))
    with pytest.raises(ConfigError, match="'plugin_codec:fixed_point' is not an algorithm"):
        config_from_dict(small_config(algorithm={"name": "plugin_codec:fixed_point"}))
    (phase,) = build_algorithm(path, {"head_share": 0.25}).schedule(fedpart.api.RoundContext(1, 2, ("fc1", "fc2"), 1))
    assert phase.params == {"head_share": 0.25}
    assert "head_warmup" not in ALGORITHMS.builtin()
    listed = subprocess.run([sys.executable, "-m", "fedpart", "algorithms"], capture_output=True, text=True,
                            timeout=WAIT, env=child_env(), check=True).stdout
    assert [line.split()[0] for line in listed.splitlines()] == list(ALGORITHMS.builtin())


def test_the_old_dataset_types_path_warns_and_gives_the_same_classes() -> None:
    old = importlib.import_module("fedpart.common.dataset_types")
    for name in ("ArrayDataset", "ClientSplit"):
        with pytest.warns(DeprecationWarning, match=rf"import {name} from fedpart\.api"):
            moved = getattr(old, name)
        assert moved is getattr(fedpart.api, name)
    with pytest.raises(AttributeError):
        old.load_dataset


def test_a_plugin_module_written_against_the_old_path_still_imports(tmp_path: Path) -> None:
    """``from fedpart.common.dataset_types import ArrayDataset`` in a plugin: it loads, and the
    warning points at the plugin's own line."""
    (tmp_path / "oldplugin.py").write_text(
        "from fedpart.common.dataset_types import ArrayDataset\n\n"
        "def digits_again(root=None):\n"
        "    from fedpart.api import load_dataset\n"
        "    d = load_dataset('digits', None)\n"
        "    return ArrayDataset('again', d.x_train, d.y_train, d.x_test, d.y_test, d.num_classes)\n")
    script = ("import warnings; warnings.simplefilter('always')\n"
              "from fedpart.api import load_dataset\n"
              "print(load_dataset('oldplugin:digits_again', None).num_classes)\n")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT,
                               cwd=tmp_path, env=dict(child_env(), PYTHONPATH=str(tmp_path)))
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "10"
    assert "oldplugin.py:1: DeprecationWarning" in completed.stderr
    assert "fedpart.api" in completed.stderr


def test_every_public_name_resolves() -> None:
    assert sorted(set(fedpart.api.__all__)) == sorted(fedpart.api.__all__)
    assert [name for name in fedpart.api.__all__ if not hasattr(fedpart.api, name)] == []


def test_every_registry_and_the_aggregator_protocol_are_exported_and_documented() -> None:
    """fedpart.api exports every kind's registry and names each in its docstring, and exports the
    Aggregator protocol a robust aggregator implements."""
    from fedpart.common.components.registry import KINDS, Registry
    from fedpart.server.policy.aggregation import Aggregator

    exported = {name: getattr(fedpart.api, name) for name in fedpart.api.__all__}
    registries = {name for name, value in exported.items() if isinstance(value, Registry)} - {"OPTIMIZERS"}
    assert {exported[name].kind for name in registries} == set(KINDS)
    assert registries == {"ALGORITHMS", "TERMS", "STEP_RULES", "CODECS", "SERVER_OPTIMIZERS", "ROBUST_AGGREGATORS",
                          "PARTITIONS", "MODELS", "DATASETS"}
    for name in registries:
        assert f":data:`{name}`" in fedpart.api.__doc__, name
    assert exported["Aggregator"] is Aggregator
    assert ":class:`Aggregator`" in fedpart.api.__doc__
