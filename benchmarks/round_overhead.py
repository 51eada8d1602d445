"""Round overhead of fedpart against a plain-PyTorch compute floor, measured in one run.

Workload (fixed): FedAvg, model ``cnn2`` (582,026 float32 parameters) on real MNIST, 10 clients,
client i holding training samples [600i, 600i+600) and test samples [100i, 100i+100) in file
order, all 10 clients every round, 1 local epoch of batch 10 (60 SGD steps, lr 0.01, momentum 0)
over shuffled index batches, sample-weighted mean of the deltas, ``--rounds`` rounds (default 12).

What is measured:

- **fedpart**: ``fedpart run`` (one server, ``--processes`` client processes on 127.0.0.1) with
  that config. A round's time is the server's ``seconds`` in ``metrics.jsonl``: sampling, task
  delivery over gRPC, local training, result upload, validation and aggregation, up to the new
  global model. It excludes the per-round checkpoint and log line written after the round, and
  the single evaluation after the last round.
- **floor**: the same work with no framework. P spawn worker processes (P = the number of client
  processes fedpart starts), the same client -> process assignment
  (``fedpart.common.wire.client_ids.split_clients``) and the same torch thread count per process
  (:func:`~fedpart.common.process.limits.client_threads` of P, as ``fedpart run`` gives each client
  process: the cores of this process's affinity and cgroup quota divided by P); each worker
  loads its clients' data and pays torch's one-off optimizer import before the first round
  (not timed; fedpart's clients load their data before they report ready, and train with an
  optimizer that needs no such import). A round's time is wall time
  in the parent from sending the global weights to holding the new global model: every worker,
  for each of its clients, loads the global weights into the model, trains the epoch (same model
  builder and seed, same per-client shuffling seeds, same input layout) and returns the delta
  over a pipe; the parent takes the sample-weighted mean of the deltas in float64 and adds it.
  The floor does not evaluate (fedpart's training rounds do not evaluate either).

The two take turns round by round, because the speed of this kind of machine drifts by 10-30 %
within minutes and by several per cent from one round to the next (other tenants of the host,
frequency), more than the 3 % being measured. Both systems' processes are started and loaded
first; then, each time a fedpart round's line lands in ``metrics.jsonl``, the benchmark waits
:data:`PAUSE_AFTER_SECONDS` (the next fedpart round is under way by then), stops every process of
the fedpart run (SIGSTOP to its process group), times one floor round while they are stopped,
and lets them go on (SIGCONT). So floor round n runs inside fedpart round n + 1, and that fedpart
round's time is its ``seconds`` less the pause: the pair saw the same state of the machine.
A pair counts once its pause is shown to lie inside the fedpart round (the round's line landed
``seconds`` after a moment no later than the pause's start, and the round outlasted its pause);
the first round of each system (start-up work) is not paired. The ratio is the median of the
pairs' ratios, printed with two 90 % intervals (seeded bootstraps): one over the pairs, and one
over the sittings and then the pairs within them. A sitting's pairs share its processes, and whole
sittings of the same code differ by more than their pairs scatter, so the second is the one the
verdict reads: the target counts as met or missed only when that whole interval lies on one side
of it. The medians of the paired rounds and their ratio are printed beside it.
``--runs K`` (default 2) repeats the whole with fresh processes and pools the pairs. A pause of a
few seconds is far inside every timeout of the run (heartbeats, gRPC keepalive), and fedpart's
final checkpoint is compared with the floor's final model: both computed the same steps, so they
agree to float rounding. Wire bytes per client-round come from ``metrics.jsonl`` (every message of the round,
divided by the clients that completed it) next to the raw size of one float32 model copy.

Diagnostics printed beside the timings: CPU seconds per round of every process of each system
(read from ``/proc``; for fedpart between two pauses, while its processes are stopped, which
spans one round's work and the checkpoint after it) and of them the seconds the training threads
(each training process's main thread: torch computes in it at one thread) ran on a core, the rest
split into the training processes' other threads (fedpart: each client's session and gRPC
threads) and the processes that do not train (fedpart's server and launcher, the floor's parent),
the share of their runnable time the training threads waited in a run queue for a core
("waited", from ``/proc/<pid>/task/<pid>/schedstat``), which tells training slowed because other
threads held the cores apart from training that itself ran slower, how often a training thread
was taken off its core while it could still run, per second it ran ("preempted": involuntary
context switches, ``/proc/<pid>/task/<pid>/status``; its time slice ended, or a thread that woke
took the core), the core-seconds the machine's cores sat idle ("idle", from ``/proc/stat``;
fedpart's without the floor's turn in its pause), which
tells a round that outlasted its CPU over the cores because cores went unused apart from one that
used more CPU, and the CPU other processes on the machine used meanwhile ("foreign"). Linux only.
"""

