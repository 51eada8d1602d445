"""Deprecated: ``ArrayDataset`` and ``ClientSplit`` moved; import them from ``fedpart.api``.

Kept so that plugins written against this path still import; each name read from here warns
(``DeprecationWarning``) and is the same class as ``fedpart.api``'s.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("ArrayDataset", "ClientSplit")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fedpart.common.dataset_types is deprecated: import {name} from fedpart.api",
                  DeprecationWarning, stacklevel=2)
    from fedpart.common.data import types

    return getattr(types, name)


def __dir__() -> list[str]:
    return sorted(_MOVED)
