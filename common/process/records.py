"""The records a run leaves in its directory (docs/output.md), typed: a line of ``metrics.jsonl``
(:class:`RoundRecord`, one per round) and ``summary.json`` (:class:`RunSummary`), and every
section below them (bytes, accuracy, delivery, privacy, per client, robust, buffered). The server
builds and writes them, the report, the CLI and the benchmarks read them. Each key of the files is
spelled once: as a field name here (or a field's ``key`` where the name cannot be a Python one).

``to_json`` gives the JSON object as the file holds it (same keys, in field order, same nesting);
``from_json`` reads one back, so ``from_json(to_json(r)) == r``. Files written by an earlier
fedpart, or by a run that ended early, may lack keys: a key with a default below reads as that
default (None: left out again when written); a key without one is a ValueError naming it. Keys
this module does not know are ignored. Keys that are data (model parts, body units, client ids,
fine-tune epochs, encodings, process names) stay dictionary keys. Standard library only: a report
reads run directories on any machine."""

from __future__ import annotations

import json
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

JsonObject = dict[str, Any]
S = TypeVar("S", bound="Section")
C = TypeVar("C", bound="Counts")

# Field metadata: how a field whose value is None is written (by default it is left out).
NULLABLE = {"nullable": True}  # written as JSON null
EMPTY = {"empty": True}        # written as {} (and {} reads as None): a section with nothing counted


def written_with(name: str) -> dict[str, str]:
    """Field metadata: written (null included) wherever the field ``name`` is written."""
    return {"written_with": name}


def _key(f: Any) -> str:
    return f.metadata.get("key", f.name)


class Section:
    """A JSON object of a run file as a dataclass: its fields under their keys, in field order."""

    def to_json(self) -> JsonObject:
        """The JSON object: sections below it written as theirs; None left out unless the field's
        metadata says otherwise (:data:`NULLABLE`, :data:`EMPTY`, :func:`written_with`)."""
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[_key(f)] = _encode(value)
            elif f.metadata.get("empty"):
                out[_key(f)] = {}
            elif f.metadata.get("nullable") or ("written_with" in f.metadata
                                                and getattr(self, f.metadata["written_with"]) is not None):
                out[_key(f)] = None
        return out

    @classmethod
    def from_json(cls: type[S], data: Any) -> S:
        """The section from its JSON object; a ValueError names the key that is missing or is not
        what its field holds."""
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object: {type(data).__name__}")
        hints = _hints(cls)
        found = {}
        for f in fields(cls):  # type: ignore[arg-type]
            key = _key(f)
            if key not in data:
                continue
            value = data[key]
            try:
                found[f.name] = None if f.metadata.get("empty") and value == {} else _decode(hints[f.name], value)
            except ValueError as error:
                raise ValueError(f"{key}: {error}") from error
        try:
            return cls(**found)
        except TypeError as error:
            raise ValueError(f"{cls.__name__}: missing keys ({error})") from error


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _encode(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_json()
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encode(item) for item in value]
    return value


def _decode(hint: Any, value: Any) -> Any:
    """``value`` read as ``hint`` says: sections (also in lists, dictionaries and ``X | None``)
    from their objects, anything else as it is."""
    if value is None:
        return None
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [option for option in get_args(hint) if option is not type(None)]
        return _decode(options[0], value) if len(options) == 1 else value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"not a JSON array: {type(value).__name__}")
        return [_decode(get_args(hint)[0], item) for item in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"not a JSON object: {type(value).__name__}")
        return {key: _decode(get_args(hint)[1], item) for key, item in value.items()}
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint.from_json(value)
    return value


