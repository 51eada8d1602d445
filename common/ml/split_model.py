"""The body/head split every fedpart model follows, plus any extra parts an algorithm adds.

A :class:`SplitModel` is an ordered list of named body *units* (input to output) followed by a
*head* (the final classifier ``Linear`` with its bias) and optional *extra parts* (FedRoD's
personal head), each an additive output head on the detached body features. Algorithms address
parameters through these names: a tensor belongs to the part ``body`` (unit ``<name>``),
``head``, an extra part ``<part>`` (``parts.<part>.``) or ``other``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

HEAD = "head"
BODY_PREFIX = "body."
HEAD_PREFIX = "head."
PARTS_PREFIX = "parts."


@dataclass
class ModelOutput:
    """One forward pass in pieces: body ``features``, the ``head``'s output, each extra part's
    output, and the ``prediction`` (head plus extra parts)."""

    features: torch.Tensor
    head: torch.Tensor
    parts: dict[str, torch.Tensor]
    prediction: torch.Tensor


class SplitModel(nn.Module):
    """A network cut into ordered body units and a head.

    ``units`` maps unit names to modules applied in order; ``head`` maps the last unit's output
    to the prediction. ``head_joins_last_unit`` makes gradual unfreezing treat the head and the
    last body unit as one step (ResNets in FedBug) instead of the head being a step of its own. ``forward`` can run a frozen prefix of units under ``torch.no_grad()`` so
    that its backward pass is skipped entirely (freeze schedules save that compute).
    """

    def __init__(self, units: "OrderedDict[str, nn.Module]", head: nn.Module,
                 head_joins_last_unit: bool = False) -> None:
        super().__init__()
        if not units:
            raise ValueError("a SplitModel needs at least one body unit")
        if HEAD in units:
            raise ValueError(f"a body unit may not be called {HEAD!r}")
        self.body = nn.ModuleDict(units)
        self.head = head
        self.parts = nn.ModuleDict()
        self.head_joins_last_unit = head_joins_last_unit
        self.no_grad_prefix = 0

    def add_part(self, name: str, module: nn.Module) -> None:
        """Add extra part ``name``: an output head on the detached features, added to the head's."""
        if name in self.schedule_units:
            raise ValueError(f"extra part {name!r} clashes with a unit of {self.schedule_units}")
        self.parts[name] = module

    @property
    def unit_names(self) -> list[str]:
        """Body unit names, input to output."""
        return list(self.body.keys())

    @property
    def schedule_units(self) -> list[str]:
        """Everything a freeze schedule addresses: the body units, ``head``, then extra parts."""
        return self.unit_names + [HEAD] + list(self.parts.keys())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Body output (the head's input), flattened to ``[batch, features]``."""
        for index, unit in enumerate(self.body.values()):
            if index < self.no_grad_prefix:
                with torch.no_grad():
                    x = unit(x)
            else:
                x = unit(x)
        return torch.flatten(x, 1)

    def forward(self, x: torch.Tensor, pieces: bool = False) -> torch.Tensor | ModelOutput:
        """The prediction; with ``pieces`` the whole :class:`ModelOutput` (what objective terms see)."""
        features = self.features(x)
        head = self.head(features)
        parts = {name: part(features.detach()) for name, part in self.parts.items()}
        prediction = head
        for output in parts.values():
            prediction = prediction + output
        return ModelOutput(features, head, parts, prediction) if pieces else prediction

    def unfreeze_steps(self, units: Sequence[str]) -> list[tuple[str, ...]]:
        """``units`` (in schedule order) grouped into the steps of gradual unfreezing."""
        steps = [(u,) for u in units]
        last = self.unit_names[-1]
        if self.head_joins_last_unit and (last,) in steps and (HEAD,) in steps:
            steps.remove((HEAD,))
            steps[steps.index((last,))] = (last, HEAD)
        return steps

    def unit_module(self, unit: str) -> nn.Module:
        """The module of one schedule unit (a body unit name, ``head`` or an extra part)."""
        if unit == HEAD:
            return self.head
        return self.parts[unit] if unit in self.parts else self.body[unit]

    def unit_parameters(self, unit: str) -> list[nn.Parameter]:
        """Parameters of one schedule unit."""
        return list(self.unit_module(unit).parameters())

    def set_trainable(self, units: Iterable[str]) -> None:
        """Make exactly ``units`` trainable (``requires_grad``) and freeze the rest.

        The longest frozen prefix of body units then runs under ``torch.no_grad()``.
        """
        wanted = set(units)
        unknown = wanted - set(self.schedule_units)
        if unknown:
            raise ValueError(f"unknown units {sorted(unknown)}; this model has {self.schedule_units}")
        for name in self.schedule_units:
            for parameter in self.unit_parameters(name):
                parameter.requires_grad_(name in wanted)
        prefix = 0
        for name in self.unit_names:
            if name in wanted:
                break
            prefix += 1
        self.no_grad_prefix = prefix


def tensor_part(name: str) -> str:
    """The part (``body``, ``head``, an extra part's name or ``other``) a state-dict entry belongs to."""
    if name.startswith(BODY_PREFIX):
        return "body"
    if name.startswith(HEAD_PREFIX):
        return HEAD
    if name.startswith(PARTS_PREFIX):
        return name[len(PARTS_PREFIX):].split(".", 1)[0]
    return "other"


def tensor_unit(name: str) -> str | None:
    """The schedule unit a state-dict entry belongs to (``None`` for ``other``)."""
    if name.startswith(BODY_PREFIX):
        return name[len(BODY_PREFIX):].split(".", 1)[0]
    part = tensor_part(name)
    return None if part == "other" else part


def count_parameters(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Number of parameter elements, optionally only of the given state-dict names."""
    params = dict(model.named_parameters())
    if names is None:
        return sum(p.numel() for p in params.values())
    return sum(params[n].numel() for n in names if n in params)
