"""Exact byte accounting: serialized size of every gRPC message, by round, client, direction
and part (``body``, ``head``, ``other`` for tensor bytes, ``control`` for everything else)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping

PARTS = ("body", "head", "other", "control")
DIRECTIONS = ("down", "up")
PROCESS = -1  # client id for messages that belong to a process, not one client (join, polls)


class ByteLedger:
    """Thread-safe byte counters keyed by (round, client, direction, part)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int, str, str], int] = defaultdict(int)

    def add(self, round_number: int, client: int, direction: str, by_part: Mapping[str, int]) -> None:
        with self._lock:
            for part, count in by_part.items():
                if count:
                    self._counts[(round_number, client, direction, part)] += count

    def _select(self, round_number: int | None = None, client: int | None = None) -> dict[str, dict[str, int]]:
        out = {part: {d: 0 for d in DIRECTIONS} for part in PARTS}
        with self._lock:
            items = list(self._counts.items())
        for (r, c, direction, part), count in items:
            if (round_number is None or r == round_number) and (client is None or c == client):
                out[part][direction] += count
        return out

    def by_part(self, round_number: int | None = None, client: int | None = None) -> dict[str, dict[str, int]]:
        """``{part: {"down": n, "up": n}}`` for one round and/or client (all when None)."""
        return self._select(round_number, client)

    def totals(self, round_number: int | None = None, client: int | None = None) -> dict[str, int]:
        """``{"down": n, "up": n}``."""
        parts = self._select(round_number, client)
        return {d: sum(parts[p][d] for p in PARTS) for d in DIRECTIONS}
