"""A TCP relay that injects connection faults and counts the bytes it forwards.

Tests and benchmarks put it between fedpart client processes and the server to show that a run
which suffers connection faults ends with the same model. It forwards raw TCP bytes (gRPC, TLS or
anything else) between each accepted connection and a fresh connection to the target, both ways,
byte for byte, and half-closes each direction when its sender does. A :class:`FaultPlan` chooses:

- **reset**: connection ``i`` is cut after ``fault_offset(i)`` bytes relayed, counting both
  directions together, drawn uniformly from ``reset_bytes`` with the plan's seed (the same seed
  gives the same offsets). The relay forwards exactly that many bytes, then closes both sockets
  with ``SO_LINGER {1, 0}``: each peer gets a TCP RST, and whatever was still in flight is lost.
- **reset in the traffic**: ``reset_at`` lists offsets in the relay's whole traffic (every
  connection, both directions, together); the connection that relays byte ``X`` of it is reset
  right after that byte, as above. Offsets spread over a run's expected traffic cut connections
  wherever its bytes flow at the time (a task stream, a result upload, an evaluation), whereas
  offsets per connection mostly cut long-lived connections early in their life.
- **black hole**: after ``blackhole_bytes`` bytes the relay forwards nothing more, in either
  direction, and closes neither socket: it keeps reading and discarding, so neither sender ever
  blocks on a full buffer. The relay's kernel still acknowledges every segment (TCP keepalive
  probes included), so only application keepalives (gRPC's HTTP/2 PINGs) can detect it. The
  sockets are released when both peers have closed theirs, or when the relay stops.
- **cuts**: at most this many connections over the relay's lifetime are reset or black-holed
  (all of them when None); later ones pass intact, so a faulted run can still complete.
- **delay**: each chunk is delivered ``delay_ms`` (plus or minus up to ``jitter_ms``, never
  below 0) after the relay read it, in order: a pipeline, so latency is added, not a throughput cap.

Bounds: at most ``max_connections`` connections at once (one more is reset when accepted); the
target must accept within ``connect_timeout`` seconds, or the client's connection is reset at
once; at most ``QUEUE_CHUNKS`` chunks of ``CHUNK_BYTES`` wait for delivery per direction; stopping
the relay closes every connection. Use :class:`Relay` on a running event loop, :class:`RelayThread`
from synchronous code (its own loop on a thread), or the command line::

    python -m lab.relay --listen 127.0.0.1:0 --target 127.0.0.1:50051 \\
        --reset-bytes 300000-3000000 --cuts 9 --seed 1

which prints ``relay listening on HOST:PORT`` once ready, and its counts as one JSON line when
stopped by SIGTERM or SIGINT (exit 0). ``--reset-at 5000000,90000000`` resets in the traffic instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import struct
import sys
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from fedpart.common.process.exit_codes import ExitCode
from fedpart.common.process.limits import raise_open_file_limit

CHUNK_BYTES = 65536
QUEUE_CHUNKS = 16
CLOSE_TIMEOUT = 5.0  # a graceful close waits this long for the peer to take the last bytes
THREAD_TIMEOUT = 30.0  # RelayThread waits this long for the loop to start or stop the relay

Address = tuple[str, int]


@dataclass(frozen=True)
class FaultPlan:
    """What the relay does to the connections it forwards (the module docstring has the details)."""

    reset_bytes: tuple[int, int] | None = None  # [low, high] bytes, both directions, then a RST
    reset_at: tuple[int, ...] = ()  # offsets in the relay's whole traffic: the connection relaying each is reset
    blackhole_bytes: int | None = None  # bytes, both directions, then silence without a close
    cuts: int | None = None  # connections reset or black-holed at most; None: every connection
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    seed: int = 0
    max_connections: int = 1024
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.reset_bytes is not None:
            low, high = self.reset_bytes
            if not 0 <= low <= high:
                raise ValueError(f"reset_bytes must be 0 <= low <= high, got {low}-{high}")
            if self.blackhole_bytes is not None:
                raise ValueError("a plan either resets or black-holes connections, not both")
        if self.reset_at:
            if min(self.reset_at) < 0:
                raise ValueError(f"reset_at offsets must be >= 0, got {min(self.reset_at)}")
            if self.reset_bytes is not None or self.blackhole_bytes is not None:
                raise ValueError("a plan resets at offsets in the traffic or per connection, not both")
        if self.blackhole_bytes is not None and self.blackhole_bytes < 0:
            raise ValueError(f"blackhole_bytes must be >= 0, got {self.blackhole_bytes}")
        if self.cuts is not None and self.cuts < 0:
            raise ValueError(f"cuts must be >= 0, got {self.cuts}")
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"delay_ms and jitter_ms must be >= 0, got {self.delay_ms} and {self.jitter_ms}")
        if self.max_connections < 1 or self.connect_timeout <= 0:
            raise ValueError("max_connections must be >= 1 and connect_timeout > 0")

    def fault_offset(self, index: int) -> int | None:
        """Bytes after which relayed connection ``index`` (0-based, in the order the relay opened
        them to the target) is reset or black-holed; None when the plan has no fault."""
        if self.reset_bytes is not None:
            return random.Random(f"{self.seed}/{index}").randint(*self.reset_bytes)
        return self.blackhole_bytes


@dataclass
class RelayCounts:
    """What the relay did; ``up`` is client to target, ``down`` target to client (bytes forwarded)."""

    accepted: int = 0  # connections accepted from clients
    relayed: int = 0  # of those, connected to the target
    refused: int = 0  # the target refused or did not answer in time: the client was reset
    rejected: int = 0  # over max_connections: the client was reset
    open: int = 0  # relayed connections not yet closed
    resets: int = 0
    black_holes: int = 0
    up: int = 0
    down: int = 0
    discarded: int = 0  # bytes read from black-holed connections and dropped
    cut_offsets: list[int] = field(default_factory=list)  # bytes relayed by each reset connection
    cut_totals: list[int] = field(default_factory=list)  # the relay's whole traffic (up + down) at each reset

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class _ConnectionCut(Exception):
    """A reset fault fired: both sockets of the connection are already reset."""


@dataclass
class _Connection:
    index: int
    client: asyncio.StreamWriter
    target: asyncio.StreamWriter
    until_fault: int | None  # bytes still to relay before the fault; None: relayed intact
    jitter: random.Random
    relayed: int = 0
    black_holed: bool = False


def _arm_reset(writer: asyncio.StreamWriter) -> None:
    """Make closing this socket send a TCP RST (``SO_LINGER {1, 0}``) instead of a FIN."""
    if not writer.transport.is_closing():
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                             struct.pack("ii", 1, 0))


async def _close(writer: asyncio.StreamWriter, how: str) -> None:
    """Close one socket: ``close`` (FIN after the buffered bytes), ``abort`` (at once) or
    ``reset`` (at once, with a RST); wait until it is closed, ``CLOSE_TIMEOUT`` at most."""
    if how == "reset":
        _arm_reset(writer)
    if how == "close":
        writer.close()
    else:
        writer.transport.abort()
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        writer.transport.abort()


class Relay:
    """The relay on the running event loop: ``await start()``, then ``await stop()``."""

    def __init__(self, target: Address, plan: FaultPlan | None = None, listen: Address = ("127.0.0.1", 0)) -> None:
        self.target = target
        self.plan = plan or FaultPlan()
        self.listen = listen
        self.address: Address | None = None
        self._counts = RelayCounts()
        self._faults = 0
        self._traffic_offsets = deque(sorted(self.plan.reset_at))  # those of reset_at not yet reached
        self._tasks: set[asyncio.Task] = set()  # one a connection
        self._server: asyncio.Server | None = None

    async def start(self) -> Address:
        """Listen; returns the bound address (port 0 in ``listen`` picks a free one)."""
        self._server = await asyncio.start_server(self._accept, *self.listen)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self.address

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._server is None:
            return
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def counts(self) -> RelayCounts:
        """A copy of the counts (call it on the relay's loop)."""
        return replace(self._counts, cut_offsets=list(self._counts.cut_offsets),
                       cut_totals=list(self._counts.cut_totals))

    def _fault_allowed(self) -> bool:
        return self.plan.cuts is None or self._faults < self.plan.cuts

    def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        """A new client connection: relay it on a task of our own, or reset it when over the bound."""
        self._counts.accepted += 1
        if len(self._tasks) >= self.plan.max_connections:
            self._counts.rejected += 1
            task = asyncio.create_task(_close(client_writer, "reset"))
        else:
            task = asyncio.create_task(self._relay(client_reader, client_writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), self.plan.connect_timeout)
        except (OSError, asyncio.TimeoutError):
            self._counts.refused += 1
            await _close(client_writer, "reset")
            return
        except asyncio.CancelledError:
            await _close(client_writer, "abort")
            raise
        counts = self._counts
        index = counts.relayed
        counts.relayed += 1
        counts.open += 1
        offset = self.plan.fault_offset(index) if self._fault_allowed() else None
        connection = _Connection(index, client_writer, target_writer, offset,
                                 random.Random(f"{self.plan.seed}/{index}/delay"))
        try:
            await self._forward(connection, client_reader, target_reader)
        finally:
            counts.open -= 1

    async def _forward(self, connection: _Connection, client_reader: asyncio.StreamReader,
                       target_reader: asyncio.StreamReader) -> None:
        """Both directions until both have ended (closed gracefully), a side failed (the other
        is reset, as a peer's reset would travel), a reset fault fired, or the relay stops."""
        up: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
        down: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
        tasks = [asyncio.create_task(self._read(connection, client_reader, up)),
                 asyncio.create_task(self._write(connection, up, connection.target, "up")),
                 asyncio.create_task(self._read(connection, target_reader, down)),
                 asyncio.create_task(self._write(connection, down, connection.client, "down"))]
        how = "abort"
        try:
            if connection.until_fault == 0:
                self._fire(connection)
            await asyncio.gather(*tasks)
            how = "close"
        except (_ConnectionCut, OSError):
            how = "reset"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(_close(connection.client, how), _close(connection.target, how))

    async def _read(self, connection: _Connection, reader: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                if connection.black_holed:
                    self._counts.discarded += len(chunk)
                    continue
                await queue.put((loop.time() + self._latency(connection), chunk))
        except OSError:
            if not connection.black_holed:
                raise
        await queue.put(None)

    def _latency(self, connection: _Connection) -> float:
        plan = self.plan
        if not plan.delay_ms and not plan.jitter_ms:
            return 0.0
        jitter = connection.jitter.uniform(-plan.jitter_ms, plan.jitter_ms) if plan.jitter_ms else 0.0
        return max(0.0, plan.delay_ms + jitter) / 1000

    async def _write(self, connection: _Connection, queue: asyncio.Queue, writer: asyncio.StreamWriter,
                     direction: str) -> None:
        loop = asyncio.get_running_loop()
        while (item := await queue.get()) is not None:
            due, chunk = item
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if connection.until_fault is not None and not self._fault_allowed():
                connection.until_fault = None
            if connection.black_holed:
                self._counts.discarded += len(chunk)
                continue
            take = len(chunk) if connection.until_fault is None else min(len(chunk), connection.until_fault)
            traffic_cut = self._traffic_cut(take)
            if traffic_cut is not None:
                take = traffic_cut
            writer.write(chunk[:take])
            connection.relayed += take
            if direction == "up":
                self._counts.up += take
            else:
                self._counts.down += take
            fire = traffic_cut is not None
            if connection.until_fault is not None:
                connection.until_fault -= take
                fire = fire or connection.until_fault == 0
            if fire:
                self._counts.discarded += len(chunk) - take
                self._fire(connection)
            await writer.drain()
        if not connection.black_holed and writer.can_write_eof():
            writer.write_eof()

    def _traffic_cut(self, size: int) -> int | None:
        """Bytes of a ``size``-byte write after which the relay's whole traffic reaches the next
        offset of ``reset_at`` (0 when it has passed it already); None when the write stays short
        of it, or no more cuts are allowed. Reaching it takes the offset off the list."""
        if not self._traffic_offsets or not self._fault_allowed():
            return None
        to_offset = self._traffic_offsets[0] - self._counts.up - self._counts.down
        if to_offset > size:
            return None
        self._traffic_offsets.popleft()
        return max(0, to_offset)

    def _fire(self, connection: _Connection) -> None:
        """The fault of ``connection``: a reset (both sockets reset; raises) or a black hole."""
        connection.until_fault = None
        self._faults += 1
        if self.plan.blackhole_bytes is not None:
            connection.black_holed = True
            self._counts.black_holes += 1
            return
        self._counts.resets += 1
        self._counts.cut_offsets.append(connection.relayed)
        self._counts.cut_totals.append(self._counts.up + self._counts.down)
        for writer in (connection.client, connection.target):
            _arm_reset(writer)
            writer.transport.abort()
        raise _ConnectionCut


class RelayThread:
    """A :class:`Relay` on its own event loop in a background thread, for synchronous code::

        with RelayThread(("127.0.0.1", port), FaultPlan(reset_bytes=(300_000, 3_000_000), cuts=9)) as relay:
            host, port = relay.address
            ...
            print(relay.counts().to_json())
    """

    def __init__(self, target: Address, plan: FaultPlan | None = None, listen: Address = ("127.0.0.1", 0)) -> None:
        self.relay = Relay(target, plan, listen)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> Address:
        assert self.relay.address is not None, "the relay has not started"
        return self.relay.address

    def start(self) -> Address:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fedpart-relay", daemon=True)
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self.relay.start(), self._loop).result(THREAD_TIMEOUT)
        except BaseException:
            self._shut_loop()
            raise

    def stop(self) -> None:
        """Close every connection and the loop; the counts stay readable."""
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.relay.stop(), self._loop).result(THREAD_TIMEOUT)
        finally:
            self._shut_loop()

    def _shut_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(THREAD_TIMEOUT)
        self._loop.close()
        self._loop = None

    def counts(self) -> RelayCounts:
        if self._loop is None:
            return self.relay.counts()
        return asyncio.run_coroutine_threadsafe(self._counts(), self._loop).result(THREAD_TIMEOUT)

    async def _counts(self) -> RelayCounts:
        return self.relay.counts()

    def __enter__(self) -> RelayThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def parse_address(text: str) -> Address:
    """``HOST:PORT`` (``[IPv6]:PORT``) as a (host, port) pair."""
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def format_address(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_offsets(text: str) -> tuple[int, ...]:
    """``N,N,...`` byte offsets."""
    parts = text.split(",")
    if not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated byte offsets, got {text!r}")
    return tuple(int(part) for part in parts)


def parse_byte_range(text: str) -> tuple[int, int]:
    """``LOW-HIGH`` or ``N`` (always N) bytes."""
    low, _, high = text.partition("-")
    if not low.isdigit() or not (high or low).isdigit():
        raise argparse.ArgumentTypeError(f"expected BYTES or LOW-HIGH bytes, got {text!r}")
    return int(low), int(high or low)


async def _serve(relay: Relay) -> int:
    try:
        host, port = await relay.start()
    except OSError as error:
        print(f"relay: cannot listen on {format_address(relay.listen)}: {error}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"relay listening on {format_address((host, port))} -> {format_address(relay.target)}", flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stopped.set)
    await stopped.wait()
    await relay.stop()
    print(relay.counts().to_json(), flush=True)
    return ExitCode.COMPLETED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=parse_address, default=("127.0.0.1", 0), help="HOST:PORT (port 0: a free one)")
    parser.add_argument("--target", type=parse_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--reset-bytes", type=parse_byte_range, help="reset each connection after LOW-HIGH bytes")
    parser.add_argument("--reset-at", type=parse_offsets, default=(),
                        help="reset the connection that relays each of these bytes of the whole traffic, "
                             "e.g. 5000000,9000000")
    parser.add_argument("--blackhole-bytes", type=int, help="stop forwarding after N bytes, closing nothing")
    parser.add_argument("--cuts", type=int, help="connections faulted at most (default: every one)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="latency added to each chunk, one way")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter around --delay-ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-connections", type=int, default=FaultPlan.max_connections)
    parser.add_argument("--connect-timeout", type=float, default=FaultPlan.connect_timeout, help="seconds")
    args = parser.parse_args(argv)
    try:
        plan = FaultPlan(reset_bytes=args.reset_bytes, reset_at=args.reset_at, blackhole_bytes=args.blackhole_bytes,
                         cuts=args.cuts, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, seed=args.seed,
                         max_connections=args.max_connections, connect_timeout=args.connect_timeout)
    except ValueError as error:
        parser.error(str(error))
    raise_open_file_limit()  # two sockets a relayed connection
    return asyncio.run(_serve(Relay(args.target, plan, args.listen)))


if __name__ == "__main__":
    sys.exit(main())
