"""What the server and the clients derive identically from a run config, built once per process
as one value (:class:`Experiment`: the algorithm, the dataset's dims, the initial model) and
passed down; and the check of a whole run config before anything starts
(:func:`check_experiment`), which returns it."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from fedpart.common.components.importing import import_callable
from fedpart.common.config.run_config import ConfigError, RunConfig, check_dp_accounting
from fedpart.common.data.datasets import (
    class_counts,
    dataset_spec,
    missing_dataset_files,
)
from fedpart.common.data.partition import check_partition
from fedpart.common.ml.algorithms import (
    Algorithm,
    RoundContext,
    build_algorithm,
    has_global_model,
)
from fedpart.common.ml.split_model import HEAD, SplitModel
from fedpart.common.models.zoo import build_model
from fedpart.common.process.checkpoint import load_tensors

# The page that says where each dataset's files go and how to fetch them.
DATA_PAGE = "docs/data.md"


def dataset_dims(config: RunConfig) -> tuple[tuple[int, ...], int]:
    """Input shape and number of classes (0 = regression) of the configured dataset."""
    data = config.data
    if data.input_shape is not None and data.num_classes is not None:
        return tuple(data.input_shape), data.num_classes
    if ":" not in data.dataset:
        spec = dataset_spec(data.dataset)  # known without reading the data: the server never reads client data
        return spec.input_shape, spec.num_classes
    raise ValueError(f"data.dataset {data.dataset!r} is custom: set data.input_shape and data.num_classes")


def run_algorithm(config: RunConfig) -> Algorithm:
    """The run's algorithm: its declaration plus the objective terms of ``algorithm.objective``."""
    section = config.algorithm
    return build_algorithm(section.name, section.options, section.objective)


