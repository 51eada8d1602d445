"""The cores a client process may use (common/process/limits.py): CPU affinity, the cgroup v2 and v1 CPU
quotas read from fake /proc and cgroup trees, the even share among the client processes of a host,
and how ``fedpart client`` and ``fedpart run`` use it; and the threads beside training, which yield
to it (``SCHED_BATCH``) in client processes and in ``fedpart run``'s server."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import WAIT, child_env, fedpart_command, small_config, write_config
from fedpart.client.session import SessionThread
from fedpart.common.process.limits import (
    HOST_SHARE_ENV,
    CpuBudget,
    HostShare,
    cgroup_cpu_quota,
    client_threads,
    cpu_budget,
    yield_to_training,
)

linux_policies = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
GRPC_THREADS = {"event_engine", "grpc_global_tim", "lifeguard"}  # what gRPC's C core names its threads


def fake_proc(tmp_path: Path, memberships: list[str], mounts: list[tuple[str, Path, str, str]]) -> Path:
    """A /proc/self directory: its ``cgroup`` lines and a ``mountinfo`` line per (root, mount
    point, file system type, super options)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("".join(f"{line}\n" for line in memberships))
    lines = [f"{30 + i} 23 0:{28 + i} {root} {str(point).replace(' ', chr(92) + '040')} rw,nosuid shared:{i} - "
             f"{fstype} {fstype} {options}\n" for i, (root, point, fstype, options) in enumerate(mounts)]
    lines.insert(0, "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n")  # not a cgroup
    (proc / "mountinfo").write_text("".join(lines))
    return proc


def write_files(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text + "\n")


def test_cgroup_v2_in_its_own_namespace(tmp_path: Path) -> None:
    """A container with a cgroup namespace (Kubernetes, Docker on cgroup v2): its cgroup is the root
    of the mount; `docker run --cpus 1.5` wrote cpu.max."""
    mount = tmp_path / "sys" / "fs" / "cgroup"
    write_files(mount, cpu__max="150000 100000")
    proc = fake_proc(tmp_path, ["0::/"], [("/", mount, "cgroup2", "rw,nsdelegate")])
    assert cgroup_cpu_quota(proc) == 1.5


def test_cgroup_v2_a_parent_limit_applies_to_its_children(tmp_path: Path) -> None:
    """The pod's cgroup limits 2 cores, its container's cgroup sets none: 2 cores. A sibling's
    tighter limit does not count."""
    mount = tmp_path / "cgroup"
    write_files(mount / "kubepods" / "pod1", cpu__max="200000 100000")
    write_files(mount / "kubepods" / "pod1" / "ctr", cpu__max="max 100000")
    write_files(mount / "kubepods" / "pod2", cpu__max="10000 100000")
    proc = fake_proc(tmp_path, ["0::/kubepods/pod1/ctr"], [("/", mount, "cgroup2", "rw")])
    assert cgroup_cpu_quota(proc) == 2.0


