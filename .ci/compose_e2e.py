#!/usr/bin/env python3
"""CI: fedpart's images built and its Compose deployment run for real, killed and resumed (issue 52).

Run as root on a machine of CI's kind (Debian bookworm, Python 3.11, the CPU torch wheel found
through pip's configuration, the package index behind a proxy with certificates of its own), with
the repository's virtual environment active (``.ci/run`` calls it after the test suite)::

    python .ci/compose_e2e.py [--dockerfile deploy/Dockerfile] [--compose deploy/docker-compose.yml]

Phases, each timed and each wait bounded:

1. **tools**: Docker Engine, Compose and debootstrap from Debian's packages, where missing.
2. **daemon**: a dockerd of its own (own socket, data root and pidfile), stopped by PID at the
   end. It leaves the host's network alone (no iptables rules, no IP forwarding, no default
   bridge: builds use the host's network, Compose makes its own bridge and publishes through
   Docker's userland proxy); the host's network settings and the mounts in the daemon's
   directories are compared before and after anyway, and restored where they differ.
3. **base image**: a Debian bookworm image made with debootstrap and ``docker import`` (Python
   3.11, the version of the local CPU torch wheel; the host's local CA certificates and pip's
   certificate setting), kept in the data root between runs and made again only when its recipe
   or the certificates change.
4. **wheels**: torch 2.13.0 and its dependencies as pip's configuration on this host finds them,
   served as a package index on 127.0.0.1 for the build (``TORCH_INDEX_URL``).
5. **build**: the client and server images of ``deploy/Dockerfile`` with the build arguments
   ``BASE_IMAGE`` and ``TORCH_INDEX_URL``; their sizes.
6. **certs**: ``fedpart certs`` inside the server image.
7. **run**: the Compose deployment from a copy of the Compose file that differs only where a test
   must (the build context as an absolute path, the server published on an ephemeral port of
   127.0.0.1): the server first, healthy by its image's healthcheck and answering mutual TLS
   through the published port, then the clients; all exit 0 with a complete ``summary.json``,
   mutual TLS named in the server's log and TLS in the clients'.
8. **resume**: the same run again, the server killed (SIGKILL) at round 2, the resume service
   started, and the resumed run's final accuracies equal to the uninterrupted run's.
9. **teardown**: the Compose project and its volumes removed, the images this run replaced
   pruned, dockerd stopped, the host as it was before.

The build, run and resume phases are bounded as a whole (:data:`PHASE_SECONDS`); the other steps
each by their own bound. A failure ends with one line naming the phase and why (Docker that cannot
start: only that line); logs stay in ``/tmp/fedpart-compose-e2e``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
LOGS = Path("/tmp/fedpart-compose-e2e")
DATA_ROOT = Path("/var/lib/fedpart-ci-docker")  # images and build cache, kept between runs
RUNTIME = Path("/run/fedpart-ci-docker")        # socket, pidfile, exec root, the wheel index
WHEELS = Path("/var/cache/fedpart-ci/wheels")
SOCKET = RUNTIME / "docker.sock"
PIDFILE = RUNTIME / "dockerd.pid"
BASE_IMAGE = "fedpart-ci/base:bookworm"
BASE_LABEL = "org.fedpart.ci.recipe"
SUITE = "bookworm"  # Python 3.11: the local CPU torch wheel is cp311
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
LOCAL_CA_DIR = Path("/usr/local/share/ca-certificates")
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TORCH = "torch==2.13.0"
WHEEL_PORT = 38741  # fixed: the index URL is a build argument, part of the build cache's key
PROJECT = "fedpartci"
IMAGES = {"client": "fedpart:client", "server": "fedpart:server"}
# The wheel stage, tagged so that pruning the images a run replaced keeps it: a wheel built again
# differs in its timestamps and would rebuild the images' install layers on every run.
WHEEL_IMAGE = "fedpart-ci/wheel"
CERTS_ARGS = ["--server-names", "server", "--clients", "10", "--processes", "2"]
CLIENT_SERVICES = ("client-0", "client-1")
KILL_ROUND = 2
UID = 1000  # the images' user

# Bounds, in seconds, of each step; a failure that is not a hang shows up as soon as it happens.
APT_SECONDS = 600
DAEMON_SECONDS = 60
DEBOOTSTRAP_SECONDS = 900
DOWNLOAD_SECONDS = 600
COMMAND_SECONDS = 120
PROBE_SECONDS = 10
# The build, run and resume phases as a whole, every step in them included: a broken Dockerfile, a
# server that cannot start or a client that cannot join fails CI within this of its phase's start
# (a cold build takes 2-3 minutes on a busy 2-core machine).
PHASE_SECONDS = 300
STOP_SECONDS = 60

# dockerd's changes to the host's network, switched off (the module docstring says why).
DAEMON_NETWORK_FLAGS = ["--iptables=false", "--ip-forward=false", "--bridge=none"]
SYSCTLS = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/bridge/bridge-nf-call-iptables",
           "net/bridge/bridge-nf-call-ip6tables")
DOCKER_LINKS = re.compile(r"^(docker\d*|br-[0-9a-f]+|veth[0-9a-f]+)$")
ROUND_LINE = re.compile(r"\bround\s+(\d+)/(\d+)\b")


class Failed(Exception):
    """A check or step failed: ``reason`` is the line CI prints last, ``details`` (log lines)
    go before it."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


