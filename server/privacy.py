"""User-level differential privacy on the server: DP-FedAvg's noised sum and its privacy budget.

McMahan et al., "Learning Differentially Private Recurrent Language Models" (ICLR 2018): each
client's uploaded deltas are clipped to ``privacy.dp.clip_norm`` C in L2 over all of them (on the
client, before any codec, and again here on what the server decoded: :func:`fedpart.common.privacy.clip_deltas`);
the server adds Gaussian noise of standard deviation ``z * C`` (``z`` =
``privacy.dp.noise_multiplier``) to every coordinate of the round's SUM of clipped deltas and
divides by the expected number of clients, a fixed denominator, so that one client moves the
released mean by at most C / denominator whatever the others sent (:class:`NoisedSum`). A round
with no result releases noise alone.

The budget is Google's dp-accounting library, never a formula of fedpart's own
(:class:`PrivacyBudget`): per round, the sampled Gaussian mechanism of the sampling actually used.
Poisson sampling (``sampling.scheme: poisson``, each client with probability q) is
``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under add-or-remove-one adjacency, accounted by
the RDP or the PLD accountant; a fixed-size sample of m of N clients is
``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` under replace-one adjacency
(RDP only), where replacing one client's clipped update by another's moves the sum by up to 2C,
so the noise is z / 2 times that sensitivity (the convention of dp-accounting's own DP-SGD events).

Epsilon after k rounds depends only on (q, z, k, delta), so the rounds that fit within
``privacy.dp.target_epsilon`` are known before the run starts (:meth:`PrivacyBudget.rounds_within`).
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fedpart.common.algorithms import Role
from fedpart.common.config import DP_ACCOUNTING_INSTALL, ConfigError, RunConfig
from fedpart.common.experiment import build_run_model, run_algorithm
from fedpart.common.privacy import clip_deltas
from fedpart.server.aggregation import CompensatedSum
from fedpart.server.sampling import expected_clients, round_target

CLIP_NOTE_TOLERANCE = 1e-3
"""A decoded delta over the clip by less than this fraction of it (a lossy codec's rounding of a
delta the client clipped) is clipped again without a note in the server log."""


class PrivacyBudget:
    """Epsilon after k rounds of the run's sampled Gaussian mechanism, from dp-accounting."""

    def __init__(self, config: RunConfig) -> None:
        try:
            import dp_accounting
        except ImportError as error:
            raise ConfigError(f"privacy.dp needs Google's dp-accounting library on the server ({error}): "
                              f"{DP_ACCOUNTING_INSTALL}") from error
        self._dp = dp_accounting
        dp = config.privacy.dp
        sampling = config.sampling
        self.noise_multiplier = dp.noise_multiplier
        self.delta = dp.resolved_delta(config.clients)
        self.accountant = dp.accountant
        self.sampling = sampling.scheme
        self.clients = config.clients
        self.fraction = sampling.fraction
        self.sample_size = round_target(config.clients, sampling.fraction)
        self._epsilons: dict[int, float] = {}  # rounds -> epsilon, computed once each

    def round_event(self) -> Any:
        """One round's DpEvent (see the module's docstring)."""
        dp = self._dp
        if self.sampling == "poisson":
            return dp.PoissonSampledDpEvent(self.fraction, dp.GaussianDpEvent(self.noise_multiplier))
        return dp.SampledWithoutReplacementDpEvent(self.clients, self.sample_size,
                                                   dp.GaussianDpEvent(self.noise_multiplier / 2))

    def new_accountant(self) -> Any:
        """A fresh dp-accounting accountant of the configured kind and the sampling's adjacency."""
        dp = self._dp
        if self.accountant == "pld":
            return dp.pld.PLDAccountant()
        relation = (dp.NeighboringRelation.ADD_OR_REMOVE_ONE if self.sampling == "poisson"
                    else dp.NeighboringRelation.REPLACE_ONE)
        return dp.rdp.RdpAccountant(neighboring_relation=relation)

    def epsilon(self, rounds: int) -> float:
        """Epsilon at ``delta`` after ``rounds`` rounds (0 before any; infinite without noise)."""
        if rounds <= 0:
            return 0.0
        if not self.noise_multiplier:
            return math.inf
        if rounds not in self._epsilons:
            accountant = self.new_accountant()
            accountant.compose(self.round_event(), rounds)
            self._epsilons[rounds] = float(accountant.get_epsilon(self.delta))
        return self._epsilons[rounds]

    def rounds_within(self, target_epsilon: float, rounds: int) -> int:
        """The most rounds, at most ``rounds``, whose epsilon is within ``target_epsilon`` (epsilon
        grows with the rounds: a binary search)."""
        low, high = 0, rounds
        while low < high:
            middle = (low + high + 1) // 2
            if self.epsilon(middle) <= target_epsilon:
                low = middle
            else:
                high = middle - 1
        return low


def json_epsilon(epsilon: float) -> float | None:
    """Epsilon as metrics.jsonl and summary.json write it: None (null) where it is infinite."""
    return epsilon if math.isfinite(epsilon) else None


