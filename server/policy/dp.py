"""User-level differential privacy on the server, a layer of its policy (``privacy.dp``; DP-FedAvg:
McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018): the clip
is the bound. Screening clips every delta to ``privacy.dp.clip_norm`` (a client that did not clip
is clipped here, and a lossy codec's rounding of a clipped delta too; under adaptive clipping the
clip moves from round to round), every result weighs 1, and a round's deltas are combined into
their noised sum over the expected number of clients; the budget comes from Google's
dp-accounting and may end the run early (``privacy.dp.target_epsilon``). The mechanism is
:mod:`fedpart.server.policy.privacy`'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from fedpart.common.config.experiment import Experiment
from fedpart.common.config.run_config import ConfigError, RunConfig
from fedpart.common.ml.algorithms import Role
from fedpart.common.process.records import RoundRecord
from fedpart.server.policy.aggregate import RoundAggregate, Screened
from fedpart.server.policy.base import Policy
from fedpart.server.policy.privacy import DifferentialPrivacy
from fedpart.server.policy.robust import ResultRefused


def applies(config: RunConfig) -> bool:
    """Where ``privacy.dp`` is on."""
    return config.privacy.dp.enabled


def wrap(inner: Policy, config: RunConfig, log: Callable[[str], None], experiment: Experiment) -> Policy:
    """The DP-FedAvg layer around ``inner``; raises ConfigError where the model aggregates a
    tensor that is not floating point (Gaussian noise cannot be added to it)."""
    algorithm = experiment.algorithm
    integers = sorted(name for name, tensor in experiment.model.state_dict().items()
                      if algorithm.role(name) is Role.GLOBAL and not tensor.is_floating_point())
    if integers:
        raise ConfigError(f"privacy.dp: the model aggregates tensors that are not floating point "
                          f"({', '.join(integers[:3])}), which Gaussian noise cannot be added to")
    return DPFedAvg(inner, config, log)


class DPFedAvg(Policy):
    """Clips each result, noises each round's sum, spends the budget (see the module)."""

    def __init__(self, inner: Policy, config: RunConfig, log: Callable[[str], None]) -> None:
        super().__init__(inner)
        self.privacy = DifferentialPrivacy(config, log)

    def screen(self, client: int, deltas: dict[str, torch.Tensor], samples: int) -> Screened:
        """The inner screening (sample caps), then the deltas clipped to the clip norm (counted as
        clipped where the result was over it by more than a codec's rounding; under adaptive
        clipping, over the round's clip at all), weight 1. The clipped deltas keep their norm
        before clipping (:class:`~fedpart.server.policy.privacy.ClippedDeltas`), which adaptive clipping
        counts when they are folded."""
        screened = self.inner.screen(client, deltas, samples)
        if not screened.deltas:
            return replace(screened, weight=1.0)
        try:
            clipped, note = self.privacy.clip(screened.deltas)
        except ValueError as error:
            raise ResultRefused(str(error)) from error
        was_clipped = note is not None or (self.privacy.adaptive is not None and not clipped.unclipped)
        return replace(screened, deltas=clipped, weight=1.0, clipped=was_clipped,
                       notes=screened.notes + ((note,) if note else ()))

    def relative_bounds(self) -> bool:
        """False: the clip norm is absolute."""
        return False

    def open_round(self, round_number: int, uploads: Mapping[str, torch.Tensor]) -> RoundAggregate:
        """The inner round's aggregate, its results summed and noised over the fixed denominator."""
        aggregate = self.inner.open_round(round_number, uploads)
        aggregate.combiner = self.privacy.aggregator(round_number, uploads)
        return aggregate

    def sum_noise(self, round_number: int) -> tuple[float, float, torch.Generator]:
        return self.privacy.noise(round_number)

    def round_record(self, record: RoundRecord) -> None:
        self.inner.round_record(record)
        record.privacy = self.privacy.round_record(record.round)

    def last_round(self, rounds: int) -> int:
        return min(self.privacy.rounds, self.inner.last_round(rounds))

    def stop_note(self) -> str | None:
        return self.privacy.stop_note() or self.inner.stop_note()

    def state(self) -> dict[str, torch.Tensor]:
        """The inner state and the adaptive clip (keys :attr:`DifferentialPrivacy.STATE_KEYS`)."""
        return {**self.inner.state(), **self.privacy.state()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        clip = {k: v for k, v in state.items() if k in DifferentialPrivacy.STATE_KEYS}
        self.inner.load_state({k: v for k, v in state.items() if k not in clip})
        self.privacy.load_state(clip)