# ------------------------------------------------------------------------------ pure pieces


def ci_compose(compose: dict[str, Any], source_dir: Path) -> dict[str, Any]:
    """The Compose file as the test runs it: build contexts absolute (the copy lives elsewhere)
    and every published port on an ephemeral port of 127.0.0.1 only. Nothing else changes."""
    copy = json.loads(json.dumps(compose))  # anchors and merges already resolved by the loader
    for service in copy["services"].values():
        build = service.get("build")
        if isinstance(build, dict):
            build["context"] = str((source_dir / build.get("context", ".")).resolve())
        if "ports" in service:
            service["ports"] = [f"127.0.0.1::{str(port).rsplit(':', 1)[-1]}" for port in service["ports"]]
    return copy


def summary_problems(summary: dict[str, Any], rounds: int) -> list[str]:
    """What makes ``summary.json`` short of a completed run of ``rounds`` rounds."""
    problems = []
    if summary.get("status") != "completed" or summary.get("exit_code") != 0:
        problems.append(f"status {summary.get('status')!r}, exit code {summary.get('exit_code')!r}")
    if summary.get("rounds_completed") != rounds or summary.get("rounds") != rounds:
        problems.append(f"{summary.get('rounds_completed')} of {rounds} rounds")
    accuracy = summary.get("accuracy", {})
    missing = [key for key in ("initial", "personalized", "global") if not accuracy.get(key)]
    if missing:
        problems.append(f"no {', '.join(missing)} accuracy")
    return problems


def host_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The host settings (:func:`host_state`) that differ."""
    differences = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            shown = {k: v if len(str(v)) < 200 else f"{str(v)[:200]}..." for k, v in
                     (("before", before.get(key)), ("after", after.get(key)))}
            differences.append(f"{key}: {shown['before']!r} -> {shown['after']!r}")
    return differences


def write_wheel_index(wheels: Path, index: Path) -> None:
    """A PEP 503 simple index of the wheels in ``wheels``: ``index/<project>/<file>``, linked
    (a directory listing is a project page pip reads)."""
    shutil.rmtree(index, ignore_errors=True)
    for wheel in sorted(wheels.glob("*.whl")):
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()
        (index / project).mkdir(parents=True, exist_ok=True)
        (index / project / wheel.name).symlink_to(wheel)


def round_reached(line: str) -> tuple[int, int] | None:
    """(round, rounds) of a server's progress line."""
    match = ROUND_LINE.search(line)
    return (int(match[1]), int(match[2])) if match else None


# --------------------------------------------------------------------------- host and processes


