"""The records a run leaves in its directory (docs/output.md), typed: a line of ``metrics.jsonl``
(:class:`RoundRecord`, one per round) and ``summary.json`` (:class:`RunSummary`). The server
writes them, the report and the benchmarks read them.

``to_json`` gives the JSON object as the file holds it (same keys, in the same order, same
nesting); ``from_json`` reads one back, so ``from_json(to_json(r)) == r``. Files written by an
earlier fedpart, or by a run that ended early, may lack keys: a key marked optional below reads as
None and is left out again when written; a round's number or list reads as zero or empty. Keys
this module does not know are ignored. The sections below a key (bytes by part, accuracy, ...)
stay plain JSON values. Standard library only: a report reads run directories on any machine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

JsonObject = dict[str, Any]
Record = TypeVar("Record", "RoundRecord", "RunSummary")
NULLABLE = {"nullable": True}  # a key written even when its value is None (JSON null)


def _key(f: Any) -> str:
    return f.metadata.get("key", f.name)


def _to_json(record: RoundRecord | RunSummary) -> JsonObject:
    """The record's fields under their JSON keys, in field order; None left out unless nullable."""
    out = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is not None or f.metadata.get("nullable"):
            out[_key(f)] = value
    return out


def _from_json(cls: type[Record], data: JsonObject) -> Record:
    """``cls`` from a JSON object; a ValueError names the required keys it lacks."""
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object: {type(data).__name__}")
    found = {f.name: data[_key(f)] for f in fields(cls) if _key(f) in data}
    try:
        return cls(**found)
    except TypeError as error:
        raise ValueError(f"{cls.__name__}: missing keys ({error})") from error


@dataclass(kw_only=True)
class RoundRecord:
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
    bytes_by_part: JsonObject = field(default_factory=dict)  # part -> {down, up}
    logical: JsonObject | None = None        # optional: {down, up, by_part}
    bytes_by_unit: JsonObject | None = None  # optional: logical bytes by body unit and head
    clients: JsonObject | None = None        # optional: client id -> its bytes and compute seconds
    robust: JsonObject | None = None         # optional: clipped, rejected, samples capped, non-finite
    insiders: JsonObject | None = None       # optional: the insider monitor's median norm and outliers
    delivery: dict[str, int] | None = None   # optional: what had to be sent again, by kind
    server_step: JsonObject | None = None    # optional: what the server optimizer's step chose
    gpu_peak_bytes: dict[str, int] | None = None  # optional: per client process that used a GPU
    privacy: JsonObject | None = None        # optional: {epsilon} after the round (privacy.dp)
    global_metrics: dict[str, float] | None = field(default=None, metadata={"key": "global"})  # optional
    virtual_seconds: float | None = None     # optional: the virtual clock when the round closed
    virtual_busy: float | None = None        # optional: device seconds of the tasks it folded (virtual clock)
    buffered: JsonObject | None = None       # optional: the buffered engine's version (staleness, ...)

    def bytes_in(self, direction: str) -> int:
        """The round's physical bytes in ``direction`` (down: to the clients, up)."""
        return self.bytes_down if direction == "down" else self.bytes_up

    def to_json(self) -> JsonObject:
        """The line's JSON object."""
        return _to_json(self)

    @classmethod
    def from_json(cls, data: JsonObject) -> RoundRecord:
        """A record from a line's JSON object; ValueError where it has no round number."""
        record = _from_json(cls, data)
        if not isinstance(record.round, int):
            raise ValueError("no round number")
        return record


@dataclass(kw_only=True)
class RunSummary:
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
    parameters: JsonObject | None = None     # {total, body, head}
    accuracy: JsonObject | None = None       # {metric, initial, personalized, [headless...], [global]}
    bytes: JsonObject | None = None          # physical and logical, by part, per round, compression
    compute: JsonObject | None = None        # client seconds, train flops, round seconds, [gpu peak]
    delivery: JsonObject | None = None       # {rounds, evaluation}: what had to be sent again
    robust: JsonObject | None = None         # the defences' counts, capped evaluation reports, insiders named
    privacy: JsonObject | None = None        # the DP budget spent (privacy.dp)
    seconds: float | None = None             # the run's wall time
    failures: list[str] | None = None
    per_client: list[JsonObject] | None = None
    exit_code: int | None = None             # the server's exit code

    def to_json(self) -> JsonObject:
        """The file's JSON object."""
        return _to_json(self)

    @classmethod
    def from_json(cls, data: JsonObject) -> RunSummary:
        """A summary from the file's JSON object; ValueError where it is not an object."""
        return _from_json(cls, data)


def read_rounds(path: str | Path) -> list[RoundRecord]:
    """Every round record of a ``metrics.jsonl`` (blank lines skipped)."""
    return [RoundRecord.from_json(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def read_summary(path: str | Path) -> RunSummary:
    """A ``summary.json``."""
    return RunSummary.from_json(json.loads(Path(path).read_text()))
