"""Custom components (models, datasets, losses, registered components) named by
``package.module:name`` paths."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_attribute(path: str, setting: str) -> Any:
    """The attribute at ``path``; errors name the config ``setting`` and the path."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{setting} {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ImportError(f"{setting} {path!r}: cannot import {module_name!r}: {error}") from error
    if not hasattr(module, attribute):
        raise ImportError(f"{setting} {path!r}: {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


def import_callable(path: str, setting: str) -> Callable[..., Any]:
    """The callable at ``path``; errors name the config ``setting`` and the path."""
    target = import_attribute(path, setting)
    if not callable(target):
        module_name, _, attribute = path.partition(":")
        raise ImportError(f"{setting} {path!r}: {module_name!r} has no callable {attribute!r}")
    return target
