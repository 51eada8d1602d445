"""Round overhead of fedpart against a plain-PyTorch compute floor, measured in one run.

Workload (fixed): FedAvg, model ``cnn2`` (582,026 float32 parameters) on real MNIST, 10 clients,
client i holding training samples [600i, 600i+600) and test samples [100i, 100i+100) in file
order, all 10 clients every round, 1 local epoch of batch 10 (60 SGD steps, lr 0.01, momentum 0)
over shuffled index batches, sample-weighted mean of the deltas, ``--rounds`` rounds (default 5).

What is measured:

- **fedpart**: ``fedpart run`` (one server, ``--processes`` client processes on 127.0.0.1) with
  that config. A round's time is the server's ``seconds`` in ``metrics.jsonl``: sampling, task
  delivery over gRPC, local training, result upload, validation and aggregation, up to the new
  global model. It excludes the per-round checkpoint and log line written after the round, and
  the single evaluation after the last round.
- **floor**: the same work with no framework. P spawn worker processes (P = the number of client
  processes fedpart starts), the same client -> process assignment
  (``fedpart.common.client_ids.split_clients``) and the same torch thread count per process
  (:func:`~fedpart.common.limits.client_threads` of P, as ``fedpart run`` gives each client
  process: the cores of this process's affinity and cgroup quota divided by P); each worker
  loads its clients' data and pays torch's one-off optimizer import before the first round
  (not timed; fedpart's clients do both before they report ready). A round's time is wall time
  in the parent from sending the global weights to holding the new global model: every worker,
  for each of its clients, loads the global weights into the model, trains the epoch (same model
  builder and seed, same per-client shuffling seeds, same input layout) and returns the delta
  over a pipe; the parent takes the sample-weighted mean of the deltas in float64 and adds it.
  The floor does not evaluate (fedpart's training rounds do not evaluate either).

The floor's final model is compared with fedpart's final checkpoint: both computed the same
steps, so they agree to float rounding. The speed of this kind of machine drifts by 10-30 % over
minutes (other tenants of the host, frequency), more than the 3 % being measured, so the two
systems take turns: ``--pairs K`` (default 3) runs the floor, then K times fedpart and the floor
again. The ratio is the median of all fedpart rounds over the median of all floor rounds; each
fedpart run is also set against the mean of the floor runs on either side of it, which shows how
far the drift moved the pooled figure.
Wire bytes per client-round come from ``metrics.jsonl`` (every message of the round, divided
by the clients that completed it) next to the raw size of one float32 model copy.

Diagnostics printed beside the timings, per run: the training seconds of the round's slowest
process (fedpart's ``compute_seconds`` per client, summed per client process) and the round
minus them ("outside": task delivery, the work between tasks, the last upload, aggregation;
the part of the round that does not drift with the speed of training), CPU seconds per round of
every process of each system (read from ``/proc``; for fedpart sampled when a round's line lands
in ``metrics.jsonl``, looked for every 50 ms so that the looking takes fedpart's cores little, so
not for round 1) and of them the seconds the training threads (each training process's main
thread: torch computes in it at one thread) ran on a core, the rest split into the training
processes' other threads (fedpart: each client's session and gRPC threads) and the processes that
do not train (fedpart's server and launcher, the floor's parent), the share of their runnable
time the training threads waited in a run queue for a core ("waited", from
``/proc/<pid>/task/<pid>/schedstat``, sampled likewise), which tells training slowed because
other threads held the cores apart from training that itself ran slower, how often a training
thread was taken off its core while it could still run, per second it ran ("preempted":
involuntary context switches, ``/proc/<pid>/task/<pid>/status``; its time slice ended, or a thread
that woke took the core), the core-seconds the machine's cores sat idle ("idle", from
``/proc/stat``, sampled likewise), which tells a round that outlasted its CPU over the cores
because cores went unused apart from one that used more CPU, and the CPU other processes on the
machine used meanwhile ("foreign"). Linux only.
"""

from __future__ import annotations

import argparse
import gzip
import multiprocessing as mp
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.nn.utils import parameters_to_vector

