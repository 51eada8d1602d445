"""Run configuration: defaults, bundled configs, strict validation naming the key, overrides."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fedpart.common.config.run_config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_override,
)

REPO = Path(__file__).parents[1]
BUNDLED = sorted((REPO / "configs").glob("*.yaml"))


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_load():
    config = load_config(None)
    assert isinstance(config, RunConfig)
    assert config == RunConfig()
    assert config.algorithm.name == "fedavg" and config.algorithm.options == {}
    assert config.model.name == "mlp"
    assert config.data.dataset == "digits" and config.data.root is None
    assert isinstance(config.data.partition.scheme, str) and isinstance(config.data.partition.options, dict)
    assert config.train.lr == 0.01 and isinstance(config.train.lr, float)
    assert config.sampling.probability is None
    # The resolved config is what the server sends to clients: it must be JSON.
    assert json.loads(config.to_json())["train"]["batch_size"] == config.train.batch_size


def test_default_options_are_not_shared_between_instances():
    a, b = RunConfig(), RunConfig()
    a.data.partition.options["mutated"] = 99
    a.model.options["mutated"] = 1
    a.train.lr_milestones.append(0.5)
    assert "mutated" not in b.data.partition.options
    assert "mutated" not in b.model.options
    assert b.train.lr_milestones == []


def test_bundled_configs_exist():
    names = {p.name for p in BUNDLED}
    assert {"quickstart.yaml", "mnist_cnn2.yaml"} <= names


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_bundled_config_loads(path, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(path)
    assert config.name and config.rounds >= 1
    if config.data.root is not None:
        assert Path(config.data.root).is_absolute()
    # Round-trips through its own JSON form.
    assert config_from_dict(json.loads(config.to_json())) == config


def test_quickstart_values():
    config = load_config(REPO / "configs" / "quickstart.yaml")
    assert config.algorithm.name == "fedbabu"
    assert config.train.lr_milestones == [0.5, 0.75]
    assert config.data.partition.options == {"shards_per_client": 2}
    assert config.evaluate.finetune_epochs == [1, 5]


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match="'roundz'"):
        load_config(_write(tmp_path, "roundz: 3\n"))


def test_unknown_key_inside_train(tmp_path):
    with pytest.raises(ConfigError, match=r"'train\.learning_rate'"):
        load_config(_write(tmp_path, "train:\n  learning_rate: 0.1\n"))


def test_unknown_key_inside_data_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"'data\.datasett'"):
        load_config(_write(tmp_path, "data:\n  datasett: mnist\n"))


@pytest.mark.parametrize("text, key", [
    ("rounds: '10'\n", "rounds"),                              # string for an int
    ("rounds: 10.0\n", "rounds"),                              # float for an int
    ("rounds: true\n", "rounds"),                              # bool for an int
    ("train:\n  lr: true\n", "train.lr"),                      # bool for a number
    ("train:\n  lr: fast\n", "train.lr"),                      # string for a number
    ("train:\n  batch_size: 'ten'\n", "train.batch_size"),
    ("evaluate:\n  headless: 1\n", "evaluate.headless"),       # int for a bool
    ("train:\n  lr_milestones: 0.5\n", "train.lr_milestones"),  # scalar for a list
    ("train:\n  lr_milestones: [0.5, yes]\n", "train.lr_milestones[1]"),
    ("sampling:\n  probability: false\n", "sampling.probability"),
    ("name: 5\n", "name"),
    ("train: 5\n", "train"),
])
def test_wrong_type_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert key in str(info.value)


def test_partition_options_are_checked():
    with pytest.raises(ConfigError, match=r"data\.partition"):
        config_from_dict({"data": {"partition": {"scheme": "dirichlet", "alpah": 0.1}}})
    with pytest.raises(ConfigError, match=r"data\.partition"):
        config_from_dict({"data": {"partition": {"scheme": "shards"}}})  # shards_per_client missing
    with pytest.raises(ConfigError, match=r"data\.partition"):
        config_from_dict({"data": {"partition": {"scheme": "stripes"}}})


def test_dataset_options_are_checked():
    with pytest.raises(ConfigError, match=r"data\.options.*train_samples.*positive integer"):
        config_from_dict({"data": {"dataset": "mnist", "options": {"train_samples": 0}}})
    with pytest.raises(ConfigError, match=r"data\.options\.test_samples: expected an integer"):
        config_from_dict({"data": {"dataset": "digits", "options": {"test_samples": True}}})
    with pytest.raises(ConfigError, match=r"data\.options.*normalize"):
        config_from_dict({"data": {"dataset": "digits", "options": {"normalize": True}}})
    with pytest.raises(ConfigError, match=r"data\.options.*colour"):
        config_from_dict({"data": {"dataset": "cifar10", "options": {"colour": True}}})
    config = config_from_dict({"data": {"dataset": "mnist", "options": {"train_samples": 3000, "normalize": True}}})
    assert config.data.options == {"train_samples": 3000, "normalize": True}
    # a custom loader checks its own options
    assert config_from_dict({"data": {"dataset": "mypkg.data:load", "options": {"any": 1}}}).data.options == {"any": 1}


def test_unknown_dataset_is_rejected():
    with pytest.raises(ConfigError, match=r"data\.dataset"):
        config_from_dict({"data": {"dataset": "imagenet-9000"}})
    # A custom dataset is an import path, checked when it is loaded.
    assert config_from_dict({"data": {"dataset": "mypkg.data:load"}}).data.dataset == "mypkg.data:load"


def test_int_accepted_for_float():
    config = config_from_dict({"train": {"lr": 1}, "sampling": {"fraction": 1}})
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert isinstance(config.sampling.fraction, float)


@pytest.mark.parametrize("raw, fragment", [
    ({"rounds": 0}, "rounds"),
    ({"sampling": {"fraction": 0.0}}, "sampling.fraction"),
    ({"sampling": {"fraction": 1.5}}, "sampling.fraction"),
    ({"sampling": {"probability": 0.0}}, "sampling.probability"),
    ({"train": {"weighting": "median"}}, "train.weighting"),
    ({"train": {"lr_milestones": [0.5, 1.0]}}, "train.lr_milestones"),
    ({"evaluate": {"part": "neck"}}, "evaluate.part"),
    ({"server": {"chunk_bytes": 10}}, "server.chunk_bytes"),
    ({"server": {"result_chunk_bytes": 10}}, "server.result_chunk_bytes"),
    ({"server": {"chunk_bytes": (4 << 20) + 1}}, "server.chunk_bytes"),
    ({"server": {"result_chunk_bytes": 8 << 20}}, "server.result_chunk_bytes"),
    ({"server": {"waiting_upload_bytes": -1}}, "server.waiting_upload_bytes"),
])
def test_invalid_values(raw, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        config_from_dict(raw)


def test_load_config_with_overrides(tmp_path):
    path = _write(tmp_path, "algorithm:\n  name: fedbabu\ntrain:\n  lr: 0.1\n")
    config = load_config(path, ["train.lr=0.5", "algorithm.name=fedavg", "rounds=3",
                                "sampling.probability=0.1", "evaluate.finetune_epochs=[0, 2]"])
    assert config.train.lr == 0.5
    assert config.algorithm.name == "fedavg"
    assert config.rounds == 3
    assert config.sampling.probability == 0.1
    assert config.evaluate.finetune_epochs == [0, 2]


def test_override_creates_missing_sections():
    raw = apply_overrides({}, ["data.partition.scheme=dirichlet", "data.partition.alpha=0.1", "model.hidden=64"])
    assert raw == {"data": {"partition": {"scheme": "dirichlet", "alpha": 0.1}}, "model": {"hidden": 64}}
    config = config_from_dict(raw)
    assert config.data.partition.scheme == "dirichlet"
    assert config.data.partition.options == {"alpha": 0.1}
    assert config.model.options == {"hidden": 64}


def test_override_fills_an_empty_section(tmp_path):
    config = load_config(_write(tmp_path, "train:\nalgorithm:\n"), ["train.epochs=4", "algorithm.name=fedrep"])
    assert config.train.epochs == 4 and config.algorithm.name == "fedrep"


def test_override_values_are_yaml():
    assert parse_override("train.lr=0.25") == (["train", "lr"], 0.25)
    assert parse_override("a.b=null") == (["a", "b"], None)
    assert parse_override("a=x=y") == (["a"], "x=y")
    assert parse_override(" evaluate.headless = true") == (["evaluate", "headless"], True)


@pytest.mark.parametrize("text", ["train.lr", "=3", " =3", ""])
def test_malformed_override(text):
    with pytest.raises(ConfigError):
        apply_overrides({}, [text])
    with pytest.raises(ConfigError):
        load_config(None, [text])


def test_override_through_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="'rounds' is not a section"):
        apply_overrides({"rounds": 3}, ["rounds.x=1"])


def test_override_type_error_names_the_key():
    with pytest.raises(ConfigError, match=r"train\.epochs"):
        load_config(None, ["train.epochs=many"])
    with pytest.raises(ConfigError, match=r"'train\.nope'"):
        load_config(None, ["train.nope=1"])


def test_open_sections_collect_options(tmp_path):
    path = _write(tmp_path, """