def build_run_model(config: RunConfig, algorithm: Algorithm | None = None) -> SplitModel:
    """The run's model, seeded from ``config.init_seed`` or loaded from ``model.init_checkpoint``, with
    the extra parts ``algorithm`` (the run's, where None) declares (added after the checkpoint, at
    their own start)."""
    input_shape, num_classes = dataset_dims(config)
    model = build_model(config.model.name, num_classes=num_classes, input_shape=input_shape,
                        seed=config.init_seed, **config.model.options)
    if config.model.init_checkpoint:
        state = load_tensors(config.model.init_checkpoint)
        missing = set(model.state_dict()) - set(state)
        unexpected = set(state) - set(model.state_dict())
        if missing or unexpected:
            raise ValueError(f"model.init_checkpoint {config.model.init_checkpoint}: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        model.load_state_dict(state)
    return (algorithm or run_algorithm(config)).add_parts(model)


@dataclass(frozen=True)
class Experiment:
    """What a run's config derives, built once per process (:func:`build_experiment`) and passed
    down, so that no part of the process builds the algorithm or the model again: the algorithm
    (its declaration and objective), the dataset's input shape and classes (0 = regression), and
    the initial model (seeded or loaded, with the algorithm's extra parts). Parts that change a
    model take their own copy (:meth:`new_model`)."""

    algorithm: Algorithm
    input_shape: tuple[int, ...]
    num_classes: int
    model: SplitModel

    @property
    def classification(self) -> bool:
        """Whether the task is classification (it has classes)."""
        return self.num_classes > 0

    def initial_state(self) -> dict[str, torch.Tensor]:
        """A copy of the initial model's tensors."""
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def new_model(self) -> SplitModel:
        """A copy of the initial model, for a part of the process that loads other weights into it."""
        return copy.deepcopy(self.model)


def build_experiment(config: RunConfig) -> Experiment:
    """The run's :class:`Experiment`, for a config already checked (raises ValueError, TypeError
    and what building the model raises; :func:`check_experiment` turns them into ConfigErrors)."""
    input_shape, num_classes = dataset_dims(config)
    algorithm = run_algorithm(config)
    return Experiment(algorithm, tuple(input_shape), num_classes, build_run_model(config, algorithm))


@dataclass(frozen=True)
class LocalData:
    """A data root on this machine, and the option that set it (for the error message)."""

    root: str | None
    option: str = "data.root"


def check_experiment(config: RunConfig, clients_data: LocalData | None = None,
                     server_data: bool = False) -> Experiment:
    """Check what :mod:`fedpart.common.config.run_config` cannot check from the keys and types alone, before
    any process starts or any file is written, and return the :class:`Experiment` built on the
    way; raises :class:`ConfigError` naming the setting.

    - the algorithm and its options, the model and its options (built on the CPU), an initial
      checkpoint that fits it, the schedule of every round;
    - the dataset's loader options, and whether the partition can be cut (from the samples per
      class of a built-in dataset, without reading it);
    - ``clients_data``: the clients' data is on this machine under that root (``fedpart run``, a
      ``fedpart client`` with its data root): every file of the dataset is there;
    - ``server_data``: the server's own needs: with ``evaluate.global_test`` on and an algorithm
      whose server holds a whole model, the test split under ``data.root``; with ``privacy.dp``,
      the accountant's library.
    """
    try:
        input_shape, num_classes = dataset_dims(config)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if server_data:
        check_dp_accounting(config)
    try:
        algorithm = run_algorithm(config)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"algorithm: {error}") from error
    try:
        model = build_run_model(config, algorithm)  # on the CPU: well under a second
    except (ValueError, TypeError, ImportError, OSError, RuntimeError) as error:
        raise ConfigError(f"model: {error}") from error
    _check_schedule(config, algorithm, model)
    experiment = Experiment(algorithm, tuple(input_shape), num_classes, model)
    data = config.data
    custom = ":" in data.dataset
    if custom:
        if clients_data is not None or (server_data and config.evaluate.global_test):
            try:
                import_callable(data.dataset, "data.dataset")
            except (ValueError, ImportError) as error:
                raise ConfigError(str(error)) from error
        return experiment
    try:
        counts = class_counts(data.dataset, data.options)
    except ValueError as error:
        raise ConfigError(f"data.options: {error}") from error
    try:
        check_partition(data.partition.scheme, data.partition.options, config.clients, config.partition_seed, counts)
    except ValueError as error:
        raise ConfigError(f"data.partition cannot be cut from {data.dataset} for {config.clients} clients: "
                          f"{error}") from error
    if clients_data is not None:
        missing = _missing_files(data.dataset, clients_data.root, ("train", "test"))
        if missing:
            raise ConfigError(f"{clients_data.option}: {missing} ({clients_data.option} = {clients_data.root!r}); "
                              f"{DATA_PAGE} says where the files go and how to fetch them")
    if server_data and config.evaluate.global_test and has_global_model(algorithm):
        missing = _missing_files(data.dataset, data.root, ("test",))
        if missing:
            raise ConfigError(f"evaluate.global_test: the server tests the global model on the test split of "
                              f"{data.dataset}, which it reads from data.root ({data.root!r}): {missing}; set "
                              "evaluate.global_test: false for a server without the data "
                              f"(--set evaluate.global_test=false), or point data.root at it ({DATA_PAGE})")
    return experiment


def _missing_files(dataset: str, root: str | None, splits: tuple[str, ...]) -> str | None:
    """What is missing of the files of ``splits`` under ``root`` (None: nothing)."""
    if not dataset_spec(dataset).files:
        return None  # shipped in the package
    if root is None:
        return f"no data root is set, and dataset {dataset!r} is read from files under one"
    missing = missing_dataset_files(dataset, root, splits)
    if not missing:
        return None
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return f"dataset file {missing[0]} not found{more}"

def _check_schedule(config: RunConfig, algorithm: Algorithm, model: SplitModel) -> None:
    """Every round's phases name units of the model (a schedule may depend on the round)."""
    units = tuple(model.unit_names)
    known = set(model.schedule_units) | {HEAD}
    for round_number in range(1, config.rounds + 1):
        try:
            phases = algorithm.schedule(RoundContext(round_number, config.rounds, units, config.train.epochs))
        except ValueError as error:
            raise ConfigError(str(error)) from error
        unknown = sorted({u for phase in phases for u in phase.trainable} - known)
        if unknown:
            raise ConfigError(f"algorithm {algorithm.name}: round {round_number} trains {unknown}, which the model "
                              f"{config.model.name} does not have (units {sorted(known)})")