from __future__ import annotations

import argparse
import gzip
import multiprocessing as mp
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.nn.utils import parameters_to_vector

from fedpart.common.process.checkpoint import load_tensors
from fedpart.common.process.limits import client_threads
from fedpart.common.models.zoo import build_model
from fedpart.common.process.records import RoundRecord, read_rounds
from fedpart.common.wire.client_ids import split_clients

MODEL = "cnn2"
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
PARAMETERS = 582_026
SEED = 0
CLIENTS = 10
TRAIN_PER_CLIENT = 600
TEST_PER_CLIENT = 100
EPOCHS = 1
BATCH_SIZE = 10
LR = 0.01
TARGET_RATIO = 1.03
# the intervals printed for the median of the pairs' ratios: percentile bootstraps, seeded so that
# the same pairs always print the same intervals
CONFIDENCE = 0.90
BOOTSTRAP_RESAMPLES = 4000
RAW_MODEL_BYTES = PARAMETERS * 4
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# how often the run's metrics.jsonl is looked at: the looking runs beside fedpart's rounds (the floor's
# have no such observer), and every 10 ms, reading the file, it took 2.7-3.4 % of a core; a size
# check every 50 ms takes 0.4 %
POLL_SECONDS = 0.05
PAUSE_AFTER_SECONDS = 0.3  # from a round's line to the pause: the checkpoint is written and the next round under way
WORKER_START_SECONDS = 300.0
WORKER_STOP_SECONDS = 30.0
FLOOR_ROUND_SECONDS = 600.0
STOP_SECONDS = 5.0


def default_data_root() -> Path:
    """``<checkout>/../shared/data``: the real MNIST copy beside the repository."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def client_processes(processes: int) -> tuple[list[list[int]], int]:
    """Client ids per process and torch threads per process, exactly as ``fedpart run`` does."""
    ranges = split_clients(CLIENTS, processes)
    groups = []
    for spec in ranges:
        low, high = (int(x) for x in spec.split("-"))
        groups.append(list(range(low, high + 1)))
    return groups, client_threads(len(groups))


def task_seed(round_number: int, client: int) -> int:
    """The shuffling seed fedpart's coordinator puts in a client's training plan."""
    return (SEED * 1_000_003 + round_number) * 1_000_003 + client


# ------------------------------------------------------------------------------------ the floor


def _read_idx(path: Path) -> np.ndarray:
    """A gzipped uint8 IDX file as an array of its declared shape."""
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    dims = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _client_train_data(raw: Path, clients: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each client's training block as float32 ``[600, 1, 28, 28]`` in [0, 1] and int64 labels.

    The block is taken by index from the ``[N, 1, 28, 28]`` view, as fedpart's loader does: numpy
    then gives the channel axis stride 1, a layout that is channels-last as well as contiguous,
    and PyTorch runs the convolutions in channels-last kernels (same numbers, other speed).
    """
    images = _read_idx(raw / "train-images-idx3-ubyte.gz")[:, None]
    labels = _read_idx(raw / "train-labels-idx1-ubyte.gz")
    out = {}
    for client in clients:
        block = np.arange(client * TRAIN_PER_CLIENT, (client + 1) * TRAIN_PER_CLIENT)
        x = torch.from_numpy(images[block]).to(torch.float32).mul_(1.0 / 255)
        out[client] = (x, torch.from_numpy(labels[block].astype(np.int64)))
    return out


def _train_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    """One epoch of SGD over shuffled index batches."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    for _ in range(EPOCHS):
        order = torch.randperm(x.shape[0], generator=generator)
        for start in range(0, x.shape[0], BATCH_SIZE):
            index = order[start:start + BATCH_SIZE]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x[index]), y[index]).backward()
            optimizer.step()


def floor_worker(conn: Connection, clients: list[int], threads: int, raw: str) -> None:
    """Worker process: load data once, then per message ``(round, global vector)`` train every
    hosted client from the global weights and send back
    ``[(client, samples, delta), ...]``."""
    torch.set_num_threads(threads)
    model = build_model(MODEL, NUM_CLASSES, INPUT_SHAPE, SEED)
    torch.optim.SGD(model.parameters(), lr=0.0)  # torch's one-off optimizer import, before the rounds are timed
    data = _client_train_data(Path(raw), clients)
    conn.send("ready")
    while (message := _next_message(conn)) is not None:
        conn.send(train_clients(model, data, clients, *message))
    conn.close()


def train_clients(model: torch.nn.Module, data: dict[int, tuple[torch.Tensor, torch.Tensor]], clients: list[int],
                  round_number: int, global_vector: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """A worker's round: each of ``clients`` trained from the global weights, as
    ``[(client, samples, delta), ...]``."""
    start = torch.from_numpy(global_vector)
    state = _unflatten(start, model)
    results = []
    for client in clients:
        x, y = data[client]
        model.load_state_dict(state)
        _train_epoch(model, x, y, task_seed(round_number, client))
        delta = parameters_to_vector(model.parameters()).detach() - start
        results.append((client, x.shape[0], delta.numpy()))
    return results


def _next_message(conn: Connection) -> Any:
    """The parent's next message; None (stop) also when the parent closed its end."""
    try:
        return conn.recv()
    except EOFError:
        return None


