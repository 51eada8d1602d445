"""Clipping of a client's update for user-level differential privacy (DP-FedAvg: McMahan et al.,
"Learning Differentially Private Recurrent Language Models", ICLR 2018): every delta tensor a
client uploads is scaled by one factor so that their joint L2 norm is at most the clip norm. The
client clips before any codec; the server clips again what it decoded
(``fedpart.server.policy.privacy``), so the bound holds whatever a client sent."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


NORM_ROUNDING = 1e-9
"""Relative margin of the clip for the rounding of the float64 norm itself (float64 tensors)."""


def joint_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over all ``tensors`` together, accumulated in float64."""
    return math.hypot(*(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) for t in tensors.values()))


def clip_deltas(deltas: Mapping[str, torch.Tensor], clip_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """``deltas`` scaled down together to an L2 norm of at most ``clip_norm`` (unchanged where they
    are within it), and their norm before clipping. The factor is multiplied in float64 and shrunk
    by the coarsest tensor dtype's rounding (at least :data:`NORM_ROUNDING`), so the clipped
    tensors' norm in their own dtypes is within ``clip_norm`` too. Raises ValueError for a norm that is not finite."""
    norm = joint_norm(deltas)
    if not math.isfinite(norm):
        raise ValueError(f"the update's L2 norm is {norm}; it cannot be clipped")
    if norm <= clip_norm:
        return dict(deltas), norm
    rounding = max((torch.finfo(t.dtype).eps for t in deltas.values() if t.is_floating_point()), default=0.0)
    scale = clip_norm / norm / (1.0 + max(rounding, NORM_ROUNDING))
    return {name: (tensor.to(torch.float64) * scale).to(tensor.dtype) for name, tensor in deltas.items()}, norm
