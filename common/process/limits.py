"""Process limits: the open files a program that holds many connections raises, the cores a
client process may use for its torch threads, and how the threads beside training share them.

The cores available to a process are the fewer of the CPUs it may be scheduled on (its affinity:
``taskset``, a cpuset) and its cgroup's CPU quota (cgroup v2 ``cpu.max``, cgroup v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: what ``docker run --cpus`` and a Kubernetes CPU limit
set), the quota rounded up as the Go and Java runtimes do. Client processes that share a host
share them: :func:`client_threads` gives each an even share, at least one thread. They find each
other without an operator's flag (:class:`HostShare`): each registers itself in a directory of
this user's on the host and counts the live processes registered there whose CPUs overlap its
own, before each task, so that a process started beside others and one whose neighbours stopped
both take their share from their next task on. Two processes that each took every core would
fight for them, torch's intra-op threads spinning against each other's: rounds many times slower
(``benchmarks/hand_started.py --every-core`` shows it).

The threads beside training (a client's session and gRPC threads; a server on a host
where client processes train) :func:`yield_to_training`: they run under Linux's ``SCHED_BATCH``
policy (sched(7)), so that one of them waking up waits for the scheduler's next tick instead of
taking the core from a training thread at once. Their share of the CPU is unchanged. Each such
wakeup would otherwise cost the training thread its place on the core and a refill of its caches
(``benchmarks/round_overhead.py`` counts the training threads' preemptions, docs/benchmarks.md).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Where the client processes of a host register (HostShare); tests point it at a folder of their own.
HOST_SHARE_ENV = "FEDPART_HOST_SHARE_DIR"


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit: a server holds a socket
    per connected client process, a load generator one per virtual process. Returns the soft
    limit now in force (-1 where the platform has no such limit)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit that the kernel caps lower
        return soft
    return hard


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use."""

    affinity: int         # CPUs it may be scheduled on
    quota: float | None   # its cgroup's CPU quota in cores (None: no quota)

    @property
    def cores(self) -> int:
        """The fewer of the two, the quota rounded up; at least 1."""
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.ceil(self.quota)))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup CPU quota {self.quota:g}"
        return f"{self.cores} cores available (affinity {self.affinity}, {quota})"


def cpu_budget(proc: Path = Path("/proc/self")) -> CpuBudget:
    """The CPUs of this process (``proc``: where its ``cgroup`` and ``mountinfo`` files are)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity, cgroup_cpu_quota(proc))


def client_threads(processes_per_host: int, budget: CpuBudget | None = None) -> int:
    """Torch threads of one of ``processes_per_host`` client processes on this host: an even
    share of the cores available (:func:`cpu_budget`), at least 1."""
    if processes_per_host < 1:
        raise ValueError(f"processes per host must be at least 1, not {processes_per_host}")
    return max(1, (budget or cpu_budget()).cores // processes_per_host)


class HostShare:
    """This client process's registration among the client processes of its host, and the share
    of the cores it takes from it (:func:`client_threads`).

    Each process holds an exclusive ``flock`` on a file of its own in the registry directory
    (``$FEDPART_HOST_SHARE_DIR``, else ``/dev/shm`` or the temporary directory, in a folder of this
    user's, mode 0700) for as long as it lives; the kernel drops the lock when the process ends,
    however it ends. :meth:`processes` counts the files whose lock is held and whose CPUs overlap
    this process's (processes pinned to other cores, or in another container with its own
    ``/dev/shm``, do not share them), and removes the files of processes that are gone. A file is
    locked before it gets its name, so no process sees another's file unlocked while it lives.
    """

    def __init__(self, budget: CpuBudget | None = None, directory: Path | None = None) -> None:
        self.budget = budget or cpu_budget()
        self.directory = directory or host_share_directory()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.cpus = _affinity()
        held = tempfile.NamedTemporaryFile("w", dir=self.directory, prefix=".joining-", delete=False)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        json.dump({"pid": os.getpid(), "cpus": sorted(self.cpus)}, held)
        held.flush()
        self.path = self.directory / f"{os.getpid()}-{os.path.basename(held.name)[len('.joining-'):]}.share"
        os.replace(held.name, self.path)
        self._file = held  # open, and so locked, for as long as this process registers

    def processes(self) -> int:
        """Live client processes on this host whose CPUs overlap this one's, this one included."""
        count = 1
        for path in self.directory.glob("*.share"):
            if path == self.path:
                continue
            cpus = _live_share(path)
            if cpus is not None and (not cpus or cpus & self.cpus):
                count += 1
        return count

    def threads(self) -> tuple[int, int]:
        """(torch threads for this process, client processes sharing the cores)."""
        sharing = self.processes()
        return client_threads(sharing, self.budget), sharing

    def close(self) -> None:
        """Leave the registry (the kernel would release the lock at exit anyway)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._file.close()


def host_share_directory() -> Path:
    """The registry directory of this user's client processes on this host."""
    override = os.environ.get(HOST_SHARE_ENV)
    if override:
        return Path(override)
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    return base / f"fedpart-cores-{os.getuid()}"


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _live_share(path: Path) -> set[int] | None:
    """The CPUs of the live process registered in ``path``; None (and the file removed) when its
    process is gone, or the file went away meanwhile."""
    try:
        with path.open() as file:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    return set(json.load(file).get("cpus", []))
                except ValueError:
                    return set()
            path.unlink(missing_ok=True)  # its process is gone: nobody holds the lock
            return None
    except FileNotFoundError:
        return None


