"""``fedpart server``: bind the gRPC service, run the rounds, evaluate, write the run directory;
or continue a run that was stopped (``--resume``).

The order protects earlier work: everything is checked (config, whether the credentials can host
every client id, run directory, the data the server itself needs, the address) before the port
is bound, and the run directory is written (an earlier run removed, with ``--overwrite``) only
once the server listens. A run that ends early (SIGINT / SIGTERM, or the server gives up waiting
for its clients) tells the clients so, writes ``summary.json`` with what it knows marked
``interrupted`` or ``failed``, and keeps its ``server_state/`` for ``--resume``. Exit codes:
:mod:`fedpart.common.process.exit_codes`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path

import grpc
from fedpart.common.config.experiment import Experiment
from fedpart.common.config.run_config import RunConfig
from fedpart.common.ml.algorithms import has_global_model
from fedpart.common.process.console import Display, Log, ProgressLines, render_run, stamp
from fedpart.common.process.exit_codes import ExitCode, Stopped, signals_to
from fedpart.common.process.limits import raise_open_file_limit
from fedpart.common.process.records import RoundRecord
from fedpart.common.wire.addresses import AddressInUse, check_address
from fedpart.common.wire.client_ids import format_id_ranges
from fedpart.common.wire.plans import RunOutcome
from fedpart.common.wire.protocol import KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS
from fedpart.common.wire.security import Principal, SecurityError, ServerSecurity
from fedpart.server.engine.buffered import BufferedCoordinator
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.engine.global_eval import GlobalEvaluator
from fedpart.server.engine.run_state import (
    check_resume_security,
    mark_finished,
    read_run_state,
    write_run_state,
)
from fedpart.server.engine.sampling import round_target
from fedpart.server.output.console_text import format_round, format_table
from fedpart.server.output.metrics import (
    MetricsServer,
    RunCollector,
    check_metrics_available,
)
from fedpart.server.output.run_directory import (
    FAILED,
    INTERRUPTED,
    RunDirectory,
    build_summary,
    check_new_run_dir,
)
from fedpart.server.policy.aggregation import prepare_kernels
from fedpart.server.transport.auth import CallGuard, Credentials, TokenGate, fingerprint
from fedpart.server.transport.health import RunHealth
from fedpart.server.transport.service import CoordinatorService, add_to_server
from fedpart.server.transport.transfers import receive_window

# How long the server keeps answering after the run so that every process hears DONE.
SHUTDOWN_GRACE_SECONDS = 10.0
# Calls one client may have open at once, for the server-wide cap (a poll, an upload, a heartbeat).
MAX_CALLS_PER_CLIENT = 3
# gRPC's own hard limit on calls waiting to be taken by the server (grpc.server.max_pending_requests_hard_limit)
GRPC_PENDING_CALLS_HARD_LIMIT = 3000
# How often the server reads its credentials file again (a revoked credential is refused from then on)
CREDENTIALS_RELOAD_SECONDS = 2.0


class GrpcServer:
    """The gRPC (asyncio) server on an event loop of its own thread (and the fold threads, if any).

    A waiting client costs a coroutine and a socket, not a thread. Coordinator calls beyond the
    server's cap (:data:`MAX_CALLS_PER_CLIENT` per client of the run, and 64) are refused at once
    (RESOURCE_EXHAUSTED) instead of queueing, and with credentials each client process may hold
    only a few calls at a time; health checks have a budget of their own. With a credentials file
    the server reads it again every :data:`CREDENTIALS_RELOAD_SECONDS`: a revoked credential's
    process is dropped and refused from its next call on.
    """

    def __init__(self, coordinator: Coordinator, address: str, security: ServerSecurity,
                 health_port: int | None = None) -> None:
        server_config = coordinator.config.server
        workers = server_config.fold_workers
        self._fold_pool = (futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fold")
                           if workers else None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-server", daemon=True)
        self._thread.start()
        upload_slots = server_config.upload_slots or 4 * (workers or os.cpu_count() or 1)
        self.health = RunHealth()
        self._probes: grpc.aio.Server | None = None  # the plaintext health port, if any
        self.health_address: str | None = None
        self.credentials: Credentials | None = None
        self.guard: CallGuard | None = None  # admits the Coordinator calls (how many are open: guard.calls)
        self.service: CoordinatorService | None = None
        self._watcher: asyncio.Task | None = None
        start = self._start(coordinator, address, security, upload_slots, server_config.download_slots, health_port)
        try:
            self._server, self.address = asyncio.run_coroutine_threadsafe(start, self._loop).result()
        except BaseException:
            self._close_loop()
            raise

    async def _start(self, coordinator: Coordinator, address: str, security: ServerSecurity,
                     upload_slots: int, download_slots: int, health_port: int | None) -> tuple[grpc.aio.Server, str]:
        credentials = None
        if security.principals is not None:
            credentials = Credentials(security.principals, security.credentials_file, security.credentials_content)
        self.credentials = credentials
        mutual_tls = security.client_ca is not None
        admission = coordinator.registry.admission
        most_calls = MAX_CALLS_PER_CLIENT * coordinator.config.clients + 64
        backlog = max(most_calls, GRPC_PENDING_CALLS_HARD_LIMIT)
        server = grpc.aio.server(
            interceptors=[TokenGate(credentials, mutual_tls, admission)] if credentials else [],
            options=[
                ("grpc.so_reuseport", 0),
                # calls that arrived and wait for the event loop to take them (one a turn): past
                # gRPC's default backlog some are cancelled, CANCELLED at the client, when
                # thousands of processes call at once
                ("grpc.server.max_pending_requests", backlog),
                ("grpc.server.max_pending_requests_hard_limit", backlog),
                # clients ping every KEEPALIVE_SECONDS (NAT mappings stay, dead connections are
                # found); the server pings too, so that a call on a dead connection ends and frees
                # its upload slot or poll
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_SECONDS * 1000)),
                ("grpc.http2.max_ping_strikes", 0),
                ("grpc.keepalive_time_ms", int(2 * KEEPALIVE_SECONDS * 1000)),
                ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_SECONDS * 1000)),
                ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_SECONDS * 1000)),
                ("grpc.http2.max_pings_without_data", 0),
                *receive_window_options(receive_window(coordinator.config.server.receive_window,
                                                       coordinator.config.clients)),
            ])
        self.guard = CallGuard(credentials, mutual_tls, most_calls, admission)
        service = CoordinatorService(coordinator, coordinator.ledger, self.guard, self._fold_pool, upload_slots,
                                     download_slots)
        self.service = service
        add_to_server(service, server)
        server.add_generic_rpc_handlers((self.health.handler(),))
        host, _, _ = address.rpartition(":")
        bound = _add_port(server, address, security)
        if health_port is not None:
            # health checks only, in plaintext: what Kubernetes' gRPC probes can reach
            self._probes = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            self._probes.add_generic_rpc_handlers((self.health.handler(),))
            self.health_address = f"{host}:{_add_port(self._probes, f'{host}:{health_port}', ServerSecurity())}"
            await self._probes.start()
        await server.start()
        await self.health.run_serving(True)
        if credentials is not None and credentials.path is not None:
            self._watcher = asyncio.create_task(self._watch_credentials(coordinator, credentials))
        return server, f"{host}:{bound}"

    async def _watch_credentials(self, coordinator: Coordinator, credentials: Credentials) -> None:
        """Read the credentials file again every :data:`CREDENTIALS_RELOAD_SECONDS`; take a changed
        one that can host the run's processes, drop the processes of the credentials it no longer
        names, and keep the current credentials (saying why) when it cannot be used."""
        loop = asyncio.get_running_loop()
        clients = coordinator.config.clients
        while True:
            await asyncio.sleep(CREDENTIALS_RELOAD_SECONDS)
            try:
                changed = await loop.run_in_executor(
                    None, credentials.reload, lambda principals: check_reloaded_credentials(principals, clients))
            except SecurityError as error:
                coordinator.log.error(f"{error}; the server keeps the credentials it had")
                continue
            if changed is not None:
                coordinator.credentials_changed(*changed, credentials.fingerprint)

    def run_ended(self) -> None:
        """Report the run NOT_SERVING (the server still answers while its clients hear it)."""
        self._loop.call_soon_threadsafe(self.service.run_over.set)
        asyncio.run_coroutine_threadsafe(self.health.run_serving(False), self._loop).result()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (calls still open get ``grace`` seconds), then the loop and fold threads."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop).result()
        self._close_loop()

    async def _stop(self, grace: float | None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self.health.stopping()
        servers = [self._server, *([self._probes] if self._probes is not None else [])]
        await asyncio.gather(*(server.stop(grace) for server in servers))

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        if self._fold_pool is not None:
            self._fold_pool.shutdown(wait=True)


def _add_port(server: grpc.aio.Server, address: str, security: ServerSecurity) -> int:
    """Add ``address`` to ``server`` (TLS where ``security`` has it); returns the bound port."""
    try:
        if security.tls:
            bound = server.add_secure_port(address, security.grpc_credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as error:
        raise AddressInUse(f"cannot listen on {address}: {error}") from error
    if bound == 0:
        raise AddressInUse(f"cannot listen on {address}")
    return bound


def receive_window_options(window_bytes: int) -> list[tuple[str, int]]:
    """gRPC options for the bytes a connection may send before the server reads them: a fixed
    window bounds what thousands of connections can park in the server's memory (gRPC's adaptive
    window grows per connection); 0 keeps gRPC's adaptive window."""
    if not window_bytes:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)]