def _unflatten(vector: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of views into ``vector`` (``cnn2`` has parameters only, in state-dict order)."""
    state, offset = {}, 0
    for name, value in model.state_dict().items():
        state[name] = vector[offset:offset + value.numel()].view_as(value)
        offset += value.numel()
    return state


def process_tree(root: int) -> list[int]:
    """Process ``root`` and its live descendants."""
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:  # it has just ended
            continue
        tree.append(pid)
        pending.extend(int(child) for child in children)
    return tree


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name, the state first; OSError once
    process ``pid`` has ended."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far; 0 once it has ended."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_seconds() -> tuple[float, float]:
    """Core-seconds the machine's cores have so far been busy and idle (``/proc/stat``; idle
    counts idle + iowait, busy everything else, hypervisor steal included)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / CLOCK_TICKS, idle / CLOCK_TICKS


def main_thread_schedstat(pid: int) -> tuple[float, float]:
    """Seconds the main thread of process ``pid`` has so far run on a core and waited in a run
    queue for one (runnable, not running: ``/proc/<pid>/task/<pid>/schedstat``); zeros once it
    has ended."""
    try:
        running, waiting, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except OSError:
        return 0.0, 0.0
    return int(running) / 1e9, int(waiting) / 1e9


def main_thread_preemptions(pid: int) -> int:
    """Times the main thread of process ``pid`` has so far been taken off its core while it could
    still run (involuntary context switches, ``/proc/<pid>/task/<pid>/status``); 0 once it has
    ended."""
    try:
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines()
                 if line.startswith("nonvoluntary_ctxt_switches:")), 0)


@dataclass(frozen=True)
class Usage:
    """What a system's processes have used so far: CPU seconds of all of them, seconds its
    training threads (each training process's main thread, the one torch computes in at one
    thread) ran on a core and waited for one, the core-seconds the machine's cores sat idle, CPU
    seconds of the training processes (all their threads) and the times the training threads were
    preempted."""

    cpu: float
    trainers_running: float
    trainers_waiting: float
    machine_idle: float
    training_processes: float
    trainers_preempted: int

    @staticmethod
    def of(processes: Iterable[int], trainers: Iterable[int]) -> Usage:
        trainers = list(trainers)
        stats = [main_thread_schedstat(pid) for pid in trainers]
        return Usage(sum(map(cpu_seconds, processes)), sum(run for run, _ in stats), sum(wait for _, wait in stats),
                     machine_seconds()[1], sum(map(cpu_seconds, trainers)),
                     sum(map(main_thread_preemptions, trainers)))

    def __sub__(self, earlier: Usage) -> Usage:
        """The usage between ``earlier`` and this one."""
        return Usage(self.cpu - earlier.cpu, self.trainers_running - earlier.trainers_running,
                     self.trainers_waiting - earlier.trainers_waiting, self.machine_idle - earlier.machine_idle,
                     self.training_processes - earlier.training_processes,
                     self.trainers_preempted - earlier.trainers_preempted)

    @property
    def others(self) -> float:
        """CPU seconds of every thread but the training threads."""
        return self.cpu - self.trainers_running

    @property
    def beside_training(self) -> float:
        """CPU seconds of the training processes' other threads (fedpart: a client's session and
        gRPC threads)."""
        return self.training_processes - self.trainers_running

    @property
    def not_training(self) -> float:
        """CPU seconds of the processes that do not train (fedpart: server and launcher; the
        floor: its parent)."""
        return self.cpu - self.training_processes

    @property
    def trainers_waited(self) -> float | None:
        """The share of the training threads' runnable time they spent waiting for a core (None
        when they were not runnable)."""
        runnable = self.trainers_running + self.trainers_waiting
        return self.trainers_waiting / runnable if runnable > 0 else None

    @property
    def trainers_preempted_per_second(self) -> float | None:
        """Preemptions of the training threads per second they ran (None when they did not run)."""
        return self.trainers_preempted / self.trainers_running if self.trainers_running > 0 else None


