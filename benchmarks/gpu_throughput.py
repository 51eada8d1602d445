"""Local-training throughput of a fedpart client process on a GPU against a plain PyTorch loop
doing the same steps on the same device, measured in one run; and whole rounds with 1, 2 and 4
client processes sharing the device.

Workloads: ``cnn4`` and ``mobilenet`` (FedBABU) and ``resnet18`` with GroupNorm (FedBug) on
CIFAR-shaped inputs (3x32x32, 10 classes): real CIFAR-10 from ``--data-root`` when it holds
``cifar-10-batches-py/``, else synthetic CIFAR-10 pickles (random images and labels, the same
file format) written to a temporary directory and read by fedpart's own loader. ``--clients``
clients with an iid share each, every client every round, ``--epochs`` local epochs of batch
``--batch-size`` (SGD lr 0.01, momentum 0.9), under three schedules:

- ``fedavg``: every unit trains;
- ``fedbabu``: the body trains, the head is frozen;
- ``layer_expansion_vanilla`` in its early rounds: only the first body unit trains (the others
  join at a round the run never reaches), the head is frozen.

What is measured, per model and schedule:

- **fedpart**: ``fedpart run --devices DEVICE`` (one client process). Its samples/s in a round
  are ``epochs x train_samples / client_compute_seconds`` of that round in ``metrics.jsonl``:
  the process's own measure of its local training (from building the optimizer to reading the
  loss back, which waits for the device), summed over its clients. The median is over rounds 2
  onwards; round 1 pays the warm-up (allocator, cuDNN, ``torch.compile``): what its local
  training took beyond a later round's is shown beside it.
- **plain**: in this process, on the same device, before and after fedpart: the same clients'
  data (loaded once to the device), the same initial weights and trainable units, the same
  batches (fedpart's per-client shuffling seeds), a plain ``nn.Sequential`` of the same modules,
  ``torch.optim.SGD`` over the trainable parameters, and the same speed options (autocast and a
  gradient scaler, channels-last, ``torch.compile``); timed per client like fedpart, from the
  optimizer to the loss read back. Median over rounds 2 onwards of both passes.
- the **ratio** fedpart / plain; the target is >= 0.9.

Then, per model with FedAvg, a whole round with 1, 2 and 4 client processes on the one device
(``--devices D,D,...``): the server's round seconds (median over rounds 2 onwards), the
samples/s of the round, and each process's peak GPU memory (``gpu_peak_bytes``).

Without a GPU (``--device auto`` on a machine without CUDA, or ``--device cpu``) everything runs
on the CPU, with smaller defaults, and the output says that these are CPU numbers and the GPU
figures unmeasured.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from fedpart.client.local_data import ClientData, load_client_data
from fedpart.client.placement import describe, resolve_device
from fedpart.client.speed import AMP_DTYPES
from fedpart.common.ml.algorithms import RoundContext
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.config.experiment import build_run_model, run_algorithm
from fedpart.common.process.limits import client_threads
from fedpart.common.models.zoo import build_model
from fedpart.common.process.records import RoundRecord, read_rounds
from fedpart.common.wire.client_ids import split_clients
from fedpart.deploy.launcher import stop_processes

MODELS = ("cnn4", "mobilenet", "resnet18")
SCHEDULES = ("fedavg", "fedbabu", "layer_expansion_vanilla")
INPUT_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
SEED = 0
LR = 0.01
MOMENTUM = 0.9
TARGET_RATIO = 0.9
NEVER = 1_000_000  # a round no run reaches: the unit joins layer expansion after the measured rounds
TEST_PER_CLIENT = 10
RUN_SECONDS = 3600.0
GPU_DEFAULTS = {"clients": 10, "samples": 500, "epochs": 2, "rounds": 4}
CPU_DEFAULTS = {"clients": 4, "samples": 100, "epochs": 1, "rounds": 3}


# ------------------------------------------------------------------------------------------ data


def write_synthetic_cifar10(root: Path, train: int, test: int) -> None:
    """CIFAR-10 python pickles of random uint8 images and labels (5 training files and a test file)."""
    rng = np.random.default_rng(SEED)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def write(path: Path, count: int) -> None:
        batch = {"data": rng.integers(0, 256, (count, 3 * 32 * 32), dtype=np.uint8),
                 "labels": rng.integers(0, NUM_CLASSES, count).tolist()}
        with path.open("wb") as f:
            pickle.dump(batch, f, protocol=2)

    for index, part in enumerate(np.array_split(np.arange(train), 5), start=1):
        write(folder / f"data_batch_{index}", len(part))
    write(folder / "test_batch", test)


# ---------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Workload:
    model: str
    schedule: str
    clients: int
    epochs: int
    batch_size: int
    rounds: int
    amp: str
    channels_last: bool
    compile: bool


def run_config(work: Workload, data_root: Path, processes: int) -> dict:
    """The fedpart run config of ``work``; the evaluation after the last round is reduced to each
    client's initial test accuracy."""
    algorithm: dict = {"name": work.schedule}
    if work.schedule == "layer_expansion_vanilla":
        units = build_model(work.model, NUM_CLASSES, INPUT_SHAPE, SEED).unit_names
        algorithm["unfreeze_rounds"] = [0] + [NEVER] * (len(units) - 1)
    return {
        "name": f"gpu_throughput_{work.model}_{work.schedule}",
        "seed": SEED,
        "rounds": work.rounds,
        "clients": work.clients,
        "processes": processes,
        "data": {"dataset": "cifar10", "root": str(data_root), "partition": {"scheme": "iid"}},
        "model": {"name": work.model},
        "algorithm": algorithm,
        "train": {"epochs": work.epochs, "batch_size": work.batch_size, "lr": LR, "momentum": MOMENTUM,
                  "amp": work.amp, "channels_last": work.channels_last, "compile": work.compile},
        "evaluate": {"finetune_epochs": [], "global_test": False},
        "server": {"round_timeout": RUN_SECONDS, "join_timeout": 600, "heartbeat_timeout": 120},
    }