def pump(stream, sink: queue.Queue) -> None:
    """Lines of ``stream`` into ``sink``, then None."""
    for line in iter(stream.readline, ""):
        sink.put(line)
    sink.put(None)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run(command: list[str], timeout: float, log: Path | None = None, env: dict[str, str] | None = None,
        what: str | None = None) -> str:
    """Run ``command`` to its end within ``timeout`` (killed by PID after it); its output goes to
    ``log`` (appended) or is returned. Raises Failed when it fails or runs out of time."""
    what = what or " ".join(command[:3])
    sink = log.open("ab") if log else subprocess.PIPE
    try:
        result = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                check=False)
    except subprocess.TimeoutExpired:
        raise Failed(f"{what}: no end within {timeout:.0f} s", tail(log) if log else "") from None
    except OSError as error:
        raise Failed(f"{what}: {error}") from None
    finally:
        if log:
            sink.close()
    output = "" if log else result.stdout.decode(errors="replace")
    if result.returncode != 0:
        raise Failed(f"{what}: exit code {result.returncode}", tail(log) if log else output.strip()[-3000:])
    return output


def read_sysctl(name: str) -> str | None:
    try:
        return (Path("/proc/sys") / name).read_text().strip()
    except OSError:
        return None


def docker_mounts() -> list[str]:
    """Mount points under this run's Docker directories (a daemon's network namespace, containers'
    file systems)."""
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return sorted(p for p in points if any(p.startswith(f"{root}/") for root in (RUNTIME, DATA_ROOT)))


def host_state() -> dict[str, Any]:
    """The host settings a Docker daemon may change: network interfaces, forwarding and bridge
    filtering switches, the iptables rules (without counters), and mounts in its directories."""
    state: dict[str, Any] = {"links": sorted(os.listdir("/sys/class/net")), "mounts": docker_mounts()}
    state |= {name: read_sysctl(name) for name in SYSCTLS}
    for tool in ("iptables-save", "ip6tables-save"):
        if shutil.which(tool):
            rules = subprocess.run([tool], capture_output=True, text=True, timeout=COMMAND_SECONDS).stdout
            state[tool] = "\n".join(re.sub(r" \[\d+:\d+\]$", "", line) for line in rules.splitlines()
                                    if not line.startswith("#"))
    return state


def restore_host(before: dict[str, Any]) -> None:
    """Put back what a Docker daemon changed: its interfaces deleted, its mounts unmounted, the
    switches and the iptables rules as they were."""
    after = host_state()
    for mount in reversed(sorted(set(after["mounts"]) - set(before["mounts"]))):
        subprocess.run(["umount", mount], capture_output=True, timeout=COMMAND_SECONDS)
    for link in sorted(set(after["links"]) - set(before["links"])):
        if DOCKER_LINKS.match(link):
            subprocess.run(["ip", "link", "delete", link], capture_output=True, timeout=COMMAND_SECONDS)
    for name in SYSCTLS:
        if before[name] is not None and after[name] != before[name]:
            (Path("/proc/sys") / name).write_text(before[name])
    for tool in ("iptables", "ip6tables"):
        saved = before.get(f"{tool}-save")
        if saved is not None and after.get(f"{tool}-save") != saved:
            subprocess.run([f"{tool}-restore"], input=saved + "\n", text=True, capture_output=True,
                           timeout=COMMAND_SECONDS)


