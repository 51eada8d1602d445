"""Partial-parameter algorithms as declarations over sharing, schedule, upload and aggregation.

An :class:`Algorithm` says which role the body and the head play (sharing), which schedule units
train in each local phase of a round (schedule), and optionally a client objective term (FedProx)
. Upload and aggregation follow from the roles: trainable ``GLOBAL`` tensors go back as deltas and
are averaged; ``COLLECTED`` tensors go back whole into a per-client dictionary whose mean is the
global copy (FedHA); ``FIXED`` and ``PERSONAL`` tensors never go back. Adding an algorithm means
adding a small factory to :data:`ALGORITHMS`; the round engine stays the same.
"""

from __future__ import annotations

import math
from fractions import Fraction
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from fedpart.common.split_model import HEAD, tensor_part, tensor_unit


class Role(str, Enum):
    """What happens to a part (body or head) of the model."""

    GLOBAL = "global"        # sent down, trained, deltas aggregated on the server
    FIXED = "fixed"          # sent down, identical everywhere, never trained during the rounds
    PERSONAL = "personal"    # initialised once from the global copy, then never leaves the client
    COLLECTED = "collected"  # personal on the client, uploaded whole; server keeps one per client


@dataclass(frozen=True)
class RoundContext:
    """What a schedule may depend on."""

    round: int               # 1-based
    rounds: int
    units: tuple[str, ...]   # body units, input to output (the head is ``HEAD``)
    epochs: int              # configured local epochs per round


@dataclass(frozen=True)
class Phase:
    """A stretch of local training in which ``trainable`` units train (see the proto's Phase)."""

    epochs: int
    trainable: tuple[str, ...]
    unfreeze_fraction: float = 0.0


Schedule = Callable[[RoundContext], tuple[Phase, ...]]


@dataclass(frozen=True)
class Algorithm:
    """One partial-parameter algorithm: roles of body and head, a schedule, an objective term."""

    name: str
    body: Role
    head: Role
    schedule: Schedule
    proximal_mu: float = 0.0

    def role(self, tensor_name: str) -> Role:
        """Role of a state-dict entry; tensors outside body and head follow the body."""
        return self.head if tensor_part(tensor_name) == "head" else self.body

    @property
    def personal_parts(self) -> tuple[str, ...]:
        """Parts that live on the client (initialised once from the global copy)."""
        return tuple(part for part, role in (("body", self.body), ("head", self.head))
                     if role in (Role.PERSONAL, Role.COLLECTED))

    def shared_names(self, names: Iterable[str]) -> list[str]:
        """Tensors a client receives every time they change (global and fixed parts)."""
        return [n for n in names if self.role(n) in (Role.GLOBAL, Role.FIXED)]

    def personal_names(self, names: Iterable[str]) -> list[str]:
        """Tensors a client keeps for itself."""
        return [n for n in names if self.role(n) in (Role.PERSONAL, Role.COLLECTED)]

    def uploads(self, names: Iterable[str], phases: Iterable[Phase]) -> tuple[list[str], list[str]]:
        """(deltas, values) a client sends back after training ``phases``.

        Only tensors of units that actually train have a delta: frozen tensors are never sent.
        """
        trained = {unit for phase in phases for unit in phase.trainable}
        deltas, values = [], []
        for name in names:
            unit = tensor_unit(name)
            if (unit in trained) if unit is not None else bool(trained):
                role = self.role(name)
                if role is Role.GLOBAL:
                    deltas.append(name)
                elif role is Role.COLLECTED:
                    values.append(name)
        return deltas, values


# ---------------------------------------------------------------------------------------------
# Schedule building blocks


def train_everything(ctx: RoundContext) -> tuple[Phase, ...]:
    """All units and the head train for the configured epochs."""
    return (Phase(ctx.epochs, ctx.units + (HEAD,)),)


def train_body(ctx: RoundContext) -> tuple[Phase, ...]:
    """Only the body trains (FedBABU: the head stays at its random initialisation)."""
    return (Phase(ctx.epochs, ctx.units),)