class Counts(Section):
    """A section of numbers: added and subtracted field by field."""

    def __add__(self: C, other: C) -> C:
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self: C, other: C) -> C:
        return type(self)(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @classmethod
    def total(cls: type[C], counts: Iterable[Counts]) -> C:
        """The fields of ``cls`` summed over ``counts`` (which may have more fields)."""
        counts = list(counts)
        return cls(**{f.name: sum(getattr(c, f.name) for c in counts) for f in fields(cls)})  # type: ignore[arg-type]


# ---- bytes -------------------------------------------------------------------------------------

DIRECTIONS = ("down", "up")  # down: to the clients


class Directed:
    """A section with bytes ``down`` (to the clients) and ``up``."""

    down: float
    up: float

    def bytes_in(self, direction: str) -> float:
        """The bytes in ``direction`` (one of :data:`DIRECTIONS`)."""
        return self.down if direction == "down" else self.up


@dataclass(kw_only=True)
class ByteCounts(Directed, Counts):
    """Bytes by direction (a count; a mean where the section is one per round)."""

    down: float
    up: float

    @classmethod
    def of(cls, counts: Mapping[str, float]) -> ByteCounts:
        """From the byte ledger's counts by direction."""
        return cls(down=counts["down"], up=counts["up"])


def by_key(split: Mapping[str, Mapping[str, float]]) -> dict[str, ByteCounts]:
    """The byte ledger's counts by key (model part, body unit) as sections."""
    return {key: ByteCounts.of(counts) for key, counts in split.items()}


@dataclass(kw_only=True)
class BytesByPart(Directed, Section):
    """Bytes by direction, in all and by model part (body, head, other, extra parts, control,
    secagg)."""

    down: int
    up: int
    by_part: dict[str, ByteCounts] = field(default_factory=dict)


@dataclass(kw_only=True)
class LogicalBytes(BytesByPart):
    """``summary.json``'s ``bytes.logical``: the run's logical bytes (its rounds' and the final
    evaluation's), by part and body unit, the mean of a training round and the evaluation's."""

    by_unit: dict[str, ByteCounts] = field(default_factory=dict)
    per_round_mean: ByteCounts
    evaluation: ByteCounts


@dataclass(kw_only=True)
class EncodedBytes(Section):
    """Tensor bytes of one encoding: serialized (``wire``) and decoded (``raw``)."""

    wire: int
    raw: int


@dataclass(kw_only=True)
class RunBytes(BytesByPart):
    """``summary.json``'s ``bytes``: physical bytes over the whole run, by part; the mean of a
    training round; the final evaluation's; bytes of refused results (apart from any round); tensor
    bytes by direction and encoding and the compression ratio per direction; the logical bytes."""

    per_round_mean: ByteCounts
    evaluation: ByteCounts
    refused_up: int | None = None
    encodings: dict[str, dict[str, EncodedBytes]] | None = None
    compression_ratio: dict[str, float | None] | None = None  # decoded / wire tensor bytes
    logical: LogicalBytes | None = None


# ---- a round's sections --------------------------------------------------------------------------

@dataclass(kw_only=True)
class RoundClient(Directed, Section):
    """A sampled client's entry in its round (``clients``): its physical and logical bytes, its
    measured training seconds (null where it completed none) and, with ``privacy.dp_sgd``, its own
    budget over the rounds it trained (epsilon left out where infinite), delta and noised steps."""

    down: int
    up: int
    logical_down: int | None = None
    logical_up: int | None = None
    compute_seconds: float | None = field(default=None, metadata=NULLABLE)
    dp_sgd_epsilon: float | None = None
    dp_sgd_steps: float | None = None
    dp_sgd_delta: float | None = None

    def logical_bytes_in(self, direction: str) -> int | None:
        """The client's logical bytes in ``direction`` (None: not recorded)."""
        return self.logical_down if direction == "down" else self.logical_up


@dataclass(kw_only=True)
class RobustCounts(Counts):
    """What the defences did to results (docs/security.md): deltas clipped, results rejected,
    sample counts capped."""

    clipped: int = 0
    rejected: int = 0
    samples_capped: int = 0


@dataclass(kw_only=True)
class RoundRobust(RobustCounts):
    """A round's ``robust`` entry: the counts and the aggregated tensors that came out non-finite
    (refused; the previous value stays)."""

    non_finite: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Outlier(Section):
    """A result the insider monitor found an outlier: its delta norm over the round's median, its
    cosine to the round's robust centre (null: a zero sketch) and its client's outliers in a row."""

    norm_ratio: float
    cosine: float | None = field(default=None, metadata=NULLABLE)
    streak: int


@dataclass(kw_only=True)
class SumCheck(Section):
    """Under secure aggregation: the revealed sum's norm over the median of the sums before it,
    and how many rounds in a row it was an outlier."""

    norm_ratio: float
    streak: int


@dataclass(kw_only=True)
class Insiders(Section):
    """A round's ``insiders`` entry (the insider monitor): the median delta norm of its folded
    results and its outliers by client id, or under secure aggregation the check of its sum."""

    median_norm: float
    outliers: dict[str, Outlier] | None = None
    revealed_sum: SumCheck | None = field(default=None, metadata={"key": "sum"})


@dataclass(kw_only=True)
class DeliveryCounts(Counts):
    """What a round (or the final evaluation) had to send again, and why."""

    tasks_sent_again: int = 0    # tasks offered again: their stream was lost, or their process restarted
    results_sent_again: int = 0  # result streams after a task's first
    streams_cut: int = 0         # task and result streams that ended early (a transport failure)
    cut_bytes: int = 0           # bytes received of result streams that ended early
    duplicates: int = 0          # copies of results already taken, acknowledged and dropped
    given_up: int = 0            # tasks dropped after server.delivery_attempts


@dataclass(kw_only=True)
class RoundPrivacy(Section):
    """A round's ``privacy`` entry (``privacy.dp``): epsilon after it (null: infinite, no noise);
    under adaptive clipping the clip the round used and the noised fraction of its results within
    it (null where the round uploaded nothing)."""

    epsilon: float | None = field(default=None, metadata=NULLABLE)
    clip_norm: float | None = None
    unclipped_fraction: float | None = field(default=None, metadata=written_with("clip_norm"))


@dataclass(kw_only=True)
class BufferedVersion(Section):
    """A server version's ``buffered`` entry (the buffered engine, docs/buffered.md)."""

    concurrency: int
    buffer_size: int
    dispatched: list[int] = field(default_factory=list)  # clients given a task while the version was open
    staleness: dict[str, int] = field(default_factory=dict)  # staleness -> results folded with it
    in_flight: int = 0
    held: int = 0


@dataclass(kw_only=True)
class ModelMetrics(Section):
    """The global model on the server's test set: mean loss, and accuracy for a classifier."""

    loss: float | None = None
    acc: float | None = None


@dataclass(kw_only=True)
class RoundRecord(Section):
    """A round's line of ``metrics.jsonl``. Bytes are counted at their serialized size: physical
    (``bytes_down`` / ``bytes_up``, what crossed each process's connection) and ``logical`` (each
    sampled client as its own device)."""

    round: int
    sampled: list[int] = field(default_factory=list)     # the clients sampled, in order
    completed: list[int] = field(default_factory=list)   # the clients whose results were folded
    train_loss: float | None = field(default=None, metadata=NULLABLE)  # sample-weighted mean
    lr: float = 0.0
    seconds: float = 0.0                    # the round's wall time on the server
    train_samples: int = 0
    client_compute_seconds: float = 0.0     # summed over the completed clients
    trainable_parameters: float | None = field(default=None, metadata=NULLABLE)  # sample-weighted mean
    train_flops: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_by_part: dict[str, ByteCounts] = field(default_factory=dict)
    logical: BytesByPart | None = None
    bytes_by_unit: dict[str, ByteCounts] | None = None  # logical tensor bytes by body unit and head
    clients: dict[str, RoundClient] | None = None  # by client id: each sampled client
    robust: RoundRobust | None = None
    insiders: Insiders | None = None
    delivery: DeliveryCounts | None = None
    server_step: dict[str, float] | None = None   # what the server optimizer's step chose, by name
    gpu_peak_bytes: dict[str, int] | None = None  # per client process that used a GPU
    privacy: RoundPrivacy | None = None
    virtual_seconds: float | None = None     # the virtual clock when the round closed
    virtual_busy: float | None = None        # device seconds of the tasks it folded (virtual clock)
    buffered: BufferedVersion | None = None
    global_metrics: ModelMetrics | None = field(default=None, metadata={"key": "global"})

    def bytes_in(self, direction: str) -> int:
        """The round's physical bytes in ``direction`` (down: to the clients, up)."""
        return self.bytes_down if direction == "down" else self.bytes_up

    def global_accuracy(self) -> float | None:
        """The global model's accuracy on the server's test set after the round (None: not tested)."""
        return self.global_metrics.acc if self.global_metrics is not None else None

    @classmethod
    def from_json(cls, data: Any) -> RoundRecord:
        """A record from a line's JSON object; ValueError where it has no round number."""
        record = super().from_json(data)
        if not isinstance(record.round, int):
            raise ValueError("no round number")
        return record


# ---- summary.json's sections ---------------------------------------------------------------------

@dataclass(kw_only=True)
class Parameters(Section):
    """The model's parameter counts."""

    total: int
    body: int
    head: int


@dataclass(kw_only=True)
class ClientStats(Section):
    """A metric over clients: its mean over clients (unweighted) and standard deviation, the
    sample-weighted mean (each client by its test samples) and how many clients reported it."""

    mean: float | None = field(default=None, metadata=NULLABLE)
    std: float | None = field(default=None, metadata=NULLABLE)
    weighted_mean: float | None = field(default=None, metadata=NULLABLE)
    clients: int = 0


@dataclass(kw_only=True)
class Accuracy(Section):
    """The final evaluation (``metric``: ``acc``, or ``loss`` for a regression and a run without
    one): the global model with each client's personal parts on its test split (``initial``),
    after each number of fine-tune epochs (``personalized``, keyed by epochs), the head-less
    nearest-template classifiers, and the global model on the server's test set."""

    metric: str
    initial: ClientStats
    personalized: dict[str, ClientStats] = field(default_factory=dict)
    headless: ClientStats | None = None
    headless_cosine: ClientStats | None = None
    global_metrics: ModelMetrics | None = field(default=None, metadata={"key": "global"})

    def longest_finetune(self) -> str | None:
        """The key of ``personalized`` with the most fine-tune epochs (None: none)."""
        return max(self.personalized, key=int, default=None)

    def global_value(self) -> float | None:
        """The global model's value on the server's test set in :attr:`metric` (None: not tested)."""
        return getattr(self.global_metrics, self.metric, None) if self.global_metrics is not None else None


@dataclass(kw_only=True)
class Compute(Section):
    """Client training seconds and FLOPs summed over the rounds, the mean round's wall time, and
    the highest peak GPU memory of a client process (left out on the CPU)."""

    client_seconds: float
    train_flops: float
    round_seconds_mean: float | None = field(default=None, metadata=NULLABLE)
    gpu_peak_bytes: int | None = None


@dataclass(kw_only=True)
class RunDelivery(Section):
    """What the rounds (summed) and the final evaluation had to send again ({}: nothing counted)."""

    rounds: DeliveryCounts | None = field(default=None, metadata=EMPTY)
    evaluation: DeliveryCounts | None = field(default=None, metadata=EMPTY)


@dataclass(kw_only=True)
class NamedInsider(Section):
    """A client the insider monitor named: its outlier results in all and the rounds it was named in."""

    outlier_results: int = 0
    named_in_rounds: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class RunRobust(Section):
    """What the defences did over the run: the rounds' counts summed, the clients whose
    evaluation sample counts were capped, and the clients the insider monitor named, by id."""

    rounds: RobustCounts = field(default_factory=RobustCounts)
    evaluation_samples_capped: list[int] | None = None
    insiders: dict[str, NamedInsider] | None = None


@dataclass(kw_only=True)
class RunPrivacy(Section):
    """The DP budget spent (``privacy.dp``, docs/privacy.md): epsilon reached (null: infinite),
    at which delta, for which sampling and accountant, and the mechanism's settings."""

    epsilon: float | None = field(default=None, metadata=NULLABLE)
    delta: float
    sampling: str
    accountant: str
    noise_multiplier: float
    clip_norm: float
    target_epsilon: float | None = field(default=None, metadata=NULLABLE)
    rounds: int


@dataclass(kw_only=True)
class ClientResult(Section):
    """A client's entry in ``per_client``: its sample counts, its final evaluation (``initial``
    and ``personalized`` by fine-tune epochs, in the summary's metric; null where it did not
    report) and its physical bytes over the run."""

    id: int
    train_samples: int | None = field(default=None, metadata=NULLABLE)
    test_samples: int | None = field(default=None, metadata=NULLABLE)
    initial: float | None = field(default=None, metadata=NULLABLE)
    personalized: dict[str, float | None] = field(default_factory=dict)
    bytes: ByteCounts


@dataclass(kw_only=True)
class RunSummary(Section):
    """``summary.json``: how the run ended, what was trained, the final evaluation, bytes,
    compute and failures. A run that ended early writes what it knew, marked by its status.
    Every key is optional here: a reader of an early end or of an older file reads what it has
    (a completed run's summary has them all, ``note``, ``privacy`` and ``exit_code`` aside)."""

    status: str | None = None                # completed, interrupted, failed (none before fedpart wrote it)
    note: str | None = None                  # why the run ended early, or trained fewer rounds
    rounds_completed: int | None = None
    algorithm: str | None = None
    model: str | None = None
    dataset: str | None = None
    rounds: int | None = None                # the configured rounds
    clients: int | None = None
    seeds: dict[str, int | None] | None = None  # the seed of each source of randomness
    parameters: Parameters | None = None
    accuracy: Accuracy | None = None
    bytes: RunBytes | None = None
    compute: Compute | None = None
    delivery: RunDelivery | None = None
    robust: RunRobust | None = None
    privacy: RunPrivacy | None = None
    seconds: float | None = None             # the run's wall time
    failures: list[str] | None = None
    per_client: list[ClientResult] | None = None
    exit_code: int | None = None             # the server's exit code

    def global_accuracy(self) -> float | None:
        """The global model's accuracy on the server's test set after the last round (None: not tested)."""
        if self.accuracy is None or self.accuracy.global_metrics is None:
            return None
        return self.accuracy.global_metrics.acc


def read_rounds(path: str | Path) -> list[RoundRecord]:
    """Every round record of a ``metrics.jsonl`` (blank lines skipped)."""
    return [RoundRecord.from_json(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def read_summary(path: str | Path) -> RunSummary:
    """A ``summary.json``."""
    return RunSummary.from_json(json.loads(Path(path).read_text()))