class ForeignCpu:
    """Cores' worth of CPU that processes outside this benchmark (other users of the machine,
    hypervisor steal) used during a ``with`` block: how far the timings in it can be trusted.

    Machine-wide busy time comes from ``/proc/stat``; this process and its descendants are
    subtracted once they have been waited for (``RUSAGE_CHILDREN``), so the block must end after
    every process it started has ended.
    """

    def __init__(self) -> None:
        self.cores = 0.0
        self._start = (0.0, 0.0, 0.0)

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        machine, _ = machine_seconds()
        own = sum(getattr(resource.getrusage(who), field)
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for field in ("ru_utime", "ru_stime"))
        return machine, own, time.perf_counter()

    def __enter__(self) -> ForeignCpu:
        self._start = self._sample()
        return self

    def __exit__(self, *_: object) -> None:
        machine, own, wall = (end - start for end, start in zip(self._sample(), self._start, strict=True))
        self.cores = max(0.0, (machine - own) / wall)


class Floor:
    """The floor's worker processes, started and loaded on entry and stopped on exit (bounded, by
    process handle); :meth:`round` times one round from the current global weights."""

    def __init__(self, processes: int, raw: Path) -> None:
        self.groups, self.threads = client_processes(processes)
        self.raw = raw
        self.pipes: list[Connection] = []
        self.workers: list[mp.process.BaseProcess] = []
        self.global_vector = parameters_to_vector(
            build_model(MODEL, NUM_CLASSES, INPUT_SHAPE, SEED).parameters()).detach()
        self.rounds_done = 0

    def __enter__(self) -> Floor:
        context = mp.get_context("spawn")
        try:
            for clients in self.groups:
                parent, child = context.Pipe()
                worker: mp.process.BaseProcess = context.Process(
                    target=floor_worker, args=(child, clients, self.threads, str(self.raw)), daemon=True)
                worker.start()
                child.close()
                self.pipes.append(parent)
                self.workers.append(worker)
            for pipe in self.pipes:
                _receive(pipe, WORKER_START_SECONDS)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for pipe in self.pipes:
            pipe.close()
        deadline = time.monotonic() + WORKER_STOP_SECONDS
        for worker in self.workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)

    def usage(self) -> Usage:
        """What the parent (this process) and the workers (the training processes) used so far."""
        trainers = [worker.pid for worker in self.workers]
        return Usage.of([os.getpid(), *trainers], trainers)

    def round(self) -> tuple[float, Usage]:
        """The next round: its wall seconds and the usage of the parent and the workers in it."""
        self.rounds_done += 1
        before = self.usage()
        started = time.perf_counter()
        payload = (self.rounds_done, self.global_vector.numpy())
        for pipe in self.pipes:
            pipe.send(payload)
        results = [result for pipe in self.pipes for result in _receive(pipe, FLOOR_ROUND_SECONDS)]
        self.global_vector = add_mean(self.global_vector, results)
        seconds = time.perf_counter() - started
        return seconds, self.usage() - before


def add_mean(global_vector: torch.Tensor, results: list[tuple[int, int, np.ndarray]]) -> torch.Tensor:
    """The global weights plus the sample-weighted mean of the workers' deltas, summed in float64
    in client order."""
    total = torch.zeros(PARAMETERS, dtype=torch.float64)
    for _, samples, delta in sorted(results, key=lambda r: r[0]):
        total += torch.from_numpy(delta).to(torch.float64) * samples
    mean = total / sum(samples for _, samples, _ in results)
    return (global_vector.to(torch.float64) + mean).to(torch.float32)


def _receive(pipe: Connection, timeout: float) -> Any:
    """One message from a worker; RuntimeError when it sends nothing within ``timeout`` or died."""
    try:
        if pipe.poll(timeout):
            return pipe.recv()
    except EOFError:
        raise RuntimeError("a floor worker ended unexpectedly (see its output above)") from None
    raise RuntimeError(f"a floor worker sent nothing within {timeout:.0f} s")


# -------------------------------------------------------------------------------- taking turns


def fedpart_config(rounds: int, processes: int, data_root: Path) -> dict:
    """The run config of the workload; the evaluation after the last round is reduced to each
    client's initial test accuracy (no fine-tuning, no server-side test)."""
    return {
        "name": "round_overhead",
        "seed": SEED,
        "rounds": rounds,
        "clients": CLIENTS,
        "processes": processes,
        "sampling": {"fraction": 1.0},
        "data": {
            "dataset": "mnist",
            "root": str(data_root),
            "partition": {"scheme": "contiguous", "train_per_client": TRAIN_PER_CLIENT,
                          "test_per_client": TEST_PER_CLIENT},
        },
        "model": {"name": MODEL},
        "algorithm": {"name": "fedavg"},
        "train": {"epochs": EPOCHS, "batch_size": BATCH_SIZE, "lr": LR, "momentum": 0.0},
        "evaluate": {"finetune_epochs": [], "global_test": False},
    }


