"""Partial-parameter algorithms as declarations over parts, schedule, objective and upload.

An :class:`Algorithm` maps each model part (``body``, ``head``, and extra parts such as FedRoD's
personal head, added to the model from the declaration) to a role (sharing), says which schedule
units train in each local phase of a round (schedule), and which client objective terms and step
rule the local training uses (``fedpart.common.ml.objectives``), and which of a phase's units train
at each local step (its :data:`UnitSchedule`, the schedule's primitive on the client, reading the
numbers the phase carries in ``Phase.params``). Upload and aggregation follow from the roles:
trainable ``GLOBAL`` tensors go back as deltas and are averaged; ``COLLECTED`` tensors go back
whole into a per-client dictionary whose mean is the global copy (FedHA); ``FIXED`` and
``PERSONAL`` tensors never go back. Adding an algorithm means adding a small factory with its
declared options to :data:`ALGORITHMS` (or one module outside fedpart that a run config names by
``package.module:name``, docs/plugins.md); the round engine, the wire and the training loop stay
the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from fractions import Fraction
from typing import Any

from torch import nn

from fedpart.common.ml.objectives import DITTO_LAMBDA, MU, PERFEDAVG_OPTIONS, ObjectiveSpec, checked
from fedpart.common.wire.plans import Phase
from fedpart.common.components.registry import ALGORITHMS, Option, non_negative
from fedpart.common.ml.split_model import HEAD, SplitModel, tensor_part, tensor_unit


class Role(str, Enum):
    """What happens to a part of the model."""

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


Schedule = Callable[[RoundContext], tuple[Phase, ...]]
PartFactory = Callable[[SplitModel], nn.Module]  # builds an extra part for a given model
UnitSchedule = Callable[[Sequence[tuple[str, ...]], Mapping[str, float], int, int], tuple[str, ...]]
"""Which of a phase's units train at local step ``step`` (1-based) of ``total``:
``unit_schedule(steps, params, step, total)``, given the phase's unfreezing steps (groups of its
units, input to output; :meth:`SplitModel.unfreeze_steps`) and the numbers the phase carries
(``Phase.params``). The client runs it; the server's schedule only sets the numbers."""


def every_unit(steps: Sequence[tuple[str, ...]], params: Mapping[str, float], step: int,
               total: int) -> tuple[str, ...]:
    """Every unit of the phase from its first step (the default unit schedule)."""
    return tuple(unit for group in steps for unit in group)


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: roles of the model's parts, a schedule, extra parts, a client objective."""

    name: str
    roles: Mapping[str, Role]  # part -> role; ``body`` and ``head`` always, extra parts as declared
    schedule: Schedule
    extra_parts: Mapping[str, PartFactory] = field(default_factory=dict)
    objective: ObjectiveSpec = ObjectiveSpec()
    unit_schedule: UnitSchedule = every_unit  # which of a phase's units train at each local step

    @property
    def body(self) -> Role:
        return self.roles["body"]

    @property
    def head(self) -> Role:
        return self.roles[HEAD]

    def role(self, tensor_name: str) -> Role:
        """Role of a state-dict entry; tensors outside the declared parts follow the body."""
        return self.roles.get(tensor_part(tensor_name), self.body)

    @property
    def personal_parts(self) -> tuple[str, ...]:
        """Parts that live on the client (initialised once from the global copy)."""
        return tuple(part for part, role in self.roles.items() if role in (Role.PERSONAL, Role.COLLECTED))

    @property
    def collected_parts(self) -> tuple[str, ...]:
        """Parts the server keeps one copy of per client (FedHA's heads)."""
        return tuple(part for part, role in self.roles.items() if role is Role.COLLECTED)

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

    def add_parts(self, model: SplitModel) -> SplitModel:
        """``model`` with this algorithm's extra parts added (server and client do the same)."""
        for part, factory in self.extra_parts.items():
            model.add_part(part, factory(model))
        return model

    @property
    def server_step(self) -> tuple[str, dict[str, Any]] | None:
        """The server step an objective term needs (``("feddyn", {"alpha": ..})``), if any."""
        return self.objective.server_step


def _roles(body: Role, head: Role, **parts: Role) -> dict[str, Role]:
    return {"body": body, HEAD: head, **parts}


# ---------------------------------------------------------------------------------------------
# Schedule building blocks


def train_everything(ctx: RoundContext) -> tuple[Phase, ...]:
    """All units and the head train for the configured epochs."""
    return (Phase(ctx.epochs, ctx.units + (HEAD,)),)


def train_body(ctx: RoundContext) -> tuple[Phase, ...]:
    """Only the body trains (FedBABU: the head stays at its random initialisation)."""
    return (Phase(ctx.epochs, ctx.units),)


UNFREEZE_FRACTION = "unfreeze_fraction"
"""The phase parameter :func:`gradual_unfreezing` reads."""


