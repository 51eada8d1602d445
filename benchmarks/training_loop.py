"""fedpart's local training loop against the compute floor's, in one process at one torch thread.

Workload: ``round_overhead.py``'s client 0 (cnn2, its 600 MNIST training samples, one epoch of 60
SGD steps of batch 10, lr 0.01), from the same initial weights and with the same shuffling seed.
The two loops are :func:`fedpart.client.training.train_local` as a client process calls it for
FedAvg (plain speed options, no objective terms, the progress callback every 10 steps) and the
floor's epoch (``round_overhead._train_epoch``: zero_grad, forward, loss, backward, step).

What is printed:

- **operators**: the torch operators each loop dispatches in one epoch (``torch.profiler`` counts,
  deterministic) and the ones whose counts differ: the loops' own work beside the model's.
- **CPU an epoch**: ``--pairs`` epochs of each, taking turns (the order alternating from pair to
  pair), each timed by ``time.thread_time``; the median of the pairs' ratios with its 90 % interval
  (``round_overhead.median_interval``). A pair's ratio scatters by several per cent on a shared
  machine, so the interval, not the median alone, says what the pairs show.
- **same work**: whether both loops end at identical weights.

``python benchmarks/training_loop.py [--pairs 60]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_overhead as floor  # noqa: E402 - scripts beside this one

from fedpart.client.local_data import ClientData  # noqa: E402
from fedpart.client.training import train_local  # noqa: E402
from fedpart.common.models.zoo import build_model, unit_forward_flops  # noqa: E402
from fedpart.common.wire.plans import Phase, TrainPlan  # noqa: E402

CLIENT = 0
ROUND = 1


class Loops:
    """The two loops over the same model, data and seed; each call trains one epoch from the
    initial weights and returns the weights it ends at."""

    def __init__(self, data_root: Path) -> None:
        torch.set_num_threads(1)
        self.x, self.y = floor._client_train_data(data_root / "MNIST" / "raw", [CLIENT])[CLIENT]
        self.data = ClientData(self.x, self.y, self.x[:0], self.y[:0])
        self.model = build_model(floor.MODEL, floor.NUM_CLASSES, floor.INPUT_SHAPE, floor.SEED)
        self.start = {name: value.clone() for name, value in self.model.state_dict().items()}
        self.unit_flops = unit_forward_flops(self.model, floor.INPUT_SHAPE)
        self.seed = floor.task_seed(ROUND, CLIENT)
        self.plan = TrainPlan(phases=(Phase(floor.EPOCHS, tuple(self.model.schedule_units)),), lr=floor.LR,
                              batch_size=floor.BATCH_SIZE, upload_deltas=tuple(self.start), seed=self.seed)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def fedpart_epoch(self) -> dict[str, torch.Tensor]:
        self.model.load_state_dict(self.start)
        train_local(self.model, self.data, self.plan, self.loss_fn, self.start, self.unit_flops,
                    on_steps=lambda steps, all_steps: None)
        return self._weights()

    def floor_epoch(self) -> dict[str, torch.Tensor]:
        self.model.load_state_dict(self.start)
        floor._train_epoch(self.model, self.x, self.y, self.seed)
        return self._weights()

    def _weights(self) -> dict[str, torch.Tensor]:
        return {name: value.clone() for name, value in self.model.state_dict().items()}


def operator_counts(loop: Callable[[], object]) -> Counter[str]:
    """The torch operators one epoch of ``loop`` dispatches, by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        loop()
    return Counter({event.key: event.count for event in profiled.key_averages()})


def thread_seconds(loop: Callable[[], object]) -> float:
    started = time.thread_time()
    loop()
    return time.thread_time() - started


def paired_ratios(loops: Loops, pairs: int) -> tuple[list[float], list[float], list[float]]:
    """``pairs`` epochs of each loop taking turns: (fedpart / floor ratios, fedpart seconds, floor seconds)."""
    ratios, fedpart_seconds, floor_seconds = [], [], []
    for index in range(pairs):
        if index % 2:
            ours, theirs = thread_seconds(loops.fedpart_epoch), thread_seconds(loops.floor_epoch)
        else:
            theirs, ours = thread_seconds(loops.floor_epoch), thread_seconds(loops.fedpart_epoch)
        ratios.append(ours / theirs)
        fedpart_seconds.append(ours)
        floor_seconds.append(theirs)
    return ratios, fedpart_seconds, floor_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60, help="timed epochs of each loop, taking turns (default 60)")
    parser.add_argument("--data-root", type=Path, default=floor.default_data_root(),
                        help="directory holding MNIST/raw (default ../shared/data)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    loops = Loops(args.data_root)
    ours_final, floor_final = loops.fedpart_epoch(), loops.floor_epoch()
    same = all(torch.equal(ours_final[name], floor_final[name]) for name in ours_final)
    ours, theirs = operator_counts(loops.fedpart_epoch), operator_counts(loops.floor_epoch)
    print(f"{floor.MODEL} / MNIST client {CLIENT}: {len(loops.x)} samples, batch {floor.BATCH_SIZE}, "
          f"{floor.EPOCHS} epoch, 1 torch thread; torch {torch.__version__}")
    print(f"operators an epoch  fedpart {sum(ours.values())}, floor {sum(theirs.values())}")
    for name in sorted(set(ours) | set(theirs)):
        if ours[name] != theirs[name]:
            print(f"  {name:32s} fedpart {ours[name]:5d}  floor {theirs[name]:5d}  ({ours[name] - theirs[name]:+d})")
    ratios, fedpart_seconds, floor_seconds = paired_ratios(loops, args.pairs)
    low, high = floor.median_interval(ratios)
    print(f"CPU an epoch        fedpart {statistics.median(fedpart_seconds):.4f} s, "
          f"floor {statistics.median(floor_seconds):.4f} s (medians of {args.pairs})")
    print(f"ratio fedpart / floor {statistics.median(ratios):.4f} (median of {args.pairs} pairs), "
          f"90% interval {low:.4f}-{high:.4f}")
    print(f"same work           {'identical final weights' if same else 'THE FINAL WEIGHTS DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