@dataclass(frozen=True)
class Pause:
    """The fedpart run stopped from ``started`` to ``ended`` (``time.monotonic``) while the floor
    ran ``floor_rounds``, with the run's usage when it was stopped and the core-seconds the cores
    sat idle after that, while the floor ran (not fedpart's)."""

    started: float
    ended: float
    floor_rounds: tuple[int, ...]
    usage: Usage
    idle_while_stopped: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass(frozen=True)
class Pair:
    """A fedpart round and the floor round that ran inside it."""

    round: int
    fedpart_seconds: float
    floor_seconds: float

    @property
    def ratio(self) -> float:
        return self.fedpart_seconds / self.floor_seconds


@dataclass
class Sitting:
    """One run of both systems taking turns: fedpart's round records, the moment (monotonic) each
    round's line was seen, the pauses after each line, the floor's rounds (seconds and usage, by
    round), both final models and the foreign CPU meanwhile."""

    records: list[RoundRecord]
    landed: dict[int, float]
    pauses: dict[int, Pause]
    floor_rounds: dict[int, tuple[float, Usage]]
    floor_final: torch.Tensor
    fedpart_final: dict[str, torch.Tensor]
    foreign_cores: float

    def pairs(self) -> list[Pair]:
        """Each fedpart round whose pause (the one after the previous round's line) held exactly
        one floor round, not the floor's first, and lies inside it: the round started no later than
        the pause (its line was seen ``seconds`` after a moment no later than the pause's start)
        and outlasted it. Its time is its ``seconds`` less the pause."""
        pairs = []
        for record in self.records:
            pause = self.pauses.get(record.round - 1)
            if pause is None or len(pause.floor_rounds) != 1 or pause.floor_rounds[0] < 2:
                continue
            seconds = record.seconds - pause.seconds
            seen = self.landed.get(record.round)
            if seconds > 0 and seen is not None and seen - record.seconds <= pause.started:
                pairs.append(Pair(record.round, seconds, self.floor_rounds[pause.floor_rounds[0]][0]))
        return pairs

    def fedpart_usage(self) -> list[Usage]:
        """The run's usage between consecutive pauses: a round's work each (from round 2 on). The
        cores' idle time leaves out the floor's rounds in the earlier pause; it keeps the few
        milliseconds the later pause took to stop the run."""
        rounds = sorted(self.pauses)
        return [_idle_less(self.pauses[n].usage - self.pauses[m].usage, self.pauses[m].idle_while_stopped)
                for m, n in zip(rounds, rounds[1:]) if n == m + 1]

    def floor_usage(self) -> list[Usage]:
        """The floor's usage per round from round 2 on (round 1 includes start-up work)."""
        return [usage for n, (_, usage) in sorted(self.floor_rounds.items()) if n >= 2]


def _idle_less(usage: Usage, idle: float) -> Usage:
    """``usage`` with ``idle`` core-seconds taken off the cores' idle time."""
    return replace(usage, machine_idle=usage.machine_idle - idle)


def run_sitting(rounds: int, processes: int, data_root: Path, work: Path, timeout: float) -> Sitting:
    """Both systems, taking turns (the module's docstring); raises if fedpart's run fails."""
    config_path = work / "round_overhead.yaml"
    config_path.write_text(yaml.safe_dump(fedpart_config(rounds, processes, data_root), sort_keys=False))
    out = work / "run"
    log_path = work / "fedpart.log"
    command = [sys.executable, "-m", "fedpart", "run", str(config_path), "--out", str(out)]
    with ForeignCpu() as foreign, Floor(processes, data_root / "MNIST" / "raw") as floor:
        with log_path.open("w") as log:
            # Its own process group (to stop and continue it as a whole) but not its own session:
            # with autogroup scheduling a new session would get its own share of the CPU next to
            # other users' load, which the floor's workers, in this session, do not.
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
            try:
                code, landed, pauses, floor_rounds = take_turns(process, out / "metrics.jsonl", floor, rounds,
                                                                time.monotonic() + timeout)
            finally:
                _stop(process)
        if code != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            reason = f"exit code {code}" if code is not None else f"no end within {timeout:.0f} s"
            raise RuntimeError(f"fedpart run failed ({reason}); last lines of its output:\n{tail}")
        _floor_up_to(floor, rounds, floor_rounds)  # the floor's rounds after fedpart's last line: not paired
    final = load_tensors(out / "checkpoints" / f"round_{rounds:04d}.safetensors")
    return Sitting(read_rounds(out / "metrics.jsonl"), landed, pauses, floor_rounds, floor.global_vector, final,
                   foreign.cores)


