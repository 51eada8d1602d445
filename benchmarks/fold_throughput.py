"""Server fold throughput: milliseconds of one cnn2 result's fold into the weighted mean, measured
side by side in one run.

Workload: results shaped like ``cnn2``'s state (582,026 float32 parameters in 8 tensors) with
integer weights, cycled from a pool of ``--pool`` distinct results (more than the last-level
cache holds, as a server's fresh uploads are), folded into a fresh mean for ``--seconds`` per
measurement.

Variants:

- **torch ops (before)**: the fold the server used before it was compiled, copied here for the
  comparison only: the same blocks, each folded by nine torch ops (TwoSum over float64 rows),
  one result at a time.
- **compiled, 1 thread**: :class:`fedpart.server.policy.aggregation.WeightedMean` fed from one thread
  (one compiled pass a block).
- **compiled, N threads**: the same mean fed by a pool of ``--threads`` Python threads, one
  result per task, as the server's fold threads feed it with ``server.fold_workers``.

Conditions, each measured for every variant:

- **idle**: nothing else runs in this process (other processes on the machine are counted: the
  "other CPU" column is the cores they used meanwhile).
- **core busy**: a spinning process keeps one core busy, as a server's other work does (its core
  counts as other CPU).
- **GIL busy**: a thread of this process runs Python code the whole time, as a server's event
  loop does when it is saturated; every torch op or compiled block fold releases the GIL, and a
  fold thread whose call ends waits for it (up to ``sys.getswitchinterval()``).

Before timing, every variant folds the same results and their means are checked to be
bit-identical. Each variant is measured ``--repeat`` times per condition, interleaved with the
others, and its fastest measurement is printed with the CPU other processes used meanwhile (the
machine is shared: that is the noise). CPU ms/result counts every thread of this process, the
GIL-busy spinner included. Linux only (reads ``/proc/stat``).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fedpart.common.models.zoo import build_model
from fedpart.server.policy.aggregation import FOLD_BLOCK_ELEMENTS, WeightedMean

Result = tuple[dict[str, torch.Tensor], int]


class TorchOpsMean:
    """Reference copy of the fold before it was compiled (commit 7f8ed8a): the same blocks, each
    folded as nine torch ops over float64 rows and two scratch rows; one fold at a time."""

    def __init__(self, block: int) -> None:
        self.block = block
        self._sums: dict[str, tuple[list[tuple[torch.Tensor, ...]], list[int]]] = {}
        self._weights: dict[str, float] = {}
        self._scratch = torch.empty((2, block), dtype=torch.float64)

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        for name, tensor in tensors.items():
            if name not in self._sums:
                rows = torch.zeros((3, tensor.numel()), dtype=torch.float64)
                blocks = list(zip(*(row.split(self.block) for row in rows)))
                self._sums[name] = (blocks, [0] * len(blocks))
                self._weights[name] = 0.0
            blocks, currents = self._sums[name]
            for index, ((first, second, error), part) in enumerate(zip(blocks, tensor.reshape(-1).split(self.block))):
                term, lost = (row[:part.numel()] for row in self._scratch)
                value, total = (first, second) if currents[index] == 0 else (second, first)
                term.copy_(part).mul_(weight)
                torch.add(value, term, out=total)
                torch.sub(total, value, out=lost)
                term.sub_(lost)
                torch.sub(total, lost, out=lost)
                torch.sub(value, lost, out=lost)
                error.add_(lost.add_(term))
                currents[index] = 1 - currents[index]
            self._weights[name] += weight

    def result(self) -> dict[str, torch.Tensor]:
        means = {}
        for name, (blocks, currents) in self._sums.items():
            rows = [(first if current == 0 else second) + error
                    for (first, second, error), current in zip(blocks, currents)]
            means[name] = torch.cat(rows) / self._weights[name]
        return means


def cnn2_results(count: int, seed: int = 0) -> list[Result]:
    """``count`` random results shaped like cnn2 on MNIST, with integer weights in [1, 600]."""
    shapes = {name: tensor.shape for name, tensor in build_model("cnn2", 10, (1, 28, 28), seed=0).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    return [({name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in shapes.items()},
             int(torch.randint(1, 601, (1,), generator=generator)))
            for _ in range(count)]


def digest(means: Mapping[str, torch.Tensor]) -> str:
    """Short SHA-256 of the means' float64 bytes, in name order."""
    hasher = hashlib.sha256()
    for name in sorted(means):
        hasher.update(means[name].numpy().tobytes())
    return hasher.hexdigest()[:12]


def fold_sequentially(mean, results: list[Result]) -> None:
    for tensors, weight in results:
        mean.add(tensors, weight)


def fold_on_pool(pool: ThreadPoolExecutor, mean: WeightedMean, results: list[Result]) -> None:
    """Fold every result as its own task of the thread pool (as the server's fold threads do)."""
    for done in [pool.submit(mean.add, tensors, weight) for tensors, weight in results]:
        done.result()