def gradual_unfreeze(ratio: float) -> Schedule:
    """FedBug (Kao & Wang 2023): over the first ``ratio`` of the local iterations the units,
    head last, unfreeze bottom-up (:func:`gradual_unfreezing`, the algorithm's unit schedule);
    afterwards everything trains."""

    def schedule(ctx: RoundContext) -> tuple[Phase, ...]:
        return (Phase(ctx.epochs, ctx.units + (HEAD,), {UNFREEZE_FRACTION: ratio}),)

    return schedule


def gradual_unfreezing(steps: Sequence[tuple[str, ...]], params: Mapping[str, float], step: int,
                       total: int) -> tuple[str, ...]:
    """FedBug's unit schedule: the groups of :func:`unfrozen_units` over the phase's
    ``unfreeze_fraction`` of its steps (0 or absent: every unit from the first step)."""
    return unfrozen_units(list(steps), params.get(UNFREEZE_FRACTION, 0.0), step, total)


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


def with_parts(schedule: Schedule, parts: tuple[str, ...]) -> Schedule:
    """``schedule`` with the extra ``parts`` training whenever the head does."""

    def extended(ctx: RoundContext) -> tuple[Phase, ...]:
        return tuple(replace(p, trainable=p.trainable + parts) if HEAD in p.trainable else p for p in schedule(ctx))

    return extended


# ---------------------------------------------------------------------------------------------
# Extra parts


def zero_linear_head(model: SplitModel) -> nn.Module:
    """A linear head shaped like ``model.head``, starting at zero (so the prediction starts as the
    head's alone, and the server's copy of the model is the generic one)."""
    head = model.head
    if not isinstance(head, nn.Linear):
        raise ValueError(f"an extra linear head needs a model whose head is nn.Linear, not {type(head).__name__}")
    part = nn.Linear(head.in_features, head.out_features)
    nn.init.zeros_(part.weight)
    nn.init.zeros_(part.bias)
    return part


# ---------------------------------------------------------------------------------------------
# Declarations

PROXIMAL = "proximal"


def _proximal(mu: float) -> ObjectiveSpec:
    return ObjectiveSpec(terms=((PROXIMAL, {"mu": mu}),) if mu else ())


def _epochs(name: str, help: str) -> Option:
    return Option(name, int, help, non_negative, "must be >= 0")


def _increasing_rounds(rounds: list[Any]) -> bool:
    return all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rounds) and rounds == sorted(rounds)


@ALGORITHMS.register("fedavg", "FedAvg (McMahan et al., AISTATS 2017): the whole model federated.")
def _fedavg() -> Algorithm:
    return Algorithm("fedavg", _roles(Role.GLOBAL, Role.GLOBAL), train_everything)


@ALGORITHMS.register("fedbabu", "FedBABU (Oh et al., ICLR 2022): body federated under a fixed random head.")
def _fedbabu() -> Algorithm:
    return Algorithm("fedbabu", _roles(Role.GLOBAL, Role.FIXED), train_body)


@ALGORITHMS.register("fedprox", "FedProx (Li et al., MLSys 2020): proximal term on the shared parameters.", MU)
def _fedprox(mu: float = 0.01) -> Algorithm:
    return Algorithm("fedprox", _roles(Role.GLOBAL, Role.GLOBAL), train_everything, objective=_proximal(mu))


@ALGORITHMS.register("fedprox_babu", "FedBABU with FedProx's proximal term on the body (``mu``).", MU)
def _fedprox_babu(mu: float = 0.01) -> Algorithm:
    return Algorithm("fedprox_babu", _roles(Role.GLOBAL, Role.FIXED), train_body, objective=_proximal(mu))


@ALGORITHMS.register(
    "fedbug", "FedBug (Kao & Wang 2023), optionally with FedProx's term (other terms: ``algorithm.objective``).",
    Option("gu_ratio", float, "share of the local iterations over which the units unfreeze bottom-up",
           lambda value: 0 < value <= 1, "must be in (0, 1]"), MU)
def _fedbug(gu_ratio: float = 0.2, mu: float = 0.0) -> Algorithm:
    return Algorithm("fedbug", _roles(Role.GLOBAL, Role.GLOBAL), gradual_unfreeze(gu_ratio),
                     objective=_proximal(mu), unit_schedule=gradual_unfreezing)


def _layer_expansion(order: str) -> None:
    @ALGORITHMS.register(
        f"layer_expansion_{order}",
        f"Sequential layer expansion (Jang & Choi, 2024): body units unfrozen at ``unfreeze_rounds`` under a fixed "
        f"head, {'shallow' if order == 'vanilla' else 'deep'} first.",
        Option("unfreeze_rounds", list, "the 0-based round at which each body unit joins training, in order",
               _increasing_rounds, "must be increasing non-negative round indices", [0, 100, 200]))
    def build(unfreeze_rounds: list[int]) -> Algorithm:
        return Algorithm(f"layer_expansion_{order}", _roles(Role.GLOBAL, Role.FIXED),
                         expand_layers(unfreeze_rounds, order))


