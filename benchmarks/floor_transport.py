"""What the data port's transport alone costs a round: the compute floor of ``round_overhead.py``
over its pipes against the same floor over fedpart's sealed TLS connections, measured in one run.

Both floors are ``round_overhead.py``'s (the same workload, worker processes, clients per process,
torch threads and training steps); only what carries the bytes differs:

- **pipes**: ``multiprocessing.Pipe``, as ``round_overhead.py``'s floor;
- **sealed**: one TCP connection on 127.0.0.1 from each worker to the parent, a TLS handshake with
  certificates of both ends made by :func:`fedpart.deploy.certs.write_run_credentials`, then the
  frames of :mod:`fedpart.common.sealed` (AES-256-GCM under keys agreed inside that handshake):
  the transport of fedpart's data port, with none of fedpart's calls, checks or threads around it.

Messages go as raw bytes with their length (nothing is unpickled): the worker's index, the round
and the global float32 weights, and each client's number, sample count and float32 delta. Each
array is copied once into the message and once out of it, as a pipe's pickling and unpickling copy
it. The two floors take turns
round by round (the machine's speed drifts more than the difference measured); the first round of
each is not paired. Printed: the median of the pairs' ratios (sealed / pipes) with its 90 %
interval (``round_overhead.median_interval``), the medians of each floor's CPU a round (all its
processes; its training threads, which here also seal and send; the rest), and the largest
difference between the two floors' final weights (0: the same steps).

Against ``round_overhead.py``'s ratio this separates the cost of moving the bytes with TLS from the
cost of fedpart's own work around them. Linux only (``/proc``).

    python benchmarks/floor_transport.py --processes 2 --rounds 31
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_overhead as floor  # noqa: E402 - scripts beside this one
from transport_cost import client_context, server_context  # noqa: E402

from fedpart.common.sealed import SealedSocket, seal  # noqa: E402
from fedpart.deploy.certs import write_run_credentials  # noqa: E402

LENGTH = struct.Struct(">Q")
INDEX = struct.Struct(">I")           # a worker's hello
ROUND = struct.Struct(">Q")           # heads the global weights
RESULT = struct.Struct(">II")         # heads a client's delta: client, samples
DELTA_BYTES = floor.PARAMETERS * 4    # float32
CONNECT_SECONDS = 300.0  # a worker loads torch and its data before it connects


def send_message(connection: SealedSocket, payload: bytes) -> None:
    connection.sendall(LENGTH.pack(len(payload)))
    connection.sendall(payload)


def _read_exactly(connection: SealedSocket, count: int) -> bytearray:
    buffer = bytearray(count)
    view, filled = memoryview(buffer), 0
    while filled < count:
        got = connection.recv_into(view[filled:])
        if not got:
            raise EOFError("the connection ended in the middle of a message")
        filled += got
    return buffer


def receive_message(connection: SealedSocket) -> bytearray | None:
    """The next message's bytes; None once the peer closed the connection between messages."""
    head = bytearray(LENGTH.size)
    if not connection.recv_into(head, 1):
        return None
    head[1:] = _read_exactly(connection, LENGTH.size - 1)
    (length,) = LENGTH.unpack(head)
    return _read_exactly(connection, length)


def weights_message(round_number: int, global_vector: np.ndarray) -> bytes:
    return ROUND.pack(round_number) + global_vector.tobytes()


def read_weights(message: bytearray) -> tuple[int, np.ndarray]:
    """The round and a copy of the global weights of :func:`weights_message`'s message."""
    (round_number,) = ROUND.unpack_from(message)
    return round_number, np.frombuffer(message, dtype=np.float32, offset=ROUND.size).copy()


def results_message(results: list[tuple[int, int, np.ndarray]]) -> bytes:
    return b"".join(RESULT.pack(client, samples) + delta.tobytes() for client, samples, delta in results)


def read_results(message: bytearray) -> list[tuple[int, int, np.ndarray]]:
    """The ``(client, samples, delta)`` of :func:`results_message`'s message, each delta a copy."""
    step = RESULT.size + DELTA_BYTES
    if len(message) % step:
        raise ValueError(f"a results message of {len(message)} bytes, not a multiple of {step}")
    return [(*RESULT.unpack_from(message, start),
             np.frombuffer(message, dtype=np.float32, count=floor.PARAMETERS, offset=start + RESULT.size).copy())
            for start in range(0, len(message), step)]


def sealed_worker(port: int, certs: str, index: int, clients: list[int], threads: int, raw: str) -> None:
    """``round_overhead.floor_worker`` over a sealed connection to the parent."""
    torch.set_num_threads(threads)
    model = floor.build_model(floor.MODEL, floor.NUM_CLASSES, floor.INPUT_SHAPE, floor.SEED)
    torch.optim.SGD(model.parameters(), lr=0.0)  # torch's one-off optimizer import, as the pipe floor's workers
    data = floor._client_train_data(Path(raw), clients)
    tls = client_context(Path(certs), index).wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=CONNECT_SECONDS), server_hostname="127.0.0.1")
    with seal(tls, server_side=False) as connection:
        connection.settimeout(None)
        send_message(connection, INDEX.pack(index))
        while (message := receive_message(connection)) is not None:
            send_message(connection, results_message(floor.train_clients(model, data, clients,
                                                                         *read_weights(message))))


