"""CPU that moving a training result's bytes over mutual TLS costs the receiver and the sender, by
transport, measured side by side in one run beside the same transfers without TLS.

Workload: ``--senders`` processes (default 2, as round_overhead's 2 client processes) each upload
``--bytes`` (default 2,328,104: one ``cnn2`` result, 582,026 float32 parameters) ``--rate`` times a
second (default 1.72: round_overhead's 10 results a round of about 2.9 s from 2 processes) to one
receiver process on 127.0.0.1 (the unix transport: a Unix-domain socket), over TLS but for tcp and
unix, with client certificates made by :func:`fedpart.deploy.certs.write_run_credentials`. No
fedpart code runs on either side of the connection: this is what the transport itself costs, the
bound under fedpart's own transfers.

Transports:

- **grpc-aio** (what fedpart uses): a client-streaming call of ``grpc.aio``
  on both sides, the result in messages of ``server.result_chunk_bytes`` (1 MiB), each made as
  ``bytes`` from the sender's buffer (gRPC Python sends ``bytes``), the server's HTTP/2 receive
  window of a 10-client run (:func:`fedpart.server.transport.transfers.receive_window`); the receiver counts
  the bytes of the messages it is handed.
- **ssl-asyncio**: the receiver an ``asyncio`` TLS server whose ``BufferedProtocol`` has the
  bytes decrypted into one reused buffer per connection; the sender a blocking Python ``ssl``
  socket that sends from its buffer (``sendall``), waiting for a one-byte acknowledgement.
- **ssl-blocking**: the same sender; the receiver a thread per connection reading a blocking
  ``ssl`` socket into one reused buffer (``recv_into``).
- **ssl-bio**: TLS in memory (``ssl.MemoryBIO``) over plain blocking sockets on both sides, the
  question being whether fewer, larger socket calls save CPU: an ``ssl`` socket reads each TLS
  record of at most 16 KiB with two ``recv`` calls and writes each with one ``send``, where the
  sender here encrypts a whole upload into memory and hands it to one ``sendall``, and the
  receiver reads up to 256 KiB a call and decrypts them from memory.
- **tcp**: the ssl-blocking receiver and sender over the same TCP connections with no TLS: what
  moving the bytes costs without encryption.
- **unix**: the same over a Unix-domain stream socket, the kind of connection the compute floor
  of ``round_overhead.py`` moves its deltas over (``multiprocessing.Pipe``). The difference
  between ssl-blocking and these two is the part of a transfer's CPU that TLS adds.

For each transport in turn, ``--repeat`` times (the machine's speed drifts): start the receiver and
the senders, wait ``--warmup`` seconds, then count the uploads the receiver completed and the CPU
seconds (user + system, ``/proc/PID/stat``) of the receiver and of the senders over ``--seconds``.
Printed: per transport the medians of milliseconds of CPU per upload at the receiver and at the
senders (together), each measurement, and each transport's sum against grpc-aio's. Linux only.
Every process is stopped by PID when its measurement ends, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

BENCHMARKS = Path(__file__).resolve().parent
TRANSPORTS = ("grpc-aio", "ssl-asyncio", "ssl-blocking", "ssl-bio", "tcp", "unix")
# the transports whose sender is the blocking one (and, but for ssl-asyncio, the receiver too), by
# the layer their bytes go through
LAYERS = {"ssl-asyncio": "tls", "ssl-blocking": "tls", "ssl-bio": "tls-in-memory", "tcp": "plain", "unix": "plain"}
BIO_READ_BYTES = 256 << 10  # ssl-bio: the most one socket read takes
CNN2_RESULT_BYTES = 582_026 * 4
METHOD = "/transport_cost.Receiver/Upload"
UPLOADED = "uploaded"


def _uploaded() -> None:
    print(UPLOADED, flush=True)


# ------------------------------------------------------------------ receivers (processes of their own)

def server_context(certs: Path) -> ssl.SSLContext:
    """The receiving end's TLS: the run's server certificate, client certificates required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.pem", certs / "server.key")
    context.load_verify_locations(certs / "ca.pem")
    context.verify_mode = ssl.CERT_REQUIRED
    return context


