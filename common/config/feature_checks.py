"""What the config checks of the privacy features (:mod:`fedpart.common.config.dp`,
:mod:`fedpart.common.config.dp_sgd`, :mod:`fedpart.common.config.secure_aggregation_checks`) ask of
the rest of a run's config: the capabilities of the components it names, never their names, and
the settings of a feature left behind while the feature is off.

A feature's check module declares ``KEY`` (its config key), ``enabled(config)``,
``value_errors(config)`` (its values and their combinations: no component imported, no torch)
and ``refusals(config, algorithm, server_parts)`` (what it cannot run with: the capabilities of
the components, the run's algorithm built once by the config check),
and is registered in :data:`fedpart.common.config.run_config.FEATURE_CHECKS`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fedpart.common.components.registry import (
    ROBUST_AGGREGATORS,
    SERVER_OPTIMIZERS,
    OptionError,
)

if TYPE_CHECKING:
    from fedpart.common.config.run_config import CodecConfig


def server_optimizer_capabilities(name: str) -> frozenset[str]:
    """The capabilities of the server optimizer ``name`` (a name, or a plug-in's path):
    ``needs_result_norms`` (FedExP's), ``needs_result_counts``."""
    try:
        return SERVER_OPTIMIZERS.resolve(name, "server_optimizer.name").capabilities
    except OptionError:
        return frozenset()  # the server optimizer check reports it


def aggregator_is_linear(name: str) -> bool:
    """Whether the robust aggregator ``name`` (a name, or a plug-in's path) has the capability
    ``linear``: it combines the deltas as their weighted mean, as a sum does."""
    try:
        return "linear" in ROBUST_AGGREGATORS.resolve(name, "robust.aggregator").capabilities
    except OptionError:
        return True  # the robust aggregator check reports it


def uplink_codec(up: CodecConfig) -> Any:
    """The codec ``compression.up`` builds (None: tensors travel raw; or where the codec check
    reports it), whose capabilities (``error_feedback``, ``sparse``, ``lossless``) depend on
    its options."""
    from fedpart.common.wire.codecs import build_codec

    try:
        return build_codec(up.codec, up.options)
    except (OptionError, KeyError):
        return None


def set_while_disabled(section: Any, key: str) -> list[str]:
    """The messages for values of a feature's section ``key`` set while its ``enabled`` is false:
    the run would have none of what they describe and say nothing (the user believes the run
    private). One message, naming the first such value."""
    if section.enabled:
        return []
    defaults = type(section)()
    changed = [f.name for f in dataclasses.fields(section)
               if f.name != "enabled" and getattr(section, f.name) != getattr(defaults, f.name)]
    if not changed:
        return []
    return [f"{key}.{changed[0]} is set but {key}.enabled is false, so the run would have no such privacy: set "
            f"{key}.enabled: true, or remove {key}.{changed[0]}"]


def failed(checks: list[tuple[bool, str]]) -> list[str]:
    """The messages of the ``(ok, message)`` checks that failed, in order."""
    return [message for ok, message in checks if not ok]
