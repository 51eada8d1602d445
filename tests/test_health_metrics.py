"""What operators expect of a server: the standard gRPC health service (``grpc.health.v1``; a
check needs no token, and ``--health-port`` answers plaintext probes) and the optional Prometheus
endpoint (``--metrics-port``), read from the server's own state. Certificates and tokens are real
ones made by ``fedpart certs`` in each test."""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import WAIT, LineReader, fedpart_command, small_config, write_config
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.security import ClientSecurity, ServerSecurity, load_credentials
from fedpart.deploy.certs import write_run_credentials
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.transport.health import RUN_SERVICE
from fedpart.server.main import start_grpc

BOUND = 60.0


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    """A run's credentials: CA, server certificate for 127.0.0.1, two processes (clients 0-1, 2-3)."""
    out = tmp_path_factory.mktemp("secrets")
    write_run_credentials(out, ["127.0.0.1"], clients=4, processes=2)
    return out


def _security(secrets: Path, process: int | None = None, token: bool = False) -> ClientSecurity:
    """Trusts the run's CA; with ``process`` presents its client certificate (and its token)."""
    files = {} if process is None else {"certificate": (secrets / f"process_{process}.pem").read_bytes(),
                                        "private_key": (secrets / f"process_{process}.key").read_bytes()}
    return ClientSecurity(ca=(secrets / "ca.pem").read_bytes(), **files,
                          token=(secrets / f"process_{process}.token").read_text().strip() if token else None)


def _check(address: str, security: ClientSecurity, service: str = "") -> str:
    with security.channel(address, options=[]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=BOUND)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value.code()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls-tokens", "mutual-tls"])
def test_health_checks_need_no_token_and_follow_the_run(secrets: Path, mutual: bool) -> None:
    """The server's own status ("") and the run's: SERVING from the start; the run NOT_SERVING
    once it ended while the server still answers; after the stop nothing answers. A check needs no
    token (a Join without one is still refused); with mutual TLS the TLS port still needs a client
    certificate, the plaintext health port does not. Watch (a stream held open) is not served."""
    security = ServerSecurity(certificate=(secrets / "server.pem").read_bytes(),
                              private_key=(secrets / "server.key").read_bytes(),
                              client_ca=(secrets / "ca.pem").read_bytes() if mutual else None,
                              principals=load_credentials(secrets / "credentials.yaml"))
    coordinator = Coordinator(config_from_dict(small_config(clients=4)), log=lambda _: None)
    server = start_grpc(coordinator, "127.0.0.1:0", security, health_port=0)
    probe = ClientSecurity(insecure=True)
    caller = _security(secrets, process=0 if mutual else None)  # no token
    try:
        observed = {}
        for where, address, credentials in (("tls", server.address, caller), ("plaintext", server.health_address, probe)):
            observed[where] = (_check(address, credentials), _check(address, credentials, RUN_SERVICE))
            assert _code(lambda: _check(address, credentials, "no.such.Service")) == grpc.StatusCode.NOT_FOUND
        assert observed == {"tls": ("SERVING", "SERVING"), "plaintext": ("SERVING", "SERVING")}

        with caller.channel(server.address, options=[]) as channel:
            join = pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name="p", clients=[pb.HostedClient(id=0)])
            if not mutual:
                assert _code(lambda: pb_grpc.CoordinatorStub(channel).Join(join, timeout=BOUND)) == \
                    grpc.StatusCode.UNAUTHENTICATED
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=BOUND)
            assert _code(lambda: next(watch)) == grpc.StatusCode.UNIMPLEMENTED
        if mutual:  # the handshake wants a client certificate before any call
            assert _code(lambda: _check(server.address, _security(secrets))) == grpc.StatusCode.UNAVAILABLE

        server.run_ended()
        assert (_check(server.health_address, probe), _check(server.health_address, probe, RUN_SERVICE)) == \
            ("SERVING", "NOT_SERVING")
        assert _check(server.address, caller, RUN_SERVICE) == "NOT_SERVING"
    finally:
        server.stop(0)
    assert _code(lambda: _check(server.health_address, probe)) == grpc.StatusCode.UNAVAILABLE