async def _grpc_receiver(certs: Path, size: int) -> None:
    import grpc

    from fedpart.server.main import receive_window_options
    from fedpart.server.transport.transfers import receive_window

    async def upload(messages, context) -> bytes:
        received = 0
        async for message in messages:
            received += len(message)
        if received != size:
            raise RuntimeError(f"received {received} bytes of {size}")
        _uploaded()
        return b""

    server = grpc.aio.server(options=receive_window_options(receive_window(None, 10)))
    service, method = METHOD.rsplit("/", 1)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service[1:], {method: grpc.stream_unary_rpc_method_handler(upload)}),))
    credentials = grpc.ssl_server_credentials([((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())],
                                              root_certificates=(certs / "ca.pem").read_bytes(),
                                              require_client_auth=True)
    print(f"port {server.add_secure_port('127.0.0.1:0', credentials)}", flush=True)
    await server.start()
    await server.wait_for_termination()


class _BufferedReceiver(asyncio.BufferedProtocol):
    """Decrypted bytes go into one reused buffer; a one-byte acknowledgement per upload."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffer = memoryview(bytearray(size))
        self.received = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer[self.received:]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self.received == self.size:
            self.received = 0
            _uploaded()
            self.transport.write(b"k")


async def _asyncio_receiver(certs: Path, size: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _BufferedReceiver(size), "127.0.0.1", 0,
                                                            ssl=server_context(certs))
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


class _MemoryTls:
    """TLS through memory buffers over a plain blocking socket (the ssl-bio transport)."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=server_side,
                                    server_hostname=server_hostname)
        self.read_buffer = memoryview(bytearray(BIO_READ_BYTES))
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionError("the connection ended during the TLS handshake") from None
        self._flush()

    def __enter__(self) -> _MemoryTls:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sock.close()

    def _flush(self) -> None:
        encrypted = self.outgoing.read()
        if encrypted:
            self.sock.sendall(encrypted)

    def _fill(self) -> bool:
        got = self.sock.recv_into(self.read_buffer)
        self.incoming.write(self.read_buffer[:got])
        return got > 0

    def sendall(self, data: bytes | memoryview) -> None:
        self.tls.write(data)
        self._flush()

    def recv_into(self, buffer: memoryview) -> int:
        """Decrypted bytes into ``buffer``: how many (0: the connection ended)."""
        while True:
            try:
                return self.tls.read(len(buffer), buffer)
            except ssl.SSLWantReadError:
                if not self._fill():
                    return 0


def _secured(connection: socket.socket, layer: str, context: ssl.SSLContext, server_side: bool
             ) -> socket.socket | _MemoryTls:
    """``connection`` through ``layer`` (see :data:`LAYERS`)."""
    hostname = None if server_side else "127.0.0.1"
    if layer == "tls-in-memory":
        return _MemoryTls(connection, context, server_side=server_side, server_hostname=hostname)
    if layer == "tls":
        return context.wrap_socket(connection, server_side=server_side, server_hostname=hostname)
    return connection


def _blocking_receiver(certs: Path, size: int, transport: str) -> None:
    """A thread per connection, reading each upload into one reused buffer through ``transport``'s
    layer: an ``ssl`` socket, TLS in memory, or the socket itself (TCP or Unix-domain)."""
    context = server_context(certs)
    if transport == "unix":
        path = certs / f"receiver-{os.getpid()}.sock"  # one per receiver: a killed one leaves its file
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen()
        print(f"port {path}", flush=True)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        print(f"port {listener.getsockname()[1]}", flush=True)

    def serve(connection: socket.socket) -> None:
        with _secured(connection, LAYERS[transport], context, server_side=True) as tls:
            buffer = memoryview(bytearray(size))
            while True:
                received = 0
                while received < size:
                    got = tls.recv_into(buffer[received:])
                    if not got:
                        return
                    received += got
                _uploaded()
                tls.sendall(b"k")

    while True:
        connection, _ = listener.accept()
        threading.Thread(target=serve, args=(connection,), daemon=True).start()