def start_grpc(coordinator: Coordinator, address: str, security: ServerSecurity | None = None,
               health_port: int | None = None) -> GrpcServer:
    """Start the gRPC server; its ``address`` is where it listens (port 0 = a free port). With
    ``health_port`` it also answers health checks in plaintext on that port of the same host
    (``health_address``)."""
    return GrpcServer(coordinator, address, security or ServerSecurity(), health_port)


def check_credentials_host_run(principals: list[Principal] | None, clients: int) -> None:
    """Raise :class:`SecurityError` unless the credentials let every client id of the run be
    hosted by exactly one process: an id no credential names could never join (the server would
    wait ``server.join_timeout`` and give up), an id two name could be hosted by only one of them,
    and an id beyond the run's belongs to credentials made for another run. None: anyone may join."""
    if principals is None:
        return
    unnamed, problems = _credential_problems(principals, clients)
    if unnamed:
        problems.insert(0, f"client ids {format_id_ranges(unnamed)} are named by no process")
    if problems:
        raise SecurityError(f"--credentials cannot host this run of {clients} clients (ids 0-{clients - 1}): "
                            f"{'; '.join(problems)}; write credentials for it with fedpart certs --clients "
                            f"{clients}, or give each id to exactly one process")


def check_reloaded_credentials(principals: list[Principal], clients: int) -> None:
    """Raise :class:`SecurityError` unless a credentials file the server read again while it runs
    can be taken: as :func:`check_credentials_host_run`, except that client ids may be named by no
    process (their credential was revoked: those clients are unavailable until one names them)."""
    _, problems = _credential_problems(principals, clients)
    if problems:
        raise SecurityError(f"the changed credentials file cannot host this run of {clients} clients: "
                            f"{'; '.join(problems)}")