class SealedFloor(floor.Floor):
    """``round_overhead.Floor`` whose workers reach the parent over sealed TLS connections."""

    def __init__(self, processes: int, raw: Path, certs: Path) -> None:
        super().__init__(processes, raw)
        self.certs = certs
        self.connections: list[SealedSocket] = []

    def __enter__(self) -> SealedFloor:
        context = mp.get_context("spawn")
        try:
            with socket.create_server(("127.0.0.1", 0)) as listener:
                listener.settimeout(CONNECT_SECONDS)
                port = listener.getsockname()[1]
                for index, clients in enumerate(self.groups):
                    worker = context.Process(target=sealed_worker, daemon=True, args=(
                        port, str(self.certs), index, clients, self.threads, str(self.raw)))
                    worker.start()
                    self.workers.append(worker)
                tls = server_context(self.certs)
                by_index: dict[int, SealedSocket] = {}
                for _ in self.groups:
                    raw, _ = listener.accept()
                    raw.settimeout(CONNECT_SECONDS)
                    connection = seal(tls.wrap_socket(raw, server_side=True), server_side=True)
                    self.connections.append(connection)  # closed on exit from here on
                    connection.settimeout(floor.FLOOR_ROUND_SECONDS)
                    hello = receive_message(connection)
                    if hello is None or len(hello) != INDEX.size:
                        raise RuntimeError("a sealed floor worker did not say which one it is (see its output above)")
                    by_index[INDEX.unpack(hello)[0]] = connection
            self.connections = [by_index[index] for index in range(len(self.groups))]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for connection in self.connections:
            connection.close()
        super().__exit__()

    def round(self) -> tuple[float, floor.Usage]:
        """The next round, as ``round_overhead.Floor.round`` over the sealed connections."""
        self.rounds_done += 1
        before = self.usage()
        started = time.perf_counter()
        payload = weights_message(self.rounds_done, self.global_vector.numpy())
        for connection in self.connections:
            send_message(connection, payload)
        results = []
        for connection in self.connections:
            answer = receive_message(connection)
            if answer is None:
                raise RuntimeError("a sealed floor worker closed its connection (see its output above)")
            results += read_results(answer)
        self.global_vector = floor.add_mean(self.global_vector, results)
        return time.perf_counter() - started, self.usage() - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="worker processes of each floor (default 2)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds of each floor, the first not paired (default 21)")
    parser.add_argument("--data-root", type=Path, default=floor.default_data_root(),
                        help="directory holding MNIST/raw/*.gz (default <checkout>/../shared/data)")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.rounds < 2:
        parser.error("--processes must be at least 1 and --rounds at least 2")
    raw = args.data_root / "MNIST" / "raw"
    ratios: list[float] = []
    usage: list[tuple[floor.Usage, floor.Usage]] = []
    with tempfile.TemporaryDirectory(prefix="fedpart-floor-transport-") as tmp:
        certs = Path(tmp)
        write_run_credentials(certs, ["127.0.0.1"], clients=floor.CLIENTS, processes=args.processes)
        with floor.Floor(args.processes, raw) as pipes, SealedFloor(args.processes, raw, certs) as sealed:
            for number in range(1, args.rounds + 1):
                piped_seconds, piped_usage = pipes.round()
                sealed_seconds, sealed_usage = sealed.round()
                if number > 1:
                    ratios.append(sealed_seconds / piped_seconds)
                    usage.append((piped_usage, sealed_usage))
            difference = float((pipes.global_vector - sealed.global_vector).abs().max())
    low, high = floor.median_interval(ratios)
    _, threads = floor.client_processes(args.processes)
    print(f"cnn2 / MNIST / FedAvg, round_overhead.py's floor: {args.processes} worker processes x {threads} torch "
          f"thread(s), {args.rounds} rounds each, taking turns")
    print(f"ratio sealed / pipes    {statistics.median(ratios):.3f}  (median of {len(ratios)} pairs; "
          f"{floor.CONFIDENCE:.0%} interval {low:.3f}-{high:.3f})")
    for name, pick in (("cpu per round", lambda u: u.cpu), ("  training threads", lambda u: u.trainers_running),
                       ("  other threads", lambda u: u.others)):
        piped = statistics.median(pick(p) for p, _ in usage)
        sealed_cpu = statistics.median(pick(s) for _, s in usage)
        print(f"{name:<23} pipes {piped:.3f} s, sealed {sealed_cpu:.3f} s (medians)")
    print(f"same work check         max |pipes - sealed| over the final weights: {difference:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