_layer_expansion("vanilla")
_layer_expansion("anti")


@ALGORITHMS.register("fedper", "FedPer (Arivazhagan et al. 2019): shared body, personal head.")
def _fedper() -> Algorithm:
    return Algorithm("fedper", _roles(Role.GLOBAL, Role.PERSONAL), train_everything)


@ALGORITHMS.register("fedrep",
                     "FedRep (Collins et al., ICML 2021): shared body, personal head trained first each round.",
                     _epochs("head_epochs", "epochs of the head alone, first"),
                     _epochs("body_epochs", "epochs of the body alone, then"))
def _fedrep(head_epochs: int = 10, body_epochs: int = 1) -> Algorithm:
    return Algorithm("fedrep", _roles(Role.GLOBAL, Role.PERSONAL), head_then_body(head_epochs, body_epochs))


@ALGORITHMS.register("lg_fedavg", "LG-FedAvg (Liang et al. 2020): personal body, shared head.")
def _lg_fedavg() -> Algorithm:
    return Algorithm("lg_fedavg", _roles(Role.PERSONAL, Role.GLOBAL), train_everything)


@ALGORITHMS.register("fedftha",
                     "FedFTHA: fine-tuned personal heads, aggregated by the server into a global head (FedHA).",
                     _epochs("tau_sync", "epochs of body and head together, first"),
                     _epochs("tau_head", "epochs of the head alone, then"))
def _fedftha(tau_sync: int = 5, tau_head: int = 5) -> Algorithm:
    return Algorithm("fedftha", _roles(Role.GLOBAL, Role.COLLECTED), all_then_head(tau_sync, tau_head))


@ALGORITHMS.register("local_only", "Local-only training: every part personal, nothing shared after the start.")
def _local_only() -> Algorithm:
    return Algorithm("local_only", _roles(Role.PERSONAL, Role.PERSONAL), train_everything)


@ALGORITHMS.register("fedrod", "FedRoD (Chen & Chao, ICLR 2022): body and generic head federated (balanced softmax), "
                               "a personal head on the detached features kept on the client.")
def _fedrod() -> Algorithm:
    part = "personal_head"
    return Algorithm("fedrod", _roles(Role.GLOBAL, Role.GLOBAL, personal_head=Role.PERSONAL),
                     with_parts(train_everything, (part,)), extra_parts={part: zero_linear_head},
                     objective=ObjectiveSpec(terms=(("fedrod", {}),)))


@ALGORITHMS.register("perfedavg", "Per-FedAvg (Fallah et al., NeurIPS 2020); ``hessian: true`` is the Hessian-free "
                                  "variant.", *PERFEDAVG_OPTIONS)
def _perfedavg(alpha: float = 0.01, beta: float = 0.001, hessian: bool = False) -> Algorithm:
    return Algorithm("perfedavg", _roles(Role.GLOBAL, Role.GLOBAL), train_everything,
                     objective=ObjectiveSpec(step_rule=("perfedavg", {"alpha": alpha, "beta": beta,
                                                                      "hessian": hessian})))


@ALGORITHMS.register("ditto", "Ditto (Li et al., ICML 2021): FedAvg plus a personal model kept on the client.",
                     DITTO_LAMBDA)
def _ditto(**options: float) -> Algorithm:
    return Algorithm("ditto", _roles(Role.GLOBAL, Role.GLOBAL), train_everything,
                     objective=ObjectiveSpec(step_rule=("ditto", {"lambda": options["lambda"]})))


def build_algorithm(name: str, options: Mapping[str, Any] | None = None,
                    objective: Mapping[str, Mapping[str, Any] | None] | None = None) -> Algorithm:
    """The algorithm ``name`` (a built-in name, or a ``package.module:name`` path to a plug-in's
    :class:`~fedpart.common.components.registry.Component`) with its ``options`` read by its declaration,
    plus the objective terms ``objective`` (``algorithm.objective`` of the run config)."""
    typed = ALGORITHMS.read(name, options or {}, "algorithm.", "algorithm.name")
    algorithm = ALGORITHMS.build(name, typed)
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"algorithm.name {name!r} built {type(algorithm).__name__}, not an Algorithm")
    spec = algorithm.objective.with_terms(objective) if objective else checked(algorithm.objective)
    return replace(algorithm, objective=spec)


def has_global_model(algorithm: Algorithm) -> bool:
    """Whether the server holds a complete model worth testing (body and head both global;
    FedHA: the averaged head)."""
    return algorithm.body in (Role.GLOBAL, Role.FIXED) and algorithm.head in (Role.GLOBAL, Role.FIXED, Role.COLLECTED)


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
