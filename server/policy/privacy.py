"""User-level differential privacy on the server: DP-FedAvg's noised sum and its privacy budget.

McMahan et al., "Learning Differentially Private Recurrent Language Models" (ICLR 2018): each
client's uploaded deltas are clipped to ``privacy.dp.clip_norm`` C in L2 over all of them (on the
client, before any codec, and again here on what the server decoded:
:func:`fedpart.common.privacy.clipping.clip_deltas`); the server adds Gaussian noise of standard
deviation ``z * C`` (``z`` = ``privacy.dp.noise_multiplier``) to every coordinate of the round's SUM
of clipped deltas and divides by the expected number of clients, a fixed denominator, so that one
client moves the released mean by at most C / denominator whatever the others sent
(:class:`NoisedSum`). A round with no result releases noise alone.

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

Adaptive clipping (``privacy.dp.adaptive_clip``; Andrew, Thakkar, McMahan, Ramaswamy,
"Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, the geometric update,
:class:`AdaptiveClip`): the clip of round t is C_t, C_0 = ``clip_norm``. Only the server clips
(with C_t, on what it decoded); each folded result also gives b_i = 1 where its delta norm before
clipping was within C_t. The server releases b = 1/2 + (sum of (b_i - 1/2) + N(0, sigma_b^2)) / m
over the same fixed denominator m (limited to [0, 1]) and sets C_{t+1} = C_t * exp(-eta_C * (b -
gamma)), so the clip moves by a factor of at most exp(eta_C * max(gamma, 1 - gamma)) a round. Centring
b_i at 1/2 makes the count's sensitivity 1/2 under add-or-remove-one (1 under replace-one, like the
sum's 2C), so the deltas noised with multiplier z_delta and the count with sigma_b are together
the Gaussian mechanism of z with z^-2 = z_delta^-2 + (2 sigma_b)^-2 (the paper's Theorem 1): the
budget is accounted with ``noise_multiplier`` z as before, and the deltas get
z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (:meth:`fedpart.common.config.dp.DPConfig.delta_noise_multiplier`).
Where every sampled client answers, b is the noised fraction sum(b_i) / m of the paper.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from fedpart.common.config.dp import DP_ACCOUNTING_INSTALL
from fedpart.common.config.run_config import ConfigError, RunConfig
from fedpart.common.privacy.clipping import clip_deltas
from fedpart.common.process.console import Log
from fedpart.common.process.records import RoundPrivacy
from fedpart.server.engine.sampling import expected_clients, round_target
from fedpart.server.policy.aggregation import CompensatedSum

CLIP_NOTE_TOLERANCE = 1e-3
"""A decoded delta over the clip by less than this fraction of it (a lossy codec's rounding of a
delta the client clipped) is clipped again without a note in the server log."""


class ClippedDeltas(dict[str, torch.Tensor]):
    """A result's deltas clipped to ``clip_norm`` (the round's clip), with their joint L2 norm
    before clipping, ``norm``: adaptive clipping counts the results that were within the clip."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], norm: float, clip_norm: float) -> None:
        super().__init__(tensors)
        self.norm = norm
        self.clip_norm = clip_norm

    @property
    def unclipped(self) -> bool:
        """b_i of Andrew et al.: the delta norm was within the clip."""
        return self.norm <= self.clip_norm