model:
  name: resnet18
  units: block
algorithm:
  name: fedbug
  gu_ratio: 0.4
  mu: 0.01
data:
  partition:
    scheme: dirichlet
    alpha: 0.3
    min_size: 10
""")
    config = load_config(path)
    assert config.model.name == "resnet18" and config.model.options == {"units": "block"}
    assert config.algorithm.name == "fedbug" and config.algorithm.options == {"gu_ratio": 0.4, "mu": 0.01}
    assert config.data.partition.scheme == "dirichlet"
    assert config.data.partition.options == {"alpha": 0.3, "min_size": 10}


def test_explicit_options_merge_with_extra_keys():
    config = config_from_dict({"algorithm": {"name": "fedrep", "options": {"head_epochs": 2}, "body_epochs": 3}})
    assert config.algorithm.options == {"head_epochs": 2, "body_epochs": 3}


def test_relative_data_root_resolves_against_cwd(tmp_path, monkeypatch):
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    path = _write(config_dir, "data:\n  dataset: mnist\n  root: ../data\n")
    monkeypatch.chdir(work)
    config = load_config(path)
    assert config.data.root == str((tmp_path / "data").resolve())


def test_absolute_data_root_is_kept(tmp_path):
    root = (tmp_path / "abs").resolve()
    config = load_config(_write(tmp_path, f"data:\n  root: {root}\n"))
    assert config.data.root == str(root)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(_write(tmp_path, "train: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))


def test_empty_file_is_the_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == RunConfig()


@pytest.mark.parametrize("text", ["data: [1, 2]\n", "data: mnist\n"])
def test_non_mapping_data_section_is_a_config_error(tmp_path, text):
    with pytest.raises(ConfigError, match="data"):
        load_config(_write(tmp_path, text))


def test_non_mapping_data_section_via_dict_is_a_config_error():
    with pytest.raises(ConfigError, match="data"):
        config_from_dict({"data": [1, 2]})


def test_scientific_notation_is_a_number(tmp_path):
    config = load_config(_write(tmp_path, "train:\n  lr: 1e-3\n  weight_decay: 5e-4\n"), ["evaluate.lr=1e-4"])
    assert config.train.lr == 1e-3
    assert config.train.weight_decay == 5e-4
    assert config.evaluate.lr == 1e-4


def test_scientific_notation_with_dot_is_a_number(tmp_path):
    config = load_config(_write(tmp_path, "train:\n  lr: 1.0e-3\n"))
    assert config.train.lr == 1e-3


# ------------------------------------------------------------- components checked at config time


def test_an_unknown_algorithm_is_refused_with_the_known_names():
    from fedpart.common.components.registry import ALGORITHMS

    known = ", ".join(ALGORITHMS.selectable())
    with pytest.raises(ConfigError) as error:
        config_from_dict({"algorithm": {"name": "fedsgd"}})
    assert str(error.value) == f"algorithm.name: unknown algorithm 'fedsgd'; known: {known}, or a " \
                               "'package.module:name' path"
    with pytest.raises(ConfigError) as error:  # a path names a plug-in's Component, imported
        config_from_dict({"algorithm": {"name": "no_such_package.algorithms:mine"}})
    assert str(error.value).startswith("algorithm.name 'no_such_package.algorithms:mine': cannot import "
                                       "'no_such_package.algorithms'")
    assert config_from_dict({"algorithm": {"name": "fedbabu"}}).algorithm.name == "fedbabu"


NORM_OPTIMIZER = '''
from fedpart.api import SERVER_OPTIMIZERS, RoundDelta, ServerOptimizer, apply_deltas


class NormScaled(ServerOptimizer):
    """Steps by the mean over the root of the results' second moment."""

    name = "norm_scaled"
    needs_result_norms = True

    def step(self, global_state, delta: RoundDelta):
        return apply_deltas(global_state, delta.mean, 1.0 / max(delta.second_moment, 1e-12) ** 0.5)


