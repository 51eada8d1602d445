"""Order-independent aggregation on the server: the streaming weighted mean and robust aggregators.

The default, :class:`WeightedMean`, folds results into running sums as they arrive, so server
memory is O(model), not O(clients x model). Each running sum is a double-double (float64 value
plus float64 error term, Knuth's TwoSum): the products ``weight * delta`` of float32 deltas and
integer weights are exact in float64 and the compensated sum keeps about 106 bits, so the float32
result does not depend on the order in which results arrived: same seed, same numbers. The sums
are kept in blocks with a lock each, so several threads fold results at once, each
into the blocks the others are not folding.

The robust aggregators :class:`CoordinateMedian` and :class:`CoordinateTrimmedMean` (Yin et al.,
ICML 2018) must see every value of a coordinate at once, so they hold the round's tensors.
How the combined delta then moves the global model is the server optimizer's business
(``fedpart.server.policy.optimizers``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Protocol

import numpy as np
import torch


class Aggregator(Protocol):
    """Combines the tensors of one round's results, per tensor over the results that sent it.

    ``add`` may be called from several threads at once and keeps no reference to the tensors it
    was given once it returns (their buffers may be reused); ``result`` is called once, after
    every ``add`` has returned."""

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None: ...

    def result(self) -> dict[str, torch.Tensor]: ...

    def counts(self) -> dict[str, int]:
        """How many results sent each tensor."""
        ...


def _check_weight(weight: float) -> None:
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"aggregation weight must be positive and finite, got {weight}")


def _two_sum_fold(value: np.ndarray, total: np.ndarray, error: np.ndarray, source: np.ndarray,
                  weight: float) -> None:
    """Add ``weight * source`` to the double-double (``value``, ``error``), writing the new value
    into ``total`` (Knuth's TwoSum, one pass): term = float64(source) * weight (exact for float32
    sources and integer weights below 2**29); new = value + term; back = new - value;
    term - back and value - (new - back) are what the rounding of new lost of each, and their sum
    goes to the error term. Compiled without fast-math, so nothing is reassociated: each element
    gets exactly the IEEE operations written here."""
    for index in range(source.shape[0]):
        old = value[index]
        term = np.float64(source[index]) * weight
        new = old + term
        back = new - old
        error[index] += (old - (new - back)) + (term - back)
        total[index] = new


def _two_sum_first(value: np.ndarray, total: np.ndarray, error: np.ndarray, source: np.ndarray,
                   weight: float) -> None:
    """:func:`_two_sum_fold` into a sum that holds nothing yet: the same operations with 0.0 for
    the value and the error term, so the same bits, without zeroing the sum first or reading it
    (``value`` is not read)."""
    for index in range(source.shape[0]):
        term = np.float64(source[index]) * weight
        new = 0.0 + term
        back = new - 0.0
        error[index] = 0.0 + ((0.0 - (new - back)) + (term - back))
        total[index] = new


_FOLD_SIGNATURES = ["void(float64[::1], float64[::1], float64[::1], float32[::1], float64)",
                    "void(float64[::1], float64[::1], float64[::1], float64[::1], float64)"]
_KERNEL_OPTIONS = {"nogil": True, "error_model": "numpy", "boundscheck": False}


def _torch_two_sum_fold(value: np.ndarray, total: np.ndarray, error: np.ndarray, source: np.ndarray,
                        weight: float) -> None:
    """:func:`_two_sum_fold` as whole-array torch operations: the same IEEE operations per
    element, so the same bits, in nine passes instead of one (slower than the compiled pass:
    ``benchmarks/fold_throughput.py`` compares them, docs/benchmarks.md)."""
    old = torch.from_numpy(value)
    term = torch.from_numpy(source).to(torch.float64) * weight
    new = torch.from_numpy(total)
    torch.add(old, term, out=new)
    back = new - old
    torch.from_numpy(error).add_((old - (new - back)) + (term - back))


def _torch_two_sum_first(value: np.ndarray, total: np.ndarray, error: np.ndarray, source: np.ndarray,
                         weight: float) -> None:
    """:func:`_two_sum_first` by way of :func:`_torch_two_sum_fold` from a zeroed value and error."""
    value.fill(0.0)
    error.fill(0.0)
    _torch_two_sum_fold(value, total, error, source, weight)


COMPILED_FROM_ELEMENTS = 65_536
"""The fewest elements a kernel call takes before Numba is started for it. Starting Numba (its
compiler's registries, its check for BLAS) costs a process more CPU than the compiled pass saves
over a small model's folds in a whole run, so a server whose tensors are all smaller never starts
it and folds with the fallback, which gives the same bits."""


class Kernel:
    """A loop compiled by Numba (the ``server`` extra) for ``signatures``, without fast-math and
    releasing the GIL: :func:`_two_sum_fold` and :func:`_two_sum_first` for float32 and float64
    sources (one pass instead of torch's nine), and the insider monitor's sketch. It is compiled
    when a call first takes :data:`COMPILED_FROM_ELEMENTS` elements or more, or when the server
    starts with such a tensor (:func:`prepare_kernels`); calls before run ``fallback``, the same
    bits by torch, as every call does without Numba. Compiled code is cached beside the kernel's
    file, or in the user's cache directory; where neither can be written each kernel is compiled
    in each process, once."""

    def __init__(self, loop: Callable[..., None], fallback: Callable[..., None], signatures: list[str]) -> None:
        self.loop = loop
        self.fallback = fallback
        self.signatures = signatures
        self._compiled: Callable[..., None] | None = None
        _KERNELS.append(self)

    def compiled(self) -> Callable[..., None]:
        """The compiled loop (compiled, or loaded from the cache, on the first call), or the
        fallback where Numba is not installed."""
        if self._compiled is None:
            with _COMPILING:
                if self._compiled is None:
                    self._compiled = self._compile()
        return self._compiled

    def for_elements(self, count: int) -> Callable[..., None]:
        """The loop to run on ``count`` elements: the compiled one once there is one or when
        ``count`` reaches :data:`COMPILED_FROM_ELEMENTS`, else the fallback."""
        if self._compiled is not None:
            return self._compiled
        return self.compiled() if count >= COMPILED_FROM_ELEMENTS else self.fallback

    def _compile(self) -> Callable[..., None]:
        try:
            import numba
        except ImportError:
            return self.fallback
        try:
            return numba.njit(self.signatures, cache=True, **_KERNEL_OPTIONS)(self.loop)
        except RuntimeError:  # Numba found no writable cache directory
            return numba.njit(self.signatures, **_KERNEL_OPTIONS)(self.loop)


_KERNELS: list[Kernel] = []
_COMPILING = threading.Lock()


def prepare_kernels(largest_elements: int) -> None:
    """Compile every kernel now if a tensor of ``largest_elements`` would use the compiled loops:
    the server calls this at its start, so that its first round does not pay for Numba's start."""
    if largest_elements >= COMPILED_FROM_ELEMENTS:
        for kernel in _KERNELS:
            kernel.compiled()


_fold_elements = Kernel(_two_sum_fold, _torch_two_sum_fold, _FOLD_SIGNATURES)
_first_fold_elements = Kernel(_two_sum_first, _torch_two_sum_first, _FOLD_SIGNATURES)

FOLD_BLOCK_ELEMENTS = 131_072
"""Elements per block of a running sum: the unit that one thread folds under a block's lock, so
that several threads fold one result's blocks at once. A block's fold is one compiled call that
releases the GIL; smaller blocks cost more calls and lock turns, larger ones let fewer threads fold
a tensor at once. ``benchmarks/fold_throughput.py --block N`` measures another block size."""


def fold_source(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s elements as the contiguous 1-D float32 or float64 array a fold reads; other
    real dtypes become float64 (exact for integers below 2**53 and for float16 and bfloat16)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.to(torch.float64)
    return flat.contiguous().numpy()


class _Block:
    """One block of a running sum: the current value is ``values[current]``; a fold writes the new
    value into the other row (no copy back). Folds of a block run one at a time under ``lock``.
    The rows are not zeroed: until the first fold the block holds nothing (``empty``), and the
    first fold writes them whole (:func:`_two_sum_first`)."""

    def __init__(self, values: tuple[torch.Tensor, torch.Tensor], error: torch.Tensor) -> None:
        self.lock = threading.Lock()
        self.values = values
        self.error = error
        self.current = 0
        self.empty = True
        self._arrays = (values[0].numpy(), values[1].numpy(), error.numpy())

    def fold(self, source: np.ndarray, weight: float) -> None:
        """Add ``weight * source`` (see :func:`_two_sum_fold`); the caller holds the lock."""
        first, second, error = self._arrays
        value, total = (first, second) if self.current == 0 else (second, first)
        kernel = _first_fold_elements if self.empty else _fold_elements
        kernel.for_elements(source.shape[0])(value, total, error, source, weight)
        self.empty = False
        self.current = 1 - self.current

    def result(self, out: torch.Tensor) -> None:
        if self.empty:
            out.zero_()
        else:
            torch.add(self.values[self.current], self.error, out=out)


def _fold(parts: list[tuple[_Block, np.ndarray]], weight: float) -> None:
    """Fold ``weight * part`` into each block. Safe to call from several threads at once: a block
    that another thread is folding is skipped and taken on a later pass, and a thread waits for a
    block only when every block it still needs is busy."""
    pending = parts
    while pending:
        busy = []
        for block, part in pending:
            if block.lock.acquire(blocking=False):
                try:
                    block.fold(part, weight)
                finally:
                    block.lock.release()
            else:
                busy.append((block, part))
        if busy and len(busy) == len(pending):
            block, part = busy.pop(0)
            with block.lock:
                block.fold(part, weight)
        pending = busy


class CompensatedSum:
    """Sum of weighted tensors in double-double precision (float64 value plus float64 error term),
    kept in blocks of ``block_elements`` so that several threads can fold into it at once.

    Every element sees the same operations as in an unblocked fold. A block receives the terms in
    the order its lock was taken, which may differ between blocks when threads fold at once; the
    compensated sum makes the result independent of that order (see the module's docstring).
    """

    def __init__(self, shape: Sequence[int], block_elements: int = FOLD_BLOCK_ELEMENTS) -> None:
        if block_elements <= 0:
            raise ValueError(f"block_elements must be positive, got {block_elements}")
        self.shape = torch.Size(shape)
        self.block_elements = block_elements
        count = self.shape.numel()
        rows = torch.empty((3, count), dtype=torch.float64)  # each block's first fold writes its part
        self._blocks = [_Block((first, second), error) for first, second, error
                        in zip(*(row.split(block_elements) for row in rows))]

    def parts(self, tensor: torch.Tensor) -> list[tuple[_Block, np.ndarray]]:
        """Each block paired with its part of ``tensor`` (any real dtype, the sum's shape), as
        :func:`fold_source` gives it."""
        if tensor.shape != self.shape:
            raise ValueError(f"cannot add a tensor of shape {list(tensor.shape)} to a sum of shape {list(self.shape)}")
        source = fold_source(tensor)
        size = self.block_elements
        return [(block, source[start:start + size]) for block, start in zip(self._blocks, range(0, len(source), size))]

    def add(self, tensor: torch.Tensor, weight: float = 1.0) -> None:
        """Fold in ``weight * tensor``; safe to call from several threads at once (see :func:`_fold`)."""
        _fold(self.parts(tensor), float(weight))

    def result(self) -> torch.Tensor:
        """value + error, in float64, shaped like the terms."""
        out = torch.empty(self.shape.numel(), dtype=torch.float64)
        for block, part in zip(self._blocks, out.split(self.block_elements)):
            with block.lock:
                block.result(part)
        return out.view(self.shape)


class WeightedMean:
    """Per-tensor weighted mean over the clients that sent that tensor.

    :meth:`add` may be called from several threads at once: their folds run concurrently, in
    different blocks of the running sums (of any of the result's tensors).
    """

    def __init__(self, block_elements: int = FOLD_BLOCK_ELEMENTS) -> None:
        self.block_elements = block_elements
        self._sums: dict[str, CompensatedSum] = {}
        self._weights: dict[str, list[float]] = {}
        self._lock = threading.Lock()     # guards the two dicts, not the sums' contents

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold one client's tensors in with aggregation weight ``weight`` (> 0). A bad weight, or
        a tensor whose shape differs from earlier results' or that is not real, changes nothing."""
        _check_weight(weight)
        for name, tensor in tensors.items():
            if tensor.is_complex():
                raise ValueError(f"tensor {name!r}: cannot average dtype {tensor.dtype}")
        with self._lock:
            for name, tensor in tensors.items():
                known = self._sums.get(name)
                if known is not None and known.shape != tensor.shape:
                    raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, earlier results "
                                     f"sent {list(known.shape)}")
            for name, tensor in tensors.items():
                if name not in self._sums:
                    self._sums[name] = CompensatedSum(tensor.shape, self.block_elements)
                    self._weights[name] = []
                self._weights[name].append(weight)
            parts = [part for name, tensor in tensors.items() for part in self._sums[name].parts(tensor)]
        _fold(parts, float(weight))

    def __len__(self) -> int:
        return len(self._sums)

    def result(self) -> dict[str, torch.Tensor]:
        """Weighted mean of every tensor received, in float64 (call after every fold has returned).
        The weights are summed exactly rounded (math.fsum), so in any order."""
        with self._lock:
            return {name: total.result().div_(math.fsum(self._weights[name]))
                    for name, total in self._sums.items()}

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {name: len(weights) for name, weights in self._weights.items()}


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
        self._lock = threading.Lock()

    def trimmed(self, count: int) -> int:
        """How many values are dropped at each end of a coordinate that has ``count`` values."""
        return math.floor(Fraction(repr(self.trim_fraction)) * count)  # no float rounding

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Hold a copy of one result's tensors (``weight`` is checked like the mean's, then unused)."""
        _check_weight(weight)
        copies = {name: tensor.clone() for name, tensor in tensors.items()}
        with self._lock:
            for name, copy in copies.items():
                self._held.setdefault(name, []).append(copy)

    def __len__(self) -> int:
        return len(self._held)

    def result(self) -> dict[str, torch.Tensor]:
        """The combined value of every tensor received, in float64."""
        with self._lock:
            return {name: self._combine(torch.stack(held)) for name, held in self._held.items()}

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {name: len(held) for name, held in self._held.items()}

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
