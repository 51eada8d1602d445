"""Client ids: the ranges a process hosts (``0-9``, ``3,5,7``, ``0-3,8``) read and written, and
the contiguous even split of a run's clients over its processes (``fedpart run``, ``fedpart
certs``, the Kubernetes Job and the load generator all split the same way)."""

from __future__ import annotations

from collections.abc import Iterable


def parse_id_ranges(spec: str) -> list[int]:
    """``"0-9"``, ``"3,5,7"`` or ``"0-3,8"`` -> sorted unique non-negative ids."""
    ids: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise ValueError
                ids.update(range(low, high + 1))
            else:
                ids.add(int(part))
        except ValueError as error:
            raise ValueError(f"cannot read client ids {part!r} (use e.g. 0-9 or 3,5,7)") from error
    if not ids or min(ids) < 0:
        raise ValueError(f"{spec!r} names no valid client ids")
    return sorted(ids)


def format_id_ranges(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the inverse of :func:`parse_id_ranges`)."""
    parts: list[str] = []
    start = prev = None
    for i in [*sorted(ids), None]:
        if start is None:
            start = prev = i
        elif i is not None and i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    return ",".join(parts)


def split_clients(num_clients: int, processes: int) -> list[str]:
    """Contiguous, even client-id ranges, one per process (``0-4``, ``5-9``)."""
    processes = max(1, min(processes, num_clients))
    bounds = [round(i * num_clients / processes) for i in range(processes + 1)]
    return [f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:]) if b > a]
