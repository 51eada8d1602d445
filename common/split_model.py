"""The body/head split every fedpart model follows.

A :class:`SplitModel` is an ordered list of named body *units* (input to output) followed by a
*head* (the final classifier ``Linear`` with its bias). Algorithms address parameters through
these names: a tensor belongs to the part ``body`` (unit ``<name>``), ``head`` or ``other``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

HEAD = "head"
BODY_PREFIX = "body."
HEAD_PREFIX = "head."


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
        self.head_joins_last_unit = head_joins_last_unit
        self.no_grad_prefix = 0

    @property
    def unit_names(self) -> list[str]:
        """Body unit names, input to output."""
        return list(self.body.keys())

    @property
    def schedule_units(self) -> list[str]:
        """Everything a freeze schedule addresses: the body units, then ``head``."""
        return self.unit_names + [HEAD]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Body output (the head's input), flattened to ``[batch, features]``."""
        for index, unit in enumerate(self.body.values()):
            if index < self.no_grad_prefix:
                with torch.no_grad():
                    x = unit(x)
            else:
                x = unit(x)
        return torch.flatten(x, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def unfreeze_steps(self, units: Sequence[str]) -> list[tuple[str, ...]]:
        """``units`` (in schedule order) grouped into the steps of gradual unfreezing."""
        steps = [(u,) for u in units]
        last = self.unit_names[-1]
        if self.head_joins_last_unit and (last,) in steps and (HEAD,) in steps:
            steps.remove((HEAD,))
            steps[steps.index((last,))] = (last, HEAD)
        return steps

    def unit_parameters(self, unit: str) -> list[nn.Parameter]:
        """Parameters of one schedule unit (a body unit name or ``head``)."""
        module = self.head if unit == HEAD else self.body[unit]
        return list(module.parameters())

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
    """The part (``body``, ``head`` or ``other``) a state-dict entry belongs to."""
    if name.startswith(BODY_PREFIX):
        return "body"
    if name.startswith(HEAD_PREFIX):
        return "head"
    return "other"


def tensor_unit(name: str) -> str | None:
    """The schedule unit a state-dict entry belongs to (``None`` for ``other``)."""
    if name.startswith(HEAD_PREFIX):
        return HEAD
    if name.startswith(BODY_PREFIX):
        return name[len(BODY_PREFIX):].split(".", 1)[0]
    return None


def count_parameters(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Number of parameter elements, optionally only of the given state-dict names."""
    params = dict(model.named_parameters())
    if names is None:
        return sum(p.numel() for p in params.values())
    return sum(params[n].numel() for n in names if n in params)
