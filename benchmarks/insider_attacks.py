"""One insider among ten clients, against the old and the new robust default (issue 51).

Each run is a real ``fedpart server`` with a real ``fedpart client`` process for clients 0-8; client
9 is an insider: a process written against the proto (raw gRPC stubs, none of fedpart's client
code) that holds its own data shards, trains on them as an honest client would (plain SGD on the
tensors its task uploads, with the task's learning rate, momentum and epochs) and then sends:

- ``none``: its honest update (with client 9 honest, the clean run);
- ``flip10``: its update sign-flipped and scaled 10 times, every round;
- ``bound``: its update sign-flipped and scaled to 0.95 times the norm bound the server applies to
  that round (``robust.adaptive_bound`` x the median norm of the latest round, or before it
  ``robust.first_round_bound`` x the initial norm). The insider knows the bound exactly: it reads
  the medians from the server's run state (the worst case, an insider who knows the defence);
- ``bound10``: the same at 0.95 times the old default's bound (10 x the median) whatever the
  defence: the attack issue 51 measured;
- ``nan``: NaN in every element, which validation refuses whatever the defence: the run without
  the insider's results, the most a defence that refuses them can keep.

It answers the final evaluation with its own test metrics. The defences: ``old`` (the mean with the
adaptive bound at 10 x the median, the default before issue 51; the insider monitor watches with
``robust.monitor_action: warn``, which changes nothing) and ``new`` (the run's defaults).
The table gives the global model's accuracy on the server's test set per seed, its mean, the gap to
the same defence's clean run, the server's exit codes and the rounds in which the insider monitor
named client 9. Settings: ``quickstart`` (configs/quickstart.yaml as shipped: FedBABU, digits, ten
clients with two label shards each, 20 rounds) and ``mnist`` (FedAvg, cnn2 on real MNIST, ten
clients with two label shards each, reduced: see :func:`mnist_config`).

    nice -n 19 python benchmarks/insider_attacks.py                    # the table of docs/security.md
    python benchmarks/insider_attacks.py --settings quickstart --seeds 0 --attacks none flip10

The insider alone (the hostile process of tests/test_insiders.py): ``python
benchmarks/insider_attacks.py insider --server ADDR --client 9 --attack flip10 --run-dir DIR``;
``--report`` forges its evaluation report instead: ``test-samples`` claims 1e9 test samples,
``malformed-first`` sends an accuracy of 1.5 in its first report and an honest one when asked again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml

from fedpart.common.config.run_config import RunConfig, config_from_dict
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.config.experiment import build_run_model
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.process.records import NamedInsider, RunSummary, read_summary
from fedpart.common.wire.tensors import decode_chunks, encode_chunks, make_spec
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.policy.robust import AdaptiveBound
from fedpart.server.engine.run_state import ResumeError, read_run_state

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO.parent / "shared" / "data"
INSIDER = 9
ATTACKS = ("none", "flip10", "bound", "bound10", "nan")
# the old default: the mean with the adaptive bound at 10 x; the insider monitor only watches (it changes nothing)
DEFENCES = {"old": {"adaptive_bound": 10.0, "first_round_bound": 10.0, "monitor_action": "warn"}, "new": {}}
OLD_BOUND = 10.0   # the old default's robust.adaptive_bound and robust.first_round_bound
CALL_SECONDS = 60.0
_LISTENING = re.compile(r"listening on (\S+:\d+)")


# ------------------------------------------------------------------------------ the insider process


class RawSession:
    """A client process speaking the proto with raw stubs and hosting ``clients``: it joins, long-polls
    for tasks (keeping the global tensors they bring) and submits results, nothing more."""

    def __init__(self, server: str, clients: list[int], name: str = "hostile", timeout: float = CALL_SECONDS) -> None:
        self.timeout = timeout
        self.channel = grpc.insecure_channel(server)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        reply = self.stub.Join(pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=name,
                                              clients=[pb.HostedClient(id=c) for c in clients]), timeout=timeout)
        self.session = reply.session
        self.config: RunConfig = config_from_dict(json.loads(reply.run_config_json))
        self.held: dict[str, int] = {}
        self.state: dict[str, torch.Tensor] = {}  # the global tensors as last received

    def next_task(self) -> pb.TaskHeader:
        """Long-poll until a task (or DONE) arrives; keeps the received tensors."""
        while True:
            request = pb.TaskRequest(session=self.session, held_versions=self.held, wait_seconds=self.timeout / 4)
            header, tensors = decode_chunks(self.stub.GetTask(request, timeout=self.timeout))
            if header.kind != pb.IDLE:
                self.state.update(tensors)
                self.held.update({spec.name: spec.version for spec in header.tensors})
                return header

    def submit(self, header: pb.TaskHeader, uploads: dict[str, torch.Tensor], samples: int,
               metrics: dict[str, float] | None = None) -> pb.SubmitReply:
        """Send a result of ``header``'s task in messages of the size it names; raises
        ``grpc.RpcError`` where the server refuses it."""
        result = pb.ResultHeader(session=self.session, task_id=header.task_id, client_id=header.client_id,
                                 round=header.round, num_samples=samples, metrics=metrics or {"loss": 1.0},
                                 tensors=[make_spec(n, t) for n, t in uploads.items()])
        chunk_bytes = self.config.server.largest_result_message(header.result_chunk_bytes)
        chunks: Iterator = encode_chunks(pb.ResultChunk, result, list(uploads.values()), chunk_bytes)
        return self.stub.SubmitResult(chunks, timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()


class Insider(RawSession):
    """The hostile process for one client: its own data, honest local training, poisoned uploads."""

    def __init__(self, server: str, client: int, attack: str, run_dir: Path | None, report: str | None) -> None:
        super().__init__(server, [client], f"insider-{client}")
        self.client = client
        self.attack = attack
        self.run_dir = run_dir
        # the server sends clients none of its own knobs: the oracle reads them where the server writes them
        self.server_config = yaml.safe_load((run_dir / "config.yaml").read_text()) if run_dir else None
        self.report = report
        self.reports = 0
        self.model = build_run_model(self.config)
        self.initial = {name: tensor.clone() for name, tensor in self.model.state_dict().items()}
        data = self.config.data
        dataset = load_dataset(data.dataset, data.root, **data.options)
        split = make_partition(dataset.y_train, dataset.y_test, self.config.clients, data.partition.scheme,
                               self.config.partition_seed, num_classes=dataset.num_classes,
                               **data.partition.options)[client]
        self.x, self.y = dataset.features(dataset.x_train[split.train]), dataset.targets(dataset.y_train[split.train])
        self.x_test = dataset.features(dataset.x_test[split.test])
        self.y_test = dataset.targets(dataset.y_test[split.test])
        self._beating = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._beating.wait(5.0):
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(session=self.session), timeout=self.timeout)
            except grpc.RpcError:
                pass

    def run(self) -> int:
        try:
            while True:
                header = self.next_task()
                if header.kind == pb.DONE:
                    return 0
                if header.kind == pb.TRAIN:
                    self._train(header)
                elif header.kind == pb.EVALUATE:
                    self._evaluate(header)
        finally:
            self._beating.set()
            self.close()

    def _answer(self, header: pb.TaskHeader, uploads: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
        try:
            self.submit(header, uploads, len(self.y), metrics)
        except grpc.RpcError as error:  # refused: the server says why in its log; the insider goes on
            print(f"insider: round {header.round}: {error.code().name}: {error.details()}", flush=True)

    def _train(self, header: pb.TaskHeader) -> None:
        """Train honestly on the uploaded tensors, then send the attack's version of the update."""
        plan = header.train
        self.model.load_state_dict({**self.model.state_dict(), **self.state})
        names = list(plan.upload_deltas)
        parameters = dict(self.model.named_parameters())
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        trained = [parameters[name].requires_grad_(True) for name in names if name in parameters]
        optimizer = torch.optim.SGD(trained, lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay)
        generator = torch.Generator().manual_seed(int(plan.seed))
        loss_fn = torch.nn.CrossEntropyLoss()
        self.model.train()
        for _ in range(sum(phase.epochs for phase in plan.phases)):
            for index in torch.randperm(len(self.y), generator=generator).split(plan.batch_size):
                optimizer.zero_grad()
                loss_fn(self.model(self.x[index]), self.y[index]).backward()
                optimizer.step()
        update = {name: self.model.state_dict()[name] - self.state[name] for name in names}
        self._answer(header, self._poisoned(header.round, update), {"loss": 1.0})

    def _poisoned(self, round_number: int, update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.attack == "none":
            return update
        if self.attack == "flip10":
            return {name: -10 * delta for name, delta in update.items()}
        if self.attack == "nan":
            return {name: torch.full_like(delta, math.nan) for name, delta in update.items()}
        if self.server_config is None:
            raise SystemExit("insider: the bound attacks read the server's settings and run state: give --run-dir")
        factors = config_from_dict(self.server_config).robust
        bound, first = (factors.adaptive_bound, factors.first_round_bound) if self.attack == "bound" else (OLD_BOUND,
                                                                                                           OLD_BOUND)
        limit = self._bound(list(update), bound, first, round_number)
        norm = math.sqrt(sum(float(delta.double().pow(2).sum()) for delta in update.values()))
        return {name: -delta * (0.95 * limit / norm) for name, delta in update.items()}

    def _bound(self, names: list[str], factor: float, first_factor: float, round_number: int) -> float:
        """The norm bound the server applies in ``round_number`` at these factors, from the medians
        in its run state (the insider's oracle)."""
        bound = AdaptiveBound(factor, first_factor, self.initial)
        if round_number > 1:
            try:
                state = read_run_state(self.run_dir, self.server_config).server_optimizer
            except ResumeError as error:
                raise SystemExit(f"insider: the bound oracle needs the server's run state: {error}") from error
            bound.load_state({k: v for k, v in state.items() if k.startswith(AdaptiveBound.STATE_PREFIX)})
        return bound.limit(names)[0]

    def _evaluate(self, header: pb.TaskHeader) -> None:
        self.reports += 1
        self.model.load_state_dict({**self.model.state_dict(), **self.state})
        self.model.eval()
        with torch.no_grad():
            out = self.model(self.x_test)
            loss = float(torch.nn.functional.cross_entropy(out, self.y_test))
            accuracy = float((out.argmax(dim=1) == self.y_test).double().mean())
        metrics = {"train_samples": float(len(self.y)), "test_samples": float(len(self.y_test)),
                   "initial_loss": loss, "initial_acc": accuracy}
        for epochs in header.evaluate.finetune_epochs:
            metrics.update({f"finetune_{epochs}_loss": loss, f"finetune_{epochs}_acc": accuracy})
        if self.report == "test-samples":
            metrics["test_samples"] = 1e9
        elif self.report == "malformed-first" and self.reports == 1:
            metrics["initial_acc"] = 1.5
        self._answer(header, {}, metrics)


# ------------------------------------------------------------------------------ the runs


def quickstart_config(seed: int) -> dict[str, Any]:
    """configs/quickstart.yaml as shipped, at ``seed``."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config.update(seed=seed, processes=2)
    return config


def mnist_config(seed: int, data_root: Path) -> dict[str, Any]:
    """FedAvg, cnn2 on real MNIST, ten clients with two label shards each (data.partition
    shards), all every round; reduced to fit a shared two-core machine: a class-stratified subset of
    6,000 training and 1,000 test samples (600 and 100 a client; the global model is tested on the
    1,000), 10 rounds of one local epoch."""
    return {
        "name": "mnist-insider", "seed": seed, "rounds": 10, "clients": 10, "processes": 2,
        "sampling": {"fraction": 1.0},
        "data": {"dataset": "mnist", "root": str(data_root),
                 "options": {"train_samples": 6000, "test_samples": 1000},
                 "partition": {"scheme": "shards", "shards_per_client": 2}},
        "model": {"name": "cnn2"}, "algorithm": {"name": "fedavg"},
        "train": {"epochs": 1, "batch_size": 10, "lr": 0.01, "momentum": 0.5},
        "evaluate": {"finetune_epochs": [1], "lr": 0.001, "momentum": 0.9, "batch_size": 50},
    }


@dataclass
class Outcome:
    """One run: the global accuracy, the server's exit code and the insider monitor's verdict."""

    accuracy: float | None
    exit_code: int | None
    named_in_rounds: list[int] = field(default_factory=list)
    refused: int = 0
    error: str | None = None


class _Lines:
    """A process's output lines, read on a thread, with a bounded wait for one that matches."""

    def __init__(self, process: subprocess.Popen, log: Path) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._log = log.open("w")
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self._log.write(line)
            self._log.flush()
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError("the server ended before it listened")
            match = pattern.search(line)
            if match:
                return match


def run_once(config: dict[str, Any], attack: str, work: Path, timeout: float) -> Outcome:
    """One run: server, honest client process, insider; every process stopped by its PID."""
    work.mkdir(parents=True)
    config_path = work / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out = work / "run"
    cli = [sys.executable, "-m", "fedpart"]
    processes: list[subprocess.Popen] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        server = subprocess.Popen([*cli, "server", "--insecure", str(config_path), "--address", "127.0.0.1:0", "--out",
                                   str(out), "--progress", "plain"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env, cwd=work)
        processes.append(server)
        address = _Lines(server, work / "server.log").wait_for(_LISTENING, timeout).group(1)
        honest = "0-9" if attack == "none" else f"0-{INSIDER - 1}"
        with (work / "clients.log").open("w") as log:
            processes.append(subprocess.Popen([*cli, "client", "--insecure", "--server", address, "--clients", honest,
                                               "--threads", "1", "--state-dir", str(work / "state")], stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=work))
        if attack != "none":
            with (work / "insider.log").open("w") as log:
                processes.append(subprocess.Popen([sys.executable, __file__, "insider", "--server", address, "--client",
                                                   str(INSIDER), "--attack", attack, "--run-dir", str(out)],
                                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work))
        code = server.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, RuntimeError, queue.Empty) as error:
        return Outcome(None, None, error=f"{type(error).__name__}: {error} (logs in {work})")
    finally:
        _stop(processes)
    summary = read_summary(out / "summary.json") if (out / "summary.json").is_file() else RunSummary()
    named = summary.robust.insiders if summary.robust is not None else None
    insider = (named or {}).get(str(INSIDER), NamedInsider())
    refused = sum(1 for failure in summary.failures or [] if f"client {INSIDER}: result rejected" in failure)
    return Outcome(summary.global_accuracy(), code, insider.named_in_rounds, refused)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _rounds(rounds: list[int]) -> str:
    return f"{len(rounds)} ({rounds[0]}-{rounds[-1]})" if rounds else "0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    insider = sub.add_parser("insider", help="the hostile client process alone")
    insider.add_argument("--server", required=True)
    insider.add_argument("--client", type=int, default=INSIDER)
    insider.add_argument("--attack", choices=ATTACKS, default="none")
    insider.add_argument("--run-dir", type=Path, help="the server's run directory (the bound attacks' oracle)")
    insider.add_argument("--report", choices=("test-samples", "malformed-first"), help="forge the evaluation report")
    parser.add_argument("--settings", nargs="+", choices=("quickstart", "mnist"), default=["quickstart", "mnist"])
    parser.add_argument("--defences", nargs="+", choices=tuple(DEFENCES), default=list(DEFENCES))
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--new", action="append", default=[], metavar="KEY=VALUE",
                        help="a robust key of the new defence changed from its default (to compare settings)")
    parser.add_argument("--data-root", type=Path, default=DATA_ROOT)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))  # its processes are stopped on the way
    if args.command == "insider":
        torch.set_num_threads(1)
        return Insider(args.server, args.client, args.attack, args.run_dir, args.report).run()
    defences = {**DEFENCES, "new": {key: yaml.safe_load(value) for key, value in
                                    (setting.split("=", 1) for setting in args.new)}}
    work = args.work or Path(tempfile.mkdtemp(prefix="insider-attacks-"))
    print(f"runs in {work}", flush=True)
    print(f"{'setting':<11}{'defence':<8}{'attack':<8}{'accuracy % by seed':<24}{'mean':>7}{'gap':>7}  exit codes"
          f"  refused  named by the monitor in rounds", flush=True)
    for setting in args.settings:
        for defence in args.defences:
            clean: dict[int, float] = {}
            for attack in args.attacks:
                outcomes = {}
                for seed in args.seeds:
                    config = quickstart_config(seed) if setting == "quickstart" else mnist_config(seed, args.data_root)
                    config["robust"] = dict(defences[defence])
                    outcome = run_once(config, attack, work / f"{setting}-{defence}-{attack}-{seed}", args.timeout)
                    if outcome.error:
                        print(f"  {setting} {defence} {attack} seed {seed}: {outcome.error}", flush=True)
                    outcomes[seed] = outcome
                accuracies = {seed: o.accuracy for seed, o in outcomes.items() if o.accuracy is not None}
                if attack == "none":
                    clean = accuracies
                mean = statistics.fmean(accuracies.values()) if accuracies else None
                gaps = [accuracies[s] - clean[s] for s in accuracies if s in clean]
                by_seed = " ".join(f"{100 * accuracies[s]:.1f}" if s in accuracies else "-" for s in args.seeds)
                print(f"{setting:<11}{defence:<8}{attack:<8}{by_seed:<24}"
                      f"{'-' if mean is None else f'{100 * mean:.1f}':>7}"
                      f"{f'{100 * statistics.fmean(gaps):+.1f}' if gaps and attack != 'none' else '':>7}  "
                      f"{' '.join(str(o.exit_code) for o in outcomes.values()):<11} "
                      f"{' '.join(str(o.refused) for o in outcomes.values()):<8} "
                      f"{' / '.join(_rounds(o.named_in_rounds) for o in outcomes.values())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
