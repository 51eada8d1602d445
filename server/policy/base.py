"""The shape every server policy has, the core's and each layer's (:mod:`fedpart.server.policy`):
what the round engine asks of a round's results, and what a layer may ask of the engine.

A :class:`Policy` answers the engine; a layer is a policy around another (``inner``) that changes
some of the answers and forwards the rest, as Flower wraps a strategy in a DP strategy. The
engine (:mod:`fedpart.server.engine.coordinator`, :mod:`fedpart.server.engine.buffered`) calls only these
methods and knows no layer. A layer that needs tasks of its own (secure aggregation's steps) runs
them through the :class:`RoundSteps` the engine hands it; a layer that takes results of its own
(:meth:`Policy.owns`) folds them through the :class:`Folding` the engine hands it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from fedpart.common.wire.plans import ResultInfo
from fedpart.common.process.records import RoundRecord
from fedpart.server.policy.aggregation import HeadDictionary
from fedpart.server.policy.aggregate import RoundAggregate, RoundResults, Screened
from fedpart.server.engine.task_board import Task



class RoundFailed(RuntimeError):
    """A round's aggregate cannot be taken (a layer's own steps did not get through); the message
    says what failed. The round keeps the global model as it was."""


class RoundSteps(Protocol):
    """What the round engine offers a layer during round ``round_number``: ``run(make, clients)``
    makes a task for each client with ``make(client, task_id, session, chunk_bytes)``, dispatches
    them to the clients' processes and waits for them like the round's training."""

    round_number: int

    def run(self, make: Callable[[int, int, str, int], Task], clients: Iterable[int]) -> None: ...


class Folding(Protocol):
    """What accepting a result of ``task`` may do with the round: ``fold`` it (``fold`` folds it
    into the round's results outside the engine's lock, ``record`` notes what it says under it; the
    task is then answered), and ``record_training`` note a training result's metrics and samples."""

    def fold(self, fold: Callable[[RoundResults], None], record: Callable[[RoundResults], None]) -> None: ...

    def record_training(self, results: RoundResults, result: ResultInfo, screened: Screened) -> None: ...


class Policy:
    """A round's results: screen each, combine them, step the global model. This base forwards
    every call to ``inner``; a layer overrides what it changes."""

    def __init__(self, inner: Policy | None) -> None:
        self.inner = inner

    # ------------------------------------------------------------------ one result

    def screen(self, client: int, deltas: dict[str, torch.Tensor], samples: int) -> Screened:
        """Decide what a training result with ``deltas`` and ``samples`` counts for; raises
        :class:`~fedpart.server.policy.robust.ResultRefused` (nothing changed) for one refused."""
        return self.inner.screen(client, deltas, samples)

    def screen_evaluation(self, client: int, metrics: Mapping[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
        """An evaluation report as counted, and what was changed (for the log)."""
        return self.inner.screen_evaluation(client, metrics)

    def relative_bounds(self) -> bool:
        """Whether a result is bounded relative to the others' (the adaptive bound, the monitor),
        so that the buffered engine screens one trained with an earlier learning rate on the
        current one's scale; False where a layer clips to an absolute norm."""
        return self.inner.relative_bounds()

    def owns(self, task: Task) -> bool:
        """Whether a layer takes the results of ``task`` itself (:meth:`accept`)."""
        return self.inner.owns(task)

    def accept(self, task: Task, result: ResultInfo, tensors: Mapping[str, torch.Tensor], folding: Folding) -> None:
        """Take a result of a task this policy :meth:`owns`."""
        self.inner.accept(task, result, tensors, folding)

    def expected_uploads(self, task: Task) -> Mapping[str, torch.Tensor] | None:
        """Tensors with the names, dtypes and shapes a result of ``task`` must carry, where a layer
        decides them (None: the task's own uploads of the global model)."""
        return self.inner.expected_uploads(task)

    # ------------------------------------------------------------------ one round

    def open_round(self, round_number: int, uploads: Mapping[str, torch.Tensor]) -> RoundAggregate:
        """A round begins whose results upload deltas of ``uploads`` (global tensors by name):
        the aggregate its results are folded into."""
        return self.inner.open_round(round_number, uploads)

    def task_fields(self) -> dict[str, Any]:
        """What every training task of the open round carries besides its plan."""
        return self.inner.task_fields()

    def close_round(self, steps: RoundSteps) -> str | None:
        """The round's training is in: run what a layer needs before the round's aggregate can be
        taken; returns why it cannot be (None: it can). :meth:`new_global` may still raise
        :class:`RoundFailed`."""
        return self.inner.close_round(steps)

    def counted(self, clients: Iterable[int]) -> set[int]:
        """Of the clients whose results were folded, those the round's aggregate holds."""
        return self.inner.counted(clients)

    def new_global(self, global_state: Mapping[str, torch.Tensor], aggregate: RoundAggregate,
                   heads: HeadDictionary | None) -> dict[str, torch.Tensor]:
        """The updated global tensors from the round's aggregate (and FedHA's ``heads``)."""
        return self.inner.new_global(global_state, aggregate, heads)

    def sum_noise(self, round_number: int) -> tuple[float, float, torch.Generator] | None:
        """The noise a round's sum takes, where a layer adds noise to it: (standard deviation,
        fixed denominator, generator); None: the sum is a weighted mean."""
        return self.inner.sum_noise(round_number)

    def round_record(self, record: RoundRecord) -> None:
        """Write what the round's ``record`` carries of the policy (its server step, its privacy)."""
        self.inner.round_record(record)

    # ------------------------------------------------------------------ the run

    def last_round(self, rounds: int) -> int:
        """The last round the run trains of its ``rounds``."""
        return self.inner.last_round(rounds)

    def stop_note(self) -> str | None:
        """Why the run trains fewer than its rounds (None: it trains them all)."""
        return self.inner.stop_note()

    def state(self) -> dict[str, torch.Tensor]:
        """What the policy carries from round to round, for the run state."""
        return self.inner.state()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with :meth:`state` of a saved run; raises ValueError where it does not fit."""
        self.inner.load_state(state)

    def find(self, kind: type) -> Any:
        """The layer (or core) of type ``kind`` in this policy, or None."""
        if isinstance(self, kind):
            return self
        return self.inner.find(kind) if self.inner is not None else None
