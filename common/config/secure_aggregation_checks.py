"""The config check of secure aggregation (``privacy.secure_aggregation``; Bonawitz et al.,
CCS 2017, and the SecAgg+ graph of Bell et al., CCS 2020): its values, and what it refuses to
run with. The layers it checks for are :mod:`fedpart.server.policy.secure_aggregation` and
:mod:`fedpart.client.mods.secure_aggregation`; the registration is
:data:`fedpart.common.config.run_config.FEATURE_CHECKS`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fedpart.common.config.feature_checks import (
    aggregator_is_linear,
    failed,
    server_optimizer_capabilities,
    uplink_codec,
)

if TYPE_CHECKING:
    from fedpart.common.config.run_config import RunConfig
    from fedpart.common.ml.algorithms import Algorithm

KEY = "privacy.secure_aggregation"


def enabled(config: RunConfig) -> bool:
    """Whether the run's uploads are securely aggregated."""
    return config.privacy.secure_aggregation


def value_errors(config: RunConfig) -> list[str]:
    """What is wrong with the values of the ``privacy.secure_aggregation*`` keys, and with secure
    aggregation under the buffered engine, each a sentence naming the key."""
    privacy = config.privacy
    errors = failed([
        (math.isfinite(privacy.secure_aggregation_bound) and privacy.secure_aggregation_bound > 0,
         "privacy.secure_aggregation_bound must be a finite number > 0"),
        (privacy.secure_aggregation_threshold is None or privacy.secure_aggregation_threshold >= 2,
         "privacy.secure_aggregation_threshold must be at least 2 (one share would reveal a secret)"),
        (privacy.secure_aggregation_neighbours is None or privacy.secure_aggregation_neighbours >= 2,
         "privacy.secure_aggregation_neighbours must be at least 2"),
    ])
    if privacy.secure_aggregation and config.server.engine == "buffered":
        _, buffer_size = config.buffered.resolved(config.clients, config.sampling.fraction)
        threshold = privacy.secure_aggregation_threshold
        if buffer_size < 2 or (threshold is not None and threshold > buffer_size):
            errors.append(f"privacy.secure_aggregation runs over each buffer of buffered.buffer_size = "
                          f"{buffer_size} results, fewer than its threshold of "
                          f"{max(2, threshold or 2)}: raise buffered.buffer_size")
        if config.buffered.staleness != "constant":
            errors.append(f"buffered.staleness {config.buffered.staleness!r} scales each delta by its staleness, and "
                          "under privacy.secure_aggregation the server never sees one: set buffered.staleness: "
                          "constant")
    return errors


def refusals(config: RunConfig, algorithm: Algorithm, server_parts: bool = True) -> list[str]:
    """Why ``config`` cannot run with ``privacy.secure_aggregation`` on (empty: it can): the server
    receives only masked updates and learns their sum, so nothing may need one client's update.
    ``algorithm``: the run's, as the config check built it. Without the server's parts (a client
    checking its config) the server-side components are not asked."""
    from fedpart.common.wire.codecs import lossless

    robust = config.robust
    refusals = []
    if server_parts and not aggregator_is_linear(robust.aggregator):
        refusals.append(f"robust.aggregator {robust.aggregator!r} needs every client's update, the server learns only "
                        "their sum: set robust.aggregator: mean")
    if robust.norm_bound:
        refusals.append("robust.norm_bound needs each update's norm, which the server cannot see: set "
                        "robust.norm_bound: 0 (each client clips its elements to privacy.secure_aggregation_bound)")
    if not lossless(uplink_codec(config.compression.up)):
        refusals.append(f"compression.up {config.compression.up.codec!r}: the masked update is a vector of the ring "
                        "of 2**32 that no codec may round: set compression.up.codec: none")
    if server_parts and "needs_result_norms" in server_optimizer_capabilities(config.server_optimizer.name):
        refusals.append(f"server_optimizer {config.server_optimizer.name} needs each result's delta norm, which the "
                        "server cannot see")
    if config.sampling.fraction * config.clients < 2 and config.sampling.probability is None:
        refusals.append("fewer than 2 clients a round: the sum of one masked update is that client's update")
    if algorithm.collected_parts:
        refusals.append(f"algorithm {config.algorithm.name} uploads its {', '.join(algorithm.collected_parts)} values "
                        "into a per-client dictionary, which a sum cannot give")
    return refusals
