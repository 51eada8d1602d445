"""Resuming a stopped server (``fedpart server --resume RUN_DIR``), clients that reconnect by
themselves, and evaluations asked again of a client whose process came back. The end-to-end
tests start real server and client processes on 127.0.0.1 and stop them with SIGKILL/SIGSTOP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from conftest import (
    WAIT,
    LineReader,
    Processes,
    fedpart_command,
    poll_task,
    read_metrics,
    read_summary,
    small_config,
    start_server,
    write_config,
)
from fedpart.client.session import Backoff, Session, SessionError
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.wire.plans import HostedClient, JoinInfo, ResultInfo, TaskKind
from fedpart.common.process.records import RoundRecord
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.security import ClientSecurity
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.cli.main import build_parser, resume_config
from fedpart.cli.main import main as cli_main
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.policy.aggregation import WeightedMean
from fedpart.server.output.run_directory import RunDirectory
from fedpart.server.engine.run_state import ResumeError, read_run_state, write_run_state
from fedpart.server.engine.task_board import Task

CLIENT_IDS = ("0-1", "2-3")


def _start_clients(processes: Processes, address: str, root: Path, *extra: str) -> list[subprocess.Popen]:
    """Two client processes (clients 0-1 and 2-3), logging to ``root/client_<i>.log``."""
    root.mkdir(parents=True, exist_ok=True)
    clients = []
    for index, ids in enumerate(CLIENT_IDS):
        with (root / f"client_{index}.log").open("w") as log:
            clients.append(processes.start(
                fedpart_command("client", "--insecure", "--server", address, "--clients", ids, "--threads", "1",
                                "--state-dir", str(root / f"state_{index}"), *extra),
                stdout=log, stderr=subprocess.STDOUT))
    return clients


def _client_logs(root: Path) -> list[str]:
    return [(root / f"client_{index}.log").read_text() for index in range(len(CLIENT_IDS))]


def _finish(server: subprocess.Popen, reader: LineReader, clients: list[subprocess.Popen], root: Path) -> str:
    """Wait for the run to end; every process must succeed. Returns the server's output."""
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 0, output
    for client, log in zip(clients, _client_logs(root)):
        assert client.wait(timeout=WAIT) == 0, log
    return output


def _run_id(reader: LineReader) -> str:
    return re.search(r"\(run (\w+),", reader.lines[-1]).group(1)