# ------------------------------------------------------------------ senders

def _pacer(rate: float) -> Callable[[], float]:
    """Seconds to wait after each upload so that the n-th starts n / rate seconds after the first."""
    due = time.monotonic()

    def delay() -> float:
        nonlocal due
        due += 1.0 / rate
        return max(0.0, due - time.monotonic())

    return delay


async def _grpc_sender(port: int, certs: Path, index: int, size: int, rate: float) -> None:
    import grpc

    from fedpart.common.config.run_config import ServerConfig

    chunk = ServerConfig.result_chunk_bytes
    credentials = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(),
                                               (certs / f"process_{index}.key").read_bytes(),
                                               (certs / f"process_{index}.pem").read_bytes())
    source = memoryview(os.urandom(size))
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        upload = channel.stream_unary(METHOD)
        delay = _pacer(rate)
        while True:
            await upload(iter([bytes(source[start:start + chunk]) for start in range(0, size, chunk)]))
            await asyncio.sleep(delay())


def client_context(certs: Path, index: int) -> ssl.SSLContext:
    """The sending end's TLS: the run's CA, and the certificate of client process ``index``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(certs / "ca.pem")
    context.load_cert_chain(certs / f"process_{index}.pem", certs / f"process_{index}.key")
    return context


def _blocking_sender(address: str, certs: Path, index: int, size: int, rate: float, transport: str) -> None:
    """Uploads through ``transport``'s layer (an ``ssl`` socket for ssl-asyncio and ssl-blocking),
    each answered by a one-byte acknowledgement."""
    context = client_context(certs, index)
    source = memoryview(os.urandom(size))
    acknowledgement = bytearray(1)
    if transport == "unix":
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(address)
    else:
        connection = socket.create_connection(("127.0.0.1", int(address)))
    with _secured(connection, LAYERS[transport], context, server_side=False) as tls:
        delay = _pacer(rate)
        while True:
            tls.sendall(source)
            if not tls.recv_into(memoryview(acknowledgement)) or acknowledgement != b"k":
                raise RuntimeError("the receiver closed the connection")
            time.sleep(delay())


def _role(args: argparse.Namespace) -> None:
    certs = Path(args.certs)
    if args.role == "receiver":
        if args.transport == "grpc-aio":
            asyncio.run(_grpc_receiver(certs, args.bytes))
        elif args.transport == "ssl-asyncio":
            asyncio.run(_asyncio_receiver(certs, args.bytes))
        else:
            _blocking_receiver(certs, args.bytes, args.transport)
    elif args.transport == "grpc-aio":
        asyncio.run(_grpc_sender(int(args.port), certs, args.index, args.bytes, args.rate))
    else:
        _blocking_sender(args.port, certs, args.index, args.bytes, args.rate, args.transport)


# ------------------------------------------------------------------ the measurement

@dataclass(frozen=True)
class Sample:
    uploads: int
    receiver_ms: float   # CPU per upload
    senders_ms: float    # CPU per upload, all senders together


def _lines(stream: IO[str], into: queue.Queue) -> None:
    for line in stream:
        into.put(line.strip())
    into.put(None)


def measure(transport: str, certs: Path, args: argparse.Namespace) -> Sample:
    """One measurement of ``transport`` (see the module's docstring)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    from round_overhead import cpu_seconds  # in the parent only: it imports torch

    common = [sys.executable, __file__, "--transport", transport, "--certs", str(certs), "--bytes", str(args.bytes)]
    processes: list[subprocess.Popen] = []
    try:
        receiver = subprocess.Popen([*common, "--role", "receiver"], stdout=subprocess.PIPE, text=True)
        processes.append(receiver)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(receiver.stdout, lines), daemon=True).start()
        first = lines.get(timeout=60)
        if not first or not first.startswith("port "):
            raise RuntimeError(f"{transport} receiver did not start (said {first!r})")
        port = first.split(maxsplit=1)[1]  # a path (unix) may hold spaces
        processes += [subprocess.Popen([*common, "--role", "sender", "--port", port, "--index", str(index),
                                        "--rate", str(args.rate)]) for index in range(args.senders)]
        time.sleep(args.warmup)
        _drain(lines)
        before = [cpu_seconds(p.pid) for p in processes]
        time.sleep(args.seconds)
        uploads = _drain(lines)
        after = [cpu_seconds(p.pid) for p in processes]
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a {transport} process ended during the measurement")
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)
    if not uploads:
        raise RuntimeError(f"{transport}: no upload completed in {args.seconds} s")
    spent = [b - a for a, b in zip(before, after)]
    return Sample(uploads, 1000 * spent[0] / uploads, 1000 * sum(spent[1:]) / uploads)


