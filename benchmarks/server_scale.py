"""The coordinator at cross-device scale: a real ``fedpart server`` against virtual client processes,
beside the floor for the same bytes, measured in one run (issue 7).

Workload per row ``N x K``: FedAvg, ``--model`` (default cnn2, 582,026 float32 parameters =
2.33 MB per result) on MNIST's dimensions, N clients, ``--fraction`` of them per round,
``--rounds`` rounds, then the final evaluation of every client. The server holds no data:
``evaluate.global_test`` and ``robust.partition_sizes`` are off (the only features for which the
server reads the dataset), so the numbers are the coordinator's own. The clients are K virtual
client processes (``lab.virtual``: the client protocol without training, each with its
own TCP connection) multiplexed over ``--generators`` OS processes, started together: each
generator loads, prints ``ready``, and connects when the driver says go.

Columns:

- *results per round*: clients that completed each round (all sampled ones, or the row says so);
- *joined-in s*: from "go" to the last virtual process's join reply;
- *round s*: the server's per-round record ``seconds`` in ``metrics.jsonl`` (dispatch, task
  streams, result uploads, validation, folds, new global model);
- *server peak RSS*: ``VmHWM`` of the server process (``/proc/PID/status``);
- *server CPU s/round*: user + system CPU of the server (``/proc/PID/stat``, sampled every
  50 ms) over each round's window, which ends at the round's log line and is ``seconds`` long,
  averaged over the rounds;
- *generators CPU s/round*: the same for the load generators together; they share the cores with
  the server, so a round cannot take less than (server + generators CPU) / cores;
- *heartbeats missed*: server log lines "went silent";
- *final evaluation s*: from the server's "evaluating" line to the summary table it prints after
  it (every client evaluated and the summary written);
- *floor s*: the same bytes in one process: ``results x result bytes`` through one loopback TCP
  connection (a plain socket pair) plus the fold of as many model-sized float32 deltas with the
  server's :class:`~fedpart.server.policy.aggregation.WeightedMean` on one core, each the least of 3
  measurements; *round/floor* is the mean round time over it. For reference, a plain float32
  ``add_`` of the same tensors (the bare summation) is printed beside it.

The rows run without credentials, so nothing is encrypted here (``transport_cost.py`` measures
what TLS adds).

``--set KEY=VALUE`` changes a key of the server's config (e.g. ``server.receive_window=65536``),
for measuring a setting against the default in two invocations. Linux only (``/proc``). Every
process is stopped by PID when a row ends, however it ends.

Connection faults (issue 20): ``--cuts N`` and ``--evaluation-cuts M`` put a fault relay
(``python -m lab.relay``, a process of its own) between the load generators and the
server, which resets the connection that carries each of N seeded random bytes of the rounds'
traffic and M of the final evaluation's (``reset_at``: offsets in the relay's whole traffic, so a
cut lands in whatever flows then: a task stream, a result upload, a waiting poll). Where those
bytes lie is known before the run: the sampling is seeded, so :func:`expected_traffic` gives the
tensor bytes of each round (the model to each process hosting a sampled client, a model-sized
result from each sampled client) and of the evaluation (the model to each process). ``--relay``
alone relays without faults, the baseline for the relay's own cost. A relayed row also prints the
relay's counts, the server's ``delivery`` counts of each round (``metrics.jsonl``) and of the final
evaluation (``summary.json``): tasks and results sent again, streams cut, duplicates, tasks given
up; and how many clients were evaluated. The columns *cuts* (resets made) and *evaluated* join the
table. ``--keep`` also keeps the processes' output (``server.log``, ``relay.log``,
``generator_I.log``).

    python benchmarks/server_scale.py --rows 1000x100,1000x600 --rounds 2
    python benchmarks/server_scale.py --rows 10000x2000 --rounds 2 --cuts 20 --evaluation-cuts 10
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
import yaml

from fedpart.common.config.run_config import apply_overrides, config_from_dict
from fedpart.common.config.experiment import build_run_model
from fedpart.common.process.records import DeliveryCounts, RunSummary, read_rounds, read_summary
from fedpart.common.wire.client_ids import split_clients
from fedpart.deploy.launcher import stop_processes
from fedpart.server.policy.aggregation import WeightedMean
from fedpart.server.engine.sampling import sample_clients

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_SECONDS = 0.05
LISTEN_SECONDS = 120.0
READY_SECONDS = 300.0
STOP_SECONDS = 10.0
# Virtual processes give up this long after the server went away or stopped taking their calls (a
# saturated server answers some result streams CANCELLED; they are sent again with backoff).
RECONNECT_SECONDS = 60.0
FLOOR_REPEATS = 3
FOLD_POOL = 4  # distinct delta sets the fold floor cycles through, so it does not run from cache
_LISTENING = re.compile(r"listening on (\S+:\d+)")
_RELAY_LISTENING = re.compile(r"relay listening on (\S+:\d+) -> ")
_RELAY_COUNTS = re.compile(r"^\{.*\}$")
_ROUND_LINE = re.compile(r"\bround\s+(\d+)/\d+  clients")  # after the log line's time
_EVALUATING = "evaluating and personalising"
_SILENT = "went silent"
_STAMPED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")  # a server log line (console.stamp)


@dataclass(frozen=True)
class Row:
    clients: int
    processes: int


def parse_rows(text: str) -> list[Row]:
    """``"1000x100,10000x2000"`` -> rows (clients x virtual processes)."""
    rows = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match:
            raise argparse.ArgumentTypeError(f"row {part!r}: expected CLIENTSxPROCESSES, e.g. 1000x100")
        row = Row(int(match.group(1)), int(match.group(2)))
        if not 1 <= row.processes <= row.clients:
            raise argparse.ArgumentTypeError(f"row {part!r}: needs 1 <= processes <= clients")
        rows.append(row)
    return rows


def scale_config(clients: int, rounds: int, fraction: float, model: str, timeout: float,
                 overrides: list[str] = ()) -> dict:
    """The server's run config for one row, with ``--set`` overrides (dotted ``KEY=VALUE``)."""
    return apply_overrides({
        "name": "server_scale", "seed": 0, "rounds": rounds, "clients": clients,
        "sampling": {"fraction": fraction},
        "data": {"dataset": "mnist", "partition": {"scheme": "iid"}},
        "model": {"name": model},
        "algorithm": {"name": "fedavg"},
        "train": {"epochs": 1, "batch_size": 10, "lr": 0.01},
        "evaluate": {"finetune_epochs": [1, 5], "global_test": False},
        "robust": {"partition_sizes": False},
        "server": {"join_timeout": timeout, "round_timeout": timeout, "evaluation_timeout": timeout},
    }, list(overrides))