norm_scaled = SERVER_OPTIMIZERS.component("norm_scaled", "Steps scaled by the results' norms.", NormScaled)
'''


def test_a_server_optimizer_that_needs_result_norms_is_refused_by_secure_aggregation_and_dp(tmp_path, monkeypatch):
    """Not only fedexp by name: any server optimizer whose builder declares needs_result_norms,
    a plug-in's included; one that does not (plugin_optimizer:signed) is accepted."""
    from conftest import FIXTURES, small_config

    (tmp_path / "norm_optimizer_plugin.py").write_text(NORM_OPTIMIZER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(FIXTURES))
    uniform = {**small_config()["train"], "weighting": "uniform"}
    for name in ("norm_optimizer_plugin:norm_scaled", "fedexp"):
        with pytest.raises(ConfigError) as error:
            config_from_dict(small_config(privacy={"secure_aggregation": True}, server_optimizer={"name": name}))
        assert str(error.value) == (f"privacy.secure_aggregation: server_optimizer {name} needs each result's "
                                    "delta norm, which the server cannot see")
        with pytest.raises(ConfigError) as error:
            config_from_dict(small_config(train=uniform, privacy={"dp": {"enabled": True}},
                                          server_optimizer={"name": name}))
        assert str(error.value).startswith(f"privacy.dp: server_optimizer {name} sets its step from each "
                                           "result's delta norm, which is not noised")
    signed = {"name": "plugin_optimizer:signed"}
    config_from_dict(small_config(privacy={"secure_aggregation": True}, server_optimizer=signed))
    config_from_dict(small_config(train=uniform, privacy={"dp": {"enabled": True}}, server_optimizer=signed))


CAPABLE_PLUGINS = '''
from fedpart.api import CODECS, ROBUST_AGGREGATORS
from fedpart.server.policy.aggregation import WeightedMean