class NoisedSum:
    """DP-FedAvg's aggregate of one round (an :class:`~fedpart.server.aggregation.Aggregator`):
    ``(sum of the clipped deltas + N(0, std^2) per coordinate) / denominator`` for every tensor of
    ``reference`` (the tensors the round's plan uploads as deltas), also those no result sent.

    The sum is :class:`~fedpart.server.aggregation.CompensatedSum`'s, so it does not depend on the
    order of arrival; the noise of each tensor comes from ``generator``, drawn in name order."""

    def __init__(self, reference: Mapping[str, torch.Tensor], std: float, denominator: float,
                 generator: torch.Generator) -> None:
        if not denominator > 0:
            raise ValueError(f"the fixed denominator must be positive, got {denominator}")
        self.shapes = {name: tensor.shape for name, tensor in reference.items()}
        self.std = std
        self.denominator = denominator
        self.generator = generator
        self._sums = {name: CompensatedSum(shape) for name, shape in self.shapes.items()}
        self._counts = dict.fromkeys(self.shapes, 0)
        self._lock = threading.Lock()

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold one result's clipped deltas in; every result weighs 1 under DP-FedAvg."""
        if weight != 1.0:
            raise ValueError(f"DP-FedAvg weighs every result 1, got {weight}")
        unknown = sorted(set(tensors) - set(self.shapes))
        if unknown:
            raise ValueError(f"deltas of tensors the round does not upload: {unknown[:3]}")
        for name, tensor in tensors.items():
            if tensor.shape != self.shapes[name]:
                raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, the round's is "
                                 f"{list(self.shapes[name])}")
        with self._lock:
            for name in tensors:
                self._counts[name] += 1
        for name, tensor in tensors.items():
            self._sums[name].add(tensor)

    def result(self) -> dict[str, torch.Tensor]:
        """The noised mean of every tensor of the round, in float64."""
        combined = {}
        for name in sorted(self.shapes):
            total = self._sums[name].result()
            if self.std:
                total += torch.normal(0.0, self.std, total.shape, generator=self.generator, dtype=torch.float64)
            combined[name] = total / self.denominator
        return combined

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class DifferentialPrivacy:
    """The server's side of DP-FedAvg for one run: the clip it enforces, the noised aggregate of
    each round, and the budget spent (``privacy.dp``)."""

    def __init__(self, config: RunConfig, log: Callable[[str], None] = print) -> None:
        dp = config.privacy.dp
        self.config = config
        self.clip_norm = dp.clip_norm
        self.budget = PrivacyBudget(config)
        self.denominator = expected_clients(config.clients, config.sampling.fraction, config.sampling.scheme)
        if dp.noise_seed is None:
            self._seed = secrets.randbits(63)  # never written anywhere: the noise cannot be taken out again
        else:
            self._seed = dp.noise_seed
            log("warning: privacy.dp.noise_seed is set: anyone who knows it can recompute the noise and take it out "
                "of the model (for experiments only)")
        algorithm = run_algorithm(config)
        integers = sorted(name for name, tensor in build_run_model(config).state_dict().items()
                          if algorithm.role(name) is Role.GLOBAL and not tensor.is_floating_point())
        if integers:
            raise ConfigError(f"privacy.dp: the model aggregates tensors that are not floating point "
                              f"({', '.join(integers[:3])}), which Gaussian noise cannot be added to")
        self.rounds = config.rounds  # the last round to run: fewer where privacy.dp.target_epsilon says so
        if dp.target_epsilon is not None:
            self.rounds = self.budget.rounds_within(dp.target_epsilon, config.rounds)
            if not self.rounds:
                raise ConfigError(f"privacy.dp.target_epsilon {dp.target_epsilon:g} is below the epsilon of a single "
                                  f"round ({self.budget.epsilon(1):.4g} at delta {self.budget.delta:.3g}): raise it, "
                                  "or privacy.dp.noise_multiplier")
            if self.rounds < config.rounds:
                log(f"privacy.dp.target_epsilon {dp.target_epsilon:g} allows {self.rounds} of the {config.rounds} "
                    f"rounds (epsilon {self.budget.epsilon(self.rounds):.4g}; round {self.rounds + 1} would take it "
                    f"to {self.budget.epsilon(self.rounds + 1):.4g}): the run stops after round {self.rounds}")

    def stop_note(self) -> str | None:
        """Why the run stops before ``config.rounds`` (None: it does not)."""
        dp = self.config.privacy.dp
        if self.rounds == self.config.rounds:
            return None
        return (f"stopped after round {self.rounds} of {self.config.rounds}: round {self.rounds + 1} would take "
                f"epsilon to {self.budget.epsilon(self.rounds + 1):.4g}, past privacy.dp.target_epsilon "
                f"{dp.target_epsilon:g}")

    def round_generator(self, round_number: int) -> torch.Generator:
        """The noise source of one round: a function of the run's noise seed and the round only, so a
        resumed server with the same ``noise_seed`` draws the same noise."""
        digest = hashlib.sha256(f"{self._seed}:{round_number}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def noise(self, round_number: int) -> tuple[float, float, torch.Generator]:
        """The noise of round ``round_number``: its standard deviation, the fixed denominator and
        the round's generator."""
        std = self.config.privacy.dp.noise_multiplier * self.clip_norm
        return std, self.denominator, self.round_generator(round_number)

    def aggregator(self, round_number: int, reference: Mapping[str, torch.Tensor]) -> NoisedSum:
        """The noised sum of round ``round_number`` over the tensors of ``reference``."""
        return NoisedSum(reference, *self.noise(round_number))

    def clip(self, deltas: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
        """A result's deltas within the clip, and a note where it sent more than the clip (beyond a
        codec's rounding). Raises ValueError for a norm that is not finite."""
        clipped, norm = clip_deltas(deltas, self.clip_norm)
        note = None
        if norm > self.clip_norm * (1 + CLIP_NOTE_TOLERANCE):
            note = f"delta norm {norm:.6g} exceeds privacy.dp.clip_norm {self.clip_norm:g}; clipped to it on the server"
        return clipped, note

    def round_record(self, round_number: int) -> dict[str, float | None]:
        """The round's ``privacy`` entry of metrics.jsonl: epsilon after it."""
        return {"epsilon": json_epsilon(self.budget.epsilon(round_number))}

