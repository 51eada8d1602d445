"""The core of the server's policy, with no defence and no privacy in it: a result counts for its
samples (``train.weighting``), the round's results are combined by the configured aggregator
(``robust.aggregator``: the streaming weighted mean by default), and the combined delta goes
through the run's server optimizer (:mod:`fedpart.server.policy.optimizers`: the ``server_optimizer``
section, or the step an objective term brings, FedDyn's); FedHA's collected heads are combined by
the same kind of aggregator. The layers of :mod:`fedpart.server.policy` wrap it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from fedpart.common.components.registry import ROBUST_AGGREGATORS
from fedpart.common.config.run_config import RobustConfig, robust_aggregator_options
from fedpart.common.process.records import RoundRecord
from fedpart.server.policy.aggregate import RoundAggregate, Screened
from fedpart.server.policy.aggregation import Aggregator, HeadDictionary
from fedpart.server.policy.base import Policy, RoundSteps
from fedpart.server.policy.optimizers import ServerOptimizer


class Combine(Policy):
    """Counts each result for its samples, combines a round's results with the configured
    aggregator and moves the global model with the run's server optimizer."""

    def __init__(self, robust: RobustConfig, weighting: str, optimizer: ServerOptimizer) -> None:
        """``robust``: the section whose aggregator combines; ``weighting``: ``train.weighting``;
        ``optimizer``: the run's server optimizer (:func:`build_server_optimizer`)."""
        super().__init__(None)
        self.robust = robust
        self.weighting = weighting
        self.optimizer = optimizer

    def combiner(self) -> Aggregator:
        """A fresh aggregator of the configured kind, its options read from the ``robust`` section."""
        return ROBUST_AGGREGATORS[self.robust.aggregator](**robust_aggregator_options(self.robust))

    def screen(self, client: int, deltas: dict[str, torch.Tensor], samples: int) -> Screened:
        return Screened(deltas, samples, float(samples) if self.weighting == "samples" else 1.0)

    def screen_evaluation(self, client: int, metrics: Mapping[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
        return dict(metrics), ()

    def relative_bounds(self) -> bool:
        return True

    def owns(self, task) -> bool:
        return False

    def accept(self, task, result, tensors, folding) -> None:
        raise ValueError(f"no layer of the policy takes the results of task {task.task_id}")

    def expected_uploads(self, task) -> None:
        return None

    def open_round(self, round_number: int, uploads: Mapping[str, torch.Tensor]) -> RoundAggregate:
        return RoundAggregate(self.combiner(), self.optimizer.needs_result_norms, round_number)

    def task_fields(self) -> dict[str, Any]:
        return {}

    def close_round(self, steps: RoundSteps) -> None:
        return None

    def counted(self, clients: Iterable[int]) -> set[int]:
        return set(clients)

    def new_global(self, global_state: Mapping[str, torch.Tensor], aggregate: RoundAggregate,
                   heads: HeadDictionary | None) -> dict[str, torch.Tensor]:
        """The server optimizer's step over the combined delta, and the collected heads (FedHA)
        combined by the same kind of aggregator when ``heads`` is given."""
        updated = self.optimizer.step(global_state, aggregate.round_delta())
        if heads is not None and len(heads):
            combined = heads.combine(self.combiner())
            updated.update({name: value.to(global_state[name].dtype) for name, value in combined.items()})
        return updated

    def sum_noise(self, round_number: int) -> None:
        return None

    def round_record(self, record: RoundRecord) -> None:
        record.server_step = self.optimizer.report()

    def last_round(self, rounds: int) -> int:
        return rounds

    def stop_note(self) -> None:
        return None

    def state(self) -> dict[str, torch.Tensor]:
        return self.optimizer.state()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.optimizer.load_state(state)
