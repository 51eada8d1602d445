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
Each folded result leaves its norm and a count sketch of B = :data:`SKETCH_BUCKETS` numbers
(Charikar, Chen and Farach-Colton, "Finding frequent items in data streams", ICALP 2002): every
element of the delta is multiplied by a sign, +1 or -1, and added, in float32, into one of the
buckets. The signs, and an offset per tensor, are drawn from SHAKE-256 of the tensor's name;
element i of a tensor (in its flat order) goes into bucket (offset + i) mod B. The paper draws
the bucket from a hash as well; here it is fixed, so that a tensor is sketched in one pass over
its elements in order (a run of B buckets at a time), not by a scatter. B is a prime, so that the
elements of a weight matrix's column (a stride such as 1,024 or 800 elements) spread over all
buckets, and the offsets keep small tensors (biases) from sharing the first ones.

Two elements i != j in one bucket add s_i s_j x_i y_j to the inner product of the sketches of
deltas x and y, nothing on average over the signs: the inner product of two sketches estimates
that of the deltas without bias, with a variance of at most 2 sum_b |x_b|^2 |y_b|^2 (x_b: the
elements of x in bucket b), about |x|^2 |y|^2 / B (twice that at most) where neither delta holds
much of its norm in a few buckets. A cosine of sketches then estimates the deltas' cosine within
about 1/sqrt(B) (0.03). Within a tensor the buckets follow the elements' places, so a delta whose
weight lies on elements a multiple of B apart in one tensor falls into one bucket; one of a few
scattered elements, or of one constant value, spreads as under a hash. A tensor's signs and
buckets depend on its name and size only, not on the result's other tensors or the order its
results arrived in, so a round's figures are the same in every process and run, and a resumed
server (the history is in the run state) gives the same warnings. An insider who knows the signs
(they follow from the names) could shape a delta whose sketch looks ordinary; its norm stays
exact.

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

import numpy as np
import torch

from fedpart.common.process.console import Log
from fedpart.common.process.records import Insiders, Outlier, SumCheck
from fedpart.server.policy.aggregation import Kernel

SKETCH_BUCKETS = 1021  # a prime: see the module
MIN_RESULTS = 3   # the fewest results a round judges its results by
SUM_HISTORY = 5   # rounds of revealed sums the sum of a securely aggregated round is compared with
_TORCH_SKETCH_ROWS = 128  # rows of buckets per block of the sketch without Numba: a buffer of 0.5 MB


def _sketch_tensor(sums: np.ndarray, source: np.ndarray, signs: np.ndarray, offset: int) -> None:
    """Add ``source[i] * signs[i]`` into ``sums[(offset + i) % len(sums)]`` for i = 0, 1, ... in
    that order, in float32 (the product by a sign is exact): one pass, a run of buckets at a time.
    Compiled without fast-math, so each bucket gets exactly these additions in this order."""
    buckets = sums.shape[0]
    done = 0
    place = offset
    while done < source.shape[0]:
        count = min(buckets - place, source.shape[0] - done)
        run, part, sign = sums[place:place + count], source[done:done + count], signs[done:done + count]
        for index in range(count):
            run[index] += part[index] * np.float32(sign[index])
        done += count
        place = 0


def _torch_sketch_tensor(sums: np.ndarray, source: np.ndarray, signs: np.ndarray, offset: int) -> None:
    """:func:`_sketch_tensor` as torch operations, the same bits: the elements that fill the first
    run of buckets, then whole rows of ``len(sums)`` elements (:data:`_TORCH_SKETCH_ROWS` at a time,
    signed into one small buffer and added row after row: ``index_add_`` takes its rows in order),
    then the rest. Several passes instead of one, and one call per block of rows."""
    buckets, count = sums.shape[0], source.shape[0]
    total = torch.from_numpy(sums)
    source_t, signs_t = torch.from_numpy(source), torch.from_numpy(signs)
    head = min(count, buckets - offset)
    total[offset:offset + head] += source_t[:head] * signs_t[:head]
    rows = (count - head) // buckets
    block = torch.empty(min(rows, _TORCH_SKETCH_ROWS) * buckets, dtype=torch.float32)
    for first in range(0, rows, _TORCH_SKETCH_ROWS):
        taken = min(_TORCH_SKETCH_ROWS, rows - first)
        start, stop = head + first * buckets, head + (first + taken) * buckets
        signed = torch.mul(source_t[start:stop], signs_t[start:stop], out=block[:stop - start])
        total.unsqueeze(0).index_add_(0, torch.zeros(taken, dtype=torch.int64), signed.view(taken, buckets))
    done = head + rows * buckets
    total[:count - done] += source_t[done:] * signs_t[done:]


_sketch_elements = Kernel(_sketch_tensor, _torch_sketch_tensor,
                          ["void(float32[::1], float32[::1], int8[::1], int64)"])


class CountSketch:
    """Count sketches of ``buckets`` numbers (:data:`SKETCH_BUCKETS`) of sets of tensors: element i
    of a tensor, times its sign, goes into bucket (offset + i) mod ``buckets``, the offset and the
    signs drawn from SHAKE-256 of the tensor's name (the same in every process and run). The signs
    of a tensor are drawn once and kept: int8 per element, O(model)."""

    def __init__(self, buckets: int = SKETCH_BUCKETS) -> None:
        self.buckets = buckets
        self._drawn: dict[str, tuple[int, np.ndarray]] = {}  # name -> (offset, signs)
        self._lock = threading.Lock()

    def _draw(self, name: str, count: int) -> tuple[int, np.ndarray]:
        with self._lock:
            drawn = self._drawn.get(name)
            if drawn is None or drawn[1].shape[0] != count:
                stream = hashlib.shake_256(name.encode()).digest(8 + (count + 7) // 8)
                bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8, offset=8), count=count, bitorder="little")
                drawn = (int.from_bytes(stream[:8], "little") % self.buckets, bits.astype(np.int8) * 2 - 1)
                self._drawn[name] = drawn
            return drawn

    def sketch(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The sketch (float64) of ``tensors`` taken together: the tensors in the order of their
        names, each in one pass (:func:`_sketch_tensor`, compiled by Numba where the ``server``
        extra is installed and the tensors are large enough for it to pay
        (:class:`~fedpart.server.policy.aggregation.Kernel`), else the same bits by torch),
        summed in float32 straight from a float32 tensor: a float64 copy of every result would
        cost the server as much as the sum."""
        sums = np.zeros(self.buckets, dtype=np.float32)
        for name in sorted(tensors):  # in one order: the same sketch whatever order the tensors came in
            flat = tensors[name].detach().reshape(-1)
            source = (flat if flat.dtype == torch.float32 else flat.float()).contiguous().numpy()
            offset, signs = self._draw(name, source.shape[0])
            _sketch_elements.for_elements(source.shape[0])(sums, source, signs, offset)
        return torch.from_numpy(sums).double()


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
