"""What a client process does to a task's answer beside training: each mechanism a *mod* around
the worker's pure ``execute(task) -> Reply`` (as Flower wraps a client app in mods,
``mod(message, context, call_next)``).

A mod sees the task on its way in and the :class:`Reply` on its way out, and may answer a task
without calling the rest (secure aggregation's own steps). The worker
(:mod:`fedpart.client.runtime`) knows none of them: it builds them from the run's config with
:func:`build_mods`, composes them around its ``execute`` and turns the final reply into the
wire's :class:`~fedpart.client.session.Answer` with :func:`pack`. A new mechanism is one module
with a ``build(context) -> Mod | None`` and its place in :data:`MODS`.

The order of :data:`MODS`, outermost first, is the order a reply passes them backwards:
training's reply is first given its DP-SGD spending, then clipped (user-level DP), then held back
by secure aggregation (which answers its keys instead, and the steps that follow), then
encoded by the upload codec (compression with error feedback), which is what goes on the wire;
last, an emulated slower device (heterogeneity) holds the whole task for its device's time.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from fedpart.client.session import Answer
from fedpart.client.store import ClientStore
from fedpart.common.wire.codecs import Encoded
from fedpart.common.config.run_config import RunConfig
from fedpart.common.wire.plans import SecAggAnswer, TaskInfo
from fedpart.common.wire.tensors import serialized_pieces, wire_form


@dataclass
class Reply:
    """A task's answer before it goes on the wire, as the worker made it and the mods changed it."""

    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    uploads: dict[str, torch.Tensor] = field(default_factory=dict)  # on the host, in the order they are sent
    encoded: dict[str, Encoded] = field(default_factory=dict)       # the wire forms of some uploads, by name
    step_answer: SecAggAnswer | None = None                         # the answer to a step of a protocol
    train_report: object | None = None                              # what training reported (TrainOutcome)
    on_taken: list[Callable[[], None]] = field(default_factory=list)  # run once the server has the result


Execute = Callable[[TaskInfo], Reply]


class Mod(Protocol):
    """One mechanism around ``execute``: returns ``call_next(task)``, changed, or an answer of its
    own. ``train_options`` are keyword arguments it adds to the local training
    (:func:`~fedpart.client.training.train_local`)."""

    train_options: dict[str, object]

    def __call__(self, task: TaskInfo, call_next: Execute) -> Reply: ...


@dataclass
class WorkerContext:
    """What a mod may need of its process: the run's config, the clients' store on disk, the run
    id, the process's log and its wait (which a stop of the process ends early)."""

    config: RunConfig
    store: ClientStore
    run_id: str
    log: Callable[[str], None]
    wait: Callable[[float], None] = time.sleep


MODS = ("heterogeneity", "compression", "secure_aggregation", "dp_clip", "dp_sgd_ledger")
"""The registered mods, outermost first: modules of this package, each with a
``build(context) -> Mod | None``."""


def build_mods(context: WorkerContext) -> list[Mod]:
    """The mods the run's config turns on, outermost first."""
    modules = [importlib.import_module(f"{__name__}.{name}") for name in MODS]
    return [mod for module in modules if (mod := module.build(context)) is not None]


def train_options(mods: Iterable[Mod]) -> dict[str, object]:
    """The keyword arguments the mods add to local training."""
    return {key: value for mod in mods for key, value in mod.train_options.items()}


def compose(mods: Sequence[Mod], execute: Execute) -> Execute:
    """``execute`` wrapped in ``mods``, the first outermost."""
    for mod in reversed(mods):
        execute = partial(mod, call_next=execute)
    return execute


def pack(task: TaskInfo, reply: Reply, chunk_bytes: int) -> Answer:
    """The wire answer of ``reply``: its uploads (in their wire forms where a mod encoded them)
    in messages of at most ``chunk_bytes``."""
    forms = [wire_form(name, tensor, reply.encoded.get(name)) for name, tensor in reply.uploads.items()]
    specs = [spec for spec, _ in forms]
    tensors = [tensor for _, tensor in forms]

    def taken() -> None:
        for callback in reply.on_taken:
            callback()

    return Answer(reply.samples, reply.metrics, specs, lambda: _pieces(tensors, chunk_bytes), taken,
                  reply.step_answer)


def _pieces(tensors: Iterable[torch.Tensor], chunk_bytes: int) -> Iterable[bytes]:
    return serialized_pieces(tensors, chunk_bytes)