@dataclass
class Variant:
    label: str
    make_mean: Callable[[], object]
    fold: Callable[[object, list[Result]], None]


@dataclass
class Timing:
    wall_ms: float       # per result
    cpu_ms: float        # per result, this process
    other_cores: float   # CPU of other processes meanwhile, in cores


def busy_jiffies() -> int:
    """Jiffies the whole machine has spent busy (not idle, not waiting for I/O), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def measure(variant: Variant, pool: list[Result], seconds: float, batch: int = 4) -> Timing:
    """Fold the pool's results, ``batch`` at a time, into a fresh mean until ``seconds`` passed."""
    variant.fold(variant.make_mean(), pool[:batch])  # warm-up: allocator, scratch, threads
    mean = variant.make_mean()
    ticks = os.sysconf("SC_CLK_TCK")
    busy = busy_jiffies()
    wall, cpu = time.perf_counter(), time.process_time()
    folded = 0
    while folded == 0 or time.perf_counter() - wall < seconds:
        start = folded % len(pool)
        variant.fold(mean, pool[start:start + batch])
        folded += len(pool[start:start + batch])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    busy_after = busy_jiffies()
    other_cores = max(0.0, (busy_after - busy) / ticks - cpu) / wall
    return Timing(wall / folded * 1e3, cpu / folded * 1e3, other_cores)


CONDITIONS = ("idle", "core busy", "GIL busy")


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


@contextmanager
def condition(name: str) -> Iterator[None]:
    """Run the block with nothing else (idle), a spinning process (core busy) or a spinning
    Python thread in this process (GIL busy)."""
    if name == "idle":
        yield
        return
    if name == "core busy":
        stop = mp.Event()
        spinner = mp.Process(target=_spin, args=(stop,), daemon=True)
    else:
        stop = threading.Event()
        spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.7, help="folding time per measurement (default 0.7)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="measurements per variant and condition, the fastest reported (default 3)")
    parser.add_argument("--pool", type=int, default=16, help="distinct results cycled through (default 16, 37 MB)")
    parser.add_argument("--threads", type=int, default=2, help="Python threads of the concurrent variant (default 2)")
    parser.add_argument("--block", type=int, default=FOLD_BLOCK_ELEMENTS, help="elements per block of the blocked fold")
    parser.add_argument("--torch-threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: torch's, here %(default)s)")
    parser.add_argument("--switch-interval", type=float, default=sys.getswitchinterval(),
                        help="sys.setswitchinterval (default: Python's, %(default)s s)")
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS),
                        help="conditions to measure (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    sys.setswitchinterval(args.switch_interval)

    pool = cnn2_results(args.pool)
    fold_threads = ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="fold")
    variants = [
        Variant("torch ops (before)", lambda: TorchOpsMean(args.block), fold_sequentially),
        Variant("compiled, 1 thread", lambda: WeightedMean(args.block), fold_sequentially),
        Variant(f"compiled, {args.threads} threads at once", lambda: WeightedMean(args.block),
                lambda mean, results: fold_on_pool(fold_threads, mean, results)),
    ]
    digests = set()
    for variant in variants:
        mean = variant.make_mean()
        variant.fold(mean, pool)
        digests.add(digest(mean.result()))
    print(f"cnn2-sized results (582,026 float32, 8 tensors), {len(pool)} distinct; block {args.block} elements; "
          f"{torch.get_num_threads()} torch threads; switch interval {sys.getswitchinterval() * 1e3:g} ms; "
          f"{os.cpu_count()} cores")
    print("means of every variant bit-identical:", "yes" if len(digests) == 1 else f"NO ({len(digests)} different)")
    print(f"{'condition':<10} {'variant':<28} {'wall ms/result':>14} {'CPU ms/result':>13} {'results/s':>9} "
          f"{'vs before':>9} {'other CPU':>9}")
    for name in args.conditions:
        with condition(name):
            best: dict[str, Timing] = {}
            for _ in range(args.repeat):  # interleaved, so that drift of the machine hits every variant
                for variant in variants:
                    timing = measure(variant, pool, args.seconds)
                    if variant.label not in best or timing.wall_ms < best[variant.label].wall_ms:
                        best[variant.label] = timing
            before = best[variants[0].label].wall_ms
            for variant in variants:
                timing = best[variant.label]
                print(f"{name:<10} {variant.label:<28} {timing.wall_ms:>14.2f} {timing.cpu_ms:>13.2f} "
                      f"{1e3 / timing.wall_ms:>9.0f} {before / timing.wall_ms:>8.2f}x {timing.other_cores:>6.2f} cores",
                      flush=True)
    fold_threads.shutdown()


if __name__ == "__main__":
    main()
