"""Exact byte accounting: serialized size of every gRPC message, by round, client, direction
and part (``body``, ``head``, ``other`` and any extra model part such as FedRoD's
``personal_head`` for tensor bytes, ``control`` for everything else); and,
over the run, the tensor bytes of accepted traffic by direction and encoding next to the bytes
of the decoded tensors (the compression ratio achieved on the wire).

Two figures (DESIGN section 11). **Physical** bytes are what crossed each connection: a client
process caches global tensors by version, so a process hosting five clients downloads a changed
tensor once, and its joins, heartbeats and idle polls belong to no client (:data:`PROCESS`).
**Logical** bytes are what each task costs a client that is its own device and holds nothing:
every tensor the task names, in the encoding the server sends, in a stream of its own, its header
listing them all, its request, its result and the answer to it; counted once a task (a task sent
again after a fault adds physical bytes only). They do not depend on how clients are packed into
processes; their tensor bytes are also split by the model's schedule unit (``conv1``, ...,
``head``, extra parts by name, ``other``)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence

from fedpart.common.process.records import DIRECTIONS

PARTS = ("body", "head", "other", "control")  # always reported; extra parts once they carried bytes
PROCESS = -1  # client id for messages that belong to a process, not one client (join, polls)


class ByteLedger:
    """Thread-safe byte counters keyed by (round, client, direction, part), with running totals
    per round, per client and overall so that every query is a lookup, however long the run;
    beside them the logical bytes by (round, direction, part), (round, client, direction) and
    (round, direction, unit). ``units`` are the model's schedule units, in order: the units
    :meth:`by_unit` always lists (others follow once they carried bytes)."""

    def __init__(self, units: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int, str, str], int] = defaultdict(int)
        self._by_round: dict[tuple[int, str, str], int] = defaultdict(int)
        self._by_client: dict[tuple[int, str, str], int] = defaultdict(int)
        self._overall: dict[tuple[str, str], int] = defaultdict(int)
        self.refused_bytes = 0  # serialized bytes of results the server refused (not traffic of any round)
        self._encodings: dict[tuple[str, str], dict[str, int]] = {}  # (direction, encoding) -> wire / raw
        self._parts: list[str] = list(PARTS)
        self._units: list[str] = list(units)
        self._logical_by_round: dict[tuple[int, str, str], int] = defaultdict(int)
        self._logical_by_client: dict[tuple[int, int, str], int] = defaultdict(int)
        self._logical_by_unit: dict[tuple[int, str, str], int] = defaultdict(int)
        self._logical_overall: dict[tuple[str, str], int] = defaultdict(int)       # (direction, part)
        self._logical_unit_overall: dict[tuple[str, str], int] = defaultdict(int)  # (direction, unit)

    def add(self, round_number: int, client: int, direction: str, by_part: Mapping[str, int]) -> None:
        with self._lock:
            for part, count in by_part.items():
                if count:
                    if part not in self._parts:
                        self._parts.append(part)
                    self._counts[(round_number, client, direction, part)] += count
                    self._by_round[(round_number, direction, part)] += count
                    self._by_client[(client, direction, part)] += count
                    self._overall[(direction, part)] += count

    def add_logical(self, round_number: int, client: int, direction: str, by_part: Mapping[str, int],
                    by_unit: Mapping[str, int]) -> None:
        """Add logical bytes of one client's task: ``by_part`` as in :meth:`add`, ``by_unit`` its
        tensor bytes by schedule unit (they sum to its tensor parts' bytes)."""
        with self._lock:
            for part, count in by_part.items():
                if count:
                    if part not in self._parts:
                        self._parts.append(part)
                    self._logical_by_round[(round_number, direction, part)] += count
                    self._logical_by_client[(round_number, client, direction)] += count
                    self._logical_overall[(direction, part)] += count
            for unit, count in by_unit.items():
                if count:
                    if unit not in self._units:
                        self._units.append(unit)
                    self._logical_by_unit[(round_number, direction, unit)] += count
                    self._logical_unit_overall[(direction, unit)] += count

    def add_encodings(self, direction: str, counts: Mapping[str, Mapping[str, int]]) -> None:
        """Add ``{encoding: {"wire": n, "raw": m}}`` (serialized tensor bytes, decoded bytes)."""
        with self._lock:
            for encoding, count in counts.items():
                entry = self._encodings.setdefault((direction, encoding), {"wire": 0, "raw": 0})
                entry["wire"] += count["wire"]
                entry["raw"] += count["raw"]

    def encodings(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{direction: {encoding: {"wire": n, "raw": m}}}`` over the run."""
        with self._lock:
            out: dict[str, dict[str, dict[str, int]]] = {d: {} for d in DIRECTIONS}
            for (direction, encoding), entry in sorted(self._encodings.items()):
                out[direction][encoding] = dict(entry)
            return out

    def refuse(self, count: int) -> None:
        """Count the bytes of a refused result apart from accepted traffic."""
        with self._lock:
            self.refused_bytes += count

    def by_part(self, round_number: int | None = None, client: int | None = None) -> dict[str, dict[str, int]]:
        """``{part: {"down": n, "up": n}}`` for one round and/or client (all when None)."""
        with self._lock:
            parts = list(self._parts)
            if round_number is not None and client is not None:
                return {p: {d: self._counts.get((round_number, client, d, p), 0) for d in DIRECTIONS} for p in parts}
            if round_number is not None:
                return {p: {d: self._by_round.get((round_number, d, p), 0) for d in DIRECTIONS} for p in parts}
            if client is not None:
                return {p: {d: self._by_client.get((client, d, p), 0) for d in DIRECTIONS} for p in parts}
            return {p: {d: self._overall.get((d, p), 0) for d in DIRECTIONS} for p in parts}

    def totals(self, round_number: int | None = None, client: int | None = None) -> dict[str, int]:
        """``{"down": n, "up": n}``."""
        parts = self.by_part(round_number, client)
        return {d: sum(counts[d] for counts in parts.values()) for d in DIRECTIONS}

    def logical(self, round_number: int | None = None) -> dict:
        """``{"down": n, "up": n, "by_part": {part: {"down": n, "up": n}}}`` of one round (of
        every round this ledger counted when None)."""
        with self._lock:
            by_part = _split(self._logical_by_round, self._logical_overall, self._parts, round_number)
        return {**{d: sum(counts[d] for counts in by_part.values()) for d in DIRECTIONS}, "by_part": by_part}

    def logical_totals(self, round_number: int, client: int) -> dict[str, int]:
        """``{"down": n, "up": n}``: one client's logical bytes in one round."""
        with self._lock:
            return {d: self._logical_by_client.get((round_number, client, d), 0) for d in DIRECTIONS}

    def by_unit(self, round_number: int | None = None) -> dict[str, dict[str, int]]:
        """``{unit: {"down": n, "up": n}}``: logical tensor bytes by schedule unit, in the model's
        order, of one round (of every round this ledger counted when None)."""
        with self._lock:
            return _split(self._logical_by_unit, self._logical_unit_overall, self._units, round_number)


def _split(counts: Mapping[tuple[int, str, str], int], overall: Mapping[tuple[str, str], int], keys: Sequence[str],
           round_number: int | None) -> dict[str, dict[str, int]]:
    """``{key: {"down": n, "up": n}}`` from counts by (round, direction, key), of one round, or
    (``round_number`` None) from ``overall``, the running sum over every round by (direction, key)."""
    if round_number is not None:
        return {k: {d: counts.get((round_number, d, k), 0) for d in DIRECTIONS} for k in keys}
    return {k: {d: overall.get((d, k), 0) for d in DIRECTIONS} for k in keys}
