"""Tensor files on disk: safetensors, written atomically (never a half-written checkpoint)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` to ``path`` via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file; a missing or corrupt file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors checkpoint ({error})") from error
