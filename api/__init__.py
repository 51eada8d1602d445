"""fedpart's public plugin surface: the types a custom component receives and returns, and the
loader of exported personalized models.

Import plugin types from here, not from the internal modules they are defined in: those may move
(``fedpart.common.dataset_types`` became ``fedpart.common.data.types``); this module keeps the
names and gives a deprecation period when one changes. ``docs/plugins.md`` documents each kind.

- **dataset** (``data.dataset: package.module:function``): ``function(root=..., **data.options)``
  returns an :class:`ArrayDataset`.
- **model** (``model.name: package.module:function``): ``function(num_classes=...,
  input_shape=..., **model.options)`` returns a :class:`SplitModel`.
- **loss** (``train.loss: package.module:function``): ``function()`` returns a :data:`LossFn`.
- **codec**, **server optimizer**, **robust aggregator**, **algorithm** (``compression.up.codec``,
  ``server_optimizer.name``, ``robust.aggregator``, ``algorithm.name``: a name or
  ``package.module:name``): a :class:`Component` with its :class:`Option` s (and capabilities)
  made by the kind's registry (``CODECS.component(...)``), building a :class:`Codec` (every
  option with a default: the receiver decodes with the defaults), a :class:`ServerOptimizer`, an
  :class:`Aggregator` (its options are keys of the ``robust`` section) or an :class:`Algorithm`
  (whose :data:`UnitSchedule` reads the numbers its phases carry, ``Phase.params``)
  (tests/fixtures/plugin_codec.py and tests/fixtures/plugin_algorithm.py are such modules).
- **objective term**, **step rule**, **partition scheme**: the types below describe the first
  two; they are chosen by built-in name from fedpart's own registries (``docs/plugins.md`` says
  what exists).
- Every kind's registry (:data:`CODECS`, :data:`SERVER_OPTIMIZERS`, :data:`ROBUST_AGGREGATORS`,
  :data:`DATASETS`, :data:`MODELS`, :data:`PARTITIONS`, :data:`ALGORITHMS`, :data:`TERMS`,
  :data:`STEP_RULES`) lists fedpart's own components (docs/components.md).
- :func:`load_model` rebuilds a model ``fedpart export`` wrote, in plain PyTorch.
"""

from fedpart.api.exported import METADATA_KEY, load_model, read_export_metadata
from fedpart.common.ml.algorithms import (
    ALGORITHMS,
    Algorithm,
    PartFactory,
    Role,
    RoundContext,
    Schedule,
    UnitSchedule,
    all_then_head,
    build_algorithm,
    every_unit,
    expand_layers,
    gradual_unfreeze,
    gradual_unfreezing,
    head_then_body,
    train_body,
    train_everything,
    with_parts,
)
from fedpart.common.wire.codecs import Codec, CodecError, Encoded
from fedpart.common.data.datasets import DATASET_NAMES, load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.data.types import ArrayDataset, ClientSplit
from fedpart.common.ml.losses import LossFn
from fedpart.common.models.zoo import MODEL_NAMES, build_model
from fedpart.common.ml.objectives import (
    STEP_RULES,
    TERMS,
    ObjectiveContext,
    ObjectiveSpec,
    StepRule,
    Term,
)
from fedpart.common.wire.plans import Phase
from fedpart.common.components.registry import (
    CODECS,
    DATASETS,
    MODELS,
    PARTITIONS,
    ROBUST_AGGREGATORS,
    SERVER_OPTIMIZERS,
    Component,
    Option,
    OptionError,
    Options,
    Registry,
)
from fedpart.common.ml.split_model import HEAD, ModelOutput, SplitModel
from fedpart.server.policy.aggregation import Aggregator
from fedpart.server.policy.optimizers import OPTIMIZERS, RoundDelta, ServerOptimizer, StatefulOptimizer, apply_deltas

__all__ = [
    # the registries of components and their options
    "Component", "Option", "Options", "OptionError", "Registry", "CODECS", "SERVER_OPTIMIZERS", "ROBUST_AGGREGATORS",
    "DATASETS", "PARTITIONS", "MODELS",
    # datasets
    "ArrayDataset", "ClientSplit", "DATASET_NAMES", "load_dataset", "make_partition",
    # models
    "SplitModel", "ModelOutput", "HEAD", "MODEL_NAMES", "build_model",
    # losses
    "LossFn",
    # algorithms
    "Algorithm", "Role", "RoundContext", "Phase", "Schedule", "PartFactory", "ALGORITHMS", "build_algorithm",
    "train_everything", "train_body", "gradual_unfreeze", "expand_layers", "head_then_body", "all_then_head",
    "with_parts", "UnitSchedule", "every_unit", "gradual_unfreezing",
    # objective terms and step rules
    "Term", "StepRule", "ObjectiveContext", "ObjectiveSpec", "TERMS", "STEP_RULES",
    # robust aggregators
    "Aggregator",
    # server optimizers
    "ServerOptimizer", "StatefulOptimizer", "RoundDelta", "apply_deltas", "OPTIMIZERS",
    # codecs
    "Codec", "Encoded", "CodecError",
    # exported personalized models
    "load_model", "read_export_metadata", "METADATA_KEY",
]