def _drain(lines: queue.Queue) -> int:
    """Uploads reported since the last call."""
    count = 0
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            return count
        if line is None:
            raise RuntimeError("the receiver ended")
        count += line == UPLOADED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", type=int, default=2, help="sender processes (default 2)")
    parser.add_argument("--bytes", type=int, default=CNN2_RESULT_BYTES, help="bytes of one upload (one cnn2 result)")
    parser.add_argument("--rate", type=float, default=1.72, help="uploads a second from each sender (default 1.72)")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds measured per run (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (default 3)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each transport, taking turns (default 3)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, of " + ", ".join(TRANSPORTS))
    parser.add_argument("--role", choices=("receiver", "sender"), help=argparse.SUPPRESS)
    parser.add_argument("--transport", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)  # a TCP port, or the unix transport's path
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        _role(args)
        return 0
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown or not transports:
        parser.error(f"--transports: unknown {unknown}; choose from {', '.join(TRANSPORTS)}")
    if args.senders < 1 or args.bytes < 1 or args.rate <= 0 or args.seconds <= 0 or args.warmup < 0 or args.repeat < 1:
        parser.error("--senders, --bytes, --repeat must be >= 1, --rate and --seconds positive, --warmup >= 0")

    from fedpart.deploy.certs import write_run_credentials

    samples: dict[str, list[Sample]] = {t: [] for t in transports}
    with tempfile.TemporaryDirectory(prefix="fedpart-transport-cost-") as work:
        certs = Path(work)
        write_run_credentials(certs, ["127.0.0.1"], clients=args.senders, processes=args.senders)
        try:
            for _ in range(args.repeat):
                for transport in transports:
                    samples[transport].append(measure(transport, certs, args))
        except (RuntimeError, queue.Empty) as error:
            print(f"error: {error or 'a receiver did not report its port in 60 s'}", file=sys.stderr)
            return 1
    print(f"{args.bytes:,} B uploads on this machine (over mutual TLS but for tcp and unix), {args.senders} "
          f"sender process(es) at {args.rate:g}/s each, {args.seconds:g} s a run, {args.repeat} run(s) a transport "
          "taking turns\n")
    print(f"{'transport':14s} {'receiver ms':>12s} {'senders ms':>11s} {'sum':>7s} {'/ grpc-aio':>10s}   "
          "CPU ms per upload run by run (receiver / senders; uploads)")
    reference = None
    for transport in transports:
        receiver = statistics.median(s.receiver_ms for s in samples[transport])
        senders = statistics.median(s.senders_ms for s in samples[transport])
        if transport == "grpc-aio":
            reference = receiver + senders
        relative = f"{(receiver + senders) / reference:10.2f}" if reference else f"{'':10s}"
        runs = ", ".join(f"{s.receiver_ms:.2f} / {s.senders_ms:.2f}; {s.uploads}" for s in samples[transport])
        print(f"{transport:14s} {receiver:12.2f} {senders:11.2f} {receiver + senders:7.2f} {relative}   {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