def gradual_unfreeze(ratio: float) -> Schedule:
    """FedBug (Kao & Wang 2023): over the first ``ratio`` of the local iterations the units,
    head last, unfreeze bottom-up; afterwards everything trains."""

    def schedule(ctx: RoundContext) -> tuple[Phase, ...]:
        return (Phase(ctx.epochs, ctx.units + (HEAD,), unfreeze_fraction=ratio),)

    return schedule


def expand_layers(unfreeze_rounds: list[int], order: str) -> Schedule:
    """Sequential layer expansion: body unit k joins training at round ``unfreeze_rounds[k]``.

    ``vanilla`` unfreezes shallow units first, ``anti`` deep units first; the head stays frozen
    during the rounds (it trains in the final fine-tuning).
    """

    def schedule(ctx: RoundContext) -> tuple[Phase, ...]:
        if len(unfreeze_rounds) != len(ctx.units):
            raise ValueError(f"algorithm.unfreeze_rounds has {len(unfreeze_rounds)} entries but the model has "
                             f"{len(ctx.units)} body units {list(ctx.units)}")
        ordered = ctx.units if order == "vanilla" else tuple(reversed(ctx.units))
        started = {unit for unit, start in zip(ordered, unfreeze_rounds) if ctx.round - 1 >= start}
        return (Phase(ctx.epochs, tuple(u for u in ctx.units if u in started)),)

    return schedule


def head_then_body(head_epochs: int, body_epochs: int) -> Schedule:
    """FedRep (Collins et al. 2021): head-only epochs, then body-only epochs."""

    def schedule(ctx: RoundContext) -> tuple[Phase, ...]:
        return (Phase(head_epochs, (HEAD,)), Phase(body_epochs, ctx.units))

    return schedule


def all_then_head(sync_epochs: int, head_epochs: int) -> Schedule:
    """FedFTHA: ``tau_sync`` epochs on body and head, then ``tau_head`` epochs on the head only."""

    def schedule(ctx: RoundContext) -> tuple[Phase, ...]:
        return (Phase(sync_epochs, ctx.units + (HEAD,)), Phase(head_epochs, (HEAD,)))

    return schedule


# ---------------------------------------------------------------------------------------------
# Declarations


class _Options:
    """Reads algorithm options, rejecting unknown ones with the setting's full name."""

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.name = name
        self.remaining = dict(options)

    def get(self, key: str, default: Any, kind: type = float) -> Any:
        value = self.remaining.pop(key, default)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise ValueError(f"algorithm.{key} for {self.name} must be {kind.__name__}, got {value!r}")
        return value

    def done(self) -> None:
        if self.remaining:
            raise ValueError(f"unknown option(s) {sorted(self.remaining)} for algorithm {self.name}")


def _fedavg(o: _Options) -> Algorithm:
    return Algorithm("fedavg", Role.GLOBAL, Role.GLOBAL, train_everything)


def _fedbabu(o: _Options) -> Algorithm:
    """FedBABU (Oh et al., ICLR 2022): body federated under a fixed random head."""
    return Algorithm("fedbabu", Role.GLOBAL, Role.FIXED, train_body)


def _fedprox(o: _Options) -> Algorithm:
    """FedProx (Li et al., MLSys 2020): proximal term on the shared parameters."""
    return Algorithm("fedprox", Role.GLOBAL, Role.GLOBAL, train_everything, proximal_mu=o.get("mu", 0.01))


def _fedprox_babu(o: _Options) -> Algorithm:
    return Algorithm("fedprox_babu", Role.GLOBAL, Role.FIXED, train_body, proximal_mu=o.get("mu", 0.01))


def _fedbug(o: _Options) -> Algorithm:
    """FedBug (Kao & Wang 2023), optionally with FedProx's term."""
    ratio = o.get("gu_ratio", 0.2)
    if not 0 < ratio <= 1:
        raise ValueError("algorithm.gu_ratio must be in (0, 1]")
    return Algorithm("fedbug", Role.GLOBAL, Role.GLOBAL, gradual_unfreeze(ratio), proximal_mu=o.get("mu", 0.0))


