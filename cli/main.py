"""The ``fedpart`` command: ``server``, ``client``, ``run`` (all processes on this machine),
``certs`` (TLS certificates and client-process tokens for a run), ``report`` (HTML page, figures
and tables from run directories) and ``compare`` (one config once per algorithm, and per seed
with ``--seeds``, then the report).

Exit codes: docs/operating-a-run.md, "Exit codes" (``fedpart.common.process.exit_codes``)."""

from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import sys
import time
from functools import partial
from importlib import resources
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

# Nothing heavy at import time (console is standard library only): ``fedpart --help`` and
# ``fedpart CMD --help`` load neither torch nor grpc; each command imports what it needs when it runs.
from fedpart.common.process.console import PROGRESS_MODES, set_log_level
from fedpart.cli.export import add_export_parser

if TYPE_CHECKING:
    from fedpart.common.config.run_config import RunConfig

DEFAULT_CONFIG = "quickstart"
VERBOSE_ENV = "FEDPART_VERBOSE"  # "1": as --verbose; set by --verbose, so the processes a command starts inherit it


def resolve_config_path(name: str | None) -> Path:
    """A config file path, or the name of a bundled config (``quickstart``, ``mnist_cnn2``, ...)."""
    from fedpart.common.config.run_config import ConfigError

    name = name or DEFAULT_CONFIG
    path = Path(name)
    if path.is_file():
        return path
    bundled = resources.files("fedpart.configs") / (name if name.endswith(".yaml") else f"{name}.yaml")
    if bundled.is_file():
        return Path(str(bundled))
    known = sorted(p.name.removesuffix(".yaml") for p in resources.files("fedpart.configs").iterdir()
                   if p.name.endswith(".yaml"))
    raise ConfigError(f"config {name!r} is neither a file nor a bundled config ({', '.join(known)})")


def default_out_dir(name: str) -> str:
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _server(args: argparse.Namespace) -> int:
    from fedpart.common.process.limits import yield_to_training

    if args.yield_to_training:
        yield_to_training()  # before any thread starts (torch's import starts one): they all inherit it
    from fedpart.common.config.run_config import ConfigError, load_config
    from fedpart.common.wire.security import ServerSecurity
    from fedpart.common.wire.addresses import AddressInUse, check_address, check_listen_address

    # what needs no torch first, so that a mistake is said within a second
    check_listen_address(args.address, "--address")
    security = ServerSecurity.from_files(args.address, args.tls_cert, args.tls_key, args.client_ca,
                                         args.credentials, args.insecure)
    if args.resume:
        config, out = resume_config(args), args.resume
    elif args.config is None:
        raise ConfigError("fedpart server needs a CONFIG (or --resume RUN_DIR)")
    else:
        config = load_config(resolve_config_path(args.config), args.set)
        out = args.out or default_out_dir(config.name)
    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: expected at least 1")
    host = args.address.rpartition(":")[0]
    try:
        for address in (args.address, *(f"{host}:{port}" for port in (args.health_port, args.metrics_port) if port)):
            check_address(address)
    except AddressInUse as error:
        return _fail(args, error)
    from fedpart.common.config.experiment import check_experiment

    experiment = check_experiment(config, server_data=True)
    import torch

    from fedpart.server.main import serve

    torch.set_num_threads(args.threads)
    _startup_done()
    try:
        return serve(config, experiment, args.address, out, security, resume=bool(args.resume), overwrite=args.overwrite,
                     progress=args.progress, health_port=args.health_port, metrics_port=args.metrics_port,
                     resume_command=(lambda _: args.resume_command) if args.resume_command
                     else partial(server_resume_command, args, out),
                     new_credentials=args.new_credentials)
    except AddressInUse as error:
        return _fail(args, error)


def server_resume_command(args: argparse.Namespace, out: str, address: str) -> str:
    """The exact command that continues this server's run: the ``address`` it listens on, its
    transport, credentials and ports, file paths made absolute (printed when the server stops
    early, kept in its run state)."""
    words = ["fedpart", "server", "--resume", str(Path(out).resolve()), "--address", address]
    for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--client-ca", args.client_ca),
                        ("--credentials", args.credentials)):
        if value:
            words += [flag, str(Path(value).resolve())]
    if args.insecure:
        words.append("--insecure")
    for flag, port in (("--health-port", args.health_port), ("--metrics-port", args.metrics_port)):
        if port is not None:
            words += [flag, str(port)]
    if args.threads != 1:
        words += ["--threads", str(args.threads)]
    if not args.yield_to_training:
        words.append("--no-yield-to-training")
    return shlex.join(words)