def _scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of a Prometheus text exposition."""
    with urllib.request.urlopen(url, timeout=BOUND) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_a_server_with_tls_tokens_health_and_metrics_ports_through_a_run(secrets: Path, tmp_path: Path,
                                                                          processes) -> None:
    """``fedpart server`` with TLS, tokens, --health-port and --metrics-port: ``fedpart health``
    answers SERVING on both ports without a token; after round 1 the metrics on 127.0.0.1 count
    the rounds, the results folded, the connected processes and the bytes by direction and part,
    as metrics.jsonl has them."""
    config = small_config(rounds=40, server={"round_timeout": 120, "join_timeout": 120, "heartbeat_timeout": 30})
    out = tmp_path / "out"
    server = processes.start(
        fedpart_command("server", str(write_config(tmp_path / "config.yaml", config)), "--address", "127.0.0.1:0",
                        "--out", str(out), "--tls-cert", str(secrets / "server.pem"),
                        "--tls-key", str(secrets / "server.key"), "--credentials", str(secrets / "credentials.yaml"),
                        "--health-port", "0", "--metrics-port", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = LineReader(server)
    address = reader.wait_for(r"listening on (\S+:\d+)", timeout=WAIT).group(1)
    health_address = reader.wait_for(r"health checks \(grpc.health.v1 Check, plaintext\) on (\S+:\d+)",
                                     timeout=WAIT).group(1)
    metrics_url = reader.wait_for(r"Prometheus metrics on (http://127\.0\.0\.1:\d+/metrics)", timeout=WAIT).group(1)

    for target in ([address, "--ca", str(secrets / "ca.pem")], [health_address, "--insecure"]):
        for service in ("", RUN_SERVICE):
            result = subprocess.run(fedpart_command("health", "--server", *target, "--service", service),
                                    capture_output=True, text=True, timeout=WAIT)
            assert (result.returncode, result.stdout) == (0, "SERVING\n"), (target, result.stderr)

    joining = _scrape(metrics_url)
    assert joining['fedpart_stage{stage="joining"}'] == 1 and joining["fedpart_rounds_completed"] == 0
    assert joining["fedpart_clients"] == 4 and joining["fedpart_rounds"] == 40

    for process, ids in enumerate(("0-1", "2-3")):
        processes.start(fedpart_command("client", "--server", address, "--clients", ids, "--threads", "1",
                                        "--ca", str(secrets / "ca.pem"),
                                        "--token-file", str(secrets / f"process_{process}.token"),
                                        "--state-dir", str(tmp_path / f"state_{process}")),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reader.wait_for(r"round\s+1/40", timeout=WAIT)
    metrics = _scrape(metrics_url)
    rounds = metrics["fedpart_rounds_completed"]
    assert 1 <= rounds < 40
    assert metrics["fedpart_results_folded_total"] == metrics["fedpart_results_sampled_total"] == 4 * rounds
    assert metrics["fedpart_connected_processes"] == 2 and metrics["fedpart_ready_clients"] == 4
    assert metrics['fedpart_stage{stage="training"}'] == 1 and metrics["fedpart_run_ended"] == 0
    assert metrics["fedpart_last_round_seconds"] > 0 and metrics["fedpart_round_seconds_total"] > 0
    assert metrics["fedpart_failures"] == 0 and metrics["fedpart_refused_result_bytes_total"] == 0
    assert metrics['fedpart_results_robust_total{action="rejected"}'] == 0
    assert metrics['fedpart_delivery_total{kind="streams_cut"}'] == 0  # a clean network
    assert metrics['fedpart_delivery_total{kind="tasks_sent_again"}'] == 0
    for direction in ("down", "up"):
        assert metrics[f'fedpart_bytes_total{{direction="{direction}",part="body"}}'] > 0
        assert metrics[f'fedpart_bytes_total{{direction="{direction}",part="control"}}'] > 0
    run_info = [name for name in metrics if name.startswith("fedpart_run_info")]
    assert len(run_info) == 1 and re.search(r'algorithm="fedavg"', run_info[0]), run_info
    assert metrics["process_resident_memory_bytes"] > 0

    server.send_signal(signal.SIGINT)
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 130, output


def test_health_of_a_server_that_is_not_there_exits_4(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    result = subprocess.run(fedpart_command("health", "--insecure", "--server", address, "--timeout", "2"),
                            capture_output=True, text=True, timeout=WAIT)
    assert result.returncode == 4 and result.stdout == ""
    assert re.fullmatch(rf"fedpart health: error: no answer from {address} within 2 s \(UNAVAILABLE: .+\)\n",
                        result.stderr), result.stderr
