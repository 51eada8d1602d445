"""The ``fedpart`` command: ``server``, ``client`` and ``run`` (all processes on this machine)."""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

from fedpart.common.config import ConfigError, RunConfig, load_config

DEFAULT_CONFIG = "quickstart"


def resolve_config_path(name: str | None) -> Path:
    """A config file path, or the name of a bundled config (``quickstart``, ``mnist_cnn2``, ...)."""
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
    import torch

    from fedpart.server.main import main_server

    torch.set_num_threads(args.threads)
    if args.resume:
        return main_server(resume_config(args), args.address, args.resume, resume=True)
    if args.config is None:
        raise ConfigError("fedpart server needs a CONFIG (or --resume RUN_DIR)")
    config = load_config(resolve_config_path(args.config), args.set)
    return main_server(config, args.address, args.out or default_out_dir(config.name))


def resume_config(args: argparse.Namespace) -> RunConfig:
    """The config of the run ``--resume RUN_DIR`` continues: RUN_DIR/config.yaml, unchanged."""
    if args.config is not None:
        raise ConfigError(f"--resume takes the config from {args.resume}/config.yaml; give no CONFIG ({args.config})")
    if args.set:
        raise ConfigError(f"--resume continues the run as it was configured; --set {args.set[0]} would change it")
    if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
        raise ConfigError(f"--resume writes into {args.resume} itself; --out {args.out} names another directory")
    path = Path(args.resume) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {args.resume}: not a run directory (no config.yaml)")
    return load_config(path)


def _client(args: argparse.Namespace) -> int:
    from fedpart.client.runtime import ClientError, ClientProcess, parse_client_ids

    try:
        process = ClientProcess(args.server, parse_client_ids(args.clients), device=args.device,
                                data_root=args.data_root, state_dir=args.state_dir, threads=args.threads,
                                reconnect_timeout=args.reconnect_timeout)
        return process.run()
    except (ClientError, OSError, ValueError, ImportError, TypeError) as error:
        print(f"fedpart client: error: {error}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace) -> int:
    from fedpart.deploy.launcher import run_local

    path = resolve_config_path(args.config)
    config = load_config(path, args.set)
    return run_local(path, args.set, config, args.out or default_out_dir(config.name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedpart", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    server = commands.add_parser("server", help="run the coordinator")
    server.add_argument("config", nargs="?", help="config file or bundled config name (not with --resume)")
    server.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT to listen on (port 0: any free)")
    server.add_argument("--out", help="run directory (default runs/<name>-<time>)")
    server.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    server.add_argument("--threads", type=int, default=1,
                        help="torch threads for aggregation (default 1: leaves the cores to co-located clients)")
    server.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the stopped run in RUN_DIR after its last completed round (same run id, "
                             "config from RUN_DIR/config.yaml); its clients reconnect by themselves")
    server.set_defaults(handler=_server)

    client = commands.add_parser("client", help="run a client process hosting one or more clients")
    client.add_argument("--server", required=True, help="coordinator HOST:PORT")
    client.add_argument("--clients", required=True, help="client ids, e.g. 0-9 or 3,5,7")
    client.add_argument("--device", default="cpu", help="cpu or cuda:N")
    client.add_argument("--data-root", help="local data root (default: the config's data.root)")
    client.add_argument("--state-dir", default="fedpart-state", help="where personal parts and models stay")
    client.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    client.add_argument("--reconnect-timeout", type=float, metavar="SECONDS",
                        help="how long to keep trying to reach a server that went away, e.g. while it is "
                             "resumed (default 300)")
    client.set_defaults(handler=_client)

    run = commands.add_parser("run", help="run server and client processes on this machine")
    run.add_argument("config", nargs="?", help=f"config file or bundled name (default {DEFAULT_CONFIG})")
    run.add_argument("--out", help="run directory (default runs/<name>-<time>)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    run.set_defaults(handler=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, ValueError, FileNotFoundError, ImportError) as error:
        print(f"fedpart {args.command}: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
