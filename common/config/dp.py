"""DP-FedAvg's config (``privacy.dp``; McMahan et al., "Learning Differentially Private Recurrent
Language Models", ICLR 2018): its section, its values' check, and what it refuses to run with. The
layers it checks for are :mod:`fedpart.server.policy.dp` and :mod:`fedpart.client.mods.dp_clip`;
the registration is :data:`fedpart.common.config.run_config.FEATURE_CHECKS`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedpart.common.components.registry import SERVER_OPTIMIZERS
from fedpart.common.config.feature_checks import (
    aggregator_is_linear,
    failed,
    server_optimizer_capabilities,
    set_while_disabled,
    uplink_codec,
)

if TYPE_CHECKING:
    from fedpart.common.config.run_config import RunConfig
    from fedpart.common.ml.algorithms import Algorithm

DP_ACCOUNTING_INSTALL = 'pip install "dp-accounting>=0.4"  (or the privacy extra: pip install -e ".[privacy]")'


@dataclass
class DPConfig:
    """User-level differential privacy, DP-FedAvg (McMahan et al., "Learning Differentially
    Private Recurrent Language Models", ICLR 2018): each client's uploaded deltas are clipped to
    ``clip_norm`` in L2 over all of them, and the server adds Gaussian noise of standard deviation
    ``noise_multiplier * clip_norm`` to their sum and divides by the expected number of clients.
    The budget is Google's dp-accounting (``fedpart.server.policy.privacy``).

    ``adaptive_clip``: adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially
    Private Learning with Adaptive Clipping", NeurIPS 2021), the geometric update. ``clip_norm`` is
    the initial clip C_0; after each round C_{t+1} = C_t * exp(-clip_learning_rate * (b -
    target_quantile)), b being the noised fraction of the round's results whose delta norm was
    within C_t. The paper's defaults: ``target_quantile`` 0.5 (the median norm),
    ``clip_learning_rate`` 0.2, ``count_stddev`` m / 20 for m expected clients a round
    (TensorFlow Federated's ``gaussian_adaptive`` starts from C_0 = 0.1; ``clip_norm`` keeps its
    default 1.0, so set it). ``noise_multiplier`` z
    stays the total that is accounted: the deltas are noised with z_delta = (z**-2 - (2 *
    count_stddev)**-2)**-0.5, which needs 2 * count_stddev > z."""

    enabled: bool = False
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    delta: float | None = None            # None: 1 / clients ** 1.1
    target_epsilon: float | None = None   # stop before a round that would take epsilon past this
    accountant: str = "rdp"               # dp-accounting's "rdp" or "pld" (Poisson sampling only)
    noise_seed: int | None = None         # None: a secret seed per run; set only for experiments (the
                                          # noise of a known seed can be taken out again: no privacy)
    adaptive_clip: bool = False           # clip_norm is C_0 and adapts (see above); the server clips
    target_quantile: float = 0.5          # gamma: the quantile of the delta norms the clip tracks
    clip_learning_rate: float = 0.2       # eta_C of the geometric update
    count_stddev: float | None = None     # sigma_b, the noise of the count of unclipped results;
                                          # None: the expected clients per round / 20

    def resolved_delta(self, clients: int) -> float:
        """``delta``, or 1 / clients ** 1.1 where it is unset."""
        return self.delta if self.delta is not None else 1.0 / clients ** 1.1

    def resolved_count_stddev(self, expected_clients: float) -> float:
        """sigma_b: ``count_stddev``, or ``expected_clients`` / 20 (Andrew et al.) where it is unset."""
        return self.count_stddev if self.count_stddev is not None else expected_clients / 20

    def delta_noise_multiplier(self, expected_clients: float) -> float:
        """The noise multiplier of the deltas: ``noise_multiplier`` without adaptive clipping; with it
        z_delta = (z**-2 - (2 sigma_b)**-2)**-0.5, so that the deltas and the count together are the
        Gaussian mechanism of multiplier z (Andrew et al., Theorem 1); 0 where z is 0. Raises
        ValueError where the count's noise leaves none for the deltas (z**-2 <= (2 sigma_b)**-2, i.e.
        2 sigma_b <= z)."""
        z = self.noise_multiplier
        if not self.adaptive_clip or not z:
            return z
        sigma_b = self.resolved_count_stddev(expected_clients)
        rest = z ** -2 - (2 * sigma_b) ** -2 if sigma_b > 0 else -math.inf
        if not rest > 0:
            raise ValueError(f"the count noise sigma_b = {sigma_b:g} is too small for noise_multiplier {z:g}: "
                             f"z_delta = (z**-2 - (2 sigma_b)**-2)**-0.5 needs 2 sigma_b > z; raise "
                             f"privacy.dp.count_stddev above {z / 2:g}, or lower privacy.dp.noise_multiplier "
                             f"below {2 * sigma_b:g}")
        return rest ** -0.5


KEY = "privacy.dp"
ACCOUNTANTS = ("rdp", "pld")


def enabled(config: RunConfig) -> bool:
    """Whether the run has DP-FedAvg."""
    return config.privacy.dp.enabled


def value_errors(config: RunConfig) -> list[str]:
    """What is wrong with the values of ``privacy.dp`` (none set while it is off, each in range),
    and with DP-FedAvg under the buffered engine, each a sentence naming the key."""
    dp = config.privacy.dp
    errors = set_while_disabled(dp, KEY)
    errors += failed([
        (math.isfinite(dp.clip_norm) and dp.clip_norm > 0, "privacy.dp.clip_norm must be a finite number > 0"),
        (math.isfinite(dp.noise_multiplier) and dp.noise_multiplier >= 0,
         "privacy.dp.noise_multiplier must be a finite number >= 0"),
        (dp.delta is None or 0 < dp.delta < 1, "privacy.dp.delta must be in (0, 1)"),
        (dp.target_epsilon is None or (math.isfinite(dp.target_epsilon) and dp.target_epsilon > 0),
         "privacy.dp.target_epsilon must be a finite number > 0"),
        (dp.accountant in ACCOUNTANTS, f"privacy.dp.accountant must be one of {', '.join(ACCOUNTANTS)}, "
                                       f"got {dp.accountant!r}"),
        (0 < dp.target_quantile < 1, "privacy.dp.target_quantile must be in (0, 1)"),
        (math.isfinite(dp.clip_learning_rate) and dp.clip_learning_rate > 0,
         "privacy.dp.clip_learning_rate must be a finite number > 0"),
        (dp.count_stddev is None or (math.isfinite(dp.count_stddev) and dp.count_stddev >= 0),
         "privacy.dp.count_stddev must be a finite number >= 0"),
    ])
    if dp.enabled and config.server.engine == "buffered":
        _, buffer_size = config.buffered.resolved(config.clients, config.sampling.fraction)
        if buffer_size != max(1, int(config.sampling.fraction * config.clients + 1e-9)):
            errors.append(f"privacy.dp accounts each fold of buffered.buffer_size = {buffer_size} results as a round "
                          f"of fixed-size sampling of sampling.fraction * clients: set sampling.fraction to "
                          f"{buffer_size}/{config.clients} (docs/buffered.md, Privacy)")
    return errors


def refusals(config: RunConfig, algorithm: Algorithm, server_parts: bool = True) -> list[str]:
    """Why ``config`` cannot run with ``privacy.dp`` on (empty: it can). DP-FedAvg bounds each
    client's influence on the released model by the clip and hides it under noise; every setting
    below lets a client's update reach the model or the schedule some other way. ``algorithm``:
    the run's, as the config check built it. Without the server's parts (a client checking its
    config) the server-side components are not asked."""
    sampling, robust = config.sampling, config.robust
    refusals = []
    if config.train.weighting != "uniform":
        refusals.append(f"train.weighting {config.train.weighting!r} weighs a result by its self-reported sample "
                        "count, which the clip does not bound: set train.weighting: uniform")
    if server_parts and not aggregator_is_linear(robust.aggregator):
        refusals.append(f"robust.aggregator {robust.aggregator!r} is not a sum, so the noise calibrated to the "
                        "clip does not cover one client's influence on it: set robust.aggregator: mean")
    if robust.norm_bound:
        refusals.append("robust.norm_bound is a second bound beside privacy.dp.clip_norm, which already clips every "
                        "delta (and its 'reject' depends on each norm): set robust.norm_bound: 0")
    if sampling.probability is not None:
        refusals.append("sampling.probability draws again while nobody is picked, which is not the Poisson sampling "
                        "the accounting assumes: set sampling.scheme: poisson and sampling.fraction instead")
    if sampling.over_selection:
        refusals.append("sampling.over_selection folds whichever results come first: set sampling.over_selection: 0")
    if sampling.scheme == "fixed" and config.privacy.dp.accountant == "pld":
        refusals.append("dp-accounting's PLD accountant has no event for fixed-size sampling without replacement: "
                        "set privacy.dp.accountant: rdp, or sampling.scheme: poisson")
    up = config.compression.up
    if getattr(uplink_codec(up), "error_feedback", False):
        refusals.append(f"compression.up {up.codec} with error feedback keeps what a round did not send and adds it "
                        "to a later upload, outside the round's clip: set compression.up.error_feedback: false")
    chosen = server_optimizer_capabilities(config.server_optimizer.name) if server_parts else frozenset()
    if "needs_result_norms" in chosen:
        refusals.append(f"server_optimizer {config.server_optimizer.name} sets its step from each result's delta "
                        "norm, which is not noised: use plain, fedavgm, fedadam or fedyogi (steps on the noised mean "
                        "are post-processing)")
    if "needs_result_counts" in chosen:
        refusals.append(f"server_optimizer {config.server_optimizer.name} scales its step by the number of results, "
                        "which is not noised")
    dp = config.privacy.dp
    if dp.adaptive_clip:
        if config.privacy.secure_aggregation:
            refusals.append("privacy.dp.adaptive_clip counts the results whose delta norm is within the clip, and "
                            "under privacy.secure_aggregation the server sees no single delta: set "
                            "privacy.dp.adaptive_clip: false (a fixed privacy.dp.clip_norm)")
        # the expected clients a round, as fedpart.server.engine.sampling.expected_clients (common imports no server module)
        expected = (sampling.fraction * config.clients if sampling.scheme == "poisson"
                    else float(max(1, int(sampling.fraction * config.clients + 1e-9))))
        try:
            dp.delta_noise_multiplier(expected)
        except ValueError as error:
            refusals.append(f"privacy.dp.adaptive_clip: {error}")
    for term in algorithm.objective.build().terms:
        if term.server_step and "needs_result_counts" in SERVER_OPTIMIZERS[term.server_step[0]].capabilities:
            refusals.append(f"algorithm.objective.{term.name} brings a server step scaled by the number of results, "
                            f"which is not noised: remove the {term.name} term")
    collected = algorithm.collected_parts
    if collected:
        refusals.append(f"algorithm {config.algorithm.name} uploads its {', '.join(collected)} values whole into a "
                        "per-client dictionary whose mean becomes the global copy without clipping or noise")
    return refusals
