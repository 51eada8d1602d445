"""The operator's command line: what ``fedpart server``, ``fedpart client`` and ``fedpart run``
check before they start, how they refuse, how they stop, their exit codes (docs/operating-a-run.md, "Exit codes"),
their log lines and their live progress display on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (
    WAIT,
    LineReader,
    child_env,
    fedpart_command,
    read_metrics,
    read_summary,
    run_fedpart,
    small_config,
    start_server,
    write_config,
)
from fedpart.common.config.run_config import CheckpointConfig, ConfigError, config_from_dict
from fedpart.common.process.console import RunProgress, stamp
from fedpart.common.process.exit_codes import ExitCode, Stopped, stop_on_signals
from fedpart.common.process.records import RoundRecord, RoundRobust
from fedpart.common.config.experiment import LocalData, check_experiment
from fedpart.common.process.limits import client_threads
from fedpart.common.wire.client_ids import parse_id_ranges
from fedpart.common.wire.security import Principal, SecurityError
from fedpart.deploy.certs import write_run_credentials
from fedpart.server.main import check_credentials_host_run, short_rounds
from fedpart.server.output.run_directory import RunDirectory, check_new_run_dir

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "  # the start of every log line
ESCAPE = "\x1b["


def _busy_port() -> tuple[socket.socket, int]:
    """A listening socket on a free port of 127.0.0.1 (the caller closes it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


def _free_port() -> int:
    listener, port = _busy_port()
    listener.close()
    return port


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fedpart(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(fedpart_command(*args), capture_output=True, text=True, timeout=WAIT, env=child_env(),
                          cwd=cwd)


# ------------------------------------------------------------------------------------ exit codes


def test_the_exit_code_table() -> None:
    """docs/operating-a-run.md, "Exit codes": the values a supervisor sees."""
    assert {code.name: int(code) for code in ExitCode} == {
        "COMPLETED": 0, "ERROR": 1, "USAGE": 2, "FAILURES": 3, "UNREACHABLE": 4, "ENDED_EARLY": 5,
        "INTERRUPTED": 130, "TERMINATED": 143}


def test_the_first_signal_stops_in_order_and_later_ones_wait_for_it() -> None:
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Stopped) as stopped, stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(WAIT)  # interrupted by the signal
    assert stopped.value.code == 143 and stopped.value.reason == "terminated"
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers  # restored

    with pytest.raises(Stopped) as stopped, stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(WAIT)
        except Stopped:
            os.kill(os.getpid(), signal.SIGINT)  # during the orderly stop: ignored
            os.kill(os.getpid(), signal.SIGTERM)
            raise
    assert stopped.value.code == 130


# --------------------------------------------------------------------- checked before anything starts


def test_help_imports_neither_torch_nor_grpc() -> None:
    script = """
import sys
from fedpart.cli.main import main
for argv in (["--help"], ["server", "--help"], ["client", "--help"], ["run", "--help"], ["certs", "--help"],
             ["report", "--help"], ["compare", "--help"]):
    try:
        main(argv)
    except SystemExit as done:
        assert done.code == 0, argv
heavy = sorted(m for m in ("torch", "grpc", "numpy", "rich") if m in sys.modules)
print("heavy:", heavy)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT,
                            env=child_env())
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout, result.stdout


def test_the_collector_is_off_while_a_process_imports_and_on_while_it_works(tmp_path: Path) -> None:
    """The ``fedpart`` command starts with the garbage collector off (its full passes over the
    objects torch, gRPC and Numba make cost every process its startup); the server, the client,
    ``fedpart run`` and ``fedpart compare`` turn it on before they work, with what they imported
    frozen out of its passes; a short command ends with what is alive frozen."""
    script = f"""
import gc, json, sys
import fedpart.cli.compare, fedpart.client.runtime, fedpart.deploy.launcher, fedpart.server.main
from fedpart.cli import main as cli

seen = {{"starting": []}}
def working(name):
    def record(*args, **kwargs):
        seen[name] = [gc.isenabled(), gc.get_freeze_count() > 0]
        return 0
    return record

class Process:
    def __init__(self, *args, **kwargs): pass
    def log(self, line): pass
    run = staticmethod(working("client"))

fedpart.server.main.serve = working("server")
fedpart.client.runtime.ClientProcess = Process
fedpart.deploy.launcher.run_local = working("run")
fedpart.cli.compare.compare = working("compare")
started = cli.main
def main():
    seen["starting"].append(gc.isenabled())
    return started()
cli.main = main
out = {str(tmp_path)!r}
for argv in (["server", "quickstart", "--insecure", "--address", "127.0.0.1:0", "--out", out + "/server"],
             ["client", "--server", "127.0.0.1:1", "--clients", "0-4", "--insecure", "--threads", "1"],
             ["run", "quickstart", "--out", out + "/run"],
             ["compare", "quickstart", "--algorithms", "fedavg,fedbabu", "--out", out + "/compare"],
             ["configs"]):
    sys.argv = ["fedpart", *argv]
    gc.unfreeze()
    try:
        cli.command()
    except SystemExit as done:
        assert done.code == 0, (argv, done.code)
seen["configs"] = [gc.isenabled(), gc.get_freeze_count() > 0]
print(json.dumps(seen))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT,
                            env=child_env())
    assert result.returncode == 0, result.stderr
    working, ended = [True, True], [False, True]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "starting": [False] * 5, "server": working, "client": working, "run": working, "compare": working,
        "configs": ended}, result.stdout