def task_seed(round_number: int, client: int) -> int:
    """The shuffling seed fedpart's coordinator puts in a client's training plan."""
    return (SEED * 1_000_003 + round_number) * 1_000_003 + client


# --------------------------------------------------------------------------------------- fedpart


def run_fedpart(config: dict, devices: list[str], work_dir: Path, name: str) -> list[RoundRecord]:
    """``fedpart run`` of ``config`` with one client process per entry of ``devices``; its round
    records. Raises RuntimeError with the end of its output when it fails."""
    path = work_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = work_dir / name
    log = work_dir / f"{name}.log"
    command = [sys.executable, "-m", "fedpart", "run", str(path), "--out", str(out),
               "--devices", ",".join(devices)]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=RUN_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_processes([process])
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"fedpart run {name} failed ({'timeout' if code is None else code}):\n{tail}")
    return read_rounds(out / "metrics.jsonl")


# ----------------------------------------------------------------------------------------- plain


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_rounds(work: Workload, data_root: Path, device: torch.device) -> list[float]:
    """Samples/s of each round of the plain loop doing fedpart's steps (see the module docstring)."""
    config = config_from_dict(run_config(work, data_root, 1))
    split = build_run_model(config).to(device)
    ctx = RoundContext(round=1, rounds=work.rounds, units=tuple(split.unit_names), epochs=work.epochs)
    (phase,) = run_algorithm(config).schedule(ctx)
    trainable = [p for unit in phase.trainable for p in split.unit_parameters(unit)]
    for parameter in split.parameters():
        parameter.requires_grad_(False)
    for parameter in trainable:
        parameter.requires_grad_(True)
    start = {k: v.clone() for k, v in split.state_dict().items()}
    layout = torch.channels_last if work.channels_last else torch.contiguous_format
    model: nn.Module = nn.Sequential(*split.body.values(), nn.Flatten(1), split.head).to(memory_format=layout)
    forward = torch.compile(model, dynamic=False) if work.compile else model
    data = {c: ClientData(d.x_train.contiguous(memory_format=layout), d.y_train, d.x_test, d.y_test)
            for c, d in load_client_data(config, list(range(work.clients)), None, device).items()}
    amp = AMP_DTYPES.get(work.amp) if device.type == "cuda" else None
    rates = []
    for round_number in range(1, work.rounds + 1):
        seconds = samples = 0.0
        for client, client_data in data.items():
            split.load_state_dict(start)
            synchronize(device)
            started = time.perf_counter()
            samples += work.epochs * train_client(forward, trainable, client_data, work, amp, device,
                                                  task_seed(round_number, client))
            seconds += time.perf_counter() - started
        rates.append(samples / seconds)
    return rates