class Exact:
    name, sparse, error_feedback, lossless, wire_args = "exact_copy", False, False, True, ()


class Remembering:
    name, sparse, error_feedback, wire_args = "remembering", False, True, ()


exact = CODECS.component("exact_copy", "Every element exactly.", Exact)
remembering = CODECS.component("remembering", "Keeps what it did not send.", Remembering)
summed = ROBUST_AGGREGATORS.component("summed_mean", "The weighted mean, declared linear.", WeightedMean,
                                      capabilities=("linear",))
undeclared = ROBUST_AGGREGATORS.component("undeclared_mean", "The weighted mean, not declared linear.", WeightedMean)
'''


def test_privacy_refusals_ask_capabilities_not_names(tmp_path, monkeypatch):
    """Secure aggregation and DP accept a plug-in aggregator that declares it is linear (a sum)
    and refuse one that does not, whatever its name; secure aggregation accepts an upload codec
    that declares it is lossless; DP refuses one with error feedback."""
    from conftest import small_config

    (tmp_path / "capable_plugins.py").write_text(CAPABLE_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    secure = {"secure_aggregation": True}
    private = {"dp": {"enabled": True}}
    uniform = {**small_config()["train"], "weighting": "uniform"}
    for privacy in (secure, private):
        config_from_dict(small_config(train=uniform, privacy=privacy, robust={"aggregator": "capable_plugins:summed"}))
        with pytest.raises(ConfigError, match="robust.aggregator 'capable_plugins:undeclared' (needs|is not a sum)"):
            config_from_dict(small_config(train=uniform, privacy=privacy,
                                          robust={"aggregator": "capable_plugins:undeclared"}))
        config_from_dict(small_config(train=uniform, privacy=privacy,
                                      compression={"up": {"codec": "capable_plugins:exact"}}))
    with pytest.raises(ConfigError, match="compression.up 'capable_plugins:remembering': the masked update"):
        config_from_dict(small_config(privacy=secure, compression={"up": {"codec": "capable_plugins:remembering"}}))
    with pytest.raises(ConfigError, match="compression.up capable_plugins:remembering with error feedback"):
        config_from_dict(small_config(train=uniform, privacy=private,
                                      compression={"up": {"codec": "capable_plugins:remembering"}}))


def test_each_feature_check_lives_in_its_module_and_is_asked_only_when_on(monkeypatch):
    """Every registered feature check names its key, finds nothing wrong with the defaults, is
    asked for its refusals only where its feature is on, and its first refusal is the error,
    prefixed by its key: a new feature's check is its module and its name in FEATURE_CHECKS."""
    from conftest import small_config

    from fedpart.common.config import run_config as config_module

    assert {feature.KEY for feature in config_module.FEATURE_CHECKS} == {
        "privacy.dp", "privacy.dp_sgd", "privacy.secure_aggregation"}
    defaults = config_from_dict(small_config())
    for feature in config_module.FEATURE_CHECKS:
        assert not feature.enabled(defaults) and feature.value_errors(defaults) == []

    asked = []

    class Refusing:
        KEY = "privacy.example"

        @staticmethod
        def enabled(config) -> bool:
            return config.rounds > 1

        @staticmethod
        def value_errors(config) -> list[str]:
            return []

        @staticmethod
        def refusals(config, algorithm, server_parts: bool = True) -> list[str]:
            assert algorithm.name == config.algorithm.name
            asked.append(server_parts)
            return ["train.epochs 2 is refused", "a second reason"]

    monkeypatch.setattr(config_module, "FEATURE_CHECKS", (*config_module.FEATURE_CHECKS, Refusing))
    config_from_dict(small_config(rounds=1))
    assert asked == []
    with pytest.raises(ConfigError, match=r"^privacy\.example: train\.epochs 2 is refused$"):
        config_from_dict(small_config(rounds=2), server_parts=False)
    assert asked == [False]


def test_clients_are_not_sent_the_dp_noise_seed():
    """Whoever knows the seed of the server's noise can take it out of the model again."""
    from conftest import small_config

    config = config_from_dict(small_config(train={**small_config()["train"], "weighting": "uniform"},
                                           privacy={"dp": {"enabled": True, "noise_seed": 7}}))
    sent = config_from_dict(config.for_clients().to_dict(), server_parts=False)
    assert config.privacy.dp.noise_seed == 7 and sent.privacy.dp.noise_seed is None
    assert sent.privacy.dp == dataclasses.replace(config.privacy.dp, noise_seed=None)