def _check(**overrides) -> None:
    config = config_from_dict(small_config(**overrides))
    check_experiment(config, clients_data=LocalData(config.data.root), server_data=True)


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": {"name": "fedbabu", "muu": 0.1}}, r"algorithm.muu: not an option of algorithm 'fedbabu'"),
    ({"algorithm": {"name": "layer_expansion_vanilla", "unfreeze_rounds": [0, 1, 2]}},
     r"unfreeze_rounds has 3 entries but the model has 2 body units"),
    ({"model": {"name": "mlp", "hiden": 32}}, r"model.hiden: not an option of model 'mlp'"),
    ({"model": {"name": "cnn9"}}, r"model.name: unknown model 'cnn9'"),
    ({"data": {"dataset": "digits", "options": {"normalise": True}, "partition": {"scheme": "iid"}}},
     r"data.options.normalise: not an option of dataset 'digits'"),
    ({"clients": 6, "data": {"dataset": "digits", "partition": {"scheme": "shards", "shards_per_client": 2}}},
     r"data.partition cannot be cut from digits for 6 clients: .*2 \* 6 = 12 is not a multiple"),
    ({"clients": 500, "data": {"dataset": "digits", "partition": {"scheme": "dirichlet", "alpha": 0.1}}},
     r"data.partition cannot be cut .*min_size=10 x 500 clients exceeds"),
    ({"clients": 100, "data": {"dataset": "digits", "options": {"train_samples": 500},
                               "partition": {"scheme": "dirichlet", "alpha": 0.1}}},
     r"data.partition cannot be cut .*min_size=10 x 100 clients exceeds"),  # 1,438 samples would do
    ({"data": {"dataset": "digits", "options": {"test_samples": 400}, "partition": {"scheme": "iid"}}},
     r"data.options: dataset option test_samples must be an integer in 1\.\.359"),
    ({"data": {"dataset": "mnist", "root": "/nonexistent", "partition": {"scheme": "iid"}}},
     r"data.root: dataset file /nonexistent/MNIST/raw/train-images-idx3-ubyte.gz not found \(and 3 more\)"),
    ({"data": {"dataset": "mnist", "partition": {"scheme": "iid"}}}, r"data.root: no data root is set"),
    ({"data": {"dataset": "no_such_package.loaders:load", "input_shape": [1, 8, 8], "num_classes": 10}},
     r"data.dataset 'no_such_package.loaders:load': cannot import 'no_such_package.loaders'"),
])
def test_the_whole_config_is_checked_before_anything_starts(overrides, message, one_torch_thread) -> None:
    with pytest.raises(ConfigError, match=message):
        _check(**overrides)


