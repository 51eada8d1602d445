"""Run configuration: a YAML file, validated into typed sections, with ``key=value`` overrides.

Every setting has a default here; an unknown key or a value of the wrong type is an error that
names the key. The sections that select a component (dataset, partition, model, algorithm with
its objective terms, codecs, server optimizer, robust aggregator) carry a name plus options that
the component declares: its registry reads them (:meth:`~fedpart.common.components.registry.Registry.read`),
and the checks of what a feature refuses ask the components' capabilities, never their names.
Validating a config imports no server module: the server's parts are declared in
:mod:`fedpart.common.components.server_parts`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from fedpart.common.components.registry import (
    ALGORITHMS,
    CODECS,
    DATASETS,
    MODELS,
    PARTITIONS,
    ROBUST_AGGREGATORS,
    SERVER_OPTIMIZERS,
    OptionError,
    Registry,
    coerce,
)
from fedpart.common.config import dp, dp_sgd, secure_aggregation_checks
from fedpart.common.config.dp import DP_ACCOUNTING_INSTALL, DPConfig
from fedpart.common.config.dp_sgd import DPSGDConfig
from fedpart.common.wire.sizes import DEFAULT_CHUNK_BYTES, GRPC_LARGEST_MESSAGE

if TYPE_CHECKING:
    from fedpart.common.ml.algorithms import Algorithm

FEATURE_CHECKS = (dp, dp_sgd, secure_aggregation_checks)
"""The features whose config checks live beside them (:mod:`fedpart.common.config.feature_checks`): each
module's ``value_errors`` runs with the values, its ``refusals`` where it is ``enabled``. A new
feature of this kind is one module and its name here."""

# The registries' homes the checks below read (algorithms, codecs, models, datasets: torch) are
# imported when a config is validated, not with this module: ``fedpart --help`` loads no torch.


class ConfigError(ValueError):
    """A configuration that cannot be run, with the offending key in the message."""


@dataclass
class PartitionConfig:
    """How the dataset is split across clients (see ``fedpart.common.data.partition``)."""

    scheme: str = "iid"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    dataset: str = "digits"
    root: str | None = None
    input_shape: list[int] | None = None  # required for custom datasets only
    num_classes: int | None = None        # required for custom datasets only (0 = regression)
    options: dict[str, Any] = field(default_factory=dict)
    partition: PartitionConfig = field(default_factory=PartitionConfig)


@dataclass
class ModelConfig:
    name: str = "mlp"
    options: dict[str, Any] = field(default_factory=dict)
    init_checkpoint: str | None = None  # start from these weights (safetensors) instead of the seed


@dataclass
class AlgorithmConfig:
    """The algorithm, its options, and client objective terms added to it (``{term: {options}}``,
    see ``fedpart.common.ml.objectives``)."""

    name: str = "fedavg"
    options: dict[str, Any] = field(default_factory=dict)
    objective: dict[str, Any] = field(default_factory=dict)


SAMPLING_SCHEMES = ("fixed", "poisson")


@dataclass
class SamplingConfig:
    """Per-round participation. ``scheme: fixed`` (default): a fraction of the clients without
    replacement, or (when ``probability`` is set) an independent probability per client, drawn
    again while nobody is picked (FedBug's setting). ``scheme: poisson``: each client
    independently with probability ``fraction``, and a round may have nobody (Poisson sampling,
    what DP-FedAvg's accounting assumes: McMahan et al., ICLR 2018)."""

    scheme: str = "fixed"
    fraction: float = 1.0
    probability: float | None = None
    # Straggler remedy (cross-device practice, Bonawitz et al. 2019): sample this fraction more
    # clients than ``fraction`` asks for and close the round once that many have answered; which
    # clients make it depends on timing, so a run is then not reproducible bit for bit
    over_selection: float = 0.0


@dataclass
class SeedsConfig:
    """One seed per source of randomness, so that one can vary while the others stay fixed;
    ``None`` takes the run's ``seed``. ``partition``: which samples each client holds;
    ``init``: the initial model (FedBABU's fixed random head included); ``sampling``: the clients
    of each round; ``training``: batch order, augmentation, fine-tuning and codec rounding."""

    partition: int | None = None
    init: int | None = None
    sampling: int | None = None
    training: int | None = None


@dataclass
class TrainConfig:
    """Local training (FedBABU's step decay: ``lr_milestones`` x ``lr_gamma``)."""

    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_milestones: list[float] = field(default_factory=list)  # fractions of the rounds
    lr_gamma: float = 0.1
    grad_clip: float = 0.0
    weighting: str = "samples"  # "samples" (n_i) or "uniform"
    loss: str | None = None     # "package.module:function"; default cross-entropy (MSE for regression)
    augment: str = "none"       # batch transform of the training inputs (fedpart.common.data.augment)
    # speed options, each applied where the client's device supports it (fedpart.client.speed)
    amp: str = "off"            # mixed precision on GPUs: "off", "bf16" or "fp16" (with a gradient scaler)
    channels_last: bool = False  # conv nets: weights and images in the channels-last memory format
    compile: bool = False       # torch.compile the forward of full training batches


@dataclass
class ServerOptimizerConfig:
    """The server step over the round's combined delta (``fedpart.server.policy.optimizers``) and its
    options, ``lr`` (the server learning rate) among them."""

    name: str = "plain"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvaluateConfig:
    """FedBABU's personalization protocol: fine-tune on the client's train split, then test."""

    finetune_epochs: list[int] = field(default_factory=lambda: [1, 5])
    part: str = "full"
    lr: float = 1e-3
    momentum: float = 0.9
    batch_size: int = 50
    headless: bool = False
    global_test: bool = True   # the server tests the global model on the dataset's test split, which it
                               # reads from its own data.root (when the algorithm has a global model)
    global_every: int = 0      # also after every k-th round (0: only at the end)


@dataclass
class CheckpointConfig:
    """The global model saved in ``checkpoints/`` of the run directory (resume does not need
    them: it reads ``server_state/``). The initial model (``round_0000``) and the last round's
    are always written and kept."""

    every: int = 10  # write after every k-th round (0: only the initial and the last round)
    keep: int = 3    # round checkpoints kept, newest first, the last round's always (0: all)


ENGINES = ("sync", "buffered")


@dataclass
class ServerConfig:
    engine: str = "sync"            # the round engine: "sync" (rounds of sampled clients) or "buffered"
                                    # (FedBuff: the buffered section; fedpart.server.engine.buffered)
    join_timeout: float = 300.0     # seconds to wait for every client to be hosted
    round_timeout: float = 600.0    # a round closes with the results in hand after this
    evaluation_timeout: float = 3600.0  # the final evaluation (every client fine-tunes) closes after this
    heartbeat_timeout: float = 60.0  # a process silent this long is considered gone
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    result_chunk_bytes: int = 1 << 20  # largest message of a result stream (fewer, larger messages
                                    # cost the server less CPU)
    waiting_upload_bytes: int = 512 << 20  # what result streams waiting for an upload slot may hold
                                    # in gRPC's buffers together: results come in messages of at most
                                    # this / connected processes, within [64 KiB, result_chunk_bytes]
                                    # (0 = result_chunk_bytes)
    call_timeout: float = 900.0     # longest deadline a task or result stream may ask for
    fold_workers: int = 0           # threads that validate and fold results (0 = none: the event loop does)
    upload_slots: int = 0           # results read at once, each into a reused staging buffer; more
                                    # uploads wait under gRPC flow control (0 = 4 per fold worker,
                                    # or per CPU core without fold workers)
    download_slots: int = 64        # tasks sent at once; more wait under flow control
    receive_window: int | None = None  # bytes a connection may send before the server reads them
                                     # (None = 32 MiB / clients, within [256 KiB, 4 MiB];
                                     # 0 = gRPC's adaptive window, which grows per connection)
    round_deadline_factor: float = 0.0  # straggler remedy: a round closes once it has run this many
                                    # times as long as its first half of clients took to answer
                                    # (within round_timeout; 0 = off; timing-dependent, not reproducible)
    delivery_attempts: int = 8      # a task is sent at most this often, and at most this many result
                                    # streams are taken for it; past that it is dropped (bounds the work
                                    # a client that never completes a stream can cause)

    def largest_result_message(self, named: int) -> int:
        """The largest message of a result whose task named ``named`` bytes (0: it named none)."""
        return named or self.result_chunk_bytes


@dataclass
class RobustConfig:
    """Defences of the aggregation step against poisoned results (``fedpart.server.policy.robust``;
    median and trimmed mean: Yin et al., ICML 2018)."""

    aggregator: str = "mean"       # "mean" (streaming, train.weighting), "median" or "trimmed_mean"
    trim_fraction: float = 0.1     # trimmed_mean: fraction cut at each end of every coordinate
    norm_bound: float = 0.0        # L2 bound on a result's delta over all its delta tensors (0 = off)
    norm_action: str = "clip"      # a delta over the bound: "clip" (scale it down) or "reject" it
    max_samples: int = 0           # cap on a result's self-reported sample count (0 = none)
    partition_sizes: bool = True   # also cap at the client's partition size where the server can compute it
    adaptive_bound: float = 5.0    # refuse a result whose delta's L2 norm is over this many times the median
                                   # of the latest round's deltas of the same tensors (0 = off; the honest
                                   # and hostile norms it was chosen between: docs/security.md, Insiders)
    first_round_bound: float = 3.0   # before any such round: over this many times those tensors' L2 norm in
                                     # the initial global model (0 = no bound until a round has been folded)
    monitor_rounds: int = 3        # warn of a client whose last this many results were outliers (0 = monitor off)
    monitor_norm_ratio: float = 3.0   # an outlier: delta norm over this many times the round's median ...
    monitor_cosine: float = -0.3      # ... or cosine to the round's robust centre below this
    monitor_action: str = "refuse"    # a named client's results: "refuse" them until one is not an outlier, or "warn"


@dataclass
class CodecConfig:
    """One direction's codec (``fedpart.common.wire.codecs``) and its options."""

    codec: str = "none"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompressionConfig:
    """Codecs of the tensors uploaded (deltas, values) and downloaded (global tensors)."""

    up: CodecConfig = field(default_factory=CodecConfig)
    down: CodecConfig = field(default_factory=CodecConfig)


@dataclass
class PrivacyConfig:
    """Privacy of the clients' updates (docs/privacy.md).

    ``secure_aggregation`` masks every shared upload so that the server learns only the round's sum
    (Bonawitz et al., CCS 2017; with ``secure_aggregation_neighbours`` set, the SecAgg+ graph of
    Bell et al., CCS 2020): each element is clipped to ``secure_aggregation_bound`` and quantized
    into the ring of 2**32 (``fedpart.common.privacy.secagg``)."""

    dp: DPConfig = field(default_factory=DPConfig)
    dp_sgd: DPSGDConfig = field(default_factory=DPSGDConfig)  # record-level DP-SGD on the client
    secure_aggregation: bool = False
    secure_aggregation_threshold: int | None = None   # shares that rebuild a secret; None: a majority
                                                      # of the neighbourhood (the client and its neighbours)
    secure_aggregation_neighbours: int | None = None  # SecAgg+ neighbours per client; None: every other
                                                      # sampled client (SecAgg)
    secure_aggregation_bound: float = 1.0             # each uploaded element is clipped to +-bound


STALENESS_WEIGHTS = ("constant", "polynomial", "hinge")


@dataclass
class BufferedConfig:
    """Asynchronous buffered aggregation, FedBuff (Nguyen et al., "Federated Learning with Buffered
    Asynchronous Aggregation", AISTATS 2022), with ``server.engine: buffered``: ``concurrency``
    clients train at once, each on the global version it was given; each server version folds
    ``buffer_size`` results, each delta scaled by its staleness weight s(t - tau): ``constant``
    1, ``polynomial`` (1 + staleness)**-staleness_exponent (the paper's 1/sqrt(1 + staleness) at
    0.5), or ``hinge`` 1 up to ``hinge_cutoff`` versions and 1 / (hinge_slope * (staleness -
    hinge_cutoff) + 1) beyond (Xie et al., "Asynchronous Federated Optimization", 2019)."""

    concurrency: int | None = None   # None: the clients a synchronous round samples (sampling.fraction)
    buffer_size: int | None = None   # None: concurrency
    staleness: str = "constant"
    staleness_exponent: float = 0.5
    hinge_slope: float = 10.0
    hinge_cutoff: int = 4

    def resolved(self, clients: int, fraction: float) -> tuple[int, int]:
        """(concurrency, buffer_size), the unset ones resolved."""
        concurrency = self.concurrency or max(1, int(fraction * clients + 1e-9))
        return concurrency, self.buffer_size or concurrency


SPEED_DISTRIBUTIONS = ("none", "lognormal")
CLOCKS = ("wall", "virtual")


@dataclass
class HeterogeneityConfig:
    """Device heterogeneity, drawn from named, seeded distributions (``fedpart.common.config.heterogeneity``):
    each client's slowdown (``speed: lognormal``: exp(speed_sigma * N(0, 1)), median 1), and
    ``offline_share`` of the clients offline ``offline_fraction`` of every ``offline_period``
    seconds, from a seeded phase (they pause their training while offline). A task of ``s`` local
    steps takes ``s * step_seconds * slowdown`` seconds of device time. ``clock: wall``: each client
    process makes its tasks last that long by waiting (``fedpart.client.mods.heterogeneity``);
    ``virtual``: nobody waits, the round engines order results by the simulated time instead, so
    a run is deterministic for its seeds and takes only its compute time."""

    speed: str = "none"
    speed_sigma: float = 1.0
    offline_share: float = 0.0
    offline_fraction: float = 0.5
    offline_period: float = 600.0
    step_seconds: float = 0.05
    clock: str = "wall"
    seed: int | None = None   # None: the run's seed

    @property
    def emulated(self) -> bool:
        """Whether any device differs from the nominal one (a slowdown or an offline period)."""
        return self.speed != "none" or self.offline_share > 0


# Settings that moved: old key -> new key.
_MOVED = {"train.server_lr": "server_optimizer.lr"}

# String settings whose value "off" YAML 1.1 reads as the boolean false (``amp: off``).
_OFF_STRINGS = {"train.amp"}
AMP_MODES = ("off", "bf16", "fp16")

@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    seeds: SeedsConfig = field(default_factory=SeedsConfig)
    rounds: int = 10
    clients: int = 10
    processes: int = 2  # client processes ``fedpart run`` starts
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    server_optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    buffered: BufferedConfig = field(default_factory=BufferedConfig)
    heterogeneity: HeterogeneityConfig = field(default_factory=HeterogeneityConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_seeds(self) -> dict[str, int]:
        """Every source's seed, ``seed`` where ``seeds`` leaves it unset."""
        return {f.name: self._seed_of(f.name) for f in dataclasses.fields(SeedsConfig)}

    def _seed_of(self, source: str) -> int:
        value = getattr(self.seeds, source)
        return self.seed if value is None else value

    @property
    def partition_seed(self) -> int:
        return self._seed_of("partition")

    @property
    def init_seed(self) -> int:
        return self._seed_of("init")

    @property
    def sampling_seed(self) -> int:
        return self._seed_of("sampling")

    @property
    def training_seed(self) -> int:
        return self._seed_of("training")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def for_clients(self) -> RunConfig:
        """What a client process is sent of the run's config (in its JoinReply): the experiment
        (seeds, data, model, algorithm, training, evaluation, compression, privacy, sampling, the
        buffered engine, heterogeneity) and, of the ``server`` section, the settings a client's
        calls follow (:data:`CLIENT_SERVER_SETTINGS`). The server's own knobs keep their defaults:
        robust screening and the insider monitor (an insider would learn the bounds it is judged
        by), the server optimizer, checkpoints, the server's timeouts and capacities, and
        ``privacy.dp.noise_seed`` (whoever knows it can take the noise out)."""
        server = ServerConfig(**{key: getattr(self.server, key) for key in CLIENT_SERVER_SETTINGS})
        privacy = dataclasses.replace(self.privacy, dp=dataclasses.replace(self.privacy.dp, noise_seed=None))
        return dataclasses.replace(self, server=server, robust=RobustConfig(), server_optimizer=ServerOptimizerConfig(),
                                   checkpoint=CheckpointConfig(), privacy=privacy)


CLIENT_SERVER_SETTINGS = ("engine", "call_timeout", "heartbeat_timeout", "result_chunk_bytes")
"""The settings of the ``server`` section a client process follows: the engine (what its secure
aggregation keeps), its calls' deadline, its heartbeat interval, the size of its result messages."""

# Sections whose extra keys are free options for the selected component.
_OPEN_SECTIONS: dict[type, str] = {
    PartitionConfig: "scheme",
    ModelConfig: "name",
    AlgorithmConfig: "name",
    DataConfig: "dataset",
    CodecConfig: "codec",
    ServerOptimizerConfig: "name",
}


def _check_type(value: Any, annotation: Any, key: str) -> Any:
    """Validate (and lightly coerce) one scalar or list value against its annotation."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_check_type(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    try:
        return coerce(value, annotation, key)
    except OptionError as error:
        raise ConfigError(str(error)) from error


def _build(cls: type, raw: Any, prefix: str):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys (except open sections)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if full in _MOVED:
            raise ConfigError(f"{full} has moved: set {_MOVED[full]} instead")
        if key not in names:
            if cls in _OPEN_SECTIONS and cls is not DataConfig:
                extra[key] = value
                continue
            raise ConfigError(f"unknown setting {full!r}; known: {sorted(names)}")
        annotation = hints[key]
        if full in _OFF_STRINGS and value is False:
            value = "off"
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value, f"{full}.")
        else:
            kwargs[key] = _check_type(value, annotation, full)
    if extra:
        kwargs["options"] = {**kwargs.get("options", {}), **extra}
    return cls(**kwargs)


def _validate(config: RunConfig, server_parts: bool = True) -> None:
    """Every check of a run config: first those of its values alone, which need no torch (so
    that a mistake there is said within a second), then those of the components it names."""
    _check_values(config)
    _check_components(config, server_parts)


def _check_values(config: RunConfig) -> None:
    """The checks of values and their combinations (no component is imported)."""
    checks = [
        (config.rounds >= 1, "rounds must be at least 1"),
        (config.clients >= 1, "clients must be at least 1"),
        (config.processes >= 1, "processes must be at least 1"),
        (config.train.epochs >= 0, "train.epochs must be >= 0"),
        (config.train.batch_size >= 1, "train.batch_size must be >= 1"),
        (config.train.lr >= 0, "train.lr must be >= 0"),
        (config.train.weighting in ("samples", "uniform"), "train.weighting must be 'samples' or 'uniform'"),
        (config.train.amp in AMP_MODES, f"train.amp must be one of {', '.join(AMP_MODES)}, got {config.train.amp!r}"),
        (config.train.augment == "none" or config.data.input_shape is None
         or len(config.data.input_shape) == 3,
         "train.augment transforms images: data.input_shape must be [channels, height, width]"),
        (all(0 < m < 1 for m in config.train.lr_milestones), "train.lr_milestones are fractions of the rounds in (0, 1)"),
        (config.evaluate.part in ("full", "body", "head"), "evaluate.part must be 'full', 'body' or 'head'"),
        (all(e >= 0 for e in config.evaluate.finetune_epochs), "evaluate.finetune_epochs must be >= 0"),
        (config.evaluate.batch_size >= 1, "evaluate.batch_size must be >= 1"),
        (config.evaluate.global_every >= 0, "evaluate.global_every must be >= 0"),
        (config.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0: only the initial and the last round)"),
        (config.checkpoint.keep >= 0, "checkpoint.keep must be >= 0 (0: keep every round checkpoint)"),
        (1024 <= config.server.chunk_bytes <= GRPC_LARGEST_MESSAGE,
         f"server.chunk_bytes must be in [1024, {GRPC_LARGEST_MESSAGE}] (gRPC's largest message)"),
        (1024 <= config.server.result_chunk_bytes <= GRPC_LARGEST_MESSAGE,
         f"server.result_chunk_bytes must be in [1024, {GRPC_LARGEST_MESSAGE}] (gRPC's largest message)"),
        (config.server.waiting_upload_bytes >= 0, "server.waiting_upload_bytes must be >= 0 (0 = no bound)"),
        (min(config.server.round_timeout, config.server.join_timeout, config.server.evaluation_timeout,
             config.server.heartbeat_timeout, config.server.call_timeout) > 0, "server timeouts must be positive"),
        (config.server.fold_workers >= 0, "server.fold_workers must be >= 0 (0 = fold on the event loop)"),
        (config.server.upload_slots >= 0, "server.upload_slots must be >= 0 (0 = 4 per fold worker or CPU core)"),
        (config.server.download_slots >= 1, "server.download_slots must be at least 1"),
        (1 <= config.server.delivery_attempts <= 1000, "server.delivery_attempts must be in [1, 1000]"),
        (config.server.round_deadline_factor == 0 or config.server.round_deadline_factor >= 1,
         "server.round_deadline_factor must be 0 (off) or at least 1"),
        (0 <= config.sampling.over_selection <= 10, "sampling.over_selection must be in [0, 10]"),
        (config.sampling.over_selection == 0 or config.sampling.probability is None,
         "sampling.over_selection needs a fixed-size sample (sampling.fraction), not sampling.probability"),
        (config.server.receive_window in (None, 0) or config.server.receive_window >= 65536,
         "server.receive_window must be 0 (adaptive) or at least 65536 bytes"),
    ]
    robust = config.robust
    checks += [
        (0 <= robust.trim_fraction < 0.5, "robust.trim_fraction must be in [0, 0.5)"),
        (math.isfinite(robust.norm_bound) and robust.norm_bound >= 0,
         "robust.norm_bound must be a finite number >= 0 (0 = off)"),
        (robust.norm_action in ("clip", "reject"), "robust.norm_action must be 'clip' or 'reject'"),
        (robust.max_samples >= 0, "robust.max_samples must be >= 0 (0 = no cap)"),
        (math.isfinite(robust.adaptive_bound) and (robust.adaptive_bound == 0 or robust.adaptive_bound >= 1),
         "robust.adaptive_bound must be 0 (off) or a finite number >= 1"),
        (math.isfinite(robust.first_round_bound) and robust.first_round_bound >= 0,
         "robust.first_round_bound must be a finite number >= 0 (0 = none)"),
        (robust.monitor_rounds >= 0, "robust.monitor_rounds must be >= 0 (0 = the insider monitor off)"),
        (math.isfinite(robust.monitor_norm_ratio) and robust.monitor_norm_ratio >= 1,
         "robust.monitor_norm_ratio must be a finite number >= 1"),
        (-1 <= robust.monitor_cosine <= 1, "robust.monitor_cosine must be in [-1, 1]"),
        (robust.monitor_action in ("refuse", "warn"), "robust.monitor_action must be 'refuse' or 'warn'"),
    ]
    sampling = config.sampling
    checks.append((sampling.scheme in SAMPLING_SCHEMES,
                   f"sampling.scheme must be one of {', '.join(SAMPLING_SCHEMES)}, got {sampling.scheme!r}"))
    checks.append((0 < sampling.fraction <= 1, "sampling.fraction must be in (0, 1]"))
    if sampling.probability is not None:
        checks.append((0 < sampling.probability <= 1, "sampling.probability must be in (0, 1]"))
    if sampling.scheme == "poisson":
        checks.append((sampling.probability is None, "sampling.scheme poisson samples each client with probability "
                       "sampling.fraction: leave sampling.probability unset"))
        checks.append((sampling.over_selection == 0, "sampling.over_selection needs a fixed-size sample "
                       "(sampling.scheme fixed), not sampling.scheme poisson"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_engine_values(config)
    for feature in FEATURE_CHECKS:
        for message in feature.value_errors(config):
            raise ConfigError(message)
    _check_heterogeneity_values(config.heterogeneity)


def _check_engine_values(config: RunConfig) -> None:
    """``server.engine`` and, when it is ``buffered``, the ``buffered`` section and what the
    buffered engine cannot run with. Raises ConfigError naming the key."""
    engine, section = config.server.engine, config.buffered
    if engine not in ENGINES:
        raise ConfigError(f"server.engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "sync":
        return  # the buffered section is read by the buffered engine only (one config runs both engines)
    concurrency, buffer_size = section.resolved(config.clients, config.sampling.fraction)
    sampling = config.sampling
    checks = [
        (section.concurrency is None or 1 <= section.concurrency <= config.clients,
         f"buffered.concurrency must be in [1, clients = {config.clients}]"),
        (section.buffer_size is None or section.buffer_size >= 1, "buffered.buffer_size must be at least 1"),
        (buffer_size <= concurrency, f"buffered.buffer_size {buffer_size} is more than buffered.concurrency "
                                     f"{concurrency}: a buffer could never fill"),
        (section.staleness in STALENESS_WEIGHTS,
         f"buffered.staleness must be one of {', '.join(STALENESS_WEIGHTS)}, got {section.staleness!r}"),
        (math.isfinite(section.staleness_exponent) and section.staleness_exponent >= 0,
         "buffered.staleness_exponent must be a finite number >= 0"),
        (math.isfinite(section.hinge_slope) and section.hinge_slope >= 0,
         "buffered.hinge_slope must be a finite number >= 0"),
        (section.hinge_cutoff >= 0, "buffered.hinge_cutoff must be >= 0"),
        (sampling.scheme == "fixed" and sampling.probability is None and not sampling.over_selection,
         "server.engine buffered keeps buffered.concurrency clients training and picks each new one uniformly "
         "among the idle clients: leave sampling.scheme, sampling.probability and sampling.over_selection unset"),
        (not config.server.round_deadline_factor,
         "server.round_deadline_factor closes a synchronous round early; the buffered engine never waits for a "
         "straggler: set server.round_deadline_factor: 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_heterogeneity_values(section: HeterogeneityConfig) -> None:
    """The ``heterogeneity`` section. Raises ConfigError naming the key."""
    checks = [
        (section.speed in SPEED_DISTRIBUTIONS,
         f"heterogeneity.speed must be one of {', '.join(SPEED_DISTRIBUTIONS)}, got {section.speed!r}"),
        (math.isfinite(section.speed_sigma) and 0 <= section.speed_sigma <= 10,
         "heterogeneity.speed_sigma must be in [0, 10]"),
        (0 <= section.offline_share <= 1, "heterogeneity.offline_share must be in [0, 1]"),
        (0 <= section.offline_fraction < 1, "heterogeneity.offline_fraction must be in [0, 1)"),
        (math.isfinite(section.offline_period) and section.offline_period > 0,
         "heterogeneity.offline_period must be a finite number of seconds > 0"),
        (math.isfinite(section.step_seconds) and section.step_seconds > 0,
         "heterogeneity.step_seconds must be a finite number of seconds > 0"),
        (section.clock in CLOCKS, f"heterogeneity.clock must be one of {', '.join(CLOCKS)}, got {section.clock!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_components(config: RunConfig, server_parts: bool) -> None:
    """The checks of the components a config names (datasets, partitions, models, algorithms,
    codecs, server parts), each component's options read by its registry, and of what each
    privacy mechanism refuses. A dataset or model named by a ``package.module:function`` path
    checks its own options when it is called."""
    from fedpart.common.data.augment import AUGMENTATIONS
    from fedpart.common.ml.algorithms import build_algorithm

    if config.train.augment not in AUGMENTATIONS:
        raise ConfigError(f"train.augment must be one of {', '.join(AUGMENTATIONS)}")
    data = config.data
    if ":" not in data.dataset:
        data.options = _read_component(DATASETS, data.dataset, data.options, "data.options.", "data.dataset")
    partition = data.partition
    partition.options = _read_component(PARTITIONS, partition.scheme, partition.options, "data.partition.",
                                        "data.partition.scheme")
    if ":" not in config.model.name:
        config.model.options = _read_component(MODELS, config.model.name, config.model.options, "model.",
                                               "model.name")
    algorithm = config.algorithm
    algorithm.options = _read_component(ALGORITHMS, algorithm.name, algorithm.options, "algorithm.",
                                        "algorithm.name")
    try:
        built = build_algorithm(algorithm.name, algorithm.options, algorithm.objective)  # its terms and step rule
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if server_parts:
        _check_robust_aggregator(config.robust)
    _check_codec(config.compression.up, "compression.up")
    _check_codec(config.compression.down, "compression.down")
    if server_parts:
        _check_server_optimizer(config, built)
    for feature in FEATURE_CHECKS:
        if feature.enabled(config):
            for message in feature.refusals(config, built, server_parts):
                raise ConfigError(f"{feature.KEY}: {message}")


def check_dp_accounting(config: RunConfig) -> None:
    """Raise ConfigError when ``privacy.dp`` is on and Google's dp-accounting is not installed (the
    server's accountant; client machines never need it)."""
    if config.privacy.dp.enabled and importlib.util.find_spec("dp_accounting") is None:
        raise ConfigError(f"privacy.dp needs Google's dp-accounting library on the server, which is not installed: "
                          f"{DP_ACCOUNTING_INSTALL}")


def _check_server_optimizer(config: RunConfig, algorithm: Algorithm) -> None:
    """Validate (and type) ``server_optimizer``; a server step chosen there and one an objective
    term of ``algorithm`` (the run's, built) brings (FedDyn's) cannot both run. Raises
    ConfigError naming the keys."""
    section = config.server_optimizer
    section.options = _read_component(SERVER_OPTIMIZERS, section.name, section.options, "server_optimizer.",
                                      "server_optimizer.name")
    default = ServerOptimizerConfig().name
    if section.name == default and not section.options:
        return
    declared = algorithm.server_step
    if declared is not None:
        step = declared[0]
        named = config.algorithm
        source = f"algorithm.objective.{step}" if step in named.objective else f"algorithm.name {named.name!r}"
        chosen = f"server_optimizer.name {section.name!r}" if section.name != default else \
            f"server_optimizer.{sorted(section.options)[0]}"
        raise ConfigError(f"{chosen} cannot be combined with {source}: the {step} objective term brings its own "
                          "server step (remove the server_optimizer settings)")


def _check_robust_aggregator(robust: RobustConfig) -> None:
    """Refuse a ``robust.aggregator`` that names no robust aggregator, and one whose declared
    options are not keys of the ``robust`` section (the server passes each option the section's
    value of the same name) or whose values there its registry refuses."""
    name = robust.aggregator
    try:
        component = ROBUST_AGGREGATORS.resolve(name, "robust.aggregator")
    except OptionError as error:
        known = ", ".join(ROBUST_AGGREGATORS.selectable())
        raise ConfigError(str(error) if ":" in name else f"robust.aggregator must be one of {known} (or a "
                          f"'package.module:name' path), got {name!r}") from error
    keys = [f.name for f in dataclasses.fields(RobustConfig) if f.name != "aggregator"]
    for option in component.options:
        if option.name not in keys:
            raise ConfigError(f"robust.aggregator {name!r} declares the option {option.name!r}, which is not a key "
                              f"of the robust section (its options take the robust keys of the same name: "
                              f"{', '.join(keys)})")
    try:
        robust_aggregator_options(robust)
    except OptionError as error:
        raise ConfigError(f"{error} (robust.aggregator {name!r})") from error


def robust_aggregator_options(robust: RobustConfig) -> dict[str, Any]:
    """The options of the robust aggregator ``robust`` selects, typed and checked by its registry:
    the values of the ``robust`` keys its options name (its options are those keys)."""
    name = robust.aggregator
    declared = ROBUST_AGGREGATORS.resolve(name, "robust.aggregator").options
    return ROBUST_AGGREGATORS.read(name, {option.name: getattr(robust, option.name) for option in declared},
                                   "robust.", "robust.aggregator")


def _check_codec(section: CodecConfig, key: str) -> None:
    """Validate (and type) one direction's codec and options; raises ConfigError naming the key."""
    section.options = _read_component(CODECS, section.codec, section.options, f"{key}.", f"{key}.codec")
    if key.endswith("down") and getattr(CODECS.build(section.codec, section.options), "sparse", False):
        raise ConfigError(f"{key}.codec: {section.codec} is not supported for downloads (the global model is not "
                          "sparse); use a codec that sends every element, such as float16 or qsgd8")


def _read_component(registry: Registry, name: str, options: dict[str, Any], prefix: str,
                    setting: str) -> dict[str, Any]:
    """The typed options of the component ``name`` of ``registry`` (see
    :meth:`~fedpart.common.components.registry.Registry.read`), errors as ConfigError."""
    try:
        return registry.read(name, options, prefix, setting)
    except OptionError as error:
        raise ConfigError(str(error)) from error


def config_from_dict(raw: dict[str, Any], server_parts: bool = True) -> RunConfig:
    """Validated config from a plain mapping. A client process reads the server's resolved config
    with ``server_parts=False``: the server checked it whole, and the parts only the server runs
    (its robust aggregator and server optimizer, which a ``package.module:name`` path may bring
    from a module the client machines need not have) are not resolved in the client."""
    config = _build(RunConfig, raw, "")
    _validate(config, server_parts)
    return config


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, value = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    return key.strip().split("."), yaml.safe_load(value)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a raw config mapping (before validation)."""
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from error
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = raw.get("data")
        if isinstance(data, dict) and isinstance(data.get("root"), str) and not Path(data["root"]).is_absolute():
            data["root"] = str((Path.cwd() / data["root"]).resolve())
    return config_from_dict(apply_overrides(raw, overrides or []))