def _layer_expansion(order: str) -> Callable[[_Options], Algorithm]:
    def build(o: _Options) -> Algorithm:
        rounds = o.get("unfreeze_rounds", [0, 100, 200], list)
        if not all(isinstance(r, int) and r >= 0 for r in rounds) or rounds != sorted(rounds):
            raise ValueError("algorithm.unfreeze_rounds must be increasing non-negative round indices")
        return Algorithm(f"layer_expansion_{order}", Role.GLOBAL, Role.FIXED, expand_layers(rounds, order))

    return build


def _fedper(o: _Options) -> Algorithm:
    """FedPer (Arivazhagan et al. 2019): shared body, personal head."""
    return Algorithm("fedper", Role.GLOBAL, Role.PERSONAL, train_everything)


def _fedrep(o: _Options) -> Algorithm:
    head_epochs = o.get("head_epochs", 10, int)
    body_epochs = o.get("body_epochs", 1, int)
    return Algorithm("fedrep", Role.GLOBAL, Role.PERSONAL, head_then_body(head_epochs, body_epochs))


def _lg_fedavg(o: _Options) -> Algorithm:
    """LG-FedAvg (Liang et al. 2020): personal body, shared head."""
    return Algorithm("lg_fedavg", Role.PERSONAL, Role.GLOBAL, train_everything)


def _fedftha(o: _Options) -> Algorithm:
    sync_epochs = o.get("tau_sync", 5, int)
    head_epochs = o.get("tau_head", 5, int)
    return Algorithm("fedftha", Role.GLOBAL, Role.COLLECTED, all_then_head(sync_epochs, head_epochs))


def _local_only(o: _Options) -> Algorithm:
    return Algorithm("local_only", Role.PERSONAL, Role.PERSONAL, train_everything)


ALGORITHMS: dict[str, Callable[[_Options], Algorithm]] = {
    "fedavg": _fedavg,
    "fedbabu": _fedbabu,
    "fedprox": _fedprox,
    "fedprox_babu": _fedprox_babu,
    "fedbug": _fedbug,
    "layer_expansion_vanilla": _layer_expansion("vanilla"),
    "layer_expansion_anti": _layer_expansion("anti"),
    "fedper": _fedper,
    "fedrep": _fedrep,
    "lg_fedavg": _lg_fedavg,
    "fedftha": _fedftha,
    "local_only": _local_only,
}


def build_algorithm(name: str, options: Mapping[str, Any] | None = None) -> Algorithm:
    """The algorithm ``name`` with its options validated."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    reader = _Options(name, options or {})
    algorithm = ALGORITHMS[name](reader)
    reader.done()
    return algorithm


def unfrozen_units(steps: list[tuple[str, ...]], fraction: float, step: int, total_steps: int) -> tuple[str, ...]:
    """FedBug's gradual unfreezing: units trainable at local iteration ``step`` (1-based) of
    ``total_steps``, given the M unfreezing ``steps`` (groups of units, input to output): those of
    the first ``min(M, ceil(step * M / (fraction * total_steps)))`` groups."""
    count = len(steps)
    if fraction <= 0:
        reached = count
    else:
        exact = Fraction(step * count) / (Fraction(repr(fraction)) * total_steps)  # no float rounding
        reached = min(count, math.ceil(exact))
    return tuple(unit for group in steps[:reached] for unit in group)


def learning_rate(base: float, round_index: int, rounds: int, milestones: Iterable[float], gamma: float) -> float:
    """Step decay: ``base * gamma**k`` where k counts the milestones (fractions of the rounds)
    already passed by 0-based ``round_index`` (FedBABU: x0.1 at 50% and 75%)."""
    passed = sum(1 for m in milestones if round_index >= m * rounds)
    return base * gamma ** passed