def take_turns(process: subprocess.Popen, metrics: Path, floor: Floor, rounds: int, deadline: float
               ) -> tuple[int | None, dict[int, float], dict[int, Pause], dict[int, tuple[float, Usage]]]:
    """Follow the run until it ends (None: not by ``deadline``), noting when each count of round
    lines is first seen; after a count below ``rounds`` is seen, wait :data:`PAUSE_AFTER_SECONDS`,
    stop the run's process group, run the floor up to that count, and continue the run.
    Returns the exit code, the moments seen, the pauses (by the count they followed) and the
    floor's rounds."""
    landed: dict[int, float] = {}
    pauses: dict[int, Pause] = {}
    floor_rounds: dict[int, tuple[float, Usage]] = {}
    size = -1
    while (code := process.poll()) is None and time.monotonic() < deadline:
        try:
            changed = metrics.stat().st_size != size
        except FileNotFoundError:
            changed = False
        if changed:
            content = metrics.read_bytes()
            size, lines = len(content), content.count(b"\n")
            for line in range(len(landed) + 1, lines + 1):
                landed[line] = time.monotonic()
            if floor.rounds_done < lines < rounds:
                time.sleep(PAUSE_AFTER_SECONDS)
                pauses[lines] = _pause(process, floor, lines, floor_rounds)
                continue
        time.sleep(POLL_SECONDS)
    return code, landed, pauses, floor_rounds


def _pause(process: subprocess.Popen, floor: Floor, rounds: int, floor_rounds: dict[int, tuple[float, Usage]]) -> Pause:
    """Stop the run's process group, run the floor up to ``rounds``, continue the run."""
    started = time.monotonic()
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        tree = process_tree(process.pid)
        _wait_stopped(tree)
        usage = Usage.of(tree, [pid for pid in tree if is_client_process(pid)])
        ran = _floor_up_to(floor, rounds, floor_rounds)
        idle_while_stopped = machine_seconds()[1] - usage.machine_idle
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    return Pause(started, time.monotonic(), tuple(ran), usage, idle_while_stopped)


def _floor_up_to(floor: Floor, rounds: int, floor_rounds: dict[int, tuple[float, Usage]]) -> list[int]:
    """Run the floor's rounds up to ``rounds``, filed in ``floor_rounds``; returns their numbers."""
    ran = []
    while floor.rounds_done < rounds:
        ran.append(floor.rounds_done + 1)
        floor_rounds[ran[-1]] = floor.round()
    return ran


def _wait_stopped(pids: list[int]) -> None:
    """Return once every process of ``pids`` has taken its SIGSTOP (state T) or ended; a signal
    is taken when its process next runs, not when it is sent. RuntimeError after
    :data:`STOP_SECONDS`."""
    deadline = time.monotonic() + STOP_SECONDS
    while True:
        running = []
        for pid in pids:
            try:
                if stat_fields(pid)[0] != "T":
                    running.append(pid)
            except OSError:  # it has ended
                pass
        if not running:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {running} did not stop within {STOP_SECONDS:.0f} s of SIGSTOP")
        time.sleep(0.001)
        pids = running


def is_client_process(pid: int) -> bool:
    """Whether process ``pid`` is a client process of ``fedpart run`` (named ``fedpart-client``
    by the launcher's fork server, ``fedpart/deploy/forks.py``; False once it has ended)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "fedpart-client"
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    """Stop the launcher by PID: SIGINT lets it stop its server and clients; then its group."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# -------------------------------------------------------------------------------------- report


def _max_difference(floor_final: torch.Tensor, fedpart_final: dict[str, torch.Tensor]) -> float:
    model = build_model(MODEL, NUM_CLASSES, INPUT_SHAPE, SEED)
    return max(float((value - fedpart_final[name]).abs().max())
               for name, value in _unflatten(floor_final, model).items())