def test_cgroup_v2_mount_of_a_part_of_the_hierarchy(tmp_path: Path) -> None:
    """Without a cgroup namespace the container's mount shows only its own cgroup (mountinfo root
    /docker/abc) while /proc/self/cgroup names the full path. A mount point with a space is
    escaped in mountinfo."""
    mount = tmp_path / "my cgroup"
    write_files(mount, cpu__max="50000 100000")
    proc = fake_proc(tmp_path, ["0::/docker/abc"], [("/docker/abc", mount, "cgroup2", "rw")])
    assert cgroup_cpu_quota(proc) == 0.5


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    """cgroup v1 (hybrid: a cgroup2 mount without the cpu controller beside it): the cpu
    controller's cfs quota over its period; -1 means no quota."""
    cpu = tmp_path / "cgroup" / "cpu,cpuacct"
    write_files(cpu / "docker" / "abc", cpu__cfs_quota_us="300000", cpu__cfs_period_us="100000")
    write_files(cpu / "docker", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    memory = tmp_path / "cgroup" / "memory"
    write_files(memory / "docker" / "abc", cpu__cfs_quota_us="100000", cpu__cfs_period_us="100000")  # not cpu's
    unified = tmp_path / "cgroup" / "unified"
    write_files(unified)
    proc = fake_proc(tmp_path, ["5:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/docker/abc"],
                     [("/", cpu, "cgroup", "rw,cpu,cpuacct"), ("/", memory, "cgroup", "rw,memory"),
                      ("/", unified, "cgroup2", "rw")])
    assert cgroup_cpu_quota(proc) == 3.0
    write_files(cpu / "docker" / "abc", cpu__cfs_quota_us="-1")
    assert cgroup_cpu_quota(proc) is None


def test_no_quota_and_unreadable_files(tmp_path: Path) -> None:
    mount = tmp_path / "cgroup"
    write_files(mount, cpu__max="max 100000")
    assert cgroup_cpu_quota(fake_proc(tmp_path, ["0::/"], [("/", mount, "cgroup2", "rw")])) is None
    write_files(mount, cpu__max="not numbers")
    assert cgroup_cpu_quota(tmp_path / "proc") is None
    assert cgroup_cpu_quota(tmp_path / "no-such-proc") is None


def test_cpu_budget_of_this_process_takes_the_fewer_of_affinity_and_quota(tmp_path: Path) -> None:
    mount = tmp_path / "cgroup"
    write_files(mount, cpu__max="250000 100000")
    budget = cpu_budget(fake_proc(tmp_path, ["0::/"], [("/", mount, "cgroup2", "rw")]))
    assert budget.affinity == len(os.sched_getaffinity(0)) and budget.quota == 2.5
    assert budget.cores == min(budget.affinity, 3)


@pytest.mark.parametrize("budget, processes, threads", [
    (CpuBudget(8, None), 1, 8),
    (CpuBudget(8, None), 3, 2),        # 8 cores shared by 3 processes: 2 each, not 3
    (CpuBudget(8, 2.5), 1, 3),         # a quota of 2.5 cores rounds up
    (CpuBudget(8, 2.5), 2, 1),
    (CpuBudget(2, 16.0), 1, 2),        # affinity below the quota
    (CpuBudget(1, 0.2), 4, 1),         # never fewer than one thread
])
def test_client_threads_are_an_even_share_of_the_cores(budget: CpuBudget, processes: int, threads: int) -> None:
    assert client_threads(processes, budget) == threads


def test_client_threads_need_at_least_one_process() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        client_threads(0, CpuBudget(4, None))


def test_client_processes_of_a_host_find_each_other_and_share_its_cores(tmp_path: Path) -> None:
    """Each registers itself; each counts the live ones whose CPUs overlap its own; one that
    leaves, or dies (its lock goes with it), stops counting and its file is removed."""
    budget = CpuBudget(4, None)
    first = HostShare(budget, tmp_path)
    assert first.threads() == (4, 1)
    second = HostShare(budget, tmp_path)
    assert first.threads() == second.threads() == (2, 2)
    second.close()
    assert first.threads() == (4, 1) and not second.path.exists()
    dead = tmp_path / "12345-gone.share"  # a registration whose process died: nobody holds its lock
    dead.write_text('{"pid": 12345, "cpus": [0]}')
    assert first.processes() == 1 and not dead.exists()
    elsewhere = HostShare(budget, tmp_path)
    elsewhere.path.write_text('{"pid": 1, "cpus": [9999]}')  # pinned to CPUs this process cannot use
    assert first.processes() == 1
    elsewhere.close()
    first.close()
    assert list(tmp_path.glob("*.share")) == []


def test_the_registry_folder_is_private_to_its_user(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(HOST_SHARE_ENV, str(tmp_path / "share"))
    share = HostShare(CpuBudget(2, None))
    try:
        assert share.directory == tmp_path / "share" and (share.directory.stat().st_mode & 0o777) == 0o700
    finally:
        share.close()


def _closed_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _client_threads_line(tmp_path: Path, *options: str, env: dict[str, str] | None = None,
                         cpus: set[int] | None = None) -> str:
    """The torch-threads line of a ``fedpart client`` that finds no server (it gives up after 1 s)."""
    result = subprocess.run(
        fedpart_command("client", "--insecure", "--server", _closed_address(), "--clients", "0", "--connect-timeout", "1",
                        "--state-dir", str(tmp_path / "state"), *options),
        capture_output=True, text=True, timeout=WAIT, env=env or child_env(),
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    assert result.returncode == 4, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "torch thread" in line]
    return line


def test_a_standalone_client_takes_its_share_of_the_cores_by_itself(tmp_path: Path) -> None:
    """With another client process registered on the host, a ``fedpart client`` started without
    flags takes half the cores it may use (here its affinity, pinned to one CPU, and this machine's
    own quota), and says so in its first line; ``--threads`` wins."""
    budget = cpu_budget()
    folder = tmp_path / "share"
    env = child_env() | {HOST_SHARE_ENV: str(folder)}
    line = _client_threads_line(tmp_path, env=env)
    assert line.endswith(f"] {budget.cores} torch thread{'s' if budget.cores > 1 else ''} ({budget.describe()} / "
                         "1 client process on this host; it follows as processes start or stop beside it)"), line
    neighbour = HostShare(budget, folder)  # another client process of this host
    try:
        threads = client_threads(2, budget)
        line = _client_threads_line(tmp_path, env=env)
        assert line.endswith(f"] {threads} torch thread{'s' if threads > 1 else ''} ({budget.describe()} / "
                             "2 client processes on this host; it follows as processes start or stop beside it)"), line
        pinned = CpuBudget(1, budget.quota)
        line = _client_threads_line(tmp_path, env=env, cpus={min(os.sched_getaffinity(0))})
        assert f"1 torch thread ({pinned.describe()} / 2 client processes on this host" in line, line
        assert _client_threads_line(tmp_path, "--threads", "3", env=env).endswith("3 torch threads (--threads)")
    finally:
        neighbour.close()


# ------------------------------------------------------------------- threads beside training


@linux_policies
def test_yield_to_training_moves_the_calling_thread_and_the_threads_it_starts() -> None:
    before = os.sched_getscheduler(0)
    seen: dict[str, object] = {}

    def started() -> None:
        seen["started"] = os.sched_getscheduler(0)

    def beside() -> None:
        seen["yielded"] = yield_to_training()
        seen["beside"] = os.sched_getscheduler(0)
        thread = threading.Thread(target=started)
        thread.start()
        thread.join()

    thread = threading.Thread(target=beside)
    thread.start()
    thread.join()
    assert seen == {"yielded": True, "beside": os.SCHED_BATCH, "started": os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == before  # the caller's policy only


async def _policy() -> int:
    return os.sched_getscheduler(0)


@linux_policies
def test_a_client_process_session_thread_yields_to_training() -> None:
    session = SessionThread()
    try:
        assert session.call(_policy()) == os.SCHED_BATCH
    finally:
        session.close()


def _children(pid: int) -> list[int]:
    return [int(child) for task in os.listdir(f"/proc/{pid}/task")
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]


def _policies(pid: int) -> dict[int, tuple[str, int]]:
    """Each thread of ``pid``: its name and scheduling policy (threads that end meanwhile left out)."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(task)] = (Path(f"/proc/{pid}/task/{task}/comm").read_text().strip(),
                                os.sched_getscheduler(int(task)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


@linux_policies
def test_fedpart_run_trains_under_the_usual_policy_beside_threads_that_yield(tmp_path: Path, processes) -> None:
    """In a real ``fedpart run``: every thread of the server (``--yield-to-training``) and the gRPC
    threads of the client processes run ``SCHED_BATCH``; the clients' training (main) threads do not."""
    config = write_config(tmp_path / "run.yaml", small_config(rounds=500, clients=2, processes=2))
    run = processes.start(fedpart_command("run", str(config), "--out", str(tmp_path / "run")),
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + WAIT
    while not (metrics.exists() and '"round"' in metrics.read_text()):  # every process is up and joined
        assert run.poll() is None and time.monotonic() < deadline, "the run ended or stalled before round 1"
        time.sleep(0.1)
    # the launcher's processes are forked from its fork server (fedpart/deploy/forks.py), named for what they run
    started = {pid: Path(f"/proc/{pid}/comm").read_text().strip()
               for child in _children(run.pid) for pid in _children(child)}
    (server,) = [pid for pid, name in started.items() if name == "fedpart-server"]
    clients = [pid for pid, name in started.items() if name == "fedpart-client"]
    assert len(clients) == 2
    server_threads = _policies(server)
    assert len(server_threads) > 3, server_threads
    assert {policy for _, policy in server_threads.values()} == {os.SCHED_BATCH}, server_threads
    for client in clients:
        threads = _policies(client)
        assert threads[client][1] == os.SCHED_OTHER, threads
        grpc_threads = [policy for name, policy in threads.values() if name in GRPC_THREADS]
        assert grpc_threads and set(grpc_threads) == {os.SCHED_BATCH}, threads