def train_client(model: nn.Module, trainable: list[nn.Parameter], data: ClientData, work: Workload,
                 amp: torch.dtype | None, device: torch.device, seed: int) -> int:
    """One client's local epochs, the plain way; returns its sample count after reading the loss."""
    fused = amp == torch.float16
    optimizer = torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM, fused=True if fused else None)
    scaler = torch.amp.GradScaler(device.type) if fused else None
    generator = torch.Generator().manual_seed(seed)
    n = data.x_train.shape[0]
    total = torch.zeros((), device=device)
    for _ in range(work.epochs):
        order = torch.randperm(n, generator=generator)
        if device.type == "cuda":
            order = order.pin_memory().to(device, non_blocking=True)
        for start in range(0, n, work.batch_size):
            index = order[start:start + work.batch_size]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = F.cross_entropy(model(data.x_train[index]), data.y_train[index])
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            total += loss.detach() * len(index)
    float(total)
    return n


# ---------------------------------------------------------------------------------------- report


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


@dataclass
class ThroughputRow:
    model: str
    schedule: str
    fedpart_samples_per_s: float
    fedpart_warmup_s: float  # what round 1's local training took beyond a later round's
    plain_samples_per_s: float
    ratio: float


@dataclass
class SharingRow:
    model: str
    processes: int
    round_seconds: float
    samples_per_s: float
    peak_mb_per_process: list[float]


def measure_throughput(work: Workload, data_root: Path, device: torch.device, work_dir: Path) -> ThroughputRow:
    before = plain_rounds(work, data_root, device)
    records = run_fedpart(run_config(work, data_root, 1), [str(device)], work_dir, f"{work.model}_{work.schedule}")
    after = plain_rounds(work, data_root, device)
    fedpart = [work.epochs * r.train_samples / r.client_compute_seconds for r in records]
    plain = statistics.median(before[1:] + after[1:] if len(before) > 1 else before + after)
    ours = median_after_first(fedpart)
    compute = [r.client_compute_seconds for r in records]
    return ThroughputRow(work.model, work.schedule, ours, compute[0] - median_after_first(compute), plain,
                         ours / plain)