def expected_traffic(row: Row, config: dict, model_bytes: int) -> tuple[int, int]:
    """Tensor bytes, both ways, of the rounds together and of the final evaluation of a FedAvg
    run of ``config`` (a :func:`scale_config`): each round sends the model once to every process
    that hosts a sampled client (it then holds the version) and takes a model-sized result from
    each sampled client; the evaluation sends the model once to every process. The sampling is
    seeded, so the sampled clients are known before the run. Headers, polls and heartbeats add a
    little more on the wire."""
    run = config_from_dict(config)
    hosts = [int(spec.split("-")[0]) for spec in split_clients(row.clients, row.processes)]
    rounds = 0
    for round_number in range(1, run.rounds + 1):
        sampled = sample_clients(run.clients, round_number, run.seed, run.sampling.fraction,
                                 run.sampling.probability, run.sampling.over_selection)
        processes = {bisect.bisect_right(hosts, client) - 1 for client in sampled}
        rounds += (len(sampled) + len(processes)) * model_bytes
    return rounds, row.processes * model_bytes


def fault_offsets(rounds_bytes: int, evaluation_bytes: int, cuts: int, evaluation_cuts: int,
                  seed: int) -> tuple[int, ...]:
    """Seeded offsets in the relay's whole traffic at which it resets a connection: ``cuts``
    uniform over the rounds' bytes, ``evaluation_cuts`` uniform over the evaluation's, which
    follow them."""
    draw = random.Random(seed)
    offsets = [draw.randrange(rounds_bytes) for _ in range(cuts)]
    offsets += [rounds_bytes + draw.randrange(evaluation_bytes) for _ in range(evaluation_cuts)]
    return tuple(sorted(offsets))


