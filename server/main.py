"""``fedpart server``: bind the gRPC service, run the rounds, evaluate, write the run directory;
or continue a run that was stopped (``--resume``).

The order protects earlier work: everything is checked (config, run directory, the data the
server itself needs, the address) before the port is bound, and the run directory is written
(an earlier run removed, with ``--overwrite``) only once the server listens. A run that ends
early (SIGINT / SIGTERM, or the server gives up waiting for its clients) tells the clients so,
writes ``summary.json`` with what it knows marked ``interrupted`` or ``failed``, and keeps its
``server_state/`` for ``--resume``. Exit codes: :mod:`fedpart.common.exit_codes`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path

import grpc

from fedpart.common.algorithms import has_global_model
from fedpart.common.config import RunConfig
from fedpart.common.console import Display, ProgressLines, render_run
from fedpart.common.exit_codes import ExitCode, Stopped
from fedpart.common.limits import raise_open_file_limit
from fedpart.common.plans import RunOutcome
from fedpart.common.security import ServerSecurity
from fedpart.server.auth import CallGuard, Principals, TokenGate
from fedpart.server.coordinator import Coordinator
from fedpart.server.global_eval import GlobalEvaluator
from fedpart.server.report import (
    FAILED,
    INTERRUPTED,
    RunDirectory,
    build_summary,
    check_new_run_dir,
    format_round,
    format_table,
)
from fedpart.server.run_state import mark_finished, read_run_state, write_run_state
from fedpart.server.service import CoordinatorService, add_to_server

# How long the server keeps answering after the run so that every process hears DONE.
SHUTDOWN_GRACE_SECONDS = 10.0
# Calls one client may have open at once, for the server-wide cap (a poll, an upload, a heartbeat).
MAX_CALLS_PER_CLIENT = 3
# gRPC's own hard limit on calls waiting to be taken by the server (grpc.server.max_pending_requests_hard_limit)
GRPC_PENDING_CALLS_HARD_LIMIT = 3000


class AddressInUse(OSError):
    """The server cannot listen on the address it was given (in use, or not this machine's)."""


class GrpcServer:
    """The gRPC (asyncio) server on an event loop of its own thread (and the fold threads, if any).

    A waiting client costs a coroutine and a socket, not a thread. Calls beyond
    ``maximum_concurrent_rpcs`` are refused at once (RESOURCE_EXHAUSTED) instead of queueing,
    and with credentials each client process may hold only a few calls at a time.
    """

    def __init__(self, coordinator: Coordinator, address: str, security: ServerSecurity) -> None:
        server_config = coordinator.config.server
        workers = server_config.fold_workers
        self._fold_pool = (futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fold")
                           if workers else None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-server", daemon=True)
        self._thread.start()
        upload_slots = server_config.upload_slots or 4 * (workers or os.cpu_count() or 1)
        start = self._start(coordinator, address, security, upload_slots, server_config.download_slots)
        try:
            self._server, self.address = asyncio.run_coroutine_threadsafe(start, self._loop).result()
        except BaseException:
            self._close_loop()
            raise

    async def _start(self, coordinator: Coordinator, address: str, security: ServerSecurity,
                     upload_slots: int, download_slots: int) -> tuple[grpc.aio.Server, str]:
        principals = Principals(security.principals) if security.principals is not None else None
        mutual_tls = security.client_ca is not None
        most_calls = MAX_CALLS_PER_CLIENT * coordinator.config.clients + 64
        backlog = max(most_calls, GRPC_PENDING_CALLS_HARD_LIMIT)
        server = grpc.aio.server(
            interceptors=[TokenGate(principals, mutual_tls)] if principals else [],
            maximum_concurrent_rpcs=most_calls,
            options=[
                ("grpc.so_reuseport", 0),
                # calls that arrived and wait for the event loop to take them (one a turn): past
                # gRPC's default backlog some are cancelled, CANCELLED at the client (1,600-3,900
                # result uploads a run at 2,000 processes)
                ("grpc.server.max_pending_requests", backlog),
                ("grpc.server.max_pending_requests_hard_limit", backlog),
                # clients ping every 30 s to keep NAT mappings alive while they train for minutes
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 0),
                *receive_window_options(coordinator.config.server.receive_window),
            ])
        service = CoordinatorService(coordinator, coordinator.ledger, CallGuard(principals, mutual_tls),
                                     self._fold_pool, upload_slots, download_slots)
        add_to_server(service, server)
        host, _, _ = address.rpartition(":")
        try:
            if security.tls:
                bound = server.add_secure_port(address, security.grpc_credentials())
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError as error:
            raise AddressInUse(f"cannot listen on {address}: {error}") from error
        if bound == 0:
            raise AddressInUse(f"cannot listen on {address}")
        await server.start()
        return server, f"{host}:{bound}"

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (calls still open get ``grace`` seconds), then the loop and fold threads."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()
        self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        if self._fold_pool is not None:
            self._fold_pool.shutdown(wait=True)


def receive_window_options(window_bytes: int) -> list[tuple[str, int]]:
    """gRPC options for the bytes a connection may send before the server reads them: a fixed
    window bounds what thousands of connections can park in the server's memory (gRPC's adaptive
    window grows per connection); 0 keeps gRPC's adaptive window."""
    if not window_bytes:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)]


