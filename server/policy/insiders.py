"""The insider monitor: each client's results watched over rounds, and a warning (log line and
Prometheus metric) when one is an outlier in several results in a row (issue 51).

A screening bound judges one result against the round before it; an insider who steers the model
within the bound sends results that look unremarkable one at a time and stand out only over
rounds. The monitor keeps, per client, how many of its latest results were outliers in a row,
from two figures of each result:

- its delta's L2 norm over the median norm of the round's folded results (a norm ratio);
- the cosine of its delta to the round's robust centre: the coordinate-wise median of the folded
  results' sketches. A median, because a minority cannot move it far (the round's mean would
  follow the insider it is meant to expose).

A result is an outlier where its norm ratio exceeds ``robust.monitor_norm_ratio`` or its cosine is
below ``robust.monitor_cosine``; a client whose last ``robust.monitor_rounds`` results were all
outliers is named in a warning, again for every further outlier result, and in the
``fedpart_insider_outlier_streak`` metric. Results a norm bound refused count too (their norm is
known; they never move the median or the centre). A round with fewer than
:data:`MIN_RESULTS` results judges nobody: too few to tell an outlier from the rest.

Memory is O(model) plus a little per client: the server never holds a copy of every result.
Each folded result leaves its norm and a count sketch of :data:`SKETCH_BUCKETS` numbers (Charikar,
Chen and Farach-Colton, "Finding frequent items in data streams", ICALP 2002): every element of
the delta is added, with a sign, into one of the buckets, both drawn from a hash of the tensor's
name. The inner product of two sketches estimates that of the deltas without bias, so a cosine of
sketches estimates the deltas' cosine within about 1/sqrt(:data:`SKETCH_BUCKETS`) (0.03). The
hashes are fixed by the tensor names, so a round's figures do not depend on the order its results
arrived in, and a resumed server (the history is in the run state) gives the same warnings. An
insider who knows the hashes could shape a delta whose sketch looks ordinary; its norm stays exact.

Under secure aggregation the server sees only the round's sum: the monitor then watches that, one
figure a round, against the sums of the :data:`SUM_HISTORY` rounds before (a norm ratio to their
median). It can name no client there, and a steady insider present from the first round sets the
scale it compares against (docs/security.md).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fedpart.common.process.console import Log
from fedpart.common.process.records import Insiders, Outlier, SumCheck

SKETCH_BUCKETS = 1024
MIN_RESULTS = 3   # the fewest results a round judges its results by
SUM_HISTORY = 5   # rounds of revealed sums the sum of a securely aggregated round is compared with


class CountSketch:
    """Count sketches of :data:`SKETCH_BUCKETS` numbers of sets of tensors: each element goes, with
    a sign, into a bucket drawn from the SHA-256 of its tensor's name (the same in every process
    and run). The hashes of a tensor are drawn once and kept: int64 per element, O(model)."""

    def __init__(self, buckets: int = SKETCH_BUCKETS) -> None:
        self.buckets = buckets
        self._slots: dict[str, torch.Tensor] = {}  # name -> bucket, plus `buckets` for a negative sign
        self._lock = threading.Lock()

    def _slots_of(self, name: str, count: int) -> torch.Tensor:
        with self._lock:
            slots = self._slots.get(name)
            if slots is None or slots.numel() != count:
                seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
                generator = torch.Generator().manual_seed(seed)
                slots = torch.randint(0, 2 * self.buckets, (count,), generator=generator, dtype=torch.int64)
                self._slots[name] = slots
            return slots

    def sketch(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The sketch (float64) of ``tensors`` taken together, summed in float32 straight from a
        float32 tensor: a float64 copy of every result would cost the server as much as the sum."""
        signed = torch.zeros(2 * self.buckets, dtype=torch.float64)
        for name in sorted(tensors):  # in one order: the same sketch whatever order the tensors came in
            flat = tensors[name].detach().reshape(-1)
            part = torch.zeros(2 * self.buckets, dtype=torch.float32)
            signed += part.index_add_(0, self._slots_of(name, flat.numel()), flat.float())
        return signed[:self.buckets] - signed[self.buckets:]


@dataclass(frozen=True)
class Observation:
    """What the monitor keeps of one result: its delta's norm and sketch."""

    norm: float
    sketch: torch.Tensor