class Lines:
    """A process's output lines with the time each arrived, read on a thread."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stream: TextIO) -> None:
        for line in iter(stream.readline, ""):
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, pattern: re.Pattern, timeout: float, what: str) -> re.Match:
        """The first line matching ``pattern``; raises RuntimeError at the deadline or at the end."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for _, line in self.lines:
                    match = pattern.search(line)
                    if match:
                        return match
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    tail = "\n".join(line for _, line in self.lines[-20:])
                    raise RuntimeError(f"no {what} ({'output ended' if self._closed else f'{timeout:.0f} s'}):\n{tail}")
                self._changed.wait(remaining)

    def snapshot(self) -> list[tuple[float, str]]:
        with self._changed:
            return list(self.lines)

    def save(self, path: Path, timeout: float) -> None:
        """Write the lines to ``path`` once the output ended (or at ``timeout``)."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed, timeout)
            path.write_text("".join(f"{line}\n" for _, line in self.lines))


class ProcSampler:
    """CPU seconds (user + system) and peak RSS of one process, sampled from ``/proc``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self.peak_rss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stat = Path(f"/proc/{self.pid}/stat").read_text()
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return  # the process is gone
            fields = stat.rpartition(")")[2].split()
            cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
            self.samples.append((time.monotonic(), cpu))
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss_bytes = int(line.split()[1]) * 1024
            self._stop.wait(SAMPLE_SECONDS)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def cpu_at(self, moment: float) -> float:
        """CPU seconds at ``moment``, interpolated between the samples around it."""
        before = [s for s in self.samples if s[0] <= moment]
        after = [s for s in self.samples if s[0] >= moment]
        if not before:
            return self.samples[0][1]
        if not after:
            return self.samples[-1][1]
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (moment - t0) / (t1 - t0)


@dataclass
class RowResult:
    row: Row
    generators: int
    server_exit: int | None
    results_per_round: list[int]
    sampled_per_round: list[int]
    joined_in: float | None
    round_seconds: list[float]
    peak_rss_bytes: int
    cpu_per_round: float | None
    generators_cpu_per_round: float | None
    heartbeats_missed: int
    evaluation_seconds: float | None
    generator_exits: list[int | None]
    load: dict  # the generators' counts, summed
    problems: list[str]
    evaluated: int  # clients with an evaluation in summary.json
    delivery_per_round: list[DeliveryCounts | None]  # each round's delivery counts from metrics.jsonl
    evaluation_delivery: DeliveryCounts | None  # the final evaluation's delivery counts from summary.json
    planned_cuts: int
    relay: dict | None  # the relay's counts, when the row ran through it
    relay_cpu_per_round: float | None


def _generator_slices(row: Row, generators: int) -> list[tuple[str, int]]:
    """(client ids, virtual processes) per generator: whole ``split_clients(N, K)`` slices."""
    slices = split_clients(row.clients, row.processes)
    out = []
    for spec in split_clients(len(slices), generators):
        first, last = (int(x) for x in spec.split("-"))
        low = slices[first].split("-")[0]
        high = slices[last].split("-")[1]
        out.append((f"{low}-{high}", last - first + 1))
    return out


def _sum_loads(loads: list[dict]) -> dict:
    total: dict = {"errors": {}, "failures": [], "join_times": []}
    for load in loads:
        for key, value in load.items():
            if key == "errors":
                for code, count in value.items():
                    total["errors"][code] = total["errors"].get(code, 0) + count
            elif isinstance(value, list):
                total[key] += value
            elif key != "started_at":
                total[key] = total.get(key, 0) + value
    return total


def _relay_command(target: str, offsets: tuple[int, ...], processes: int) -> list[str]:
    """The fault relay's command line: room for every virtual process's connection and as many
    new ones while the old close, and a reset at each of ``offsets`` of its traffic."""
    command = [sys.executable, "-m", "lab.relay", "--listen", "127.0.0.1:0", "--target", target,
               "--max-connections", str(2 * processes + 64)]
    if offsets:
        command += ["--reset-at", ",".join(map(str, offsets))]
    return command