def _wait_for_file(path: Path, timeout: float) -> None:
    """Bounded wait for a file another process writes."""
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def _resume(processes: Processes, out: Path, address: str, *extra: str) -> subprocess.Popen:
    return processes.start(fedpart_command("server", "--resume", str(out), "--address", address, "--insecure", *extra),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ---------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("algorithm, server_optimizer", [("fedavg", "plain"), ("fedper", "plain"),
                                                         ("fedavg", "fedadam")])
def test_a_killed_server_resumes_the_same_run_with_identical_results(tmp_path: Path, processes, algorithm,
                                                                     server_optimizer) -> None:
    """SIGKILL the server while round 3 of 4 is in flight (one client process held by SIGSTOP,
    the other has trained and uploaded round 3, FedPer keeping its new heads), resume it: same
    run id, the clients reconnect and join again, round 3 is redone, and the final accuracies and
    checkpoint bytes equal those of an uninterrupted run (FedAdam's moments come back from the
    run state)."""
    # local training of about 0.1 s per client: the stopped process cannot finish round 3 first
    config = small_config(rounds=4, algorithm={"name": algorithm}, server_optimizer={"name": server_optimizer},
                          train={"epochs": 2, "batch_size": 5, "lr": 0.02, "momentum": 0.5})
    config_path = write_config(tmp_path / "config.yaml", config)

    baseline = tmp_path / "baseline"
    server, reader, address = start_server(processes, config_path, baseline)
    _finish(server, reader, _start_clients(processes, address, tmp_path / "baseline-clients"), tmp_path / "baseline-clients")

    out, root = tmp_path / "out", tmp_path / "clients"
    server, reader, address = start_server(processes, config_path, out)
    run_id = _run_id(reader)
    clients = _start_clients(processes, address, root, "--reconnect-timeout", "120")
    reader.wait_for(r"round\s+2/4", timeout=WAIT)
    os.kill(clients[1].pid, signal.SIGSTOP)  # round 3 cannot complete
    if algorithm == "fedper":  # the other process trained round 3 and kept the heads it trained
        _wait_for_file(root / "state_0" / run_id / "client_1" / "personal_start_0003.safetensors", WAIT)
    server.kill()
    server.wait(timeout=WAIT)
    os.kill(clients[1].pid, signal.SIGCONT)

    resumed = _resume(processes, out, address)
    reader = LineReader(resumed)
    reader.wait_for(rf"listening on {re.escape(address)} \(run {run_id},", timeout=WAIT)
    output = _finish(resumed, reader, clients, root)
    assert "resuming run" in output and "after round 2/4" in output
    for log in _client_logs(root):
        assert f"joined run {run_id} again" in log, log

    assert [m["round"] for m in read_metrics(out)] == [1, 2, 3, 4], "round 3 was redone, no duplicate line"
    assert [m["train_loss"] for m in read_metrics(out)] == [m["train_loss"] for m in read_metrics(baseline)]
    final = "checkpoints/round_0004.safetensors"
    assert (out / final).read_bytes() == (baseline / final).read_bytes()
    summary, expected = read_summary(out), read_summary(baseline)
    assert summary["accuracy"] == expected["accuracy"]
    assert summary["failures"] == []
    assert [c["initial"] for c in summary["per_client"]] == [c["initial"] for c in expected["per_client"]]

    finished = subprocess.run(fedpart_command("server", "--resume", str(baseline), "--insecure"), capture_output=True, text=True,
                              timeout=WAIT)
    assert finished.returncode == 2 and "already finished" in finished.stderr, finished.stderr


def test_resume_refuses_what_it_cannot_continue_and_changes_nothing(tmp_path: Path, capsys,
                                                                     one_torch_thread) -> None:
    config_only = tmp_path / "never-started"
    config_only.mkdir()
    write_config(config_only / "config.yaml", small_config())
    cases = [
        ([str(tmp_path / "empty")], "not a run directory (no config.yaml)"),
        ([str(config_only)], "no resumable run state"),
        ([str(config_only), "--set", "rounds=5"], "--set rounds=5 would change it"),
        ([str(config_only), "quickstart"], "give no CONFIG"),
        ([str(config_only), "--out", str(tmp_path / "elsewhere")], "names another directory"),
    ]
    for args, message in cases:
        assert cli_main(["server", "--insecure", "--resume", *args]) == 2
        assert message in capsys.readouterr().err, args
    assert sorted(p.name for p in config_only.iterdir()) == ["config.yaml"]


def test_resume_set_may_change_the_servers_limits_only(tmp_path: Path) -> None:
    write_config(tmp_path / "config.yaml", small_config())
    args = build_parser().parse_args(["server", "--resume", str(tmp_path), "--set", "server.round_timeout=1200"])
    assert resume_config(args).server.round_timeout == 1200
    refused = build_parser().parse_args(["server", "--resume", str(tmp_path), "--set", "server.round_deadline_factor=2"])
    with pytest.raises(ConfigError, match="would change it"):
        resume_config(refused)


def test_run_state_round_trip_and_a_changed_config_is_refused(tmp_path: Path, one_torch_thread) -> None:
    config = config_from_dict(small_config(algorithm={"name": "fedftha"}))
    coordinator = Coordinator(config, log=lambda message: None)
    head = {n: torch.full_like(t, 0.5) for n, t in coordinator.global_state.items() if n.startswith("head.")}
    coordinator.heads.store(2, head, 3.0)
    coordinator.ledger.add(1, 2, "up", {"body": 100, "control": 7})
    write_run_state(tmp_path, coordinator.snapshot(1, 12.5))

    restored = Coordinator(config, log=lambda message: None)
    restored.restore(read_run_state(tmp_path, config.to_dict()))
    assert restored.run_id == coordinator.run_id
    assert all(torch.equal(restored.global_state[n], t) for n, t in coordinator.global_state.items())
    combined = restored.heads.combine(WeightedMean())
    assert combined.keys() == head.keys()
    assert all(torch.equal(combined[n].float(), head[n]) for n in head)
    assert restored.ledger.totals(client=2) == {"down": 0, "up": 107}

    changed = config_from_dict(small_config(algorithm={"name": "fedftha"}, seed=1))
    with pytest.raises(ResumeError, match=r"differs .* in seed;"):
        read_run_state(tmp_path, changed.to_dict())


def test_a_resume_may_change_the_servers_timeouts_and_limits_only(tmp_path: Path, one_torch_thread) -> None:
    server = small_config()["server"]
    config = config_from_dict(small_config())
    write_run_state(tmp_path, Coordinator(config, log=lambda message: None).snapshot(1, 1.0))
    patient = config_from_dict(small_config(server={**server, "round_timeout": 1200, "fold_workers": 2}))
    assert read_run_state(tmp_path, patient.to_dict()).operational_changes == [
        "server.fold_workers: 0 -> 2", f"server.round_timeout: {float(server['round_timeout'])} -> 1200.0"]
    assert read_run_state(tmp_path, config.to_dict()).operational_changes == []
    for changed in ({"server": {**server, "round_deadline_factor": 2.0}}, {"rounds": 4}):
        with pytest.raises(ResumeError, match="keeps what defines its experiment"):
            read_run_state(tmp_path, config_from_dict(small_config(**changed)).to_dict())


def test_metrics_of_an_unfinished_round_are_dropped(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    for round_number in (1, 2, 3):
        run_dir.append_round(RoundRecord(round=round_number))
    with run_dir.metrics_path.open("a") as f:
        f.write('{"round": 4, "samp')  # the server died while writing
    records = RunDirectory(tmp_path, resume=True).rounds_up_to(2)
    assert [r.round for r in records] == [1, 2]
    assert [json.loads(line)["round"] for line in run_dir.metrics_path.read_text().splitlines()] == [1, 2]
    with pytest.raises(ResumeError, match=r"holds rounds \[1, 2\]"):
        run_dir.rounds_up_to(3)


# ------------------------------------------------------------------------------------- reconnecting


def test_backoff_doubles_up_to_its_cap_and_ends_at_the_deadline() -> None:
    backoff = Backoff(deadline=time.monotonic() + 1000)
    assert [backoff.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert Backoff(deadline=time.monotonic() - 1).next_delay() is None


def test_clients_reconnect_for_their_timeout_and_only_to_the_same_run(tmp_path: Path, processes) -> None:
    """After SIGKILL of the server, a client with ``--reconnect-timeout 3`` gives up after its
    backoff; the other keeps trying, reaches a new server on the same address and refuses it
    because it runs another run."""
    config_path = write_config(tmp_path / "config.yaml", small_config(rounds=3))
    server, reader, address = start_server(processes, config_path, tmp_path / "first")
    logs = [tmp_path / f"client_{index}.log" for index in range(2)]
    clients = []
    for ids, timeout, log_path in zip(CLIENT_IDS, ("120", "3"), logs):
        with log_path.open("w") as log:
            clients.append(processes.start(
                fedpart_command("client", "--insecure", "--server", address, "--clients", ids, "--threads", "1",
                                "--state-dir", str(tmp_path / f"state_{ids}"), "--reconnect-timeout", timeout),
                stdout=log, stderr=subprocess.STDOUT))
    reader.wait_for(r"round\s+1/3", timeout=WAIT)
    server.kill()
    server.wait(timeout=WAIT)
    assert clients[1].wait(timeout=WAIT) == 4  # gave up: the server stayed unreachable
    text = logs[1].read_text()
    assert "trying to reconnect for up to 3 s" in text and "attempt 2 in 1.0 s" in text, text
    assert "unreachable for 3 s (--reconnect-timeout)" in text, text
    processes.start(fedpart_command("server", "--insecure", str(config_path), "--address", address, "--out", str(tmp_path / "second")),
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # a new run on the same address
    assert clients[0].wait(timeout=WAIT) == 1
    text = logs[0].read_text()
    assert "the server answers again" in text and "now runs another run" in text, text


class _AnotherRun(pb_grpc.CoordinatorServicer):
    """A server on the address a client process served, now running another run: it knows no
    session of the old run, takes a join (of client ids nobody holds) into its own run, refuses a
    second join of the same ids while their holder has not left (as the real registry does), and
    records what it is asked."""

    def __init__(self) -> None:
        self.joins = 0
        self.left: list[pb.LeaveRequest] = []

    async def Join(self, request, context):
        self.joins += 1
        if self.joins > 1 and not self.left:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "client ids 0-1 are held by a process that has not left")
        return pb.JoinReply(session=f"other-{self.joins}", run_id="other-run")

    async def GetTask(self, request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session!r}")

    async def Leave(self, request, context):
        self.left.append(request)
        return pb.LeaveReply()


def test_a_process_that_finds_another_run_leaves_it_and_every_later_call_ends_at_once() -> None:
    """The calls of a process whose server was replaced by one running another run (its result
    upload and its long poll) each find their session lost. The first to join again learns the
    run changed: it leaves that run at once (its client ids are not held for the heartbeat
    timeout) and ends the process; every later call ends too, without joining the other run
    again (before, the poll joined again, was refused while its own first join held the ids, and
    backed off until the server's heartbeat timeout)."""

    async def scenario() -> tuple[_AnotherRun, list[str]]:
        server, servicer = grpc.aio.server(), _AnotherRun()
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            session = Session(f"127.0.0.1:{port}", ClientSecurity(insecure=True),
                              lambda: pb.JoinRequest(), reconnect_timeout=60.0)
            async with session:
                session.session, session.run_id = "served-session", "served-run"
                errors = []
                for _ in range(2):  # as the upload's call, then the poll's
                    with pytest.raises(SessionError) as raised:
                        await asyncio.wait_for(session.next_task(lambda header: None), timeout=WAIT)
                    errors.append(str(raised.value))
            return servicer, errors
        finally:
            await server.stop(None)

    servicer, errors = asyncio.run(scenario())
    assert servicer.joins == 1
    assert [(r.session, r.reason) for r in servicer.left] == [("other-1", "this process served another run")]
    assert len(errors) == 2 and all(
        error.endswith("now runs another run (other-run, this process served served-run); stopping") for error in errors)


# ------------------------------------------------------------------------- the final evaluation


def test_a_process_lost_during_the_final_evaluation_is_asked_again(tmp_path: Path, processes) -> None:
    """SIGSTOP one client process as the final evaluation starts, past the heartbeat timeout (the
    server gives up on it), SIGKILL it and start it again: its clients are evaluated too."""
    config = small_config(rounds=2, evaluate={"finetune_epochs": [1, 50], "batch_size": 10},
                          server={"round_timeout": 120, "join_timeout": 120, "heartbeat_timeout": 5})
    config_path = write_config(tmp_path / "config.yaml", config)
    out, root = tmp_path / "out", tmp_path / "clients"
    server, reader, address = start_server(processes, config_path, out)
    clients = _start_clients(processes, address, root)
    reader.wait_for(r"round\s+2/2", timeout=WAIT)
    os.kill(clients[1].pid, signal.SIGSTOP)  # each evaluation takes about a second: it has not answered
    reader.wait_for(r"process \S+ went silent", timeout=WAIT)
    clients[1].kill()
    clients[1].wait(timeout=WAIT)
    with (root / "client_1.log").open("a") as log:
        restarted = processes.start(
            fedpart_command("client", "--insecure", "--server", address, "--clients", CLIENT_IDS[1], "--threads", "1",
                            "--state-dir", str(root / "state_1")),
            stdout=log, stderr=subprocess.STDOUT)
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 0, output
    assert restarted.wait(timeout=WAIT) == 0 and clients[0].wait(timeout=WAIT) == 0
    assert re.search(r"client [23]: its process was lost during the evaluation; asking \S+ again", output), output
    summary = read_summary(out)
    assert all(c["initial"] is not None for c in summary["per_client"]), summary["per_client"]
    assert summary["failures"] == []


def _next_task(coordinator: Coordinator, session: str, timeout: float) -> Task:
    """Poll until the coordinator hands this process a task (bounded)."""
    task = poll_task(coordinator, session, wait=timeout)
    assert task is not None, f"no task within {timeout} s"
    return task


def test_an_evaluation_taken_by_a_process_that_restarts_is_asked_again(one_torch_thread) -> None:
    """The take-over path, in process: a process takes its evaluation and is replaced by its
    restart (its poll ended with its connection) before answering; the restart is offered the same
    task again and no failure is recorded."""
    coordinator = Coordinator(config_from_dict(small_config(clients=1, server={"heartbeat_timeout": 30})),
                              log=lambda message: None)

    def join() -> str:
        return coordinator.join(JoinInfo(protocol=PROTOCOL_VERSION, process_name="p", clients=(HostedClient(0),)))

    first = join()
    evaluations: list[dict] = []
    worker = threading.Thread(target=lambda: evaluations.append(coordinator.evaluate_all()), daemon=True)
    worker.start()
    taken = _next_task(coordinator, first, 60)
    assert taken.kind == TaskKind.EVALUATE
    assert poll_task(coordinator, first, held=(taken.task_id,), wait=0.1, crash=True) is None
    second = join()
    task = _next_task(coordinator, second, 60)
    assert task.kind == TaskKind.EVALUATE and task.task_id == taken.task_id
    metrics = {"initial_acc": 0.5, "initial_loss": 1.0, "finetune_1_loss": 0.9, "finetune_2_loss": 0.8,
               "train_samples": 10, "test_samples": 5}
    coordinator.accept(task, ResultInfo(second, task.task_id, 0, task.round, metrics=metrics), {})
    worker.join(timeout=WAIT)
    assert evaluations == [{0: metrics}]
    assert coordinator.failures == []
