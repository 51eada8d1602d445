"""Order-independent aggregation on the server: the streaming weighted mean and robust aggregators.

The default, :class:`WeightedMean`, folds results into running sums as they arrive, so server
memory is O(model), not O(clients x model). Each running sum is a double-double (float64 value
plus float64 error term, Knuth's TwoSum): the products ``weight * delta`` of float32 deltas and
integer weights are exact in float64 and the compensated sum keeps about 106 bits, so the float32
result does not depend on the order in which results arrived: same seed, same numbers.

The robust aggregators :class:`CoordinateMedian` and :class:`CoordinateTrimmedMean` (Yin et al.,
ICML 2018) must see every value of a coordinate at once, so they hold the round's tensors.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Protocol

import torch


class Aggregator(Protocol):
    """Combines the tensors of one round's results, per tensor over the results that sent it."""

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None: ...

    def result(self) -> dict[str, torch.Tensor]: ...


def _check_weight(weight: float) -> None:
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"aggregation weight must be positive and finite, got {weight}")


class CompensatedSum:
    """Sum of float64 tensors in double-double precision (value plus running error term)."""

    def __init__(self, like: torch.Tensor) -> None:
        self.value = torch.zeros(like.shape, dtype=torch.float64)
        self.error = torch.zeros(like.shape, dtype=torch.float64)

    def add(self, term: torch.Tensor, total: torch.Tensor, lost: torch.Tensor) -> None:
        """Add ``term`` (TwoSum). ``term`` is overwritten; ``total`` and ``lost`` are scratch
        tensors of the same shape, so a fold allocates nothing."""
        torch.add(self.value, term, out=total)
        torch.sub(total, self.value, out=lost)   # the part of term that made it into total
        term.sub_(lost)                           # term - back
        torch.sub(total, lost, out=lost)
        torch.sub(self.value, lost, out=lost)     # value - (total - back)
        self.error.add_(lost.add_(term))
        self.value.copy_(total)

    def result(self) -> torch.Tensor:
        return self.value + self.error


class WeightedMean:
    """Per-tensor weighted mean over the clients that sent that tensor."""

    def __init__(self) -> None:
        self._sums: dict[str, CompensatedSum] = {}
        self._weights: dict[str, float] = {}
        self._scratch = torch.empty((3, 0), dtype=torch.float64)  # reused by every fold
        self._lock = threading.Lock()

    def _scratch_for(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Three float64 scratch tensors shaped like ``tensor``, shared across tensors."""
        if self._scratch.shape[1] < tensor.numel():
            self._scratch = torch.empty((3, tensor.numel()), dtype=torch.float64)
        return [row[:tensor.numel()].view(tensor.shape) for row in self._scratch]

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold one client's tensors in with aggregation weight ``weight`` (> 0)."""
        _check_weight(weight)
        with self._lock:
            self._fold(tensors, weight)

    def _fold(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        for name, tensor in tensors.items():
            if name not in self._sums:
                self._sums[name] = CompensatedSum(tensor)
                self._weights[name] = 0.0
            term, total, lost = self._scratch_for(tensor)
            term.copy_(tensor).mul_(weight)
            self._sums[name].add(term, total, lost)
            self._weights[name] += weight

    def __len__(self) -> int:
        return len(self._sums)

    def result(self) -> dict[str, torch.Tensor]:
        """Weighted mean of every tensor received, in float64."""
        return {name: s.result() / self._weights[name] for name, s in self._sums.items()}


class CoordinateTrimmedMean:
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): of the n values of each coordinate,
    the ``floor(trim_fraction * n)`` largest and as many smallest are dropped and the rest averaged.

    Unlike the streaming :class:`WeightedMean` it holds every result's tensors until the round
    closes: O(results x model) memory. Unweighted, as in the paper (a sample count is only what a
    client claims). The values of each coordinate are sorted before they are combined, so the
    result does not depend on the order in which results arrived.
    """

    def __init__(self, trim_fraction: float) -> None:
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"trim fraction must be in [0, 0.5), got {trim_fraction}")
        self.trim_fraction = trim_fraction
        self._held: dict[str, list[torch.Tensor]] = {}

    def trimmed(self, count: int) -> int:
        """How many values are dropped at each end of a coordinate that has ``count`` values."""
        return math.floor(Fraction(repr(self.trim_fraction)) * count)  # no float rounding

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Hold one result's tensors (``weight`` is checked like the mean's, then unused)."""
        _check_weight(weight)
        for name, tensor in tensors.items():
            self._held.setdefault(name, []).append(tensor.clone())

    def __len__(self) -> int:
        return len(self._held)

    def result(self) -> dict[str, torch.Tensor]:
        """The combined value of every tensor received, in float64."""
        return {name: self._combine(torch.stack(held)) for name, held in self._held.items()}

    def _combine(self, stacked: torch.Tensor) -> torch.Tensor:
        count = stacked.shape[0]
        cut = self.trimmed(count)
        kept = stacked.sort(dim=0).values[cut:count - cut]
        return kept.sum(dim=0, dtype=torch.float64) / (count - 2 * cut)


class CoordinateMedian(CoordinateTrimmedMean):
    """Coordinate-wise median (Yin et al., ICML 2018): the middle value of each coordinate, or the
    mean of the two middle values when the count is even. Holds the round's tensors like
    :class:`CoordinateTrimmedMean`."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def trimmed(self, count: int) -> int:
        return (count - 1) // 2


def apply_deltas(global_state: Mapping[str, torch.Tensor], mean_deltas: Mapping[str, torch.Tensor],
                 server_lr: float) -> dict[str, torch.Tensor]:
    """``new = old + server_lr * mean delta`` for the tensors that have a delta (new tensors)."""
    updated = {}
    for name, delta in mean_deltas.items():
        old = global_state[name]
        updated[name] = (old.to(torch.float64) + server_lr * delta).to(old.dtype)
    return updated


class HeadDictionary:
    """FedHA's head dictionary: the latest uploaded copy per client; the global copy combines them
    (their weighted mean, or the run's robust aggregator)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[dict[str, torch.Tensor], float]] = {}

    def store(self, client_id: int, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        _check_weight(weight)
        self._entries[client_id] = ({k: v.clone() for k, v in tensors.items()}, weight)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[int, tuple[dict[str, torch.Tensor], float]]:
        """A copy of the stored ``{client: (tensors, weight)}`` (for the run state)."""
        return dict(self._entries)

    def combine(self, aggregator: Aggregator) -> dict[str, torch.Tensor]:
        """The stored copies combined by a fresh ``aggregator``, added in client-id order."""
        for client_id in sorted(self._entries):
            tensors, weight = self._entries[client_id]
            aggregator.add(tensors, weight)
        return aggregator.result()