from fedpart.common.checkpoint import load_tensors
from fedpart.common.limits import client_threads
from fedpart.common.models.zoo import build_model
from fedpart.common.records import RoundRecord, read_rounds
from fedpart.common.client_ids import split_clients

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
RAW_MODEL_BYTES = PARAMETERS * 4
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# how often the run's metrics.jsonl is looked at: the looking runs beside fedpart's rounds (the floor's
# have no such observer), and every 10 ms, reading the file, it took 2.7-3.4 % of a core; a size
# check every 50 ms takes 0.4 %
POLL_SECONDS = 0.05
WORKER_START_SECONDS = 300.0
WORKER_STOP_SECONDS = 30.0
FLOOR_ROUND_SECONDS = 600.0


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
    ``[(client, samples, training seconds, delta), ...]``."""
    torch.set_num_threads(threads)
    model = build_model(MODEL, NUM_CLASSES, INPUT_SHAPE, SEED)
    torch.optim.SGD(model.parameters(), lr=0.0)  # torch's one-off optimizer import (~1 s), start-up like in fedpart
    data = _client_train_data(Path(raw), clients)
    conn.send("ready")
    while (message := _next_message(conn)) is not None:
        round_number, global_vector = message
        start = torch.from_numpy(global_vector)
        state = _unflatten(start, model)
        results = []
        for client in clients:
            x, y = data[client]
            model.load_state_dict(state)
            started = time.perf_counter()
            _train_epoch(model, x, y, task_seed(round_number, client))
            trained = time.perf_counter() - started
            delta = parameters_to_vector(model.parameters()).detach() - start
            results.append((client, x.shape[0], trained, delta.numpy()))
        conn.send(results)
    conn.close()


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


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far; 0 once it has ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
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


@dataclass
class RoundTimes:
    """Per round: wall seconds, training seconds of the slowest process (the sum over its
    clients) and the usage of the system under test (None where not measured)."""

    seconds: list[float]
    train_seconds: list[float]
    usage: list[Usage | None]

    def measured(self, measure: str) -> list[float | None]:
        """The ``Usage`` attribute ``measure`` of each round from round 2 on (round 1 includes
        start-up work)."""
        return [getattr(u, measure) if u is not None else None for u in self.usage[1:]]


@dataclass
class FloorRun:
    """One floor run: its round times, final global weights and the foreign CPU during it."""

    times: RoundTimes
    final: torch.Tensor
    foreign_cores: float


def run_floor(processes: int, rounds: int, raw: Path) -> FloorRun:
    """Run the floor; workers are started and loaded before the first timed round."""
    with ForeignCpu() as foreign:
        times, final = _floor_rounds(processes, rounds, raw)
    return FloorRun(times, final, foreign.cores)


def _floor_rounds(processes: int, rounds: int, raw: Path) -> tuple[RoundTimes, torch.Tensor]:
    """Start the workers, time the rounds, stop the workers (bounded, by process handle)."""
    groups, threads = client_processes(processes)
    context = mp.get_context("spawn")
    pipes: list[Connection] = []
    workers: list[mp.process.BaseProcess] = []
    try:
        for clients in groups:
            parent, child = context.Pipe()
            worker: mp.process.BaseProcess = context.Process(
                target=floor_worker, args=(child, clients, threads, str(raw)), daemon=True)
            worker.start()
            child.close()
            pipes.append(parent)
            workers.append(worker)
        for pipe in pipes:
            _receive(pipe, WORKER_START_SECONDS)
        global_vector = parameters_to_vector(build_model(MODEL, NUM_CLASSES, INPUT_SHAPE, SEED).parameters()).detach()
        times = RoundTimes([], [], [])
        trainers = [worker.pid for worker in workers]
        for round_number in range(1, rounds + 1):
            before = Usage.of(process_tree(os.getpid()), trainers)
            started = time.perf_counter()
            payload = (round_number, global_vector.numpy())
            for pipe in pipes:
                pipe.send(payload)
            by_worker = [_receive(pipe, FLOOR_ROUND_SECONDS) for pipe in pipes]
            results = sorted((r for worker_results in by_worker for r in worker_results), key=lambda r: r[0])
            total = torch.zeros(PARAMETERS, dtype=torch.float64)
            for _, samples, _, delta in results:
                total += torch.from_numpy(delta).to(torch.float64) * samples
            mean = total / sum(r[1] for r in results)
            global_vector = (global_vector.to(torch.float64) + mean).to(torch.float32)
            times.seconds.append(time.perf_counter() - started)
            times.usage.append(Usage.of(process_tree(os.getpid()), trainers) - before)
            times.train_seconds.append(max(sum(r[2] for r in worker_results) for worker_results in by_worker))
        return times, global_vector
    finally:
        for pipe in pipes:
            pipe.close()
        deadline = time.monotonic() + WORKER_STOP_SECONDS
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)


def _receive(pipe: Connection, timeout: float) -> Any:
    """One message from a worker; RuntimeError when it sends nothing within ``timeout`` or died."""
    try:
        if pipe.poll(timeout):
            return pipe.recv()
    except EOFError:
        raise RuntimeError("a floor worker ended unexpectedly (see its output above)") from None
    raise RuntimeError(f"a floor worker sent nothing within {timeout:.0f} s")


# ------------------------------------------------------------------------------------- fedpart


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


@dataclass
class FedpartRun:
    """One ``fedpart run``: its per-round records (``metrics.jsonl``), round times, final global
    weights and the foreign CPU during it."""

    records: list[RoundRecord]
    times: RoundTimes
    final: dict[str, torch.Tensor]
    foreign_cores: float


def run_fedpart(rounds: int, processes: int, data_root: Path, work: Path, timeout: float) -> FedpartRun:
    """``fedpart run`` as a subprocess (bounded wait, stopped by PID); raises if it fails."""
    config_path = work / "round_overhead.yaml"
    config_path.write_text(yaml.safe_dump(fedpart_config(rounds, processes, data_root), sort_keys=False))
    out = work / "run"
    log_path = work / "fedpart.log"
    command = [sys.executable, "-m", "fedpart", "run", str(config_path), "--out", str(out)]
    with log_path.open("w") as log, ForeignCpu() as foreign:
        # Its own process group (to stop it as a whole) but not its own session: with autogroup
        # scheduling a new session would get its own share of the CPU next to other users' load,
        # which the floor's workers, in this session, do not.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
        try:
            code, usage_at_lines = _follow(process, out / "metrics.jsonl", time.monotonic() + timeout)
        finally:
            _stop(process)
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        reason = f"exit code {code}" if code is not None else f"no end within {timeout:.0f} s"
        raise RuntimeError(f"fedpart run failed ({reason}); last lines of its output:\n{tail}")
    records = read_rounds(out / "metrics.jsonl")
    # Round 1 has no usage figure: its start is not observable from outside, and the client
    # processes are still starting up in it.
    usage = [None] + [usage_at_lines[n] - usage_at_lines[n - 1] if {n - 1, n} <= usage_at_lines.keys() else None
                      for n in range(2, len(records) + 1)]
    groups, _ = client_processes(processes)
    times = RoundTimes([r.seconds for r in records], [_slowest_training(r, groups) for r in records], usage)
    final = load_tensors(out / "checkpoints" / f"round_{rounds:04d}.safetensors")
    return FedpartRun(records, times, final, foreign.cores)


def _slowest_training(record: RoundRecord, groups: list[list[int]]) -> float:
    """Training seconds of the round's slowest client process: its clients' ``compute_seconds``."""
    return max(sum(record.clients[str(c)]["compute_seconds"] for c in group) for group in groups)


def _follow(process: subprocess.Popen, metrics: Path, deadline: float) -> tuple[int | None, dict[int, Usage]]:
    """Wait for the run to end (None: not by ``deadline``), sampling the usage of its process tree
    (training threads: the client processes' main threads) the first time ``metrics`` is seen
    holding n round lines, for each n (within :data:`POLL_SECONDS` of the line's writing)."""
    usage_at_lines: dict[int, Usage] = {}
    size = -1
    while (code := process.poll()) is None and time.monotonic() < deadline:
        try:
            changed = metrics.stat().st_size != size
        except FileNotFoundError:
            changed = False
        if changed:
            content = metrics.read_bytes()
            size, lines = len(content), content.count(b"\n")
            if lines not in usage_at_lines:
                tree = process_tree(process.pid)
                usage_at_lines[lines] = Usage.of(tree, [pid for pid in tree if is_client_process(pid)])
        time.sleep(POLL_SECONDS)
    return code, usage_at_lines


def is_client_process(pid: int) -> bool:
    """Whether process ``pid`` runs ``fedpart client`` (False once it has ended)."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return arguments[1:4] == [b"-m", b"fedpart", b"client"]


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


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _seconds(value: float | None, width: int) -> str:
    return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"


def _pooled(runs: list[RoundTimes], measure: str) -> float | None:
    """The median of the ``Usage`` attribute ``measure`` over rounds 2.. of all ``runs``."""
    return _median(value for times in runs for value in times.measured(measure))


def _percent(share: float | None, width: int = 0) -> str:
    return (f"{100 * share:.1f} %" if share is not None else "-").rjust(width)


def _outside_training(times: RoundTimes) -> list[float]:
    """Per round: wall seconds minus the slowest process's training seconds."""
    return [wall - train for wall, train in zip(times.seconds, times.train_seconds, strict=True)]


def _pair_ratios(fedparts: list[FedpartRun], floors: list[FloorRun]) -> list[float]:
    """Each fedpart run's median round over the mean of the medians of the floor runs before and
    after it (the runs alternate: floor, fedpart, floor, ...)."""
    medians = [statistics.median(f.times.seconds) for f in floors]
    return [statistics.median(fed.times.seconds) / ((medians[k] + medians[k + 1]) / 2)
            for k, fed in enumerate(fedparts)]


def report(processes: int, floors: list[FloorRun], fedparts: list[FedpartRun]) -> None:
    """Print the runs in the order they ran (floor, fedpart, ..., floor: one floor run more than
    fedpart runs), the pooled medians, the ratio and the byte counts."""
    _, threads = client_processes(processes)
    print(f"cnn2 / MNIST / FedAvg: {CLIENTS} clients x {TRAIN_PER_CLIENT} samples, {EPOCHS} epoch, batch "
          f"{BATCH_SIZE}, lr {LR}, all clients every round; {processes} client processes x {threads} torch "
          f"thread(s) on {os.cpu_count()} CPUs; torch {torch.__version__}")
    print("fedpart: the server's round seconds from metrics.jsonl (sampling -> tasks over gRPC -> training -> "
          "results over gRPC -> validated and aggregated; no evaluation, no checkpoint)")
    print("floor:   plain PyTorch, same processes, threads, clients and steps (weights to the workers -> "
          "training -> deltas back -> weighted mean; no evaluation)")
    print("train:   training seconds of the round's slowest process (the sum over its clients); "
          "outside: round minus train")
    print("cpu:     CPU seconds of every process of the system in a round (fedpart: launcher, server, "
          "clients; not measurable for round 1)")
    print("trainer: of those, the seconds the training threads (each training process's main thread) ran "
          "on a core; waited: the share of their runnable time they waited for one (/proc/<pid>/schedstat)")
    print("idle:    core-seconds in a round that the machine's cores sat idle (/proc/stat idle + iowait; "
          "fedpart: between round lines, so with the round's checkpoint)")
    print("foreign: cores' worth of CPU used by processes outside this benchmark during the run (noise)")
    print()
    runs: list[tuple[str, RoundTimes, float]] = []
    for k, floor in enumerate(floors):
        runs.append((f"floor#{k + 1}", floor.times, floor.foreign_cores))
        if k < len(fedparts):
            runs.append((f"fedpart#{k + 1}", fedparts[k].times, fedparts[k].foreign_cores))
    walls_width = max(7 * len(floors[0].times.seconds), len("round wall s"))
    print(f"{'run':<10} {'round wall s':<{walls_width}} {'median':>7} {'train':>7} {'outside':>8} "
          f"{'cpu s':>7} {'trainer':>8} {'waited':>7} {'idle':>6} {'foreign':>8}")
    for name, times, cores in runs:
        walls = "".join(f"{s:>7.3f}" for s in times.seconds)
        print(f"{name:<10} {walls:<{walls_width}} {statistics.median(times.seconds):>7.3f} "
              f"{statistics.median(times.train_seconds):>7.3f} {statistics.median(_outside_training(times)):>8.3f} "
              f"{_seconds(_median(times.measured('cpu')), 7)} "
              f"{_seconds(_median(times.measured('trainers_running')), 8)} "
              f"{_percent(_median(times.measured('trainers_waited')), 7)} "
              f"{_seconds(_median(times.measured('machine_idle')), 6)} {cores:>8.2f}")

    fed_times = [f.times for f in fedparts]
    floor_times = [f.times for f in floors]
    fed_median = statistics.median(s for t in fed_times for s in t.seconds)
    floor_median = statistics.median(s for t in floor_times for s in t.seconds)
    ratio = fed_median / floor_median
    print()
    print(f"fedpart round median        {fed_median:.3f} s  (all {sum(len(t.seconds) for t in fed_times)} rounds "
          f"of {len(fedparts)} run(s))")
    print(f"floor round median          {floor_median:.3f} s  (all {sum(len(t.seconds) for t in floor_times)} rounds "
          f"of {len(floors)} run(s))")
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"ratio fedpart / floor       {ratio:.3f}  ({verdict} the {TARGET_RATIO:.2f}x target)")
    pairs = _pair_ratios(fedparts, floors)
    print(f"run by run                  {', '.join(f'{r:.3f}' for r in pairs)}  (each fedpart run over "
          f"the mean of the floor runs either side; median {statistics.median(pairs):.3f})")
    fed_outside = statistics.median(s for t in fed_times for s in _outside_training(t))
    floor_outside = statistics.median(s for t in floor_times for s in _outside_training(t))
    print(f"outside training            fedpart {fed_outside:.3f} s, floor {floor_outside:.3f} s (medians)")
    fed_cpu, floor_cpu = _pooled(fed_times, "cpu"), _pooled(floor_times, "cpu")
    if fed_cpu is not None and floor_cpu is not None:
        print(f"cpu per round, rounds 2..   fedpart {fed_cpu:.3f} s, floor {floor_cpu:.3f} s, ratio "
              f"{fed_cpu / floor_cpu:.3f} (medians)")
        fed_trainers, floor_trainers = _pooled(fed_times, "trainers_running"), _pooled(floor_times, "trainers_running")
        print(f"  training threads on a core fedpart {fed_trainers:.3f} s, floor {floor_trainers:.3f} s; all other "
              f"threads fedpart {_pooled(fed_times, 'others'):.3f} s, floor {_pooled(floor_times, 'others'):.3f} s")
        print(f"  of the other threads      in the training processes fedpart "
              f"{_pooled(fed_times, 'beside_training'):.3f} s, floor {_pooled(floor_times, 'beside_training'):.3f} s; "
              f"in the others (fedpart: server, launcher; floor: parent) fedpart "
              f"{_pooled(fed_times, 'not_training'):.3f} s, floor {_pooled(floor_times, 'not_training'):.3f} s")
        print(f"  training threads waited   fedpart {_percent(_pooled(fed_times, 'trainers_waited'))}, floor "
              f"{_percent(_pooled(floor_times, 'trainers_waited'))} of their runnable time")
        print(f"  training threads preempted fedpart "
              f"{_pooled(fed_times, 'trainers_preempted_per_second'):.0f}, floor "
              f"{_pooled(floor_times, 'trainers_preempted_per_second'):.0f} times per second on a core "
              f"(involuntary context switches)")
        print(f"  cores idle                fedpart {_pooled(fed_times, 'machine_idle'):.3f} s, floor "
              f"{_pooled(floor_times, 'machine_idle'):.3f} s a round (core-seconds)")
    print(f"same work check             max |floor - fedpart| over the final weights: "
          f"{max(_max_difference(f.final, fed.final) for f in floors for fed in fedparts):.3g}")
    records = [r for fed in fedparts for r in fed.records]
    client_rounds = sum(len(r.completed) for r in records)
    print()
    print(f"bytes per client-round (all messages of the round / completed clients; raw float32 model "
          f"{RAW_MODEL_BYTES:,} B)")
    for direction in ("down", "up"):
        total = sum(r.bytes_in(direction) for r in records) / client_rounds
        tensors = sum(v[direction] for r in records for part, v in r.bytes_by_part.items()
                      if part != "control") / client_rounds
        print(f"  {direction:<4} {total:>14,.0f} B = {total / RAW_MODEL_BYTES:.3f} x raw  "
              f"(tensor bytes {tensors:,.0f}, control {total - tensors:,.0f})")
    print(f"  (down: fedpart's version cache sends a changed tensor once per client process, so "
          f"{len(client_processes(processes)[0])} of the {CLIENTS} tasks of a round carry the model)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each run (default 5)")
    parser.add_argument("--processes", type=int, default=2, help="client processes, and floor workers (default 2)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="fedpart runs, each followed by a floor run, after a first floor run (default 3)")
    parser.add_argument("--data-root", type=Path, default=default_data_root(),
                        help="directory holding MNIST/raw/*.gz (default <checkout>/../shared/data)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one fedpart run may take")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not 1 <= args.processes <= CLIENTS or args.pairs < 1:
        parser.error(f"--rounds and --pairs must be >= 1 and --processes in 1..{CLIENTS}")
    raw = args.data_root.resolve() / "MNIST" / "raw"
    if not raw.is_dir():
        parser.error(f"no MNIST/raw under {args.data_root}")

    try:
        floors = [run_floor(args.processes, args.rounds, raw)]
        fedparts = []
        for _ in range(args.pairs):
            with tempfile.TemporaryDirectory(prefix="fedpart-round-overhead-") as work:
                fedparts.append(run_fedpart(args.rounds, args.processes, args.data_root.resolve(), Path(work),
                                            args.timeout))
            floors.append(run_floor(args.processes, args.rounds, raw))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report(args.processes, floors, fedparts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