@dataclass
class History:
    """One client's record with the monitor."""

    streak: int = 0      # its latest results that were outliers, in a row
    since: int = 0       # the round of the first of them
    outliers: int = 0    # its outlier results in all


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The cosine of two sketches; None where either is zero."""
    scale = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    return float(a @ b) / scale if scale > 0 else None


class InsiderMonitor:
    """The per-client history of outlier results over the rounds, and its warnings."""

    STATE_PREFIX = "robust.monitor/"  # keys of the history in the run state

    def __init__(self, clients: int, norm_ratio: float, min_cosine: float, rounds: int,
                 log: Callable[[str], None]) -> None:
        self.clients = clients
        self.norm_ratio = norm_ratio
        self.min_cosine = min_cosine
        self.rounds = rounds
        self.log = Log.of(log)
        self.sketches = CountSketch()
        self._history = [History() for _ in range(clients)]
        self._sums: list[float] = []  # norms of the latest revealed sums (secure aggregation)
        self._sum_history = History()
        self._lock = threading.Lock()

    def observe(self, deltas: Mapping[str, torch.Tensor], norm: float) -> Observation:
        """What the monitor keeps of a result whose deltas have L2 norm ``norm``."""
        return Observation(norm, self.sketches.sketch(deltas))

    def close_round(self, round_number: int, folded: Mapping[int, Observation],
                    refused: Mapping[int, Observation]) -> Insiders | None:
        """Judge round ``round_number``'s results: those folded, by which the median norm and the
        robust centre are taken, and those a norm bound refused. Updates every judged client's
        history, logs the warnings, and returns the round record's ``insiders`` entry (None where
        the round judged nobody)."""
        if len(folded) < MIN_RESULTS:
            return None
        median = statistics.median(observation.norm for observation in folded.values())
        centre = torch.stack([folded[client].sketch for client in sorted(folded)]).median(dim=0).values
        outliers: dict[str, Outlier] = {}
        with self._lock:
            for client, observation in sorted({**folded, **refused}.items()):
                ratio = observation.norm / median if median > 0 else math.inf
                angle = cosine(observation.sketch, centre)
                history = self._history[client]
                if not (ratio > self.norm_ratio or (angle is not None and angle < self.min_cosine)):
                    history.streak = 0
                    continue
                history.since = history.since if history.streak else round_number
                history.streak += 1
                history.outliers += 1
                outliers[str(client)] = Outlier(norm_ratio=ratio, cosine=angle, streak=history.streak)
                if history.streak >= self.rounds:
                    self.log.warning(f"round {round_number}: client {client} is an outlier in its last "
                             f"{history.streak} results (rounds {history.since}-{round_number}): delta norm "
                             f"{ratio:.3g} x the round's median, cosine {_signed(angle)} to the round's robust "
                             f"centre (robust.monitor_norm_ratio {self.norm_ratio:g}, robust.monitor_cosine "
                             f"{self.min_cosine:g}, robust.monitor_rounds {self.rounds})")
        return Insiders(median_norm=median, outliers=outliers)

    def close_sum(self, round_number: int, norm: float) -> Insiders | None:
        """Judge a securely aggregated round by the norm of its revealed sum (of the combined
        delta), against the median of the :data:`SUM_HISTORY` sums before it; returns the round
        record's ``insiders`` entry (None until there is a sum to compare with)."""
        with self._lock:
            earlier, self._sums = self._sums, (self._sums + [norm])[-SUM_HISTORY:]
            if not earlier:
                return None
            median = statistics.median(earlier)
            ratio = norm / median if median > 0 else math.inf
            history = self._sum_history
            if ratio <= self.norm_ratio:
                history.streak = 0
                return Insiders(median_norm=median, revealed_sum=SumCheck(norm_ratio=ratio, streak=0))
            history.since = history.since if history.streak else round_number
            history.streak += 1
            history.outliers += 1
            if history.streak >= self.rounds:
                self.log.warning(f"round {round_number}: the revealed sum of the round's updates is an outlier in "
                         f"{history.streak} rounds in a row (rounds {history.since}-{round_number}): its norm is "
                         f"{ratio:.3g} x the median of the {len(earlier)} sums before it (secure aggregation shows "
                         "no single update, so no client can be named)")
            return Insiders(median_norm=median, revealed_sum=SumCheck(norm_ratio=ratio, streak=history.streak))

    def named(self, client: int) -> int | None:
        """The run of outlier results of ``client`` where it is at least ``robust.monitor_rounds``
        long (the client is named), else None."""
        with self._lock:
            streak = self._history[client].streak
        return streak if streak >= self.rounds else None

    def streaks(self) -> dict[int, int]:
        """Each client's current run of outlier results, where it has one (for the metrics)."""
        with self._lock:
            return {client: history.streak for client, history in enumerate(self._history) if history.streak}

    def state(self) -> dict[str, torch.Tensor]:
        """The history, for the run state (keys with :attr:`STATE_PREFIX`)."""
        with self._lock:
            histories = [*self._history, self._sum_history]
            return {
                self.STATE_PREFIX + "streak": torch.tensor([h.streak for h in histories], dtype=torch.int64),
                self.STATE_PREFIX + "since": torch.tensor([h.since for h in histories], dtype=torch.int64),
                self.STATE_PREFIX + "outliers": torch.tensor([h.outliers for h in histories], dtype=torch.int64),
                self.STATE_PREFIX + "sums": torch.tensor(self._sums, dtype=torch.float64),
            }

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with the history :meth:`state` returned (nothing: a run saved before the
        monitor kept one starts it afresh)."""
        if not state:
            return
        columns = [state.get(self.STATE_PREFIX + key) for key in ("streak", "since", "outliers")]
        sums = state.get(self.STATE_PREFIX + "sums")
        expected = (self.clients + 1,)
        if any(column is None or tuple(column.shape) != expected or bool((column < 0).any()) for column in columns):
            raise ValueError(f"the insider monitor's history must hold {expected[0]} non-negative counts per key")
        if sums is None or sums.dim() != 1 or sums.numel() > SUM_HISTORY or not bool(torch.isfinite(sums).all()):
            raise ValueError(f"the insider monitor's sums must be at most {SUM_HISTORY} finite norms")
        histories = [History(int(streak), int(since), int(outliers)) for streak, since, outliers in zip(*columns)]
        with self._lock:
            self._history, self._sum_history = histories[:-1], histories[-1]
            self._sums = [float(norm) for norm in sums]


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"