def _fail(args: argparse.Namespace, error: BaseException, code: int = 2) -> int:
    """Print ``fedpart CMD: error: ...`` on stderr; returns ``code``."""
    print(f"fedpart {args.command}: error: {error}", file=sys.stderr, flush=True)
    return code


def resume_config(args: argparse.Namespace) -> RunConfig:
    """The config of the run ``--resume RUN_DIR`` continues: RUN_DIR/config.yaml, with ``--set``
    changing only the server's timeouts and limits (:func:`~fedpart.server.engine.run_state.is_operational`)."""
    from fedpart.common.config.run_config import ConfigError, load_config
    from fedpart.server.engine.run_state import is_operational

    if args.overwrite:
        raise ConfigError("--resume continues the run in RUN_DIR; --overwrite would replace it")
    if args.config is not None:
        raise ConfigError(f"--resume takes the config from {args.resume}/config.yaml; give no CONFIG ({args.config})")
    defining = [text for text in args.set if not is_operational(text.split("=", 1)[0].strip())]
    if defining:
        raise ConfigError(f"--resume continues the run as it was configured; --set {defining[0]} would change it "
                          "(a resume may change server.* timeouts and limits only)")
    if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
        raise ConfigError(f"--resume writes into {args.resume} itself; --out {args.out} names another directory")
    path = Path(args.resume) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {args.resume}: not a run directory (no config.yaml)")
    return load_config(path, args.set)


def _client(args: argparse.Namespace) -> int:
    from fedpart.common.wire.client_ids import parse_id_ranges
    from fedpart.common.config.run_config import ConfigError
    from fedpart.common.process.limits import HostShare, cpu_budget
    from fedpart.common.wire.security import ClientSecurity
    from fedpart.common.wire.addresses import check_dial_address

    # every option checked before anything connects
    check_dial_address(args.server, "--server")
    client_ids = parse_id_ranges(args.clients)
    if args.data_root is not None and not Path(args.data_root).is_dir():
        raise ConfigError(f"--data-root {args.data_root}: no such directory")
    for option in ("connect_timeout", "reconnect_timeout"):
        if getattr(args, option) is not None and getattr(args, option) <= 0:
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive number of seconds")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: expected at least 1")
    security = ClientSecurity.from_options(args.ca, args.server_name, args.token_file,
                                           args.cert, args.key, args.insecure)
    from fedpart.client.placement import resolve_device

    device = str(resolve_device(args.device))
    host_share = None
    if args.threads is not None:
        threads, why = args.threads, "--threads"
    else:
        budget = cpu_budget()
        host_share = HostShare(budget)
        threads, sharing = host_share.threads()
        why = (f"{budget.describe()} / {sharing} client process{'es' if sharing > 1 else ''} on this host; "
               "it follows as processes start or stop beside it")
    from fedpart.client.runtime import ClientProcess
    from fedpart.client.session import SessionError

    _startup_done()
    try:
        process = ClientProcess(args.server, client_ids, device=device, data_root=args.data_root,
                                state_dir=args.state_dir, threads=threads, security=security,
                                reconnect_timeout=args.reconnect_timeout, connect_timeout=args.connect_timeout,
                                host_share=host_share)
        process.log(f"{threads} torch thread{'s' if threads > 1 else ''} ({why})")
        return process.run()
    except ConfigError as error:  # the run's config does not fit this machine (its data)
        return _fail(args, error)
    except SessionError as error:
        return _fail(args, error, error.code)
    except (OSError, ValueError, ImportError, TypeError) as error:
        return _fail(args, error, 1)
    finally:
        if host_share is not None:
            host_share.close()


def _run(args: argparse.Namespace) -> int:
    from fedpart.common.config.run_config import load_config
    from fedpart.deploy.launcher import run_local

    if args.resume:
        config = resume_config(args)
        path, out = Path(args.resume) / "config.yaml", args.resume
    else:
        path = resolve_config_path(args.config)
        config = load_config(path, args.set)
        out = args.out or default_out_dir(config.name)
    _startup_done()
    return run_local(path, args.set, config, out, main, args.overwrite, args.devices, args.metrics_port,
                     resume=bool(args.resume))