def median_interval(ratios: list[float], confidence: float = CONFIDENCE,
                    resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """The ``confidence`` percentile-bootstrap interval of the median of ``ratios``: the medians of
    ``resamples`` draws of as many pairs with replacement (seeded: the same pairs give the same
    interval), cut at both tails. A pair's ratio scatters by several per cent round to round: the
    90 % intervals of 30-40 pairs measured 3-5 points wide, as wide as the gap to the target."""
    return _bootstrap(lambda draw: draw.choices(ratios, k=len(ratios)), confidence, resamples)


def sittings_interval(sittings: list[list[float]], confidence: float = CONFIDENCE,
                      resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """The ``confidence`` interval of the median of every pair's ratio, with the sittings (lists of
    their pairs' ratios) as the independent draws: each resample draws as many sittings with
    replacement, then as many pairs with replacement within each drawn sitting, and takes the median
    of them all (seeded). A sitting's pairs share its processes, and six 10-process sittings of the
    same code had medians of 0.986-1.075 (docs/benchmarks.md), wider than their pairs' intervals:
    this interval carries that spread, which :func:`median_interval` over the pooled pairs leaves
    out. With pairs from one sitting only it is :func:`median_interval` of those pairs."""
    present = [ratios for ratios in sittings if ratios]
    if len(present) < 2:
        return median_interval([ratio for ratios in present for ratio in ratios], confidence, resamples)
    return _bootstrap(lambda draw: [ratio for ratios in draw.choices(present, k=len(present))
                                    for ratio in draw.choices(ratios, k=len(ratios))], confidence, resamples)


def _bootstrap(resample: Callable[[random.Random], list[float]], confidence: float,
               resamples: int) -> tuple[float, float]:
    """The ``confidence`` percentile interval of the medians of ``resamples`` draws of ``resample``
    from one seeded generator (the same ratios give the same interval)."""
    draw = random.Random(0)
    medians = sorted(statistics.median(resample(draw)) for _ in range(resamples))
    tail = int(resamples * (1 - confidence) / 2)
    return medians[tail], medians[resamples - 1 - tail]


def verdict(low: float, high: float, target: float = TARGET_RATIO) -> str:
    """Whether an interval of the ratio shows the target met, missed, or neither."""
    if high <= target:
        return f"meets the {target:.2f}x target"
    if low > target:
        return f"MISSES the {target:.2f}x target"
    return f"neither meets nor misses the {target:.2f}x target as far as these pairs can tell"


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _percent(share: float | None) -> str:
    return f"{100 * share:.1f} %" if share is not None else "-"


def _row(name: str, values: Iterable[float], digits: int = 3) -> str:
    return f"{name:<10}" + "".join(f"{v:>7.{digits}f}" for v in values)


def report(processes: int, sittings: list[Sitting]) -> None:
    """Print each sitting's pairs, the median of the pairs' ratios over all sittings, the medians
    of the paired rounds, the usage diagnostics and the byte counts."""
    _, threads = client_processes(processes)
    print(f"cnn2 / MNIST / FedAvg: {CLIENTS} clients x {TRAIN_PER_CLIENT} samples, {EPOCHS} epoch, batch "
          f"{BATCH_SIZE}, lr {LR}, all clients every round; {processes} client processes x {threads} torch "
          f"thread(s) on {os.cpu_count()} CPUs; torch {torch.__version__}")
    print("fedpart: the server's round seconds from metrics.jsonl (sampling -> tasks over gRPC -> training -> "
          "results over gRPC -> validated and aggregated; no evaluation, no checkpoint), less the pause")
    print("floor:   plain PyTorch, same processes, threads, clients and steps (weights to the workers -> "
          "training -> deltas back -> weighted mean; no evaluation), run while fedpart's round is paused")
    print("cpu:     CPU seconds of every process of the system in a round (fedpart: launcher, server, "
          "clients, between two pauses)")
    print("trainer: of those, the seconds the training threads (each training process's main thread) ran "
          "on a core; waited: the share of their runnable time they waited for one (/proc/<pid>/schedstat)")
    print("idle:    core-seconds in a round that the machine's cores sat idle (/proc/stat idle + iowait; "
          "fedpart's without the floor's turns)")
    print("foreign: cores' worth of CPU used by processes outside this benchmark during the sitting (noise)")
    all_pairs: list[Pair] = []
    by_sitting: list[list[float]] = []
    for k, sitting in enumerate(sittings, start=1):
        pairs = sitting.pairs()
        all_pairs += pairs
        by_sitting.append([p.ratio for p in pairs])
        fed_usage, floor_usage = sitting.fedpart_usage(), sitting.floor_usage()
        print()
        print(f"sitting {k}: {len(pairs)} of rounds 3..{len(sitting.records)} paired; foreign "
              f"{sitting.foreign_cores:.2f} cores; cpu fedpart {_median(u.cpu for u in fed_usage) or 0:.3f} s, "
              f"floor {_median(u.cpu for u in floor_usage) or 0:.3f} s a round (medians)")
        print(_row("round", (p.round for p in pairs), 0))
        print(_row("fedpart s", (p.fedpart_seconds for p in pairs)))
        print(_row("floor s", (p.floor_seconds for p in pairs)))
        print(_row("ratio", (p.ratio for p in pairs)))
    print()
    if not all_pairs:
        print("no round could be paired (see Sitting.pairs)")
        return
    ratios = sorted(p.ratio for p in all_pairs)
    ratio = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio, ratio, ratio]
    low, high = median_interval(ratios)
    sittings_paired = sum(1 for pairs in by_sitting if pairs)
    over_sittings = sittings_interval(by_sitting)
    print(f"ratio fedpart / floor       {ratio:.3f}  (median of {len(ratios)} pairs, quartiles {quartiles[0]:.3f} "
          f"and {quartiles[2]:.3f})")
    print(f"  {CONFIDENCE:.0%} interval        {low:.3f}-{high:.3f} (bootstrap over the pairs)")
    print(f"  {CONFIDENCE:.0%} interval        {over_sittings[0]:.3f}-{over_sittings[1]:.3f} (bootstrap over the "
          f"{sittings_paired} sitting{'s' if sittings_paired > 1 else ''}, then their pairs): "
          f"{verdict(*over_sittings)}")
    fed_median = statistics.median(p.fedpart_seconds for p in all_pairs)
    floor_median = statistics.median(p.floor_seconds for p in all_pairs)
    print(f"paired round medians        fedpart {fed_median:.3f} s, floor {floor_median:.3f} s, ratio "
          f"{fed_median / floor_median:.3f}")
    fed = [u for sitting in sittings for u in sitting.fedpart_usage()]
    flo = [u for sitting in sittings for u in sitting.floor_usage()]
    if fed and flo:
        def both(measure: str) -> tuple[float, float]:
            return _median(getattr(u, measure) for u in fed), _median(getattr(u, measure) for u in flo)

        cpu = both("cpu")
        print(f"cpu per round, rounds 2..   fedpart {cpu[0]:.3f} s, floor {cpu[1]:.3f} s, ratio "
              f"{cpu[0] / cpu[1]:.3f} (medians)")
        trainers, others = both("trainers_running"), both("others")
        print(f"  training threads on a core fedpart {trainers[0]:.3f} s, floor {trainers[1]:.3f} s; all other "
              f"threads fedpart {others[0]:.3f} s, floor {others[1]:.3f} s")
        beside, apart = both("beside_training"), both("not_training")
        print(f"  of the other threads      in the training processes fedpart {beside[0]:.3f} s, floor "
              f"{beside[1]:.3f} s; in the others (fedpart: server, launcher; floor: parent) fedpart "
              f"{apart[0]:.3f} s, floor {apart[1]:.3f} s")
        waited = both("trainers_waited")
        print(f"  training threads waited   fedpart {_percent(waited[0])}, floor {_percent(waited[1])} of their "
              f"runnable time")
        preempted = both("trainers_preempted_per_second")
        print(f"  training threads preempted fedpart {preempted[0]:.0f}, floor {preempted[1]:.0f} times per "
              f"second on a core (involuntary context switches)")
        idle = both("machine_idle")
        print(f"  cores idle                fedpart {idle[0]:.3f} s, floor {idle[1]:.3f} s a round (core-seconds)")
    print(f"same work check             max |floor - fedpart| over the final weights: "
          f"{max(_max_difference(s.floor_final, s.fedpart_final) for s in sittings):.3g}")
    records = [r for sitting in sittings for r in sitting.records]
    client_rounds = sum(len(r.completed) for r in records)
    print()
    print(f"bytes per client-round (all messages of the round / completed clients; raw float32 model "
          f"{RAW_MODEL_BYTES:,} B)")
    for direction in ("down", "up"):
        total = sum(r.bytes_in(direction) for r in records) / client_rounds
        tensors = sum(v.bytes_in(direction) for r in records for part, v in r.bytes_by_part.items()
                      if part != "control") / client_rounds
        print(f"  {direction:<4} {total:>14,.0f} B = {total / RAW_MODEL_BYTES:.3f} x raw  "
              f"(tensor bytes {tensors:,.0f}, control {total - tensors:,.0f})")
    print(f"  (down: fedpart's version cache sends a changed tensor once per client process, so "
          f"{len(client_processes(processes)[0])} of the {CLIENTS} tasks of a round carry the model)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of each sitting (default 12)")
    parser.add_argument("--processes", type=int, default=2, help="client processes, and floor workers (default 2)")
    parser.add_argument("--runs", type=int, default=2, help="sittings of both systems taking turns (default 2)")
    parser.add_argument("--data-root", type=Path, default=default_data_root(),
                        help="directory holding MNIST/raw/*.gz (default <checkout>/../shared/data)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one fedpart run may take")
    args = parser.parse_args(argv)
    if args.rounds < 3 or not 1 <= args.processes <= CLIENTS or args.runs < 1:
        parser.error(f"--rounds must be >= 3, --runs >= 1 and --processes in 1..{CLIENTS}")
    data_root = args.data_root.resolve()
    if not (data_root / "MNIST" / "raw").is_dir():
        parser.error(f"no MNIST/raw under {args.data_root}")
    sittings = []
    try:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="fedpart-round-overhead-") as work:
                sittings.append(run_sitting(args.rounds, args.processes, data_root, Path(work), args.timeout))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report(args.processes, sittings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