def run_row(row: Row, args: argparse.Namespace, work: Path, model_bytes: int) -> RowResult:
    """One real server, through the fault relay when asked, and the row's virtual processes;
    every process is stopped by PID at the end."""
    config = scale_config(row.clients, args.rounds, args.fraction, args.model, args.timeout, args.set)
    config_path = work / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    offsets = fault_offsets(*expected_traffic(row, config, model_bytes), args.cuts, args.evaluation_cuts,
                            args.fault_seed)
    out = work / "run"
    started: list[subprocess.Popen] = []
    # the relay and the load generators are the lab's (python -m lab.relay): the repository's root
    # on their path
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])))
    sampler = None
    relay_lines = relay_sampler = None
    generator_samplers: list[ProcSampler] = []
    try:
        server = subprocess.Popen([sys.executable, "-m", "fedpart", "server", "--insecure", str(config_path),
                                   "--address", "127.0.0.1:0",
                                   "--out", str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        started.append(server)
        sampler = ProcSampler(server.pid)
        server_lines = Lines(server)
        address = server_lines.wait_for(_LISTENING, LISTEN_SECONDS, "listening line from the server").group(1)
        if args.relay:
            relay = subprocess.Popen(_relay_command(address, offsets, row.processes), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
            started.append(relay)
            relay_sampler = ProcSampler(relay.pid)
            relay_lines = Lines(relay)
            address = relay_lines.wait_for(_RELAY_LISTENING, LISTEN_SECONDS, "listening line from the relay").group(1)
        generators = []
        for index, (ids, processes) in enumerate(_generator_slices(row, args.generators)):
            generator = subprocess.Popen(
                [sys.executable, "-m", "lab.virtual", "--insecure", "--server", address, "--clients", ids,
                 "--processes", str(processes), "--reconnect-timeout", str(RECONNECT_SECONDS), "--hold",
                 "--stats", str(work / f"load_{index}.json")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            started.append(generator)
            generator_samplers.append(ProcSampler(generator.pid))
            generators.append((generator, Lines(generator)))
        for _, lines in generators:
            lines.wait_for(re.compile(r"^ready$"), READY_SECONDS, "'ready' from a load generator")
        go = time.monotonic()
        for generator, _ in generators:
            generator.stdin.write("go\n")
            generator.stdin.close()
        try:  # the server bounds its join, each round and the evaluation by --timeout itself
            server.wait(timeout=(args.rounds + 2) * args.timeout + STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        for generator, _ in generators:
            try:
                generator.wait(timeout=RECONNECT_SECONDS + STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop_processes(started, STOP_SECONDS)  # the relay prints its counts when stopped
        for each in [sampler, relay_sampler, *generator_samplers]:
            if each is not None:
                each.close()
    server_lines.save(work / "server.log", STOP_SECONDS)
    for index, (_, lines) in enumerate(generators):
        lines.save(work / f"generator_{index}.log", STOP_SECONDS)
    relay_counts = None
    if relay_lines is not None:
        relay_lines.save(work / "relay.log", STOP_SECONDS)
        try:
            relay_counts = json.loads(relay_lines.wait_for(_RELAY_COUNTS, STOP_SECONDS, "counts").group(0))
        except RuntimeError:
            pass  # a problem of the row (_collect)
    return _collect(row, args, work, out, go, server, server_lines, sampler, generators, generator_samplers,
                    len(offsets), relay_counts, relay_sampler)


def _collect(row: Row, args: argparse.Namespace, work: Path, out: Path, go: float, server: subprocess.Popen,
             server_lines: Lines, sampler: ProcSampler,
             generators: list[tuple[subprocess.Popen, Lines]], generator_samplers: list[ProcSampler],
             planned_cuts: int, relay_counts: dict | None, relay_sampler: ProcSampler | None) -> RowResult:
    """Read what the row's processes left behind into its result."""
    problems = []
    metrics_path = out / "metrics.jsonl"
    records = read_rounds(metrics_path) if metrics_path.is_file() else []
    if len(records) < args.rounds:
        problems.append(f"{len(records)} of {args.rounds} rounds completed")
    problems += [f"round {r.round}: {len(r.completed)} of {len(r.sampled)} results" for r in records
                 if len(r.completed) < len(r.sampled)]
    summary_path = out / "summary.json"
    summary = read_summary(summary_path) if summary_path.is_file() else RunSummary()
    evaluated = sum(client.test_samples is not None for client in summary.per_client or [])
    if evaluated < row.clients:
        problems.append(f"{evaluated} of {row.clients} clients evaluated")
    if args.relay and relay_counts is None:
        problems.append("the relay printed no counts")
    if relay_counts is not None and relay_counts["resets"] < planned_cuts:
        problems.append(f"the relay made {relay_counts['resets']} of {planned_cuts} planned cuts (the traffic "
                        "ended before the later offsets)")
    lines = server_lines.snapshot()
    round_lines = {int(m.group(1)): t for t, line in lines if (m := _ROUND_LINE.search(line))}
    windows = [(round_lines[r.round] - r.seconds, round_lines[r.round]) for r in records if r.round in round_lines]
    cpu = [sampler.cpu_at(end) - sampler.cpu_at(start) for start, end in windows]
    generators_cpu = [sum(each.cpu_at(end) - each.cpu_at(start) for each in generator_samplers)
                      for start, end in windows]
    relay_cpu = [relay_sampler.cpu_at(end) - relay_sampler.cpu_at(start) for start, end in windows
                 ] if relay_sampler is not None else []
    evaluation = None
    for index, (moment, line) in enumerate(lines):
        if _EVALUATING in line:
            # the evaluation's own log lines (streams sent again, processes lost) are stamped; the
            # summary table printed after it is not
            after = next((t for t, later in lines[index + 1:] if not _STAMPED.match(later)), None)
            evaluation = None if after is None else after - moment
    loads = []
    for index, (generator, _) in enumerate(generators):
        path = work / f"load_{index}.json"
        if path.is_file():
            loads.append(json.loads(path.read_text()))
        else:
            problems.append(f"load generator {index} wrote no counts (exit {generator.returncode})")
    load = _sum_loads(loads)
    if server.returncode != 0:
        errors = [line for _, line in lines if line.startswith("error:")]
        problems.append(f"server exit {server.returncode}: {len(errors)} error lines, e.g. "
                        + "; ".join(errors[:2]))
    if load["failures"]:
        problems.append(f"{len(load['failures'])} virtual processes failed, e.g. {load['failures'][0]}")
    return RowResult(
        row=row, generators=len(generators), server_exit=server.returncode,
        results_per_round=[len(r.completed) for r in records],
        sampled_per_round=[len(r.sampled) for r in records],
        joined_in=max(load["join_times"]) - go if len(load["join_times"]) == row.processes else None,
        round_seconds=[r.seconds for r in records],
        peak_rss_bytes=sampler.peak_rss_bytes,
        cpu_per_round=statistics.fmean(cpu) if cpu else None,
        generators_cpu_per_round=statistics.fmean(generators_cpu) if generators_cpu else None,
        heartbeats_missed=sum(_SILENT in line for _, line in lines),
        evaluation_seconds=evaluation,
        generator_exits=[generator.returncode for generator, _ in generators],
        load=load, problems=problems, evaluated=evaluated,
        delivery_per_round=[r.delivery for r in records],
        evaluation_delivery=summary.delivery.evaluation if summary.delivery is not None else None,
        planned_cuts=planned_cuts, relay=relay_counts,
        relay_cpu_per_round=statistics.fmean(relay_cpu) if relay_cpu else None,
    )


# ------------------------------------------------------------------------------------ the floor


def result_tensors(model: str) -> dict[str, torch.Tensor]:
    """Float32 tensors shaped like one FedAvg result of ``model`` on MNIST (every parameter)."""
    config = config_from_dict(scale_config(1, 1, 1.0, model, 1.0))
    return {name: tensor.detach().clone() for name, tensor in build_run_model(config).state_dict().items()
            if tensor.is_floating_point()}


def transfer_seconds(results: int, result_bytes: int) -> float:
    """Seconds to move ``results x result_bytes`` through one loopback TCP connection."""
    payload = memoryview(bytearray(result_bytes))
    total = results * result_bytes
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()

        def send() -> None:
            with sender:
                for _ in range(results):
                    sender.sendall(payload)

        buffer = memoryview(bytearray(1 << 20))
        started = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        with receiver:
            received = 0
            while received < total:
                count = receiver.recv_into(buffer)
                if count == 0:
                    raise RuntimeError(f"loopback transfer ended after {received} of {total} bytes")
                received += count
        seconds = time.perf_counter() - started
        thread.join()
    return seconds


def fold_seconds(results: int, tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Seconds to fold ``results`` deltas shaped like ``tensors`` on one core: with the server's
    WeightedMean, and as a plain float32 sum."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        pool = [{n: torch.randn(t.shape, generator=generator) * 1e-3 for n, t in tensors.items()}
                for _ in range(FOLD_POOL)]
        mean = WeightedMean()
        started = time.perf_counter()
        for index in range(results):
            mean.add(pool[index % FOLD_POOL], 15.0)
        mean.result()
        weighted = time.perf_counter() - started
        sums = {n: torch.zeros_like(t) for n, t in tensors.items()}
        started = time.perf_counter()
        for index in range(results):
            for name, delta in pool[index % FOLD_POOL].items():
                sums[name].add_(delta)
        plain = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    return weighted, plain


@dataclass
class Floor:
    results: int
    result_bytes: int
    transfer: float
    fold: float
    plain_sum: float

    @property
    def seconds(self) -> float:
        return self.transfer + self.fold


def measure_floor(results: int, tensors: dict[str, torch.Tensor]) -> Floor:
    """The floor for ``results`` results shaped like ``tensors``: each part the least of
    :data:`FLOOR_REPEATS` measurements (other tenants of the machine only ever add time)."""
    result_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    folds = [fold_seconds(results, tensors) for _ in range(FLOOR_REPEATS)]
    transfer = min(transfer_seconds(results, result_bytes) for _ in range(FLOOR_REPEATS))
    return Floor(results, result_bytes, transfer, min(f[0] for f in folds), min(f[1] for f in folds))


# ------------------------------------------------------------------------------------ report


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def format_table(results: list[tuple[RowResult, Floor]], relayed: bool = False) -> str:
    """The rows as a Markdown table; ``relayed`` adds the columns of the fault relay."""
    header = ["clients N", "processes K", "results per round", "joined-in s", "round s", "server peak RSS",
              "server CPU s/round", "generators CPU s/round", "heartbeats missed", "final evaluation s",
              "floor s", "round/floor"]
    if relayed:
        header += ["cuts", "evaluated"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result, floor in results:
        rounds = ", ".join(f"{s:.2f}" for s in result.round_seconds) or "-"
        per_round = ", ".join(str(c) if c == s else f"{c} of {s}"
                              for c, s in zip(result.results_per_round, result.sampled_per_round)) or "-"
        ratio = statistics.fmean(result.round_seconds) / floor.seconds if result.round_seconds else None
        lines.append("| " + " | ".join([
            f"{result.row.clients:,}", f"{result.row.processes:,}", per_round, _fmt(result.joined_in), rounds,
            f"{result.peak_rss_bytes / 1e9:.2f} GB", _fmt(result.cpu_per_round, "{:.3f}"),
            _fmt(result.generators_cpu_per_round, "{:.3f}"), str(result.heartbeats_missed),
            _fmt(result.evaluation_seconds), f"{floor.seconds:.2f}", _fmt(ratio, "{:.1f}x"),
            *([_cuts(result), f"{result.evaluated:,}"] if relayed else []),
        ]) + " |")
    return "\n".join(lines)


def _cuts(result: RowResult) -> str:
    if result.relay is None:
        return "-"
    made = result.relay["resets"]
    return str(made) if made == result.planned_cuts else f"{made} of {result.planned_cuts}"


def _nonzero(counts: DeliveryCounts | None) -> str:
    return ", ".join(f"{key} {value}" for key, value in (counts or DeliveryCounts()).to_json().items() if value) or "none"


def format_details(result: RowResult, floor: Floor) -> str:
    load = result.load
    errors = ", ".join(f"{k} x{v}" for k, v in sorted(load.get("errors", {}).items())) or "none"
    lines = [
        f"{result.row.clients}x{result.row.processes}: server exit {result.server_exit}, "
        f"{result.generators} load generators exit {result.generator_exits}; virtual processes joined "
        f"{load.get('joins', 0)}, told DONE {load.get('done', 0)}, training results {load.get('train_results', 0)}, "
        f"evaluations {load.get('evaluations', 0)}, heartbeats {load.get('heartbeats', 0)}; errors: {errors}",
        f"  floor for {floor.results} results of {floor.result_bytes:,} bytes: loopback transfer "
        f"{floor.transfer:.3f} s + WeightedMean fold {floor.fold:.3f} s (1 core) = {floor.seconds:.3f} s; "
        f"plain float32 sum {floor.plain_sum:.3f} s",
    ]
    if result.relay is not None:
        relay = result.relay
        lines.append(
            f"  relay: {relay['accepted']} connections accepted ({relay['rejected']} over its bound, "
            f"{relay['refused']} refused by the server), {relay['resets']} reset of {result.planned_cuts} planned, "
            f"{relay['up']:,} bytes up, {relay['down']:,} down; "
            f"CPU s/round {_fmt(result.relay_cpu_per_round)}")
        for number, counts in enumerate(result.delivery_per_round, start=1):
            lines.append(f"  round {number} delivery: {_nonzero(counts)}")
        lines.append(f"  final evaluation: {result.evaluated} of {result.row.clients} clients evaluated; delivery: "
                     f"{_nonzero(result.evaluation_delivery)}")
    lines += [f"  problem: {problem}" for problem in result.problems]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=parse_rows, default=parse_rows("1000x100"),
                        help="CLIENTSxPROCESSES, comma-separated (default 1000x100)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.1, help="clients sampled per round")
    parser.add_argument("--model", default="cnn2")
    parser.add_argument("--generators", type=int, default=os.cpu_count() or 1,
                        help="OS processes the virtual processes are spread over (default: the cores)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="the server's join, round and evaluation timeouts (a row ends by them)")
    parser.add_argument("--keep", type=Path,
                        help="keep each row's run directory, counts and logs under this directory")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the server's config, e.g. server.receive_window=65536 (repeatable)")
    parser.add_argument("--relay", action="store_true",
                        help="connect the load generators through the fault relay (implied by the cuts)")
    parser.add_argument("--cuts", type=int, default=0,
                        help="connections the relay resets at seeded random bytes of the rounds' traffic")
    parser.add_argument("--evaluation-cuts", type=int, default=0,
                        help="connections the relay resets at seeded random bytes of the final evaluation's traffic")
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of the bytes the cuts fall on")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; ``relay`` is set when cuts are asked for."""
    args = parser.parse_args(argv)
    if args.generators < 1:
        parser.error("--generators must be at least 1")
    if args.cuts < 0 or args.evaluation_cuts < 0:
        parser.error("--cuts and --evaluation-cuts must be >= 0")
    args.relay = args.relay or args.cuts > 0 or args.evaluation_cuts > 0
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        tensors = result_tensors(args.model)
    except ValueError as error:
        parser.error(f"--model: {error}")
    for row in args.rows:
        try:
            config_from_dict(scale_config(row.clients, args.rounds, args.fraction, args.model, args.timeout,
                                          args.set))
        except ValueError as error:
            parser.error(f"row {row.clients}x{row.processes}: {error}")
        if args.keep is not None and (args.keep / f"{row.clients}x{row.processes}").exists():
            parser.error(f"--keep: {args.keep / f'{row.clients}x{row.processes}'} exists already")
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    results = []
    floors: dict[int, Floor] = {}
    for row in args.rows:
        if args.keep is not None:
            work = args.keep / f"{row.clients}x{row.processes}"
            work.mkdir(parents=True)
            result = run_row(row, args, work, model_bytes)
        else:
            with tempfile.TemporaryDirectory(prefix="fedpart-scale-") as tmp:
                result = run_row(row, args, Path(tmp), model_bytes)
        count = max(result.sampled_per_round, default=max(1, int(args.fraction * row.clients + 1e-9)))
        if count not in floors:
            floors[count] = measure_floor(count, tensors)
        results.append((result, floors[count]))
        print(format_details(result, floors[count]), flush=True)
    settings = "".join(f", {override}" for override in args.set)
    if args.relay:
        settings += (f", through the fault relay: {args.cuts} cuts in the rounds, {args.evaluation_cuts} in the "
                     f"final evaluation (seed {args.fault_seed})")
    print(f"\nFedAvg, {args.model}, fraction {args.fraction}, {args.rounds} rounds, {os.cpu_count()} cores{settings}")
    print(format_table(results, args.relay))
    return 0 if all(not result.problems for result, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