def start_grpc(coordinator: Coordinator, address: str, security: ServerSecurity | None = None) -> GrpcServer:
    """Start the gRPC server; its ``address`` is where it listens (port 0 = a free port)."""
    return GrpcServer(coordinator, address, security or ServerSecurity())


def check_address(address: str) -> None:
    """Raise :class:`AddressInUse` with the operating system's reason when ``HOST:PORT`` cannot
    be bound (in use, or not an address of this machine), before gRPC tries and logs its own
    error. Binds a probe socket the way gRPC binds (``SO_REUSEADDR``) and closes it."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return  # not HOST:PORT (e.g. unix:PATH): gRPC says what is wrong
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (ValueError, socket.gaierror) as error:
        raise AddressInUse(f"cannot listen on {address}: {error}") from error
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            raise AddressInUse(f"cannot listen on {address}: {error.strerror or error}") from error


def serve(config: RunConfig, address: str, out_dir: str | Path, security: ServerSecurity | None = None,
          resume: bool = False, overwrite: bool = False, progress: str = "auto") -> int:
    """Run a whole federated experiment as the coordinator; returns the exit code
    (:class:`~fedpart.common.exit_codes.ExitCode`). With ``resume``, continue the run in
    ``out_dir`` after its last completed round; with ``overwrite``, replace the run in
    ``out_dir`` once the server listens. ``progress``: ``auto`` (a live view on a terminal, plain
    lines otherwise), ``plain`` or ``json`` (progress lines for ``fedpart run``)."""
    security = security or ServerSecurity()
    started = time.monotonic()
    # checked before anything is bound or written
    saved = read_run_state(out_dir, config.to_dict()) if resume else None
    if not resume:
        check_new_run_dir(out_dir, overwrite)
    display = Display()
    coordinator = Coordinator(config, log=display.log)  # builds model and algorithm: bad settings fail here
    if progress == "auto":
        display.view = lambda: render_run(coordinator.progress())
    evaluator = None
    if config.evaluate.global_test and has_global_model(coordinator.algorithm):
        evaluator = GlobalEvaluator(config)
    if saved is not None:
        coordinator.restore(saved)
    raise_open_file_limit()
    check_address(address)
    server = start_grpc(coordinator, address, security)
    with ExitStack() as stack:
        stack.callback(server.stop, 2.0)
        if saved is None:
            run_dir = RunDirectory(out_dir, config.checkpoint, overwrite=overwrite)
            run_dir.write_config(config)
            run_dir.checkpoint(0, coordinator.global_state)
            write_run_state(run_dir.path, coordinator.snapshot(0, 0.0))
            records: list[dict] = []
            earlier_seconds = 0.0
        else:
            run_dir = RunDirectory(out_dir, config.checkpoint, resume=True)
            records = run_dir.rounds_up_to(saved.round)
            earlier_seconds = saved.seconds
        stack.enter_context(display)
        if progress == "json":
            stack.enter_context(ProgressLines(coordinator.progress, display))
        display.log(f"fedpart server listening on {server.address} (run {coordinator.run_id}, out {run_dir.path})")
        display.log(f"{'warning: ' if not security.tls else ''}transport: {security.describe()}")
        if saved is not None:
            display.log(f"resuming run {saved.run_id} after round {saved.round}/{config.rounds}")
        run = ServerRun(config, coordinator, evaluator, run_dir, records, display,
                        lambda: earlier_seconds + time.monotonic() - started)
        return run.to_end()


class ServerRun:
    """The rounds, the final evaluation and the summary of one server, however the run ends."""

    def __init__(self, config: RunConfig, coordinator: Coordinator, evaluator: GlobalEvaluator | None,
                 run_dir: RunDirectory, records: list[dict], display: Display, seconds: Callable[[], float]) -> None:
        self.config = config
        self.coordinator = coordinator
        self.evaluator = evaluator
        self.run_dir = run_dir
        self.records = records
        self.display = display
        self.seconds = seconds

    def to_end(self) -> int:
        """Run; then tell the clients how the run ended, write what is known of a run that ended
        early, and wait (bounded) until the clients heard it. Returns the exit code."""
        ended_early: tuple[str, str] | None = None  # summary status, and why
        try:
            code = self._rounds_and_evaluation()
        except Stopped as stop:
            code, ended_early = stop.code, (INTERRUPTED, f"{stop.reason} after round {len(self.records)}/"
                                                         f"{self.config.rounds}; continue with fedpart server "
                                                         f"--resume {self.run_dir.path}")
        except TimeoutError as error:
            self.display.log(f"error: {error}")
            code, ended_early = ExitCode.UNREACHABLE, (FAILED, f"gave up: {error}")
        except Exception as error:  # noqa: BLE001 - a bug: say so, keep what is known, exit 1
            self.display.print(traceback.format_exc().rstrip())
            code, ended_early = ExitCode.ERROR, (FAILED, f"{type(error).__name__}: {error}")
        # waiting polls answer DONE at once; the summary is written meanwhile
        self.coordinator.finish(RunOutcome.ABORTED if ended_early else RunOutcome.COMPLETED)
        if ended_early:
            self._write_what_is_known(*ended_early)
        self.coordinator.registry.wait_until_released(SHUTDOWN_GRACE_SECONDS)
        return code

    def _rounds_and_evaluation(self) -> int:
        config, coordinator = self.config, self.coordinator
        self.display.log(f"waiting for {config.clients} clients to be hosted ...")
        coordinator.registry.wait_for_clients()
        for round_number in range(len(self.records) + 1, config.rounds + 1):
            record = coordinator.run_round(round_number)
            every = config.evaluate.global_every
            if self.evaluator is not None and every and round_number % every == 0:
                record["global"] = self.evaluator.evaluate(coordinator.global_state)
            self.records.append(record)
            self.run_dir.append_round(record)
            self.run_dir.checkpoint(round_number, coordinator.global_state, last=round_number == config.rounds)
            write_run_state(self.run_dir.path, coordinator.snapshot(round_number, self.seconds()))
            self.display.log(format_round(record, config.rounds))
        self.display.log("evaluating and personalising on every client ...")
        evaluations = coordinator.evaluate_all()
        global_metrics = self.evaluator.evaluate(coordinator.global_state) if self.evaluator is not None else None
        summary = build_summary(config, coordinator.model, self.records, evaluations, global_metrics,
                                coordinator.ledger, coordinator.failures, self.seconds())
        self.run_dir.write_summary(summary)
        mark_finished(self.run_dir.path)
        self.display.print(format_table(summary))
        missing = config.clients - len(evaluations)
        if missing:
            self.display.log(f"error: {missing} clients did not report an evaluation")
        return ExitCode.COMPLETED if not summary["failures"] and not missing else ExitCode.FAILURES

    def _write_what_is_known(self, status: str, note: str) -> None:
        """summary.json of a run that ended early, marked ``status`` (the run state of the last
        completed round stays for ``--resume``)."""
        summary = build_summary(self.config, self.coordinator.model, self.records, {}, None, self.coordinator.ledger,
                                self.coordinator.failures, self.seconds(), status=status, note=note)
        self.run_dir.write_summary(summary)
        self.display.log(f"run {status}: {note}; wrote {self.run_dir.path / 'summary.json'}")
