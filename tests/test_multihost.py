"""Server and clients on separate hosts: Linux network namespaces joined by a veth pair, each
with its own address, TLS and per-process tokens on. The run must finish and move the same
tensor bytes, with the same accuracies, as the same run on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WAIT, LineReader, read_metrics, read_summary, small_config, write_config
from fedpart.deploy.certs import write_run_credentials
from fedpart.common.wire.client_ids import split_clients


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class TwoHosts:
    """Namespaces ``server`` and ``clients`` on a /30 of their own."""

    def __init__(self) -> None:
        tag = f"fp{os.getpid() % 100000}"
        subnet = 16 + os.getpid() % 200
        self.server_ns, self.client_ns = f"{tag}s", f"{tag}c"
        self.server_ip, self.client_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self._made: list[str] = []
        try:
            for ns in (self.server_ns, self.client_ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"{tag}a", "netns", self.server_ns, "type", "veth", "peer", "name", f"{tag}b",
                "netns", self.client_ns)
            for ns, device, address in ((self.server_ns, f"{tag}a", self.server_ip),
                                        (self.client_ns, f"{tag}b", self.client_ip)):
                _ip("-n", ns, "addr", "add", f"{address}/30", "dev", device)
                _ip("-n", ns, "link", "set", device, "up")
        except (subprocess.CalledProcessError, OSError):
            self.close()
            raise

    def command(self, ns: str, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *args]

    def close(self) -> None:
        for ns in self._made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")
    try:
        made = TwoHosts()
    except (subprocess.CalledProcessError, OSError) as error:
        detail = getattr(error, "stderr", b"") or b""
        pytest.skip(f"network namespaces are not permitted here: {detail.decode(errors='replace').strip() or error}")
    yield made
    made.close()


def _run(processes, tmp_path: Path, name: str, config: Path, server_ip: str, wrap_server, wrap_client) -> Path:
    """Server on ``server_ip`` and two client processes, with fresh credentials for that address."""
    secrets = tmp_path / f"{name}-secrets"
    write_run_credentials(secrets, [server_ip], clients=4, processes=2)
    out = tmp_path / name
    cli = [sys.executable, "-m", "fedpart"]
    server = processes.start(wrap_server(cli + [
        "server", str(config), "--address", f"{server_ip}:0", "--out", str(out),
        "--tls-cert", str(secrets / "server.pem"), "--tls-key", str(secrets / "server.key"),
        "--credentials", str(secrets / "credentials.yaml")]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = LineReader(server)
    address = reader.wait_for(r"listening on (\S+:\d+)", timeout=WAIT).group(1)
    assert address.startswith(server_ip)
    reader.wait_for(r"transport: TLS, 2 authorized client processes", timeout=WAIT)
    clients = []
    for index, ids in enumerate(split_clients(4, 2)):
        clients.append(processes.start(wrap_client(cli + [
            "client", "--server", address, "--clients", ids, "--ca", str(secrets / "ca.pem"),
            "--token-file", str(secrets / f"process_{index}.token"), "--threads", "1",
            "--state-dir", str(out / "state" / f"process_{index}")]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 0, output
    for client in clients:
        assert client.wait(timeout=WAIT) == 0, client.stdout.read()
    return out


def test_run_across_namespaces_with_tls_matches_loopback(hosts, processes, tmp_path) -> None:
    config = write_config(tmp_path / "run.yaml", small_config(rounds=3))
    across = _run(processes, tmp_path, "across", config, hosts.server_ip,
                  lambda args: hosts.command(hosts.server_ns, args), lambda args: hosts.command(hosts.client_ns, args))
    loopback = _run(processes, tmp_path, "loopback", config, "127.0.0.1", lambda args: args, lambda args: args)

    rounds_across, rounds_loopback = read_metrics(across), read_metrics(loopback)
    assert len(rounds_across) == len(rounds_loopback) == 3
    for a, b in zip(rounds_across, rounds_loopback):
        for part in ("body", "head", "other"):
            assert a["bytes_by_part"][part] == b["bytes_by_part"][part], (a["round"], part)
        assert a["train_loss"] == b["train_loss"]
    summary_across, summary_loopback = read_summary(across), read_summary(loopback)
    assert summary_across["accuracy"] == summary_loopback["accuracy"]
    assert summary_across["bytes"]["by_part"]["body"] == summary_loopback["bytes"]["by_part"]["body"]
    assert summary_across["failures"] == []