def _credential_problems(principals: list[Principal], clients: int) -> tuple[list[int], list[str]]:
    """The run's client ids no credential names, and what else is wrong: ids named by several
    processes, ids beyond the run."""
    named: dict[int, list[str]] = defaultdict(list)
    for principal in principals:
        for client in principal.clients:
            named[client].append(principal.name)
    problems = []
    for client_ids, names in _group_by_names({c: n for c, n in named.items() if len(n) > 1}):
        problems.append(f"client ids {format_id_ranges(client_ids)} are named by {len(names)} processes "
                        f"({', '.join(names)})")
    beyond = [c for c in named if c >= clients]
    if beyond:
        problems.append(f"client ids {format_id_ranges(beyond)} are not in the run")
    return [c for c in range(clients) if c not in named], problems


def _group_by_names(named: dict[int, list[str]]) -> list[tuple[list[int], list[str]]]:
    """Client ids grouped by the processes that name them, in order of their first id."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for client in sorted(named):
        groups.setdefault(tuple(named[client]), []).append(client)
    return [(ids, list(names)) for names, ids in groups.items()]


def serve(config: RunConfig, experiment: Experiment, address: str, out_dir: str | Path,
          security: ServerSecurity | None = None,
          resume: bool = False, overwrite: bool = False, progress: str = "auto",
          health_port: int | None = None, metrics_port: int | None = None,
          resume_command: Callable[[str], str] | None = None, new_credentials: bool = False) -> int:
    """Run a whole federated experiment as the coordinator; returns the exit code
    (:class:`~fedpart.common.process.exit_codes.ExitCode`). ``experiment``: what the config derives, as
    :func:`~fedpart.common.config.experiment.check_experiment` built it. With ``resume``, continue the run in
    ``out_dir`` after its last completed round; with ``overwrite``, replace the run in
    ``out_dir`` once the server listens. ``progress``: ``auto`` (a live view on a terminal, plain
    lines otherwise), ``plain`` or ``json`` (progress lines for ``fedpart run``). ``health_port``:
    also answer health checks in plaintext there (:mod:`fedpart.server.transport.health`);
    ``metrics_port``: serve Prometheus metrics there (:mod:`fedpart.server.output.metrics`); both on
    the host of ``address``. ``resume_command``: the exact command that continues this run, made
    from the address the server listens on; a stop prints it and the run state keeps it. A resume
    must keep the run's transport and credentials file
    (:func:`~fedpart.server.engine.run_state.check_resume_security`), unless ``new_credentials``. Called
    in the main thread, SIGINT and SIGTERM end the run at the round loop's next wait
    (:func:`~fedpart.common.process.exit_codes.signals_to`)."""
    security = security or ServerSecurity()
    started = time.monotonic()
    # checked before anything is bound or written
    check_credentials_host_run(security.principals, config.clients)
    if metrics_port is not None:
        check_metrics_available()
    saved = read_run_state(out_dir, config.to_dict()) if resume else None
    transport = "mutual TLS" if security.client_ca is not None else "TLS" if security.tls else "plaintext"
    credentials_sha256 = fingerprint(security.credentials_content) if security.credentials_content else ""
    if saved is not None:
        check_resume_security(saved.security, transport, credentials_sha256, new_credentials)
    if not resume:
        check_new_run_dir(out_dir, overwrite)
    display = Display(logger="fedpart.server")
    engine = BufferedCoordinator if config.server.engine == "buffered" else Coordinator
    coordinator = engine(config, log=Log(display), experiment=experiment)
    prepare_kernels(max(tensor.numel() for tensor in experiment.model.state_dict().values()))
    if progress == "auto":
        display.view = lambda: render_run(coordinator.progress())
    evaluator = None
    if config.evaluate.global_test and has_global_model(experiment.algorithm):
        evaluator = GlobalEvaluator(config.data, config.train.loss, experiment)
    if saved is not None:
        coordinator.restore(saved)
    raise_open_file_limit()
    host = address.rpartition(":")[0]
    for listening in (address, *(f"{host}:{port}" for port in (health_port, metrics_port) if port)):
        check_address(listening)
    records: list[RoundRecord] = []  # the round records (metrics.jsonl), read by the metrics endpoint
    with ExitStack() as stack:
        stack.enter_context(signals_to(coordinator.stop))  # the round loop stops at a wait, in order
        if metrics_port is not None:
            metrics = _start_metrics(host, metrics_port, RunCollector(coordinator, records))
            stack.callback(metrics.stop)
        server = start_grpc(coordinator, address, security, health_port)
        stack.callback(server.stop, 2.0)
        command = (resume_command(server.address) if resume_command is not None
                   else f"fedpart server --resume {Path(out_dir).resolve()}")
        coordinator.security = {"transport": transport, "credentials_sha256": credentials_sha256, "command": command}
        if saved is None:
            run_dir = RunDirectory(out_dir, config.checkpoint, overwrite=overwrite)
            run_dir.write_config(config)
            run_dir.checkpoint(0, coordinator.global_state)
            write_run_state(run_dir.path, coordinator.snapshot(0, 0.0))
            earlier_seconds = 0.0
        else:
            run_dir = RunDirectory(out_dir, config.checkpoint, resume=True)
            records.extend(run_dir.rounds_up_to(saved.round))
            earlier_seconds = saved.seconds
        stack.enter_context(display)
        if progress == "json":
            stack.enter_context(ProgressLines(coordinator.progress, display))
        # printed whatever the log level: launchers and scripts read the address from it
        display.print(stamp(f"fedpart server listening on {server.address} (run {coordinator.run_id}, "
                            f"out {run_dir.path})"))
        display.log(f"transport: {security.describe()}", level=logging.INFO if security.tls else logging.WARNING)
        if server.health_address is not None:
            display.log(f"health checks (grpc.health.v1 Check, plaintext) on {server.health_address}")
        if metrics_port is not None:
            display.log(f"Prometheus metrics on http://{metrics.address}/metrics")
        if saved is not None:
            display.log(f"resuming run {saved.run_id} after round {saved.round}/{config.rounds}")
            if saved.operational_changes:
                run_dir.write_config(config)  # config.yaml says what the rest of the run runs with
                display.log(f"changed for the rest of the run: {'; '.join(saved.operational_changes)}")
        run = ServerRun(config, coordinator, evaluator, run_dir, records, display,
                        lambda: earlier_seconds + time.monotonic() - started, server.run_ended)
        return run.to_end()


def _start_metrics(host: str, port: int, collector: RunCollector) -> MetricsServer:
    """The Prometheus endpoint on ``host:port`` (:class:`AddressInUse` when it cannot bind)."""
    try:
        return MetricsServer(host.strip("[]") or "0.0.0.0", port, collector)
    except OSError as error:
        raise AddressInUse(f"cannot listen on {host}:{port} (--metrics-port): {error.strerror or error}") from error


class ServerRun:
    """The rounds, the final evaluation and the summary of one server, however the run ends."""

    def __init__(self, config: RunConfig, coordinator: Coordinator, evaluator: GlobalEvaluator | None,
                 run_dir: RunDirectory, records: list[RoundRecord], display: Display, seconds: Callable[[], float],
                 run_ended: Callable[[], None]) -> None:
        self.config = config
        self.coordinator = coordinator
        self.evaluator = evaluator
        self.run_dir = run_dir
        self.records = records
        self.display = display
        self.seconds = seconds
        self.run_ended = run_ended  # tells the health service

    def to_end(self) -> int:
        """Run; then tell the clients how the run ended, write what is known of a run that ended
        early, and wait (bounded) until the clients heard it. Returns the exit code."""
        ended_early: tuple[str, str] | None = None  # summary status, and why
        try:
            code = self._rounds_and_evaluation()
        except Stopped as stop:
            code, ended_early = stop.code, (INTERRUPTED, f"{stop.reason} after round {len(self.records)}/"
                                                         f"{self.config.rounds}; continue with: "
                                                         f"{self.coordinator.security['command']}")
        except TimeoutError as error:
            self.display.error(str(error))
            code, ended_early = ExitCode.UNREACHABLE, (FAILED, f"gave up: {error}")
        except Exception as error:  # noqa: BLE001 - a bug: say so, keep what is known, exit 1
            self.display.print(traceback.format_exc().rstrip())
            code, ended_early = ExitCode.ERROR, (FAILED, f"{type(error).__name__}: {error}")
        # waiting polls answer DONE at once; the summary is written meanwhile
        self.coordinator.finish(RunOutcome.ABORTED if ended_early else RunOutcome.COMPLETED)
        self.run_ended()
        if ended_early:
            self._write_what_is_known(*ended_early, code)
        self.coordinator.registry.wait_until_released(SHUTDOWN_GRACE_SECONDS)
        return code

    def _rounds_and_evaluation(self) -> int:
        config, coordinator = self.config, self.coordinator
        self.display.log(f"waiting for {config.clients} clients to be hosted ...")
        coordinator.registry.wait_for_clients()
        for round_number in range(len(self.records) + 1, coordinator.last_round + 1):
            record = coordinator.run_round(round_number)
            every = config.evaluate.global_every
            if self.evaluator is not None and every and round_number % every == 0:
                record.global_metrics = self.evaluator.evaluate(coordinator.global_state)
            self.records.append(record)
            self.run_dir.append_round(record)
            self.run_dir.checkpoint(round_number, coordinator.global_state,
                                    last=round_number == coordinator.last_round)
            write_run_state(self.run_dir.path, coordinator.snapshot(round_number, self.seconds()))
            self.display.log(format_round(record, config.rounds))
        self.display.log("evaluating and personalising on every client ...")
        evaluations = coordinator.evaluate_all()
        global_metrics = self.evaluator.evaluate(coordinator.global_state) if self.evaluator is not None else None
        missing = config.clients - len(evaluations)
        failures = self._failures()
        if missing:
            failures.append(f"{missing} of {config.clients} clients did not report an evaluation")
            self.display.error(failures[-1])
        code = ExitCode.FAILURES if failures else ExitCode.COMPLETED
        summary = build_summary(config, coordinator.model, self.records, evaluations, global_metrics,
                                coordinator.ledger, failures, self.seconds(), note=coordinator.stop_note(),
                                evaluation_delivery=coordinator.board.delivery_counts(config.rounds + 1),
                                exit_code=int(code))
        self.run_dir.write_summary(summary)
        mark_finished(self.run_dir.path)
        self.display.print(format_table(summary))
        self.display.print(next_steps(self.run_dir.path))
        return code

    def _failures(self) -> list[str]:
        """What went wrong so far: the coordinator's failures (refused results, processes that
        left, tensors that came out non-finite) and every round that folded fewer clients than it
        needed (a process that went silent and came back is in no other list)."""
        return [*self.coordinator.failures, *short_rounds(self.records, self.config)]

    def _write_what_is_known(self, status: str, note: str, code: int) -> None:
        """summary.json of a run that ended early, marked ``status`` (the run state of the last
        completed round stays for ``--resume``)."""
        summary = build_summary(self.config, self.coordinator.model, self.records, {}, None, self.coordinator.ledger,
                                self._failures(), self.seconds(), status=status, note=note, exit_code=int(code))
        self.run_dir.write_summary(summary)
        self.display.log(f"run {status}: {note}; wrote {self.run_dir.path / 'summary.json'}")


def next_steps(run_dir: Path) -> str:
    """The lines after the final table: where the run is, and the commands that report on it and
    take its personalized models away (those stay with the client processes' --state-dir: under
    the run directory for fedpart run, on the client machines otherwise)."""
    path = shlex.quote(str(run_dir.resolve()))
    state = "" if (run_dir / "state").is_dir() else " --state-dir DIR  (each client process's --state-dir)"
    return (f"run directory  {path}\n"
            f"report         fedpart report {path} --out {path}/report\n"
            f"export         fedpart export {path} --out {path}/models{state}")


def short_rounds(records: list[RoundRecord], config: RunConfig) -> list[str]:
    """A line for each round in which clients it needed sent no result (every client it sampled,
    or with ``sampling.over_selection`` the clients a round waits for); results it refused are
    failures of their own already."""
    over_selection = config.sampling.over_selection
    lines = []
    for record in records:
        needed = len(record.sampled)
        if over_selection and config.sampling.probability is None:
            needed = min(needed, round_target(config.clients, config.sampling.fraction))
        answered = len(record.completed) + (record.robust.rejected if record.robust is not None else 0)
        if answered < needed:
            lines.append(f"round {record.round}: {needed - answered} of the {needed} clients it needed sent "
                         f"no result (folded {len(record.completed)})")
    return lines