def yield_to_training() -> bool:
    """Put the calling thread, and the threads it starts from now on (they inherit it), under
    ``SCHED_BATCH``: its wakeups no longer preempt a running thread (see the module's docstring).
    Returns False where the platform has no such policy or refuses it; nothing changes then."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or a sandbox that forbids it
        return False
    return True


# ----------------------------------------------------------------------------------------- cgroups


def cgroup_cpu_quota(proc: Path = Path("/proc/self")) -> float | None:
    """The CPU quota, in cores, of the cgroups ``proc`` (a process's /proc directory) belongs to:
    the smallest ``quota / period`` of its cgroup and every parent cgroup visible in its mounts,
    cgroup v2 and v1 alike; None where none sets a quota (or none can be read)."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    v2_path = v1_path = None
    for line in memberships:  # "hierarchy-ID:controllers:path"
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    quotas = []
    for root, mount_point, fstype, options in _cgroup_mounts(mounts):
        if fstype == "cgroup2" and v2_path is not None:
            quotas += [_v2_quota(d) for d in _cgroup_dirs(mount_point, root, v2_path)]
        elif fstype == "cgroup" and v1_path is not None and "cpu" in options:
            quotas += [_v1_quota(d) for d in _cgroup_dirs(mount_point, root, v1_path)]
    known = [q for q in quotas if q is not None]
    return min(known) if known else None


def _cgroup_mounts(lines: list[str]) -> list[tuple[str, Path, str, set[str]]]:
    """(root, mount point, file system type, super options) of the cgroup mounts in mountinfo lines."""
    mounts = []
    for line in lines:
        fields, separator, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if not separator or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((_unescape(fields[3]), Path(_unescape(fields[4])), tail[0], set(tail[2].split(","))))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as octal escapes."""
    for escape, character in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escape, character)
    return field


def _cgroup_dirs(mount_point: Path, root: str, path: str) -> list[Path]:
    """The directories of cgroup ``path`` and of its parents down to ``mount_point``, which shows
    the cgroup ``root`` of the hierarchy (a container sees only its own part of it). A path
    outside that root (a process moved out of the container's part) leaves the mount point."""
    relative = os.path.relpath(path, root)
    if relative.startswith(".."):
        relative = "."
    directory = mount_point / relative
    directories = [directory]
    while directory != mount_point and mount_point in directory.parents:
        directory = directory.parent
        directories.append(directory)
    return directories


def _v2_quota(directory: Path) -> float | None:
    """``cpu.max`` (``"max 100000"`` or ``"QUOTA PERIOD"``) in cores."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    """``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``, in cores."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
