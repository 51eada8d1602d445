"""Helpers for tests that start real fedpart server and client processes on 127.0.0.1."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# The lab (lab/: the fault relay, the load generator, the components page's writer) is outside the
# package: importable from the repository's root, here and in the processes the tests start.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
SHARED_DATA = REPO.parent / "shared" / "data"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The bound of every wait of the end-to-end tests for a process, a line or a file: generous for a
# busy shared 2-core machine (a run that takes 15 s alone can take several times that under load).
# A wait ends as soon as what it waits for happens; the bound only turns a hang into a failure.
# FEDPART_TEST_WAIT_SCALE multiplies it on a slower machine (e.g. 2).
WAIT = 300.0 * float(os.environ.get("FEDPART_TEST_WAIT_SCALE", "1"))


class EventWaiter:
    """An in-process long poll's waiter (what the service's loop waiter is to the task board)."""

    superseded = False

    def __init__(self) -> None:
        self.event = threading.Event()

    def wake(self) -> None:
        self.event.set()


def poll_task(coordinator: Any, session: str, held: tuple[int, ...] = (), wait: float = 60.0,
              crash: bool = False) -> Any:
    """Poll an in-process coordinator's task board as process ``session`` (holding the tasks
    ``held``) until a task comes; None once ``wait`` seconds passed without one. With ``crash`` a
    poll that found nothing ends as the poll of a process that died does: its connection closed
    (a join with its credential may then take over)."""
    waiter = EventWaiter()
    deadline = time.monotonic() + wait
    cancelled = False
    try:
        while True:
            waiter.event.clear()
            task = coordinator.board.poll(session, waiter, held=held)
            if task is not None:
                return task
            if not waiter.event.wait(max(0.0, deadline - time.monotonic())):
                cancelled = crash
                return None
    finally:
        coordinator.board.end_poll(session, waiter, cancelled)


def load_script(path: Path) -> ModuleType:
    """A script outside the package (``benchmarks/*.py``) as a module named after its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def small_config(**overrides: Any) -> dict[str, Any]:
    """A digits/mlp run that finishes in seconds; ``overrides`` replace whole top-level keys."""
    config: dict[str, Any] = {
        "name": "test",
        "seed": 0,
        "rounds": 3,
        "clients": 4,
        "processes": 2,
        "data": {"dataset": "digits", "partition": {"scheme": "iid"}},
        "model": {"name": "mlp", "hidden": 32},
        "algorithm": {"name": "fedavg"},
        "train": {"epochs": 1, "batch_size": 20, "lr": 0.05, "momentum": 0.5},
        "evaluate": {"finetune_epochs": [1, 2], "batch_size": 50},
        "server": {"round_timeout": 120, "join_timeout": 120, "heartbeat_timeout": 30},
        "checkpoint": {"every": 1},  # tests read the global model after every round
    }
    config.update(overrides)
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


# The client processes of each test worker share cores only among themselves (common/process/limits.py,
# HostShare): how many other tests run at once does not change what a test's processes choose.
os.environ.setdefault("FEDPART_HOST_SHARE_DIR", os.path.join(
    tempfile.gettempdir(), f"fedpart-test-cores-{os.getuid()}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"))


def child_env() -> dict[str, str]:
    """Environment for child processes: unbuffered, with the test fixtures and the lab importable."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FIXTURES), str(REPO), env.get("PYTHONPATH")]))
    return env


def fedpart_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedpart", *args]


class Processes:
    """Processes a test started; all are stopped by PID when the test ends."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.run_dirs: list[Path] = []  # the servers' run directories, checked once they stopped

    def start(self, args: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        process = subprocess.Popen(args, env=env or child_env(), **kwargs)
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.terminate()
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.fixture
def one_torch_thread():
    """Small tensor work runs faster on one thread than on contended cores, and deterministically."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def processes():
    tracker = Processes()
    yield tracker
    tracker.stop_all()
    for run_dir in tracker.run_dirs:
        check_records(run_dir)


class LineReader:
    """Reads a process's stdout on a thread so the test can wait for a line with a deadline."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self._queue.put(line)
        self._queue.put(None)

    def _next(self, timeout: float, waiting_for: str) -> str | None:
        """The next line (None once the stream closed), or an assertion error at the deadline."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {waiting_for} within {timeout} s; got {self.lines[-10:]}")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        while True:
            line = self._next(timeout, f"line matching {pattern!r}")
            if line is None:
                raise AssertionError(f"process ended before printing {pattern!r}; output {self.lines[-20:]}")
            self.lines.append(line)
            match = regex.search(line)
            if match:
                return match

    def rest(self, timeout: float) -> str:
        """Everything until the stream closes."""
        while True:
            line = self._next(timeout, "end of output")
            if line is None:
                return "".join(self.lines)
            self.lines.append(line)


def start_server(processes: Processes, config_path: Path, out: Path) -> tuple[subprocess.Popen, LineReader, str]:
    """``fedpart server`` on a free port; returns the process, its output reader and its address."""
    server = processes.start(fedpart_command("server", "--insecure", str(config_path), "--address", "127.0.0.1:0", "--out", str(out)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    processes.run_dirs.append(out)
    reader = LineReader(server)
    address = reader.wait_for(r"listening on (\S+:\d+)", timeout=WAIT).group(1)
    return server, reader, address


def run_fedpart(config: dict[str, Any], tmp_path: Path, *sets: str, name: str = "run") -> tuple[subprocess.CompletedProcess, Path]:
    """``fedpart run`` on ``config``; returns the finished process and the run directory."""
    config_path = write_config(tmp_path / f"{name}.yaml", config)
    out = tmp_path / name
    sets_args = [a for s in sets for a in ("--set", s)]
    args = fedpart_command("run", str(config_path), "--out", str(out), *sets_args)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                               cwd=tmp_path)
    try:
        stdout, stderr = process.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        process.terminate()  # the launcher stops its server and clients on SIGTERM
        stdout, stderr = process.communicate(timeout=WAIT)
        raise AssertionError(f"fedpart run did not finish within {WAIT} s:\n{stdout}\n{stderr}")
    check_records(out)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr), out


def check_records(run_dir: Path) -> None:
    """The records a run directory holds read into their types, read back from what they write
    (``from_json(to_json(r)) == r``) and write the same text the server wrote (a last line of
    metrics.jsonl cut short by a stopped server is left out, as readers leave it)."""
    from fedpart.common.process.records import RoundRecord, RunSummary

    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    for number, line in enumerate(lines, start=1):
        try:
            data = json.loads(line)
        except ValueError:
            assert number == len(lines), f"{metrics}:{number}: not JSON"
            continue
        record = RoundRecord.from_json(data)
        assert RoundRecord.from_json(record.to_json()) == record, f"{metrics}:{number}"
        assert json.dumps(record.to_json()) == line, f"{metrics}:{number} does not read back unchanged"
    path = run_dir / "summary.json"
    if path.is_file():
        text = path.read_text()
        summary = RunSummary.from_json(json.loads(text))
        assert RunSummary.from_json(summary.to_json()) == summary, str(path)
        assert json.dumps(summary.to_json(), indent=1) == text, f"{path} does not read back unchanged"


def read_metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def read_summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with ``slow`` cases run first (each file's own order kept), so that the workers of
    ``-n 2 --dist loadfile`` start the longest files early and finish together. Tests marked
    ``gpu`` skip, saying why, where torch sees no CUDA device."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort: otherwise as collected
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})")
    for item in gpu_tests:
        item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Destroy gRPC objects the tests left in reference cycles while the interpreter is whole:
    gRPC's core torn down during interpreter shutdown may abort the process after a green run."""
    gc.collect()
