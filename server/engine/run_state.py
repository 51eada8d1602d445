"""The server's run state at the end of each completed round: enough to resume the run after a
crash with identical results (docs/architecture.md, Trust; ``fedpart server --resume RUN_DIR``).

Layout in the run directory: ``server_state/round_NNNN.safetensors`` holds the global tensors,
FedHA's head dictionary, the server optimizer's state (``fedpart.server.policy.optimizers``: FedAvgM's
momentum, FedAdam's moments, FedDyn's ``h``) and the round engine's tensors (the buffered engine's
earlier global versions that tasks in flight train on); ``server_state/state.json`` names that
file and holds the rest (run id, last completed round, tensor versions, task-id counter, failures,
which clients hold which personal parts, byte totals per client, the config the run started with,
the round engine's state (the virtual clock, the buffered engine's tasks in flight), and how the
server was served: its transport, the fingerprint of its credentials file and the exact command
that resumes it, :func:`check_resume_security`). The tensors are
written first and ``state.json`` is replaced atomically after them, so the state on disk is
always that of one whole round. Never pickle.

What is not saved is recomputed from the round number and the seed: client sampling
(:func:`fedpart.server.engine.sampling.sample_clients`), the learning-rate schedule
(:func:`fedpart.common.ml.algorithms.learning_rate`), the training plans and their seeds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedpart.common.process.checkpoint import load_tensors, save_tensors

FORMAT = 2  # 2: the server optimizer's state
STATE_DIR = "server_state"
STATE_FILE = "state.json"
# Ledger round under which a resumed server keeps the bytes counted before it was stopped; the
# per-round bytes of those rounds stay in metrics.jsonl.
EARLIER_ROUNDS = -1
_GLOBAL = "global/"
_HEADS = "heads/"
_OPTIMIZER = "server_optimizer/"
_ENGINE = "engine/"

ByPart = dict[str, dict[str, int]]  # {part: {"down": n, "up": n}}


class ResumeError(ValueError):
    """A run directory that cannot be resumed (the message says why)."""


@dataclass
class RunState:
    """Everything the coordinator needs to continue a run after round ``round``."""

    run_id: str
    round: int                                  # last completed round (0: none yet)
    global_state: dict[str, torch.Tensor]
    versions: dict[str, int]
    next_task_id: int
    personal: dict[int, list[str]]              # parts each client holds a personal copy of
    heads: dict[int, tuple[dict[str, torch.Tensor], float]]  # FedHA head dictionary: tensors, weight
    failures: list[str]
    bytes_by_client: dict[int, ByPart]          # byte ledger totals per client (-1: per process)
    seconds: float                              # server wall time so far
    config: dict[str, Any] = field(default_factory=dict)
    server_optimizer: dict[str, torch.Tensor] = field(default_factory=dict)  # its named state tensors
    finished: bool = False                      # the final evaluation and summary are written
    operational_changes: list[str] = field(default_factory=list)  # "key: old -> new" a resume changed
    security: dict[str, Any] = field(default_factory=dict)  # transport, credentials_sha256, command
    engine: dict[str, Any] = field(default_factory=dict)    # the round engine's own state (virtual clock, buffer)
    engine_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # its named tensors


def _state_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / STATE_DIR


def _write_json(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=1))
    os.replace(tmp, path)


def write_run_state(run_dir: str | Path, state: RunState) -> None:
    """Save ``state`` (tensors first, then the JSON that names them) and drop older tensor files."""
    directory = _state_dir(run_dir)
    tensor_file = f"round_{state.round:04d}.safetensors"
    tensors = {_GLOBAL + name: tensor for name, tensor in state.global_state.items()}
    for client, (head, _) in state.heads.items():
        tensors.update({f"{_HEADS}{client}/{name}": tensor for name, tensor in head.items()})
    tensors.update({_OPTIMIZER + name: tensor for name, tensor in state.server_optimizer.items()})
    tensors.update({_ENGINE + name: tensor for name, tensor in state.engine_tensors.items()})
    save_tensors(directory / tensor_file, tensors)
    _write_json(directory / STATE_FILE, {
        "format": FORMAT,
        "run_id": state.run_id,
        "round": state.round,
        "finished": state.finished,
        "tensors": tensor_file,
        "versions": state.versions,
        "next_task_id": state.next_task_id,
        "personal": {str(c): parts for c, parts in state.personal.items()},
        "head_weights": {str(c): weight for c, (_, weight) in state.heads.items()},
        "failures": state.failures,
        "bytes_by_client": {str(c): by_part for c, by_part in state.bytes_by_client.items()},
        "seconds": state.seconds,
        "config": state.config,
        "security": state.security,
        "engine": state.engine,
    })
    for old in directory.glob("round_*.safetensors"):
        if old.name != tensor_file:
            old.unlink()


def mark_finished(run_dir: str | Path) -> None:
    """Record that the run is complete: a later ``--resume`` refuses it."""
    path = _state_dir(run_dir) / STATE_FILE
    content = json.loads(path.read_text())
    content["finished"] = True
    _write_json(path, content)


def read_run_state(run_dir: str | Path, config: dict[str, Any]) -> RunState:
    """The saved state of the run in ``run_dir``, started with ``config`` (``RunConfig.to_dict()``).

    Raises :class:`ResumeError` when there is nothing to resume, the run already finished, its
    config was changed since it started, or the state is unreadable.
    """
    path = _state_dir(run_dir) / STATE_FILE
    if not path.is_file():
        raise ResumeError(f"{run_dir} has no resumable run state ({STATE_DIR}/{STATE_FILE} is missing): "
                          "not a run directory of a fedpart server, or its server never started a round")
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ResumeError(f"{path}: unreadable run state ({error})") from error
    if content.get("format") != FORMAT:
        raise ResumeError(f"{path}: run state format {content.get('format')!r}, this fedpart reads {FORMAT}")
    if content["finished"]:
        raise ResumeError(f"run {content['run_id']} in {run_dir} already finished (summary.json is written); "
                          "nothing to resume")
    changed = _differences(content["config"], config)
    defining = [key for key in changed if not is_operational(key)]
    if defining:
        raise ResumeError(f"the config differs from the one run {content['run_id']} started with in "
                          f"{', '.join(defining)}; a resumed run keeps what defines its experiment (only "
                          "server.* timeouts and limits may change)")
    try:
        tensors = load_tensors(_state_dir(run_dir) / content["tensors"])
    except (OSError, ValueError) as error:
        raise ResumeError(f"run state of {run_dir}: {error}") from error
    heads: dict[int, tuple[dict[str, torch.Tensor], float]] = {
        int(c): ({}, weight) for c, weight in content["head_weights"].items()}
    for key, tensor in tensors.items():
        if key.startswith(_HEADS):
            client, name = key[len(_HEADS):].split("/", 1)
            heads[int(client)][0][name] = tensor
    return RunState(
        run_id=content["run_id"],
        round=content["round"],
        global_state={k[len(_GLOBAL):]: v for k, v in tensors.items() if k.startswith(_GLOBAL)},
        versions=content["versions"],
        next_task_id=content["next_task_id"],
        personal={int(c): parts for c, parts in content["personal"].items()},
        heads=heads,
        failures=content["failures"],
        bytes_by_client={int(c): by_part for c, by_part in content["bytes_by_client"].items()},
        seconds=content["seconds"],
        config=content["config"],
        operational_changes=[f"{key}: {_value(content['config'], key)} -> {_value(config, key)}" for key in changed],
        server_optimizer={k[len(_OPTIMIZER):]: v for k, v in tensors.items() if k.startswith(_OPTIMIZER)},
        security=content.get("security", {}),
        engine=content.get("engine", {}),
        engine_tensors={k[len(_ENGINE):]: v for k, v in tensors.items() if k.startswith(_ENGINE)},
    )


# Transports from weakest to strongest: a run resumes with the transport it had or a stronger one.
TRANSPORTS = ("plaintext", "TLS", "mutual TLS")


def check_resume_security(saved: dict[str, Any], transport: str, credentials_sha256: str,
                          new_credentials: bool) -> None:
    """Raise :class:`ResumeError` unless a resumed server keeps the security its run had
    (``saved``, from the run state): the same transport or a stronger one, and the same
    credentials file (its SHA-256) unless ``new_credentials`` (the operator replaced it on
    purpose). The error gives the exact command that resumes the run as it was served."""
    if not saved:
        return  # a run state from before fedpart recorded it
    command = saved.get("command", "")
    again = f"; resume it as it was served: {command}" if command else ""
    was = saved.get("transport", "plaintext")
    if TRANSPORTS.index(transport) < TRANSPORTS.index(was):
        raise ResumeError(f"the run was served with {was}, this server would serve it with {transport} (a resume "
                          f"never weakens a run's transport){again}")
    if saved.get("credentials_sha256") and credentials_sha256 != saved["credentials_sha256"] and not new_credentials:
        given = "no credentials file" if not credentials_sha256 else f"a credentials file with SHA-256 {credentials_sha256[:16]}"
        raise ResumeError(f"the run admitted the client processes of a credentials file with SHA-256 "
                          f"{saved['credentials_sha256'][:16]}, this server was given {given}{again} (or add "
                          "--new-credentials to resume with a replaced credentials file on purpose)")


def is_operational(key: str) -> bool:
    """Whether a resumed run may change the dotted config ``key``: the server's timeouts and limits
    (how long it waits, how it moves and folds bytes; the fold's sum does not depend on how many
    workers make it) change when a run ends, never what it computes. The straggler deadline
    decides which results a round folds, and the engine how rounds run: they are not among them."""
    return key.startswith("server.") and key not in ("server.round_deadline_factor", "server.engine")


def _value(config: dict[str, Any], key: str) -> Any:
    for name in key.split("."):
        config = config.get(name) if isinstance(config, dict) else None
    return config


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [key for name in sorted(set(saved) | set(current))
                for key in _differences(saved.get(name), current.get(name), f"{prefix}{name}.")]
    return [] if saved == current else [prefix.rstrip(".")]
