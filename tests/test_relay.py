"""The fault-injection relay (lab.relay): real TCP between real sockets on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import WAIT, LineReader, child_env
from lab.relay import FaultPlan, RelayThread, main

TIMEOUT = 30.0  # bound of a single socket wait; a wait ends as soon as its event happens
SILENCE = 1.5  # how long a black-holed peer must see neither data nor a close


def _payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


class _Target:
    """A TCP server on 127.0.0.1 that echoes each connection (or only reads it) and records, per
    connection, the bytes it received and how the connection ended."""

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.events: queue.Queue = queue.Queue()  # ("data", n) and then ("end", "eof" | "reset")
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                while data := connection.recv(65536):
                    self.events.put(("data", len(data)))
                    if self.echo:
                        connection.sendall(data)
                connection.shutdown(socket.SHUT_WR)
                self.events.put(("end", "eof"))
            except ConnectionResetError:
                self.events.put(("end", "reset"))

    def wait_end(self) -> tuple[int, str]:
        """Bytes received by the next connection to end, and how it ended."""
        received = 0
        while True:
            kind, value = self.events.get(timeout=TIMEOUT)
            if kind == "end":
                return received, value
            received += value

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def echo():
    target = _Target()
    yield target
    target.close()


@pytest.fixture
def sink():
    target = _Target(echo=False)
    yield target
    target.close()


def _exchange(address: tuple[str, int], payload: bytes) -> tuple[bytes, bool]:
    """Send ``payload`` (then a FIN) while reading until the end: (bytes received, was reset).
    The kernel reports a reset to one call only: ``connect`` (the relay may reset a connection
    it has just accepted), the sender's, or the reader's; any of them counts."""
    received = bytearray()
    sender_reset = threading.Event()
    try:
        connection = socket.create_connection(address, timeout=TIMEOUT)
    except ConnectionResetError:
        return b"", True
    with connection:
        def send() -> None:
            try:
                connection.sendall(payload)
                connection.shutdown(socket.SHUT_WR)
            except ConnectionResetError:
                sender_reset.set()
            except OSError:
                pass  # EPIPE once the reset was reported to the reader

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            while data := connection.recv(65536):
                received += data
        except ConnectionResetError:
            return bytes(received), True
        finally:
            sender.join(TIMEOUT)
    return bytes(received), sender_reset.is_set()


def _wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"not within {TIMEOUT} s: {what}"
        time.sleep(0.02)


def _drained_events(target: _Target) -> list[tuple[str, int]]:
    """The events ``target`` recorded so far, all of them ``data`` events."""
    events = []
    while not target.events.empty():
        events.append(target.events.get_nowait())
    assert all(kind == "data" for kind, _ in events), events
    return events


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_bytes_pass_intact_both_ways_and_are_counted(echo) -> None:
    payload = _payload(5_000_000)
    with RelayThread(echo.address) as relay:
        received, reset = _exchange(relay.address, payload)
        _wait_until(lambda: relay.counts().open == 0, "the connection closed")
        counts = relay.counts()
    assert not reset
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
    assert (counts.up, counts.down, counts.accepted, counts.relayed) == (5_000_000, 5_000_000, 1, 1)
    assert (counts.resets, counts.black_holes, counts.discarded) == (0, 0, 0)
    assert json.loads(counts.to_json())["up"] == 5_000_000


def test_a_reset_after_n_bytes_reaches_both_peers_and_is_counted(sink) -> None:
    with RelayThread(sink.address, FaultPlan(reset_bytes=(100_000, 100_000))) as relay:
        received, reset = _exchange(relay.address, _payload(1_000_000))
        target_received, target_end = sink.wait_end()
        counts = relay.counts()
    assert reset and received == b""
    assert target_end == "reset" and target_received <= 100_000
    assert (counts.resets, counts.cut_offsets, counts.up, counts.down) == (1, [100_000], 100_000, 0)


def test_cuts_bound_the_connections_reset_and_later_ones_pass_intact(echo) -> None:
    plan = FaultPlan(reset_bytes=(1_000, 5_000), cuts=2, seed=3)
    payload = _payload(50_000)
    with RelayThread(echo.address, plan) as relay:
        outcomes = [_exchange(relay.address, payload) for _ in range(4)]
        counts = relay.counts()
    assert [reset for _, reset in outcomes] == [True, True, False, False]
    assert all(received == payload for received, _ in outcomes[2:])
    assert counts.resets == 2 and counts.relayed == 4
    assert counts.cut_offsets == [plan.fault_offset(0), plan.fault_offset(1)]
    assert all(1_000 <= offset <= 5_000 for offset in counts.cut_offsets)


def test_the_same_seed_cuts_at_the_same_offsets(sink) -> None:
    def offsets(seed: int) -> list[int]:
        with RelayThread(sink.address, FaultPlan(reset_bytes=(1_000, 100_000), seed=seed)) as relay:
            for _ in range(3):
                assert _exchange(relay.address, _payload(200_000))[1]
            return relay.counts().cut_offsets

    first = offsets(7)
    assert first == offsets(7) == [FaultPlan(reset_bytes=(1_000, 100_000), seed=7).fault_offset(i) for i in range(3)]
    assert offsets(8) != first


def test_resets_in_the_traffic_cut_whichever_connection_relays_each_offset(echo) -> None:
    payload = _payload(50_000)  # 100,000 bytes of traffic a connection, echoed
    with RelayThread(echo.address, FaultPlan(reset_at=(200_000, 30_000))) as relay:
        outcomes = [_exchange(relay.address, payload) for _ in range(4)]
        counts = relay.counts()
    assert [reset for _, reset in outcomes] == [True, False, True, False]
    assert all(received == payload for received, _ in outcomes[1::2])
    # the first connection is cut at byte 30,000 of the traffic; the second passes (30,000 to
    # 130,000); the third relays 70,000 more bytes and is cut at byte 200,000
    assert counts.cut_totals == [30_000, 200_000] and counts.cut_offsets == [30_000, 70_000]
    assert (counts.resets, counts.relayed, counts.up + counts.down) == (2, 4, 300_000)


def test_delay_adds_latency_each_way_without_capping_throughput(echo) -> None:
    with RelayThread(echo.address, FaultPlan(delay_ms=150)) as relay:
        started = time.monotonic()
        received, _ = _exchange(relay.address, b"ping")
        round_trip = time.monotonic() - started
    assert received == b"ping" and round_trip >= 0.3
    payload = _payload(2_000_000, seed=1)
    with RelayThread(echo.address, FaultPlan(delay_ms=500, jitter_ms=400, seed=1)) as relay:
        started = time.monotonic()
        received, _ = _exchange(relay.address, payload)
        elapsed = time.monotonic() - started
    assert received == payload  # jittered chunks keep their order
    assert elapsed < 15  # a chunk at a time would take at least 2 x 31 chunks x 0.1 s


def test_a_black_hole_forwards_nothing_and_closes_nothing_until_the_relay_stops(echo) -> None:
    relay = RelayThread(echo.address, FaultPlan(blackhole_bytes=1_000))
    relay.start()
    try:
        client = socket.create_connection(relay.address, timeout=TIMEOUT)
        client.sendall(b"a" * 600)
        echoed = b""
        while len(echoed) < 400:
            echoed += client.recv(65536)
        assert echoed == b"a" * 400  # 600 up and 400 of the echo: 1,000 bytes relayed
        client.sendall(b"b" * 1_000)
        client.settimeout(SILENCE)
        with pytest.raises(socket.timeout):
            client.recv(65536)  # neither data nor a close
        _wait_until(lambda: relay.counts().discarded == 1_200, "the relay read and dropped 200 + 1,000 bytes")
        assert sum(value for _, value in _drained_events(echo)) == 600  # the target got nothing more, no close
        counts = relay.counts()
        assert (counts.black_holes, counts.open, counts.up, counts.down) == (1, 1, 600, 400)
    finally:
        relay.stop()
    client.settimeout(TIMEOUT)
    assert client.recv(65536) == b""  # stopping the relay closes both sides
    assert echo.wait_end() == (0, "eof")
    client.close()


def test_a_target_that_refuses_and_connections_over_the_bound_are_reset_at_once(echo) -> None:
    with RelayThread(("127.0.0.1", _free_port())) as relay:
        assert _exchange(relay.address, b"x") == (b"", True)
        assert relay.counts().refused == 1
    with RelayThread(echo.address, FaultPlan(max_connections=1)) as relay:
        with socket.create_connection(relay.address, timeout=TIMEOUT) as first:
            first.sendall(b"x")
            assert first.recv(1) == b"x"
            assert _exchange(relay.address, b"y") == (b"", True)
            counts = relay.counts()
            assert (counts.accepted, counts.relayed, counts.rejected) == (2, 1, 1)


def test_bad_plans_are_refused() -> None:
    for bad in (dict(reset_bytes=(5, 1)), dict(reset_bytes=(1, 5), blackhole_bytes=3), dict(cuts=-1),
                dict(delay_ms=-1), dict(max_connections=0), dict(connect_timeout=0), dict(reset_at=(5, -1)),
                dict(reset_at=(5,), reset_bytes=(1, 2)), dict(reset_at=(5,), blackhole_bytes=3)):
        with pytest.raises(ValueError):
            FaultPlan(**bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "127.0.0.1:1", "--reset-bytes", "10-x"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "127.0.0.1:1", "--reset-at", "10,x"])
    assert exit_info.value.code == 2


def test_the_command_prints_its_address_relays_and_reports_counts_on_sigterm(echo) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "lab.relay", "--listen", "127.0.0.1:0",
         "--target", f"127.0.0.1:{echo.address[1]}", "--reset-bytes", "1000-2000", "--cuts", "1", "--seed", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    try:
        reader = LineReader(process)
        port = int(reader.wait_for(r"relay listening on 127\.0\.0\.1:(\d+) -> ", timeout=WAIT).group(1))
        assert _exchange(("127.0.0.1", port), _payload(10_000))[1]
        payload = _payload(300_000)
        assert _exchange(("127.0.0.1", port), payload) == (payload, False)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT) == 0
        counts = json.loads(reader.rest(timeout=WAIT).splitlines()[-1])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT)
        process.stdout.close()
    assert counts["resets"] == 1 and counts["relayed"] == 2 and counts["open"] == 0
    assert 1_000 <= counts["cut_offsets"][0] <= 2_000
    assert counts["up"] + counts["down"] == counts["cut_offsets"][0] + 2 * 300_000


def test_a_reset_surfaces_as_unavailable_to_a_grpc_call_and_the_next_connection_succeeds() -> None:
    response = _payload(1_000_000, seed=2)
    handler = grpc.method_handlers_generic_handler(
        "test.Relay", {"Fetch": grpc.unary_unary_rpc_method_handler(lambda request, context: response)})
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RelayThread(("127.0.0.1", port), FaultPlan(reset_bytes=(200_000, 200_000), cuts=1)) as relay:
            target = f"127.0.0.1:{relay.address[1]}"
            # each channel with a subchannel of its own: gRPC shares one connection between the
            # channels of a process by default, so the second could start its call on the reset
            # socket before it noticed the reset ("Stream removed (sendmsg: Broken pipe)")
            own = [("grpc.use_local_subchannel_pool", 1)]
            with grpc.insecure_channel(target, options=own) as channel:
                with pytest.raises(grpc.RpcError) as error:
                    channel.unary_unary("/test.Relay/Fetch")(b"", timeout=TIMEOUT)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            with grpc.insecure_channel(target, options=own) as channel:
                assert channel.unary_unary("/test.Relay/Fetch")(b"", timeout=TIMEOUT, wait_for_ready=True) == response
            counts = relay.counts()
    finally:
        server.stop(grace=None)
    assert counts.resets == 1 and counts.cut_offsets == [200_000] and counts.relayed == 2