def _health(args: argparse.Namespace) -> int:
    """One health check; prints the status. 0: SERVING; 1: another status, or a service the
    server does not know; 4: no answer within --timeout."""
    from fedpart.common.process.exit_codes import ExitCode
    from fedpart.common.wire.security import ClientSecurity

    if args.timeout <= 0:
        raise ValueError("--timeout must be a positive number of seconds")
    security = ClientSecurity.from_options(args.ca, args.server_name, args.token_file,
                                           args.cert, args.key, args.insecure, credential_required=False)
    import grpc

    from fedpart.server.transport.health import check_health

    try:
        status = check_health(args.server, security, args.service, args.timeout)
    except grpc.RpcError as error:
        unknown = error.code() == grpc.StatusCode.NOT_FOUND
        reason = (f"{args.server} knows no service {args.service!r}" if unknown else
                  f"no answer from {args.server} within {args.timeout:g} s ({error.code().name}: {error.details()})")
        print(f"fedpart health: error: {reason}", file=sys.stderr, flush=True)
        return ExitCode.ERROR if unknown else ExitCode.UNREACHABLE
    print(status, flush=True)
    return ExitCode.COMPLETED if status == "SERVING" else ExitCode.ERROR


def port_number(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")
    return port


def _certs(args: argparse.Namespace) -> int:
    from fedpart.deploy.certs import write_run_credentials

    written = write_run_credentials(Path(args.out), args.server_names.split(","), args.clients, args.processes)
    print(f"wrote {len(written)} files to {args.out}: {', '.join(p.name for p in written)}")
    return 0


def _link(args: argparse.Namespace):
    from fedpart.report.link import Link

    return Link.from_options(args.link, args.uplink, args.downlink, args.rtt, args.server_link, args.round_trips)


def parse_target(text: str) -> float:
    """``--target``: an accuracy as a fraction (``0.9``) or a percentage (``90%``)."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an accuracy (0.9 or 90%)") from None


def bundled_configs() -> dict[str, str]:
    """Each bundled config's name and the first line of its header comment."""
    found = {}
    for entry in sorted(resources.files("fedpart.configs").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            found[entry.name.removesuffix(".yaml")] = first_sentence(
                " ".join(line.lstrip("# ") for line in entry.read_text().splitlines() if line.startswith("#")))
    return found


def first_sentence(text: str) -> str:
    """``text`` up to its first full stop (not the one of "et al."), without reST markup."""
    text = " ".join(text.replace("``", "").split())
    end = re.search(r"(?<! al)\. ", text)
    return text if end is None else text[:end.start() + 1]


def _configs(args: argparse.Namespace) -> int:
    for name, description in bundled_configs().items():
        print(f"{name:<32} {description}")
    return 0


def _algorithms(args: argparse.Namespace) -> int:
    from fedpart.common.ml.algorithms import ALGORITHMS

    for name, component in ALGORITHMS.builtin().items():
        print(f"{name:<26} {first_sentence(component.description)}".rstrip())
    return 0


def _report(args: argparse.Namespace) -> int:
    from fedpart.report.build import write_report

    report = write_report(args.run_dirs, args.out, _link(args), args.target, args.overwrite)
    print(f"wrote {report.page} ({len(report.figures)} figures, table.csv, table.md, rounds.csv)")
    for line in report.missing:
        print(f"note: {line}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from fedpart.common.config.run_config import load_config
    from fedpart.cli.compare import compare, parse_algorithms, parse_engines, parse_seeds

    path = resolve_config_path(args.config)
    algorithms = parse_algorithms(args.algorithms)
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    engines = parse_engines(args.engines) if args.engines is not None else None
    out = Path(args.out or default_out_dir(f"compare-{load_config(path).name}"))
    _startup_done()
    return compare(path, algorithms, args.set, out, _link(args), args.target, main, seeds, args.vary_partition,
                   engines)


def _add_link_options(parser: argparse.ArgumentParser) -> None:
    link = parser.add_argument_group('time on a link (docs/reports.md, "Time on a link")')
    link.add_argument("--link", metavar="RATE/RTT", help="every client's link, both directions, e.g. 10Mbit/50ms")
    link.add_argument("--uplink", metavar="RATE", help="client upload rate (bit, kbit, Mbit, Gbit per second)")
    link.add_argument("--downlink", metavar="RATE", help="client download rate")
    link.add_argument("--rtt", metavar="DURATION", help="round-trip time (us, ms, s)")
    link.add_argument("--server-link", metavar="RATE",
                      help="the server's link, shared by all clients' transfers (each direction; "
                           "default: not a bottleneck)")
    link.add_argument("--round-trips", type=int, default=2, metavar="N",
                      help="round trips per client and round (default 2: fetch the task, upload the result)")
    link.add_argument("--target", type=parse_target, metavar="ACCURACY",
                      help="accuracy for time to accuracy, e.g. 0.9 or 90%% (default: the highest every run reaches)")


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that names each option's default, where it has one its own help does not state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, [], argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _subcommand_parser(**kwargs: object) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(formatter_class=HelpWithDefaults, **kwargs)


DESCRIPTION = ("Multi-process federated learning over gRPC for partial-parameter (body/head) algorithms: "
               "run a coordinator (server) and client processes across machines, or all of them here (run); "
               "make their certificates (certs); report and compare runs; export personalized models.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedpart", description=DESCRIPTION, formatter_class=HelpWithDefaults)
    parser.add_argument("--version", action="version", version=f"fedpart {version('fedpart')}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_subcommand_parser)

    server = commands.add_parser("server", help="run the coordinator")
    server.add_argument("config", nargs="?", help="config file or bundled config name (not with --resume)")
    server.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT to listen on (port 0: any free)")
    server.add_argument("--out", help="run directory (default runs/<name>-<time>); one that holds a run is refused "
                                      "(continue it with --resume, or --overwrite it)")
    server.add_argument("--overwrite", action="store_true",
                        help="replace the run in --out (removed only once the server listens)")
    server.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    server.add_argument("--threads", type=int, default=1,
                        help="torch threads for aggregation (default 1: leaves the cores to co-located clients)")
    server.add_argument("--tls-cert", help="server certificate (PEM); with --tls-key turns TLS on")
    server.add_argument("--tls-key", help="server private key (PEM)")
    server.add_argument("--client-ca", help="mutual TLS: client certificates must chain to this CA (PEM)")
    server.add_argument("--credentials", help="YAML naming the client processes admitted and their client ids")
    server.add_argument("--insecure", action="store_true",
                        help="plaintext without client authentication: any process that reaches the port can "
                             "join (needed for a server without TLS, on loopback too)")
    server.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the stopped run in RUN_DIR after its last completed round (same run id, "
                             "config from RUN_DIR/config.yaml), with the same --address, TLS files and "
                             "--credentials it was served with (a stopped server prints the exact command). "
                             "Client processes left running rejoin by themselves if the server is back within "
                             "their --reconnect-timeout (default 300 s); restart those that exited (after that "
                             "time, or after Ctrl-C) with their own commands")
    server.add_argument("--new-credentials", action="store_true",
                        help="with --resume: take a credentials file other than the one the run was served with "
                             "(replaced on purpose; otherwise refused)")
    server.add_argument("--resume-command", help=argparse.SUPPRESS)  # fedpart run: the command its hints print
    server.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                        help="auto: a live display on a terminal, plain lines otherwise; plain; json: progress as "
                             "machine-readable lines (what fedpart run reads)")
    server.add_argument("--health-port", type=port_number, metavar="PORT",
                        help="also answer gRPC health checks (grpc.health.v1 Check, nothing else) in plaintext on "
                             "this port of the --address host, for probes that cannot use TLS (Kubernetes' gRPC "
                             "probes); the --address port answers them too, without a token")
    server.add_argument("--metrics-port", type=port_number, metavar="PORT",
                        help="serve Prometheus metrics (plain HTTP, /metrics) on this port of the --address host "
                             "(needs: pip install 'fedpart[metrics]'; default: off)")
    server.add_argument("--yield-to-training", action=argparse.BooleanOptionalAction, default=True,
                        help="the server's threads wait for the scheduler's next tick instead of taking a core "
                             "from client processes training on this host when they wake up (Linux "
                             "SCHED_BATCH, same CPU share; default: on, which changes nothing on a machine of "
                             "the server's own)")
    server.set_defaults(handler=_server)

    client = commands.add_parser("client", help="run a client process hosting one or more clients")
    client.add_argument("--server", required=True, help="the server's HOST:PORT (the port of its --address)")
    client.add_argument("--clients", required=True, help="client ids, e.g. 0-9 or 3,5,7")
    client.add_argument("--device", default="cpu",
                        help="cpu, cuda:N, or auto: the first visible GPU, else the CPU (default cpu)")
    client.add_argument("--data-root", help="local data root (default: the config's data.root)")
    client.add_argument("--state-dir", default="fedpart-state", help="where personal parts and models stay")
    client.add_argument("--threads", type=int,
                        help="torch threads (default: an even share of the cores available to this process, its "
                             "CPU affinity or cgroup CPU quota, whichever is fewer, among the client processes "
                             "running on this host, which find each other by themselves; looked at again "
                             "before each task)")
    client.add_argument("--ca", help="CA certificate that signed the server's (PEM; default: system roots)")
    client.add_argument("--server-name", help="name to expect in the server certificate (default: the host)")
    client.add_argument("--token-file", help="file holding this process's token (or set FEDPART_TOKEN)")
    client.add_argument("--cert", help="client certificate for mutual TLS (PEM)")
    client.add_argument("--key", help="client private key for mutual TLS (PEM)")
    client.add_argument("--insecure", action="store_true",
                        help="plaintext, no TLS and no credential (for a server started with --insecure)")
    client.add_argument("--connect-timeout", type=float, metavar="SECONDS",
                        help="how long to keep trying to reach the server at the start, with a log line per "
                             "attempt, before exiting with code 4 (default 120)")
    client.add_argument("--reconnect-timeout", type=float, metavar="SECONDS",
                        help="how long to keep trying to reach a server that went away, e.g. while it is "
                             "resumed (default 300)")
    client.set_defaults(handler=_client)

    run = commands.add_parser("run", help="run server and client processes on this machine")
    run.add_argument("config", nargs="?", help=f"config file or bundled name (default {DEFAULT_CONFIG})")
    run.add_argument("--out", help="run directory (default runs/<name>-<time>); one that holds a run is refused")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the run in --out (removed only once the server listens)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    run.add_argument("--devices", metavar="DEVICES",
                     help="one client process per device, with an even share of the client ids: e.g. "
                          "cuda:0,cuda:1 (repeat a device to share it: cuda:0,cuda:0) or auto (every visible GPU; "
                          "the CPU where there is none); replaces the config's processes (default: processes "
                          "client processes on the CPU)")
    run.add_argument("--metrics-port", type=port_number, metavar="PORT",
                     help="the server's Prometheus metrics on 127.0.0.1:PORT/metrics (as fedpart server; default: off)")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue the stopped run in RUN_DIR (a fedpart run stopped by Ctrl-C, or whose "
                          "processes died) after its last completed round: its server resumed, its client "
                          "processes started again on their state in RUN_DIR/state")
    run.set_defaults(handler=_run)

    health = commands.add_parser("health", help="ask a server whether it is serving (gRPC health check); "
                                                "exit 0 when SERVING")
    health.add_argument("--server", required=True, help="HOST:PORT: the server's address or its --health-port")
    health.add_argument("--service", default="", help="'' (default): the server itself; fedpart.v1.Coordinator: "
                                                      "its run (NOT_SERVING once the run ended)")
    health.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="wait for the answer (default 5)")
    health.add_argument("--ca", help="CA certificate that signed the server's (PEM), for its TLS port")
    health.add_argument("--server-name", help="name to expect in the server certificate (default: the host)")
    health.add_argument("--token-file", help="a client process's token (not needed for a health check)")
    health.add_argument("--cert", help="client certificate, where the server requires mutual TLS (PEM)")
    health.add_argument("--key", help="client private key (PEM)")
    health.add_argument("--insecure", action="store_true",
                        help="plaintext: a --health-port, or a server started with --insecure")
    health.set_defaults(handler=_health)

    certs = commands.add_parser("certs", help="make a CA, server certificate, client certificates and tokens")
    certs.add_argument("--out", required=True, help="directory to write (must not hold earlier credentials)")
    certs.add_argument("--server-names", required=True,
                       help="host names and IP addresses clients use for the server, comma-separated")
    certs.add_argument("--clients", type=int, required=True, help="number of client ids of the run")
    certs.add_argument("--processes", type=int, required=True, help="client processes to make credentials for")
    certs.set_defaults(handler=_certs)

    report = commands.add_parser("report", help="HTML page, figures and tables from run directories "
                                                "(needs: pip install 'fedpart[report]')")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (fedpart run/server --out)")
    report.add_argument("--out", required=True,
                        help="folder for index.html, table.csv, table.md, rounds.csv and the PNG figures")
    report.add_argument("--overwrite", action="store_true", help="replace the report in a non-empty --out folder")
    _add_link_options(report)
    report.set_defaults(handler=_report)

    compare = commands.add_parser("compare", help="run one config once per algorithm (same seed, partition and "
                                                  "sampled clients), then report (needs the report extra too)")
    compare.add_argument("config", nargs="?", help=f"config file or bundled name (default {DEFAULT_CONFIG})")
    compare.add_argument("--algorithms", required=True, help="comma-separated, e.g. fedavg,fedbabu,fedper")
    compare.add_argument("--set", action="append", default=[], metavar="[ALGORITHM:]KEY=VALUE",
                         help="override a setting for every run, or with ALGORITHM: for that algorithm's run only")
    compare.add_argument("--out", help="folder for the runs (OUT/<algorithm>, with --seeds OUT/<algorithm>/seed<S>) "
                                       "and the report (OUT/report); default runs/compare-<name>-<time>")
    compare.add_argument("--seeds", metavar="S,S,...",
                         help="run each algorithm once per seed, e.g. 0,1,2: seeds.init, seeds.sampling and "
                              "seeds.training set to S over one partition; the report shows mean ± std")
    compare.add_argument("--vary-partition", action="store_true",
                         help="with --seeds: also set the run's seed to S, so that the partition varies too")
    compare.add_argument("--engines", metavar="ENGINE,...",
                         help="run each algorithm (and seed) once per round engine, e.g. sync,buffered "
                              "(server.engine), into OUT/<algorithm>/<engine>")
    _add_link_options(compare)
    compare.set_defaults(handler=_compare)
    add_export_parser(commands)
    commands.add_parser("configs", help="list the bundled configs (name them instead of a file)").set_defaults(
        handler=_configs)
    commands.add_parser("algorithms", help="list the algorithms (algorithm.name)").set_defaults(handler=_algorithms)
    verbose_help = (f"log everything, and show gRPC's own log lines (handshake failures, ...) on stderr, for this "
                    f"command and the processes it starts (or set {VERBOSE_ENV}=1); by default gRPC stays quiet")
    quiet_help = ("log only warnings and errors (no round lines), for this command and the processes it starts; "
                  "tables and results are still printed")
    for target, default in [(parser, False), *((command, argparse.SUPPRESS) for command in commands.choices.values())]:
        volume = target.add_mutually_exclusive_group()  # also after the command: fedpart client ... --verbose
        volume.add_argument("--verbose", action="store_true", default=default, help=verbose_help)
        volume.add_argument("--quiet", action="store_true", default=default, help=quiet_help)
    return parser


def quiet_grpc_logging(verbose: bool) -> None:
    """gRPC's C core logs on stderr by itself (a failed TLS handshake, a closed socket): lines
    that say less than fedpart's own errors and alarm more. Unless ``verbose`` (or
    ``FEDPART_VERBOSE=1``) they are off: ``GRPC_VERBOSITY=NONE`` (grpcio >= 1.85 knows it) and no
    ``GRPC_TRACE``. gRPC reads these when it is first imported, so call this before; the processes
    a command starts inherit the choice through the environment."""
    if verbose or os.environ.get(VERBOSE_ENV) == "1":
        os.environ[VERBOSE_ENV] = "1"
        return
    os.environ["GRPC_VERBOSITY"] = "NONE"
    os.environ.pop("GRPC_TRACE", None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_grpc_logging(args.verbose)
    if args.quiet or args.verbose:
        set_log_level("quiet" if args.quiet else "verbose")
    from fedpart.common.process.exit_codes import ExitCode, Stopped, stop_on_signals

    try:
        with stop_on_signals():
            return args.handler(args)
    except Stopped as stop:
        print(f"fedpart {args.command}: {stop.reason}", file=sys.stderr, flush=True)
        return stop.code
    except (ValueError, FileNotFoundError, ImportError) as error:  # ConfigError is a ValueError
        return _fail(args, error, ExitCode.USAGE)


def command() -> NoReturn:
    """The ``fedpart`` command (console script and ``python -m fedpart``): :func:`main`, then exit
    with its code.

    Importing torch, gRPC and Numba makes hundreds of thousands of objects that live as long as
    the process, and each full pass of the cyclic garbage collector walks all of them: several
    passes while they are made, one more in the interpreter's teardown. So the collector is off
    while the process starts; a command that goes on working turns it on once its imports are
    done, with what exists by then frozen out of its passes (:func:`_startup_done`); and at exit
    what is alive is frozen again, so the teardown does not walk it. Files are closed and the
    standard streams flushed as always; only cyclic garbage left at exit is not finalized."""
    gc.disable()
    code = main()
    gc.freeze()
    sys.exit(code)


def _startup_done() -> None:
    """The process has imported what it works with: freeze those objects out of the collector's
    passes and turn it on again (see :func:`command`)."""
    gc.freeze()
    gc.enable()


if __name__ == "__main__":
    command()