def test_the_server_needs_the_test_split_only_for_the_global_test(tmp_path: Path, one_torch_thread) -> None:
    """evaluate.global_test (on by default) makes the server read the test split; the error names
    the option and the file; off, or with an algorithm whose server holds no whole model, the
    server needs no data at all."""
    data = {"dataset": "mnist", "root": str(tmp_path), "partition": {"scheme": "iid"}}
    server_only = dict(data=data, evaluate={"finetune_epochs": [1]})
    with pytest.raises(ConfigError, match=r"evaluate.global_test: .*t10k-images-idx3-ubyte.gz not found.*"
                                          r"set evaluate.global_test: false"):
        check_experiment(config_from_dict(small_config(**server_only)), server_data=True)
    check_experiment(config_from_dict(small_config(**{**server_only, "evaluate": {"global_test": False}})),
                     server_data=True)
    check_experiment(config_from_dict(small_config(**server_only, algorithm={"name": "fedper"})), server_data=True)


def test_the_readme_server_command_runs_without_data_or_names_the_option(tmp_path: Path, processes) -> None:
    """docs/across-machines.md: ``fedpart server configs/mnist_cnn2.yaml`` on a machine
    without MNIST fails at once naming evaluate.global_test, and writes nothing; with
    ``--set evaluate.global_test=false`` it starts."""
    out = tmp_path / "run"
    empty = tmp_path / "no-data"
    empty.mkdir()
    result = _fedpart("server", "--insecure", "mnist_cnn2", "--out", str(out), "--set", f"data.root={empty}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "evaluate.global_test" in result.stderr and "t10k-images-idx3-ubyte.gz not found" in result.stderr
    assert not out.exists()
    server = processes.start(fedpart_command("server", "--insecure", "mnist_cnn2", "--out", str(out), "--address", "127.0.0.1:0",
                                             "--set", f"data.root={empty}", "--set", "evaluate.global_test=false"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    LineReader(server).wait_for(r"waiting for 20 clients", timeout=WAIT)


@pytest.mark.parametrize("command, overrides, message", [
    ("run", {"algorithm": {"name": "fedbabu", "muu": 0.1}}, "muu"),
    ("run", {"model": {"name": "mlp", "hiden": 32}}, "hiden"),
    ("run", {"clients": 6, "data": {"dataset": "digits", "partition": {"scheme": "shards", "shards_per_client": 2}}},
     "data.partition"),
    ("run", {"data": {"dataset": "mnist", "root": "no-data", "partition": {"scheme": "iid"}}}, "data.root"),
    ("server", {"model": {"name": "mlp", "hiden": 32}}, "hiden"),
])
def test_a_bad_config_exits_2_before_any_process_starts(tmp_path: Path, command, overrides, message) -> None:
    """Typos in algorithm, model or data options and a partition that cannot be cut: exit 2 at
    once, nothing written, no process started (the bound is loose: it is mostly torch's import)."""
    config_path = write_config(tmp_path / "config.yaml", small_config(**overrides))
    out = tmp_path / "out"
    started = time.monotonic()
    result = _fedpart(command, str(config_path), "--out", str(out),
                      *(["--address", "127.0.0.1:0", "--insecure"] if command == "server" else []), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 20 * WAIT / 300
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not out.exists() and result.stdout == ""


def _credentials(directory: Path, clients: int, processes: int, extra_ids: str | None = None) -> Path:
    """``fedpart certs`` credentials for ``clients`` client ids in ``processes`` processes, and
    with ``extra_ids`` a third process that also names those ids; returns credentials.yaml."""
    write_run_credentials(directory, ["127.0.0.1"], clients, processes)
    path = directory / "credentials.yaml"
    if extra_ids is not None:
        credentials = yaml.safe_load(path.read_text())
        credentials["processes"].append({"name": "site-b", "clients": extra_ids, "token_sha256": "ab" * 32})
        path.write_text(yaml.safe_dump(credentials))
    return path


@pytest.mark.parametrize("clients, processes, extra_ids, problem", [
    (4, 2, None, "client ids 4-19 are named by no process"),
    (20, 2, "3,5-6,12", "client ids 3,5-6 are named by 2 processes (process_0, site-b); client ids 12 are named "
                        "by 2 processes (process_1, site-b)"),
])
def test_credentials_that_cannot_host_the_run_exit_2_before_the_server_listens(
        tmp_path: Path, clients: int, processes: int, extra_ids: str | None, problem: str) -> None:
    """Credentials for 4 clients and a 20-client config (or two processes naming the same ids):
    one line naming the ids and exit 2 as soon as the config is read, instead of listening and
    giving up after server.join_timeout (600 s here)."""
    credentials = _credentials(tmp_path / "secrets", clients, processes, extra_ids)
    config = small_config(clients=20, server={"join_timeout": 600, "round_timeout": 600, "heartbeat_timeout": 30})
    out = tmp_path / "out"
    started = time.monotonic()
    result = _fedpart("server", str(write_config(tmp_path / "config.yaml", config)), "--address", "127.0.0.1:0",
                      "--out", str(out), "--tls-cert", str(tmp_path / "secrets" / "server.pem"),
                      "--tls-key", str(tmp_path / "secrets" / "server.key"), "--credentials", str(credentials))
    seconds = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"fedpart server: error: --credentials cannot host this run of 20 clients (ids 0-19): {problem}; write "
        "credentials for it with fedpart certs --clients 20, or give each id to exactly one process"]
    assert result.stdout == "" and not out.exists()
    assert seconds < 20 * WAIT / 300, seconds  # mostly torch's import


def test_credentials_must_name_each_client_id_of_the_run_once() -> None:
    def principal(name: str, ids: str) -> Principal:
        return Principal(name, frozenset(parse_id_ranges(ids)), token_sha256=name[-1] * 64)

    check_credentials_host_run(None, 20)  # an open server admits anyone
    check_credentials_host_run([principal("p0", "0-9"), principal("p1", "10-19")], 20)
    with pytest.raises(SecurityError, match=r"client ids 10-15,18 are named by no process; client ids 20-23 are "
                                            r"not in the run; write credentials"):
        check_credentials_host_run([principal("p0", "0-9"), principal("p1", "16-17,19-23")], 20)
    with pytest.raises(SecurityError, match=r": client ids 5 are named by 3 processes \(p0, p1, p2\); write"):
        check_credentials_host_run([principal("p0", "0-5"), principal("p1", "5-9"), principal("p2", "5")], 10)


# --------------------------------------------------------------------------------- the run directory


def test_an_earlier_run_is_never_destroyed(tmp_path: Path) -> None:
    """``--out`` of an existing run: refused with exit 2 and nothing changed (also when the server
    then cannot bind: --overwrite removes the old run only once the server listens); replaced with
    --overwrite; a directory that holds no run is never written into."""
    config = small_config(rounds=1, evaluate={"finetune_epochs": [1]})
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stderr
    before = _files(out)
    config_path = tmp_path / "run.yaml"
    for args in (["run", str(config_path), "--out", str(out)],
                 ["server", str(config_path), "--out", str(out), "--address", "127.0.0.1:0", "--insecure"]):
        refused = _fedpart(*args)
        assert refused.returncode == 2, refused.stderr
        assert "already holds a run" in refused.stderr and f"--resume {out}" in refused.stderr \
            and "--overwrite" in refused.stderr, refused.stderr
        assert _files(out) == before
    listener, port = _busy_port()
    with listener:
        refused = _fedpart("server", "--insecure", str(config_path), "--out", str(out), "--overwrite", "--address",
                           f"127.0.0.1:{port}")
    assert refused.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in refused.stderr, refused.stderr
    assert _files(out) == before

    old_run = json.loads((out / "server_state" / "state.json").read_text())["run_id"]
    args = fedpart_command("run", str(config_path), "--out", str(out), "--overwrite", "--set", "rounds=2")
    replaced = subprocess.run(args, capture_output=True, text=True, timeout=WAIT, env=child_env(), cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((out / "server_state" / "state.json").read_text())["run_id"] != old_run
    assert [m["round"] for m in read_metrics(out)] == [1, 2]

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    refused = _fedpart("run", str(config_path), "--out", str(foreign), "--overwrite")
    assert refused.returncode == 2 and "holds no fedpart run" in refused.stderr, refused.stderr
    assert _files(foreign) == {"todo.txt": b"keep me"}


def test_checking_a_new_run_directory_writes_nothing(tmp_path: Path) -> None:
    check_new_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_new_run_dir(tmp_path / "empty")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_new_run_dir(tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]


@pytest.mark.parametrize("every, keep, written, kept", [
    (10, 3, [0, 10, 20, 25], [0, 10, 20, 25]),       # the defaults on 25 rounds
    (3, 2, [0, 3, 6, 9, 10], [0, 9, 10]),             # the initial and the last always; 2 round checkpoints
    (0, 3, [0, 10], [0, 10]),                         # only the initial and the last
    (1, 0, list(range(11)), list(range(11))),         # every round, all kept
])
def test_checkpoint_every_and_keep(tmp_path: Path, every, keep, written, kept) -> None:
    rounds = max(written)
    run_dir = RunDirectory(tmp_path, CheckpointConfig(every=every, keep=keep))
    wrote = [r for r in range(rounds + 1) if run_dir.checkpoint(r, {"w": torch.zeros(1)}, last=r == rounds)]
    assert wrote == written
    assert sorted(int(p.stem.removeprefix("round_")) for p in (tmp_path / "checkpoints").iterdir()) == kept


def test_the_address_in_use_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "config.yaml", small_config())
    out = tmp_path / "out"
    listener, port = _busy_port()
    with listener:
        result = _fedpart("server", "--insecure", str(config_path), "--out", str(out), "--address", f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"fedpart server: error: cannot listen on 127.0.0.1:{port}: "
                                                  "Address already in use"], result.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------- connecting


def test_a_wrong_server_address_is_retried_with_backoff_up_to_connect_timeout(tmp_path: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    result = _fedpart("client", "--insecure", "--server", address, "--clients", "0", "--connect-timeout", "4",
                      "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 4, result.stderr
    assert time.monotonic() - started >= 4
    lines = result.stdout.splitlines()
    assert re.match(STAMP + r"\[client \S+\] \d+ torch threads? \(\d+ cores available ", lines[0]), lines
    assert re.match(STAMP + rf"\[client \S+\] connecting to {address} \(plaintext\); trying for up to 4 s "
                    r"\(--connect-timeout\)", lines[1]), lines
    attempts = [line for line in lines if re.search(rf"attempt \d+: {address} did not take the join "
                                                    r"\(UNAVAILABLE: .+\); next attempt in \d\.\d s", line)]
    assert len(attempts) >= 2, lines
    assert f"no server answered at {address} within 4 s (--connect-timeout)" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------- stopping in order


def _client(processes, address: str, ids: str, root: Path, *extra: str) -> subprocess.Popen:
    return processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", ids, "--threads", "1",
                                           "--state-dir", str(root / f"state_{ids}"), *extra),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# about half a second of local training per client and round on a quiet machine
SLOW_ROUNDS = dict(clients=2, train={"epochs": 4, "batch_size": 5, "lr": 0.02, "momentum": 0.5},
                   evaluate={"finetune_epochs": [1]})


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_client_leaves_at_once(tmp_path: Path, processes, stop) -> None:
    """A client process stopped by SIGINT (Ctrl-C) or SIGTERM tells the server (Leave) and exits
    with 130 / 143 without a traceback; the server drops it at once: the next round closes in well
    under the heartbeat timeout (120 s here)."""
    config = small_config(rounds=20, **SLOW_ROUNDS,
                          server={"round_timeout": 600, "join_timeout": 600, "heartbeat_timeout": 120})
    server, reader, address = start_server(processes, write_config(tmp_path / "config.yaml", config), tmp_path / "out")
    staying, leaving = _client(processes, address, "0", tmp_path), _client(processes, address, "1", tmp_path)
    reader.wait_for(r"round\s+2/20", timeout=WAIT)
    os.kill(leaving.pid, stop)
    stopped = time.monotonic()
    log = leaving.communicate(timeout=WAIT)[0]
    assert leaving.returncode == 128 + stop, log
    reason = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}[stop]
    assert f"{reason}: leaving the run" in log and "Traceback" not in log, log
    reader.wait_for(rf"client process \S+ left: {reason}", timeout=WAIT)
    reader.wait_for(r"round\s+\d+/20  clients 1/\d", timeout=WAIT)  # a round without the client that left
    assert time.monotonic() - stopped < 60, reader.lines[-5:]
    assert staying.poll() is None


def test_an_interrupted_server_tells_its_clients_writes_what_it_knows_and_resumes(tmp_path: Path,
                                                                                   processes) -> None:
    """SIGINT to the server mid-run: its clients hear that the run ended early and exit 5; the
    server exits 130 with summary.json marked interrupted and its run state kept; ``--resume``
    (without checkpoints/: resume reads server_state/) completes the run and replaces the summary."""
    rounds = 10  # stopped after round 3: seven rounds of margin for the signal, few left to resume
    config = small_config(rounds=rounds, **SLOW_ROUNDS)
    config_path = write_config(tmp_path / "config.yaml", config)
    out = tmp_path / "out"
    server, reader, address = start_server(processes, config_path, out)
    clients = [_client(processes, address, ids, tmp_path) for ids in ("0", "1")]
    reader.wait_for(rf"round\s+3/{rounds}", timeout=WAIT)
    server.send_signal(signal.SIGINT)
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 130, output
    assert "Traceback" not in output and "run interrupted: interrupted after round" in output, output
    for client in clients:
        log = client.communicate(timeout=WAIT)[0]
        assert client.returncode == 5 and "the server ended the run early" in log, log
    summary = read_summary(out)
    done = len(read_metrics(out))
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == done and 3 <= done < rounds
    assert summary["exit_code"] == 130
    assert f"fedpart server --resume {out}" in summary["note"]
    assert summary["bytes"]["up"] > 0 and summary["accuracy"]["initial"]["clients"] == 0

    for path in (out / "checkpoints").iterdir():
        path.unlink()
    (out / "checkpoints").rmdir()
    resumed = processes.start(fedpart_command("server", "--resume", str(out), "--address", address, "--insecure"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = LineReader(resumed)
    reader.wait_for(rf"resuming run \w+ after round {done}/{rounds}", timeout=WAIT)
    clients = [_client(processes, address, ids, tmp_path) for ids in ("0", "1")]
    output = reader.rest(timeout=WAIT)
    assert resumed.wait(timeout=WAIT) == 0, output
    assert all(client.wait(timeout=WAIT) == 0 for client in clients)
    summary = read_summary(out)
    assert summary["status"] == "completed" and summary["rounds_completed"] == rounds and summary["exit_code"] == 0
    assert [m["round"] for m in read_metrics(out)] == list(range(1, rounds + 1))
    assert summary["accuracy"]["initial"]["clients"] == 2


def test_a_server_that_gives_up_exits_4_and_its_clients_5(tmp_path: Path, processes) -> None:
    """Not every client is hosted within server.join_timeout: the server gives up (exit 4,
    summary.json marked failed) and tells the clients it has (exit 5)."""
    config = small_config(rounds=2, server={"join_timeout": 10, "round_timeout": 60, "heartbeat_timeout": 30})
    out = tmp_path / "out"
    address = f"127.0.0.1:{_free_port()}"
    client = _client(processes, address, "0-1", tmp_path)  # first, so that it waits for the server; 2-3 never come
    server = processes.start(fedpart_command("server", "--insecure", str(write_config(tmp_path / "config.yaml", config)),
                                             "--address", address, "--out", str(out)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = LineReader(server).rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 4, output
    assert "clients 2-3 are still not hosted" in output
    log = client.communicate(timeout=WAIT)[0]
    assert client.returncode == 5, log
    summary = read_summary(out)
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0 and summary["exit_code"] == 4
    assert "gave up: after 10 s clients 2-3" in summary["note"]


# ------------------------------------------------------------------------------ what is printed


def test_without_a_terminal_the_output_is_plain_timestamped_lines(tmp_path: Path) -> None:
    """``fedpart run`` in CI or into a log: no escape codes, no progress lines; every log line of
    the server and the clients starts with the time; a client's log says what it does."""
    config = small_config(rounds=2, evaluate={"finetune_epochs": [1]})
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stderr
    assert ESCAPE not in result.stdout and "fedpart-progress" not in result.stdout
    table = result.stdout.index("evaluation ")
    for line in result.stdout[:table].splitlines()[:-1]:
        assert re.match(STAMP, line), line
    assert re.search(STAMP + r"round\s+2/2  clients 4/4", result.stdout)
    log = (out / "logs" / "client_0.log").read_text()
    assert ESCAPE not in log
    assert all(re.match(STAMP + r"\[client \S+\] ", line) for line in log.splitlines()), log
    threads = client_threads(2)  # two client processes share this host's cores
    first = re.search(r"\] (\d+) torch threads? \(\d+ cores available .* / ([12]) client process(?:es)? on this host; "
                      r"it follows as processes start or stop beside it\)", log)
    assert first, log
    if first.group(2) == "1" and client_threads(1) != threads:  # it registered before the other one
        assert re.search(rf"now {threads} torch threads?: 2 client processes share this host's \d+ cores", log), log
    for doing in (r"connecting to 127\.0\.0\.1:\d+ \(TLS with a token\)", r"joined run \w+ hosting clients 0-1",
                  r"loading digits for clients 0-1", r"task \d+: train client \d round 1",
                  r"client \d round 1: trained \d+ steps in \d+\.\d\d s, loss \d", r"result sent \([\d,]+ bytes\)",
                  r"evaluating and personalising client \d", r"run finished"):
        assert re.search(doing, log), (doing, log)


class OnTerminal:
    """A process whose stdout and stderr are a pseudo-terminal (120 x 40); what it printed is
    read on a thread."""

    def __init__(self, processes, args: list[str], **kwargs) -> None:
        master, terminal = pty.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = dict(child_env(), TERM="xterm-256color", COLUMNS="120", LINES="40")
        env.pop("NO_COLOR", None)
        self.process = processes.start(args, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, env=env,
                                       **kwargs)
        os.close(terminal)
        self._master = master
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self._master], [], [], 1.0)
            if not ready:
                if self.process.poll() is not None:
                    break
                continue
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: the process and its children closed the terminal
                break
            if not data:
                break
            self._chunks.append(data)
        os.close(self._master)

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert time.monotonic() < deadline and self._reader.is_alive(), (text, self.output[-2000:])
            time.sleep(0.1)

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return code


def test_fedpart_run_on_a_terminal_shows_the_live_progress_display(tmp_path: Path, processes) -> None:
    """The launcher renders the server's progress lines (``--progress json``) itself: a live
    display (escape codes, the round, the clients, bytes so far, the ETA) above which the log
    lines and the final table still appear."""
    config_path = write_config(tmp_path / "config.yaml", small_config(rounds=8, **SLOW_ROUNDS))
    run = OnTerminal(processes, fedpart_command("run", str(config_path), "--out", str(tmp_path / "out")),
                     cwd=tmp_path)
    assert run.finish(WAIT) == 0, run.output[-3000:]
    output = run.output
    assert ESCAPE in output and "fedpart-progress" not in output
    assert re.search(r"round \d/8", output) and "bytes so far" in output and "eta" in output, output[-3000:]
    assert re.search(STAMP + r"round\s+8/8  clients 2/2", output)
    assert "personalized, 1 epochs" in output


def test_server_and_client_on_terminals_show_their_live_displays(tmp_path: Path, processes) -> None:
    """``fedpart server`` shows the round, the clients done and the bytes; ``fedpart client`` the
    local step of its current task."""
    config_path = write_config(tmp_path / "config.yaml", small_config(rounds=4, **SLOW_ROUNDS))
    port = _free_port()
    server = OnTerminal(processes, fedpart_command("server", "--insecure", str(config_path), "--out", str(tmp_path / "out"),
                                                   "--address", f"127.0.0.1:{port}"))
    server.wait_for("listening on", WAIT)
    client = OnTerminal(processes, fedpart_command("client", "--insecure", "--server", f"127.0.0.1:{port}", "--clients", "0-1",
                                                   "--threads", "1", "--state-dir", str(tmp_path / "state")))
    assert server.finish(WAIT) == 0, server.output[-3000:]
    assert client.finish(WAIT) == 0, client.output[-3000:]
    assert ESCAPE in server.output and "bytes so far" in server.output and re.search(r"round \d/4", server.output)
    assert ESCAPE in client.output and re.search(r"client \d round \d: training", client.output), \
        client.output[-3000:]
    assert re.search(r"step \d+/\d+", client.output), client.output[-3000:]


def test_progress_lines_round_trip_and_other_lines_are_not_progress() -> None:
    progress = RunProgress("training", 3, 20, 4, 10, 1234, 5678, 12.5)
    assert RunProgress.parse(progress.line()) == progress
    assert RunProgress.parse(stamp("round    3/20  clients 4/10")) is None
    assert RunProgress.parse("fedpart-progress {broken") is None
    assert re.match(STAMP + "hello$", stamp("hello"))


def test_a_round_whose_clients_sent_no_result_is_a_failure() -> None:
    """A process that went silent and came back is in no other list: the rounds it missed are
    failures (exit code 3), not results refused (failures of their own) nor over-selected
    clients a round did not wait for."""
    config = config_from_dict(small_config(clients=4))
    records = [RoundRecord(round=1, sampled=[0, 1, 2, 3], completed=[0, 1, 2, 3]),
               RoundRecord(round=2, sampled=[0, 1, 2, 3], completed=[0, 1], robust=RoundRobust(rejected=0)),
               RoundRecord(round=3, sampled=[0, 1, 2, 3], completed=[0, 1, 2], robust=RoundRobust(rejected=1))]
    assert short_rounds(records, config) == ["round 2: 2 of the 4 clients it needed sent no result (folded 2)"]
    over = config_from_dict(small_config(clients=4, sampling={"fraction": 0.5, "over_selection": 0.5}))
    assert short_rounds([RoundRecord(round=1, sampled=[0, 1, 3], completed=[1, 3])], over) == []
    assert short_rounds([RoundRecord(round=1, sampled=[0, 1, 3], completed=[3])], over) == [
        "round 1: 1 of the 2 clients it needed sent no result (folded 1)"]


def test_version_python_m_and_defaults_in_help() -> None:
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "fedpart", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"fedpart {version('fedpart')}", result.stderr
    server_help = subprocess.run([sys.executable, "-m", "fedpart", "server", "--help"], capture_output=True,
                                 text=True, timeout=60).stdout
    assert "(default: 127.0.0.1:50051)" in " ".join(server_help.split())
    top_help = subprocess.run([sys.executable, "-m", "fedpart", "--help"], capture_output=True, text=True,
                              timeout=60).stdout
    assert "``" not in top_help and "export" in top_help


def test_the_bundled_configs_and_the_algorithms_are_listed_from_the_code() -> None:
    from fedpart.common.ml.algorithms import ALGORITHMS

    configs = subprocess.run([sys.executable, "-m", "fedpart", "configs"], capture_output=True, text=True, timeout=60)
    assert configs.returncode == 0, configs.stderr
    listed = [line.split()[0] for line in configs.stdout.splitlines()]
    assert listed == sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert all(len(line.split()) > 3 for line in configs.stdout.splitlines())  # each with its description
    algorithms = subprocess.run([sys.executable, "-m", "fedpart", "algorithms"], capture_output=True, text=True,
                                timeout=120)
    assert algorithms.returncode == 0, algorithms.stderr
    rows = [line.split(maxsplit=1) for line in algorithms.stdout.splitlines()]
    assert [row[0] for row in rows] == list(ALGORITHMS) and all(len(row) == 2 for row in rows)