def compose_command() -> list[str] | None:
    """Compose 2 (the docker plugin) where it is installed, else Compose 1."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=COMMAND_SECONDS).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def apt_source() -> str:
    """The Debian mirror this host's apt uses (through its proxy), for debootstrap."""
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if path.is_file():
            match = re.search(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", path.read_text(), re.MULTILINE)
            if match:
                return match[1]
    return "http://deb.debian.org/debian"


# ------------------------------------------------------------------------------------- the run


class ComposeE2E:
    def __init__(self, dockerfile: Path, compose_file: Path) -> None:
        self.dockerfile = dockerfile
        self.compose_file = compose_file
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{SOCKET}", DOCKER_BUILDKIT="0",
                        COMPOSE_DOCKER_CLI_BUILD="0")
        self.host_before: dict[str, Any] | None = None
        self.daemon: subprocess.Popen | None = None
        self.index_server: subprocess.Popen | None = None
        self.compose: list[str] = []
        self.compose_up = False
        self.times: list[tuple[str, float]] = []
        self.notes: list[str] = []
        self.accuracy: dict[str, Any] | None = None
        self.deadline = float("inf")  # of the phase under way (time.monotonic), where it has one

    @contextmanager
    def phase(self, name: str, bound: float = float("inf")) -> Iterator[None]:
        """Time the phase; ``bound``: seconds all of it may take (:meth:`remaining`)."""
        started = time.monotonic()
        self.deadline = started + bound
        print(f"compose-e2e: {name} ...", flush=True)
        try:
            yield
        except Failed as failure:
            raise Failed(f"{name} (after {time.monotonic() - started:.0f} s): {failure.reason}",
                         failure.details) from None
        finally:
            self.times.append((name, time.monotonic() - started))
            self.deadline = float("inf")
        print(f"compose-e2e: {name} done in {self.times[-1][1]:.1f} s", flush=True)

    def remaining(self) -> float:
        """Seconds left to the phase's bound, at least PROBE_SECONDS (what a step may still take
        once the bound has passed: collecting logs for the failure)."""
        return max(PROBE_SECONDS, self.deadline - time.monotonic())

    def docker(self, *args: str, timeout: float = COMMAND_SECONDS, log: Path | None = None,
               what: str | None = None) -> str:
        return run(["docker", *args], min(timeout, self.remaining()), log=log, env=self.env,
                   what=what or f"docker {args[0]}").strip()

    def run_all(self) -> None:
        with self.phase("tools"):
            self.install_tools()
        with self.phase("daemon"):
            self.start_daemon()
        with self.phase("base image"):
            self.make_base_image()
        with self.phase("wheels"):
            self.serve_wheels()
        with self.phase("build", PHASE_SECONDS):
            self.build_images()
        with self.phase("certs"):
            self.make_certs()
        with self.phase("run", PHASE_SECONDS):
            self.accuracy = self.run_deployment()
        with self.phase("resume", PHASE_SECONDS):
            self.run_killed_and_resumed()

    # ----------------------------------------------------------------------------- tools, daemon

    def install_tools(self) -> None:
        wanted = {"dockerd": "docker.io", "docker": "docker.io", "debootstrap": "debootstrap"}
        missing = sorted({package for tool, package in wanted.items() if shutil.which(tool) is None})
        if compose_command() is None:
            missing.append("docker-compose")
        if missing:
            log = LOGS / "apt.log"
            # no service started by the packages' scripts: this run starts its own daemon
            policy = Path("/usr/sbin/policy-rc.d")
            own_policy = not policy.exists()
            if own_policy:
                policy.write_text("#!/bin/sh\nexit 101\n")
                policy.chmod(0o755)
            try:
                env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
                run(["apt-get", "update", "-q"], APT_SECONDS, log=log, env=env)
                run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], APT_SECONDS, log=log,
                    env=env)
            finally:
                if own_policy:
                    policy.unlink()
            self.notes.append(f"installed {' '.join(missing)}")
        self.compose = compose_command() or []
        if not self.compose:
            raise Failed("no Compose after installing docker-compose")
        version = run([*self.compose, "version"], COMMAND_SECONDS, env=self.env).splitlines()[0]
        self.notes.append(f"{version}; {run(['dockerd', '--version'], COMMAND_SECONDS).strip()}; docker CLI "
                          f"{run(['docker', '--version'], COMMAND_SECONDS).strip()}")

    def start_daemon(self) -> None:
        """dockerd on a socket of its own; a daemon an earlier run left (its pidfile) is stopped first."""
        self.stop_leftover_daemon()
        self.host_before = host_state()
        RUNTIME.mkdir(parents=True, exist_ok=True)
        log = LOGS / "dockerd.log"
        with log.open("wb") as sink:
            self.daemon = subprocess.Popen(
                ["dockerd", "--host", f"unix://{SOCKET}", "--data-root", str(DATA_ROOT), "--exec-root",
                 str(RUNTIME / "exec"), "--pidfile", str(PIDFILE), *DAEMON_NETWORK_FLAGS],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + DAEMON_SECONDS
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                break
            try:
                if subprocess.run(["docker", "version"], env=self.env, capture_output=True,
                                  timeout=PROBE_SECONDS).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)
        errors = [line for line in tail(log, 200).splitlines() if "level=fatal" in line or "level=error" in line]
        message = re.search(r'msg="((?:[^"\\]|\\.)*)"', errors[-1]) if errors else None
        reason = (message[1] if message else errors[-1]) if errors else f"no answer on {SOCKET} within {DAEMON_SECONDS} s"
        raise Failed(f"Docker cannot start here: {reason}")

    @staticmethod
    def stop_leftover_daemon() -> None:
        try:
            pid = int(PIDFILE.read_text())
            alive = Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd"
        except (OSError, ValueError):
            return
        if alive:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_SECONDS
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.5)

    # ------------------------------------------------------------------------- base image, wheels

    def base_recipe(self) -> str:
        """What the base image is made of: the suite, the packages, the certificates, pip's config."""
        digest = hashlib.sha256(f"{SUITE} {BASE_PACKAGES} {apt_source()}\n{self.pip_conf()}".encode())
        for certificate in sorted(LOCAL_CA_DIR.rglob("*.crt")):
            digest.update(certificate.read_bytes())
        return digest.hexdigest()[:16]

    @staticmethod
    def pip_conf() -> str:
        """pip's configuration inside the base image: the host's certificate setting (the proxy's CA
        is in the image's bundle) and the host's index, where it names one."""
        lines = ["[global]", f"cert = {HOST_CA_BUNDLE}"]
        index = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                               text=True, timeout=COMMAND_SECONDS).stdout.strip()
        if index.startswith(("http://", "https://")):
            lines.append(f"index-url = {index}")
        return "\n".join(lines) + "\n"

    def make_base_image(self) -> None:
        recipe = self.base_recipe()
        try:
            label = self.docker("image", "inspect", "--format", f'{{{{ index .Config.Labels "{BASE_LABEL}" }}}}',
                                BASE_IMAGE)
        except Failed:
            label = None
        if label == recipe:
            self.notes.append(f"base image {BASE_IMAGE} cached")
            return
        log = LOGS / "debootstrap.log"
        with tempfile.TemporaryDirectory(prefix="fedpart-ci-rootfs-", dir="/var/tmp") as tmp:
            root = Path(tmp) / "rootfs"
            run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, str(root), apt_source()],
                DEBOOTSTRAP_SECONDS, log=log)
            for certificate in LOCAL_CA_DIR.rglob("*.crt"):
                target = root / certificate.relative_to("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(certificate, target)
            run(["chroot", str(root), "update-ca-certificates"], COMMAND_SECONDS, log=log)
            (root / "etc" / "pip.conf").write_text(self.pip_conf())
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (root / leftover).glob("*"):
                    if path.is_file():
                        path.unlink()
            for cache in (root / "var/cache/apt").glob("*.bin"):
                cache.unlink()
            archive = Path(tmp) / "rootfs.tar"
            run(["tar", "-C", str(root), "-cf", str(archive), "."], COMMAND_SECONDS, log=log)
            self.docker("import", "--change", f"LABEL {BASE_LABEL}={recipe}", "--change", "ENV LANG=C.UTF-8",
                        "--change", 'CMD ["/bin/bash"]', str(archive), BASE_IMAGE, timeout=COMMAND_SECONDS * 3)
        self.notes.append(f"base image {BASE_IMAGE} made")

    def serve_wheels(self) -> None:
        """torch and its dependencies, as this host's pip configuration finds them, behind a PEP 503
        index on 127.0.0.1 (the build uses the host's network)."""
        WHEELS.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--dest", str(WHEELS), TORCH],
            DOWNLOAD_SECONDS, log=LOGS / "wheels.log", what="pip download")
        index = RUNTIME / "index"
        write_wheel_index(WHEELS, index)
        log = (LOGS / "index.log").open("wb")
        self.index_server = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(index), str(WHEEL_PORT)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + COMMAND_SECONDS
        while time.monotonic() < deadline:
            if self.index_server.poll() is not None:
                raise Failed(f"the wheel index could not listen on 127.0.0.1:{WHEEL_PORT}", tail(LOGS / "index.log", 5))
            try:
                with urllib.request.urlopen(f"{self.index_url}/torch/", timeout=5) as answer:
                    if TORCH.split("==")[1] in answer.read().decode():
                        return
                    raise Failed(f"the wheel index holds no {TORCH}")
            except OSError:
                time.sleep(0.3)
        raise Failed(f"the wheel index did not answer within {COMMAND_SECONDS} s")

    @property
    def index_url(self) -> str:
        return f"http://127.0.0.1:{WHEEL_PORT}"

    # ----------------------------------------------------------------------------- images, certs

    def build_images(self) -> None:
        sizes, times = [], []
        for target, tag in ({"wheel": WHEEL_IMAGE} | IMAGES).items():
            started = time.monotonic()
            self.docker("build", "--network", "host", "--file", str(self.dockerfile), "--target", target,
                        "--tag", tag, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
                        "--build-arg", f"TORCH_INDEX_URL={self.index_url}", str(REPO),
                        timeout=PHASE_SECONDS, log=LOGS / f"build-{target}.log",
                        what=f"docker build --target {target}")
            times.append(f"{target} {time.monotonic() - started:.0f} s")
            if tag in IMAGES.values():
                size = int(self.docker("image", "inspect", "--format", "{{.Size}}", tag)) / 1e6
                sizes.append(f"{tag} {size:.0f} MB (fedpart's layer {self.layer_size(tag, '/tmp/wheels/fedpart-')})")
        base = int(self.docker("image", "inspect", "--format", "{{.Size}}", BASE_IMAGE)) / 1e6
        self.notes.append(f"built {', '.join(times)}; image sizes: {', '.join(sizes)}; layers both share: base "
                          f"{base:.0f} MB, torch {self.layer_size(IMAGES['server'], TORCH)}")

    def layer_size(self, image: str, made_by: str) -> str:
        """The size of the layer of ``image`` whose RUN names ``made_by``, as Docker prints it."""
        history = self.docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image)
        return next((line.split("\t")[0] for line in history.splitlines()
                     if made_by in line and "pip install" in line), "?")

    def make_certs(self) -> None:
        secrets = LOGS / "secrets"
        secrets.mkdir(mode=0o700)
        os.chown(secrets, UID, UID)
        self.docker("run", "--rm", "--network", "none", "--volume", f"{secrets}:/secrets", IMAGES["server"], "certs",
                    "--out", "/secrets", *CERTS_ARGS)
        compose = yaml.safe_load(self.compose_file.read_text())
        wanted = {Path(secret["file"]).name for secret in compose.get("secrets", {}).values()}
        missing = sorted(wanted - {path.name for path in secrets.iterdir()})
        if missing:
            raise Failed(f"fedpart certs wrote no {', '.join(missing)}")
        (LOGS / "docker-compose.yml").write_text(yaml.safe_dump(ci_compose(compose, self.compose_file.parent)))

    # ------------------------------------------------------------------------------- deployment

    def compose_run(self, *args: str, log: str = "compose.log") -> str:
        self.compose_up = True
        return run([*self.compose, "--project-name", PROJECT, "--file", str(LOGS / "docker-compose.yml"), *args],
                   min(COMMAND_SECONDS * 2, self.remaining()), log=LOGS / log, env=self.env, what=f"compose {args[0]}")

    def container(self, service: str) -> str:
        ids = self.docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={PROJECT}",
                          "--filter", f"label=com.docker.compose.service={service}").split()
        if len(ids) != 1:
            raise Failed(f"{len(ids)} containers of service {service}")
        return ids[0]

    def state(self, container: str) -> dict[str, Any]:
        """The container's State, and its RestartCount as ``restarts``."""
        inspected = json.loads(self.docker("inspect", "--format", "{{json .}}", container))
        return inspected["State"] | {"restarts": inspected["RestartCount"]}

    def logs(self, container: str) -> str:
        return run(["docker", "logs", container], COMMAND_SECONDS, env=self.env, what="docker logs")

    def failure_logs(self, services: list[str]) -> str:
        parts = []
        for service in services:
            try:
                parts.append(f"--- {service}:\n" + "\n".join(self.logs(self.container(service)).splitlines()[-15:]))
            except Failed as failure:
                parts.append(f"--- {service}: {failure.reason}")
        return "\n".join(parts)

    def start_server(self, service: str) -> str:
        """Start ``service``, wait until its image's healthcheck passes inside it and its published
        port answers a health check with mutual TLS from this host; its container id."""
        self.compose_run("up", "--detach", "--no-build", service)
        server = self.container(service)
        healthcheck = json.loads(self.docker("inspect", "--format", "{{json .Config.Healthcheck}}", server) or "null")
        if not healthcheck or healthcheck["Test"][0] != "CMD":
            raise Failed(f"{service} has no healthcheck of the form CMD ...")
        while True:
            state = self.state(server)
            if not state["Running"]:
                raise Failed(f"{service} exited with code {state['ExitCode']} before it was healthy",
                             self.failure_logs([service]))
            probe = subprocess.run(["docker", "exec", server, *healthcheck["Test"][1:]], env=self.env,
                                   capture_output=True, text=True, timeout=min(COMMAND_SECONDS, self.remaining()))
            if probe.returncode == 0:
                break
            if time.monotonic() > self.deadline:
                raise Failed(f"{service} not healthy by the phase's bound of {PHASE_SECONDS} s: its healthcheck "
                             f"{' '.join(healthcheck['Test'][1:])} says {(probe.stdout + probe.stderr).strip()!r}",
                             self.failure_logs([service]))
            time.sleep(1.0)
        port = self.docker("port", server, "50051/tcp").splitlines()[0]
        secrets = LOGS / "secrets"
        run([sys.executable, "-m", "fedpart", "health", "--server", port, "--ca", str(secrets / "ca.pem"),
             "--server-name", "server", "--cert", str(secrets / "process_0.pem"), "--key",
             str(secrets / "process_0.key")], COMMAND_SECONDS, what=f"fedpart health through {port}")
        return server

    def wait_for_exits(self, server_service: str) -> None:
        """Until the server and the clients exited 0; a nonzero exit or a restarted client fails at once."""
        services = [server_service, *CLIENT_SERVICES]
        containers = {service: self.container(service) for service in services}
        while True:
            states = {service: self.state(container) for service, container in containers.items()}
            for service, state in states.items():
                if state["restarts"]:
                    raise Failed(f"{service} failed and was restarted ({state['restarts']} restarts)",
                                 self.failure_logs(services))
                if state["Status"] == "exited" and state["ExitCode"] != 0:
                    raise Failed(f"{service} exited with code {state['ExitCode']}", self.failure_logs(services))
            if all(state["Status"] == "exited" for state in states.values()):
                return
            if time.monotonic() > self.deadline:
                running = [service for service, state in states.items() if state["Status"] != "exited"]
                raise Failed(f"{', '.join(running)} still running at the phase's bound of {PHASE_SECONDS} s",
                             self.failure_logs(services))
            time.sleep(1.0)

    def check_run(self, server_service: str) -> dict[str, Any]:
        """The finished run: a complete summary.json, TLS in the logs; its accuracies."""
        server = self.container(server_service)
        out = LOGS / server_service
        out.mkdir(exist_ok=True)
        for name in ("summary.json", "config.yaml"):
            self.docker("cp", f"{server}:/runs/quickstart/{name}", str(out / name))
        summary = json.loads((out / "summary.json").read_text())
        problems = summary_problems(summary, yaml.safe_load((out / "config.yaml").read_text())["rounds"])
        if problems:
            raise Failed(f"summary.json of {server_service}: {'; '.join(problems)}")
        server_log = self.logs(server)
        (out / "server.log").write_text(server_log)
        if "transport: mutual TLS" not in server_log:
            raise Failed(f"{server_service}'s log names no mutual TLS")
        for client in CLIENT_SERVICES:
            client_log = self.logs(self.container(client))
            (out / f"{client}.log").write_text(client_log)
            if "(TLS with a token and a client certificate)" not in client_log:
                raise Failed(f"{client}'s log does not name TLS with a token and a client certificate")
        return summary["accuracy"]

    def run_deployment(self) -> dict[str, Any]:
        self.start_server("server")
        self.compose_run("up", "--detach", "--no-build", *CLIENT_SERVICES)
        self.wait_for_exits("server")
        accuracy = self.check_run("server")
        self.compose_run("down", "--volumes", "--timeout", "10")
        return accuracy

    def run_killed_and_resumed(self) -> None:
        server = self.start_server("server")
        self.compose_run("up", "--detach", "--no-build", *CLIENT_SERVICES)
        follower = subprocess.Popen(["docker", "logs", "--follow", server], env=self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=pump, args=(follower.stdout, lines), daemon=True).start()
        reached = None
        try:
            while reached is None or reached[0] < KILL_ROUND:
                try:
                    line = lines.get(timeout=max(0.1, self.deadline - time.monotonic()))
                except queue.Empty:
                    raise Failed(f"no round {KILL_ROUND} by the phase's bound of {PHASE_SECONDS} s",
                                 self.failure_logs(["server", *CLIENT_SERVICES])) from None
                if line is None:
                    raise Failed(f"the server ended before round {KILL_ROUND}", self.failure_logs(["server"]))
                reached = round_reached(line) or reached
            self.docker("kill", server)
        finally:
            follower.terminate()
            follower.wait(timeout=COMMAND_SECONDS)
        last = max((r for r in map(round_reached, self.logs(server).splitlines()) if r), default=None)
        if last is None or last[0] >= last[1]:
            raise Failed(f"the run had ended when the server was killed (last round {last})")
        for client in CLIENT_SERVICES:
            if not self.state(self.container(client))["Running"]:
                raise Failed(f"{client} stopped when the server was killed", self.failure_logs([client]))
        self.notes.append(f"server killed after round {last[0]}/{last[1]}")
        self.start_server("server-resume")
        self.wait_for_exits("server-resume")
        resumed = self.check_run("server-resume")
        if "resuming run" not in self.logs(self.container("server-resume")):
            raise Failed("server-resume's log names no resumed run")
        if resumed != self.accuracy:
            raise Failed("the resumed run's accuracies differ from the uninterrupted run's",
                         f"resumed:       {json.dumps(resumed)}\nuninterrupted: {json.dumps(self.accuracy)}")
        self.notes.append(f"resumed run's accuracies equal the uninterrupted run's (global "
                          f"{resumed['global']['acc']:.4f}, initial {resumed['initial']['mean']:.4f})")
        self.compose_run("down", "--volumes", "--timeout", "10")
        self.compose_up = False

    # --------------------------------------------------------------------------------- teardown

    def teardown(self) -> list[str]:
        """Everything this run started, stopped by PID; the host as it was. Returns what could
        not be undone."""
        problems = []
        if self.compose_up:
            try:
                self.compose_run("down", "--volumes", "--timeout", "10")
            except Failed as failure:
                problems.append(f"compose down: {failure.reason}")
        if self.daemon is not None and self.daemon.poll() is None:
            try:  # the images this run replaced: the data root grows by what changed, not by every run
                self.docker("image", "prune", "--force")
            except Failed as failure:
                problems.append(f"image prune: {failure.reason}")
        for name, process in (("wheel index", self.index_server), ("dockerd", self.daemon)):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=STOP_SECONDS)
                    problems.append(f"{name} (PID {process.pid}) killed after {STOP_SECONDS} s")
        if self.host_before is not None:
            restore_host(self.host_before)
            problems += [f"host not restored: {difference}"
                         for difference in host_differences(self.host_before, host_state())]
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dockerfile", type=Path, default=REPO / "deploy" / "Dockerfile")
    parser.add_argument("--compose", type=Path, default=REPO / "deploy" / "docker-compose.yml")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("compose-e2e: FAILED: needs root (it installs packages and starts dockerd)", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True)
    e2e = ComposeE2E(args.dockerfile.resolve(), args.compose.resolve())
    started = time.monotonic()
    failure = None
    try:
        e2e.run_all()
    except Failed as error:
        failure = error
    except Exception as error:  # a bug here, or Docker answering in a way it does not expect
        failure = Failed(f"{type(error).__name__}: {error}", traceback.format_exc())
    finally:
        teardown = time.monotonic()
        problems = e2e.teardown()
        e2e.times.append(("teardown", time.monotonic() - teardown))
    for note in e2e.notes:
        print(f"compose-e2e: {note}", flush=True)
    print("compose-e2e: phases " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in e2e.times), flush=True)
    if problems:
        failure = Failed(f"{failure.reason + '; ' if failure else ''}teardown: {'; '.join(problems)}",
                         failure.details if failure else "")
    if failure:
        if failure.details:
            print(failure.details, flush=True)
        print(f"compose-e2e: FAILED in {time.monotonic() - started:.0f} s: {failure.reason} (logs in {LOGS})",
              flush=True)
        return 1
    print(f"compose-e2e: passed in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
