"""The server's policy for a round's results: screen each result, combine the round's results,
step the global model (Flower's strategy), kept out of the round engines
(:mod:`fedpart.server.engine.coordinator`, :mod:`fedpart.server.engine.buffered`), which call only the methods
of :class:`~fedpart.server.policy.base.Policy`.

A pure core (:mod:`~fedpart.server.policy.combine`: the configured aggregator and server
optimizer) is wrapped in layers, each a policy around a policy, as Flower wraps a strategy in a DP
strategy: robust screening (:mod:`~fedpart.server.policy.screening`: sample caps, norm bounds, the
insider monitor), DP-FedAvg (:mod:`~fedpart.server.policy.dp`) and secure aggregation
(:mod:`~fedpart.server.policy.secure_aggregation`), each on where the config turns it on. A new
mechanism of this kind is one module with ``applies(config)`` (whether the config turns it on)
and ``wrap(inner, config, log, **engine)`` (its layer around ``inner``; ``experiment`` among
``engine`` where it names it), and its name in
:data:`LAYERS` (a module of this package by its name, any other by its dotted path).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedpart.common.config.experiment import Experiment
    from fedpart.common.config.run_config import RunConfig
    from fedpart.server.policy.base import Policy

LAYERS = ("screening", "dp", "secure_aggregation")
"""The layers, innermost first: modules, each with ``applies`` and ``wrap``."""

__all__ = ["Folding", "Policy", "RoundAggregate", "RoundFailed", "RoundResults", "RoundSteps", "Screened", "build_policy", "LAYERS"]

# The names this package re-exports, by module: imported at their first use, so that importing one
# module of the package (a piece a layer or the round engine uses, such as its validation rules)
# does not import the layers, and through them the round engine, first.
_EXPORTS = {"Folding": "base", "Policy": "base", "RoundFailed": "base", "RoundSteps": "base",
            "RoundAggregate": "aggregate", "RoundResults": "aggregate", "Screened": "aggregate"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def build_policy(config: RunConfig, log: Callable[[str], None], experiment: Experiment | None = None,
                 **engine: object) -> Policy:
    """The run's policy: the core in the layers the config turns on. ``experiment``: the run's,
    as the process built it once (where None, built here). ``engine`` holds what a layer may need
    of the round engine (``run_id``: a function giving the run's id; ``blame``: records a client
    named for what it sent; ``round_uploads``: the tensors a round's results upload deltas of);
    each layer's ``wrap`` takes the ones it names, and ``experiment`` where it names it."""
    from fedpart.common.config.experiment import build_experiment
    from fedpart.server.policy.combine import Combine
    from fedpart.server.policy.optimizers import build_server_optimizer

    experiment = experiment or build_experiment(config)
    step = config.server_optimizer
    optimizer = build_server_optimizer(step.name, step.options, experiment.algorithm.server_step, config.clients)
    policy: Policy = Combine(config.robust, config.train.weighting, optimizer)
    offered = {**engine, "experiment": experiment}
    for name in LAYERS:
        layer = importlib.import_module(name if "." in name else f"{__name__}.{name}")
        if layer.applies(config):
            wanted = {key: value for key, value in offered.items() if key in inspect.signature(layer.wrap).parameters}
            policy = layer.wrap(policy, config, log, **wanted)
    return policy