class AdaptiveClip:
    """The clip of adaptive clipping (Andrew et al., NeurIPS 2021, the geometric update): C_t, and
    the private estimate of the fraction of a round's results within it (module docstring).

    The clip goes into the run state (:meth:`state`, key :attr:`STATE_KEY`), so a resumed server
    goes on from the clip the saved run reached."""

    STATE_KEY = "privacy.adaptive_clip/clip_norm"

    def __init__(self, initial: float, target_quantile: float, learning_rate: float, count_stddev: float,
                 denominator: float) -> None:
        if not (math.isfinite(initial) and initial > 0):
            raise ValueError(f"the initial clip must be a finite number > 0, got {initial}")
        self.clip_norm = initial
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.count_stddev = count_stddev
        self.denominator = denominator

    def unclipped_fraction(self, unclipped: int, results: int, generator: torch.Generator) -> float:
        """b = 1/2 + (sum of (b_i - 1/2) + N(0, sigma_b^2)) / denominator for ``unclipped`` of
        ``results`` folded results within the clip, limited to [0, 1] (post-processing, as
        TensorFlow Privacy's quantile estimator does); the noise is one draw from ``generator``."""
        centred = unclipped - results / 2
        if self.count_stddev:
            centred += float(torch.normal(0.0, self.count_stddev, (1,), generator=generator, dtype=torch.float64))
        return min(1.0, max(0.0, 0.5 + centred / self.denominator))

    def next_clip(self, unclipped_fraction: float) -> float:
        """C_{t+1} = C_t * exp(-eta_C * (b - gamma)) (without changing the clip)."""
        return self.clip_norm * math.exp(-self.learning_rate * (unclipped_fraction - self.target_quantile))

    def update(self, unclipped_fraction: float) -> float:
        """Step the clip for a round's ``unclipped_fraction``; returns the new clip."""
        clip = self.next_clip(unclipped_fraction)
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"the adaptive clip left the floating-point range ({clip})")
        self.clip_norm = clip
        return clip

    def state(self) -> dict[str, torch.Tensor]:
        return {self.STATE_KEY: torch.tensor(self.clip_norm, dtype=torch.float64)}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from the clip of :meth:`state` (the initial clip where ``state`` has none)."""
        if self.STATE_KEY not in state:
            return
        value = state[self.STATE_KEY]
        if value.numel() != 1 or not math.isfinite(clip := float(value)) or clip <= 0:
            raise ValueError(f"{self.STATE_KEY}: the adaptive clip must be one positive finite number")
        self.clip_norm = clip


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
    """DP-FedAvg's aggregate of one round (an :class:`~fedpart.server.policy.aggregation.Aggregator`):
    ``(sum of the clipped deltas + N(0, std^2) per coordinate) / denominator`` for every tensor of
    ``reference`` (the tensors the round's plan uploads as deltas), also those no result sent.

    The sum is :class:`~fedpart.server.policy.aggregation.CompensatedSum`'s, so it does not depend on the
    order of arrival; the noise of each tensor comes from ``generator``, drawn in name order.

    Under adaptive clipping, ``clip_norm`` is the round's clip C_t: the sum counts the folded
    results whose norm before clipping was within it (:class:`ClippedDeltas`; a plain mapping is
    clipped here), and :meth:`result` ends with ``on_count(unclipped, results, generator)``, whose
    draws from ``generator`` come after the deltas' noise (a round that uploads nothing has no
    count)."""

    def __init__(self, reference: Mapping[str, torch.Tensor], std: float, denominator: float,
                 generator: torch.Generator, clip_norm: float | None = None,
                 on_count: Callable[[int, int, torch.Generator], None] | None = None) -> None:
        if not denominator > 0:
            raise ValueError(f"the fixed denominator must be positive, got {denominator}")
        self.shapes = {name: tensor.shape for name, tensor in reference.items()}
        self.std = std
        self.denominator = denominator
        self.generator = generator
        self.clip_norm = clip_norm
        self.on_count = on_count
        self._sums = {name: CompensatedSum(shape) for name, shape in self.shapes.items()}
        self._counts = dict.fromkeys(self.shapes, 0)
        self._results = 0
        self._unclipped = 0
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
        unclipped = False
        if self.clip_norm is not None:
            if not (isinstance(tensors, ClippedDeltas) and tensors.clip_norm <= self.clip_norm):
                clipped, norm = clip_deltas(tensors, self.clip_norm)
                tensors = ClippedDeltas(clipped, norm, self.clip_norm)
            unclipped = tensors.unclipped
        with self._lock:
            for name in tensors:
                self._counts[name] += 1
            self._results += 1
            self._unclipped += unclipped
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
        if self.on_count is not None and self.shapes:
            with self._lock:
                unclipped, results = self._unclipped, self._results
            self.on_count(unclipped, results, self.generator)
        return combined

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class DifferentialPrivacy:
    """The server's side of DP-FedAvg for one run: the clip it enforces, the noised aggregate of
    each round, and the budget spent (``privacy.dp``)."""

    STATE_KEYS = (AdaptiveClip.STATE_KEY,)  # the run state's keys of :meth:`state`

    def __init__(self, config: RunConfig, log: Callable[[str], None] = print) -> None:
        dp = config.privacy.dp
        self.config = config
        self.budget = PrivacyBudget(config)
        self.denominator = expected_clients(config.clients, config.sampling.fraction, config.sampling.scheme)
        try:
            self.delta_noise_multiplier = dp.delta_noise_multiplier(self.denominator)
        except ValueError as error:
            raise ConfigError(f"privacy.dp.adaptive_clip: {error}") from error
        self.adaptive: AdaptiveClip | None = None
        if dp.adaptive_clip:
            self.adaptive = AdaptiveClip(dp.clip_norm, dp.target_quantile, dp.clip_learning_rate,
                                         dp.resolved_count_stddev(self.denominator), self.denominator)
            log(f"privacy.dp.adaptive_clip: the clip starts at {dp.clip_norm:g} and tracks the "
                f"{dp.target_quantile:g} quantile of the delta norms (learning rate {dp.clip_learning_rate:g}, "
                f"count noise {self.adaptive.count_stddev:g}); the deltas are noised with multiplier "
                f"{self.delta_noise_multiplier:.4g}, noise_multiplier {dp.noise_multiplier:g} in all")
        self._fixed_clip = dp.clip_norm
        self._round_clips: dict[int, float] = {}       # round -> the clip C_t it used (adaptive clipping)
        self._round_fractions: dict[int, float] = {}   # round -> its noised unclipped fraction
        self._records_lock = threading.Lock()
        if dp.noise_seed is None:
            self._seed = secrets.randbits(63)  # never written anywhere: the noise cannot be taken out again
        else:
            self._seed = dp.noise_seed
            Log.of(log).warning("privacy.dp.noise_seed is set: anyone who knows it can recompute the noise and "
                                "take it out of the model (for experiments only)")
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

    @property
    def clip_norm(self) -> float:
        """The clip of the round in progress: ``privacy.dp.clip_norm``, or under adaptive clipping
        C_t (the clip moves only when a round closes, after its results were screened)."""
        return self.adaptive.clip_norm if self.adaptive is not None else self._fixed_clip

    def noise(self, round_number: int) -> tuple[float, float, torch.Generator]:
        """The noise of round ``round_number``: its standard deviation (z, or z_delta under adaptive
        clipping, times the clip), the fixed denominator and the round's generator."""
        std = self.delta_noise_multiplier * self.clip_norm
        return std, self.denominator, self.round_generator(round_number)

    def aggregator(self, round_number: int, reference: Mapping[str, torch.Tensor]) -> NoisedSum:
        """The noised sum of round ``round_number`` over the tensors of ``reference``; under
        adaptive clipping it also counts the results within the round's clip and, when the round's
        aggregate is taken, steps the clip (:meth:`close_round`)."""
        if self.adaptive is None:
            return NoisedSum(reference, *self.noise(round_number))
        clip = self.clip_norm
        with self._records_lock:
            self._round_clips[round_number] = clip
        return NoisedSum(reference, *self.noise(round_number), clip_norm=clip,
                         on_count=lambda unclipped, results, generator:
                         self.close_round(round_number, unclipped, results, generator))

    def close_round(self, round_number: int, unclipped: int, results: int, generator: torch.Generator) -> None:
        """Adaptive clipping: the noised fraction of round ``round_number``'s ``results`` within its
        clip (``unclipped`` of them; the count noise is drawn from ``generator``) and the clip of the
        next round. A round closes once: a second call changes nothing."""
        with self._records_lock:
            if round_number in self._round_fractions:
                return
            fraction = self.adaptive.unclipped_fraction(unclipped, results, generator)
            self.adaptive.update(fraction)
            self._round_fractions[round_number] = fraction

    def clip(self, deltas: Mapping[str, torch.Tensor]) -> tuple[ClippedDeltas, str | None]:
        """A result's deltas within the clip (with their norm before clipping), and a note where it
        sent more than a fixed clip (beyond a codec's rounding; under adaptive clipping the client
        does not clip, and being clipped is no news). Raises ValueError for a norm that is not finite."""
        clip_norm = self.clip_norm
        clipped, norm = clip_deltas(deltas, clip_norm)
        note = None
        if self.adaptive is None and norm > clip_norm * (1 + CLIP_NOTE_TOLERANCE):
            note = f"delta norm {norm:.6g} exceeds privacy.dp.clip_norm {clip_norm:g}; clipped to it on the server"
        return ClippedDeltas(clipped, norm, clip_norm), note

    def state(self) -> dict[str, torch.Tensor]:
        """What the run state keeps of the privacy step: the adaptive clip (none without it)."""
        return self.adaptive.state() if self.adaptive is not None else {}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with :meth:`state` of a saved run. Raises ValueError for a bad value."""
        if self.adaptive is not None:
            self.adaptive.load_state(state)

    def round_record(self, round_number: int) -> RoundPrivacy:
        """The round's ``privacy`` entry of metrics.jsonl: epsilon after it; under adaptive clipping
        also the clip the round used and the noised fraction of its results within it: the count is
        noised before it is used, the exact count is not private and is written nowhere."""
        record = RoundPrivacy(epsilon=json_epsilon(self.budget.epsilon(round_number)))
        if self.adaptive is not None:
            with self._records_lock:
                record.clip_norm = self._round_clips.get(round_number)
                record.unclipped_fraction = self._round_fractions.get(round_number)
        return record