def measure_sharing(work: Workload, data_root: Path, device: torch.device, processes: int,
                    work_dir: Path) -> SharingRow:
    records = run_fedpart(run_config(work, data_root, processes), [str(device)] * processes, work_dir,
                          f"{work.model}_shared_{processes}")
    seconds = median_after_first([r.seconds for r in records])
    samples = work.epochs * records[-1].train_samples
    peaks: dict[str, int] = {}
    for record in records:
        for name, peak in (record.gpu_peak_bytes or {}).items():
            peaks[name] = max(peaks.get(name, 0), peak)
    return SharingRow(work.model, processes, seconds, samples / seconds, [p / 2**20 for p in peaks.values()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cuda:N, cpu, or auto (the first GPU, else the CPU)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--processes", default="1,2,4", help="client processes sharing the device (whole rounds)")
    parser.add_argument("--clients", type=int, help="clients (GPU default 10, CPU 4)")
    parser.add_argument("--samples", type=int, help="training samples per client, synthetic data (GPU 500, CPU 100)")
    parser.add_argument("--epochs", type=int, help="local epochs (GPU 2, CPU 1)")
    parser.add_argument("--rounds", type=int, help="rounds per run, the first is warm-up (GPU 4, CPU 3)")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--amp", default="off", choices=("off", "bf16", "fp16"))
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--data-root", help="a directory with cifar-10-batches-py/ (default: synthetic CIFAR-10)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    device = resolve_device(args.device)
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    clients = args.clients or defaults["clients"]
    samples = args.samples or defaults["samples"]
    epochs = args.epochs or defaults["epochs"]
    rounds = args.rounds or defaults["rounds"]
    torch.set_num_threads(client_threads(1))  # as fedpart run gives its one client process
    print(f"device {describe(device)} | torch {torch.__version__} | amp {args.amp}, channels_last "
          f"{args.channels_last}, compile {args.compile}")
    if device.type != "cuda":
        print("NOTE: no GPU: every figure below is a CPU number (smaller defaults); the GPU figures are "
              "unmeasured.")
    with tempfile.TemporaryDirectory(prefix="fedpart-gpu-throughput-") as tmp:
        work_dir = Path(tmp)
        if args.data_root and (Path(args.data_root) / "cifar-10-batches-py").is_dir():
            data_root = Path(args.data_root).resolve()
            print(f"data: CIFAR-10 from {data_root}, {clients} iid clients")
        else:
            data_root = work_dir / "data"
            write_synthetic_cifar10(data_root, clients * samples, clients * TEST_PER_CLIENT)
            print(f"data: synthetic CIFAR-10 (random 3x32x32 images), {clients} clients x {samples} samples")
        print(f"{epochs} local epochs of batch {args.batch_size}, {rounds} rounds per run (round 1: warm-up)\n")

        def workload(model: str, schedule: str) -> Workload:
            return Workload(model, schedule, clients, epochs, args.batch_size, rounds, args.amp, args.channels_last,
                            args.compile)

        rows: list[ThroughputRow] = []
        print(f"{'model':<11}{'schedule':<25}{'fedpart samples/s':>18}{'warm-up s':>11}{'plain samples/s':>17}"
              f"{'ratio':>8}")
        for model in args.models.split(","):
            for schedule in args.schedules.split(","):
                row = measure_throughput(workload(model, schedule), data_root, device, work_dir)
                rows.append(row)
                verdict = "" if row.ratio >= TARGET_RATIO else f"  below the {TARGET_RATIO}x target"
                print(f"{row.model:<11}{row.schedule:<25}{row.fedpart_samples_per_s:>18.1f}"
                      f"{row.fedpart_warmup_s:>11.2f}{row.plain_samples_per_s:>17.1f}{row.ratio:>7.2f}x{verdict}",
                      flush=True)
        print(f"\nwhole rounds, FedAvg, client processes sharing {device}:")
        print(f"{'model':<11}{'processes':>10}{'round s':>10}{'samples/s':>12}  peak GPU MB per process")
        sharing: list[SharingRow] = []
        for model in args.models.split(","):
            for processes in (int(p) for p in args.processes.split(",")):
                if len(split_clients(clients, processes)) < processes:
                    print(f"{model:<11}{processes:>10}  skipped: only {clients} clients")
                    continue
                row = measure_sharing(workload(model, "fedavg"), data_root, device, processes, work_dir)
                sharing.append(row)
                peaks = ", ".join(f"{p:.0f}" for p in row.peak_mb_per_process) or "- (not a GPU)"
                print(f"{row.model:<11}{row.processes:>10}{row.round_seconds:>10.2f}{row.samples_per_s:>12.1f}"
                      f"  {peaks}", flush=True)
    worst = min(r.ratio for r in rows)
    print(f"\nlowest fedpart / plain ratio {worst:.2f}x (target >= {TARGET_RATIO}x)"
          + ("" if device.type == "cuda" else "; CPU numbers, the GPU target is unmeasured"))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": describe(device), "torch": torch.__version__,
                                               "options": {"amp": args.amp, "channels_last": args.channels_last,
                                                           "compile": args.compile},
                                               "throughput": [asdict(r) for r in rows],
                                               "sharing": [asdict(r) for r in sharing]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
