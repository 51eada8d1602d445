"""Exported personalized models: one safetensors file per client whose header says how to
rebuild the model (``fedpart export`` writes them, :func:`load_model` reads them).

The file's tensors are the client's whole state dict (body units, head, extra parts); its
safetensors metadata holds one entry, :data:`METADATA_KEY`, a JSON object with at least
``format`` (:data:`EXPORT_FORMAT`), ``run_id``, ``client_id``, ``model`` (``name``,
``options``), ``algorithm`` (``name``, ``options``), ``num_classes``, ``input_shape`` and
``finetune_epochs`` (how many epochs the saved model was fine-tuned on the client's train split).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fedpart.common.process.checkpoint import load_tensors

METADATA_KEY = "fedpart"
EXPORT_FORMAT = 1
REQUIRED_KEYS = ("format", "run_id", "client_id", "model", "algorithm", "num_classes", "input_shape",
                 "finetune_epochs")


def write_exported_model(path: str | Path, state: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path`` with ``metadata`` (JSON-serialisable) in the header."""
    missing = [key for key in REQUIRED_KEYS if key not in metadata]
    if missing:
        raise ValueError(f"exported model metadata lacks {missing}")
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(dict(metadata), sort_keys=True)})


def read_export_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata ``fedpart export`` wrote into ``path``'s header."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exported model not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error
    if METADATA_KEY not in header:
        raise ValueError(f"{path}: no fedpart metadata in its header (not written by fedpart export)")
    metadata = json.loads(header[METADATA_KEY])
    if metadata.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: export format {metadata.get('format')!r}, this fedpart reads {EXPORT_FORMAT}")
    return metadata


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model in ``path`` (a file ``fedpart export`` wrote), rebuilt from its metadata, its
    weights loaded, in eval mode on ``device``.

    A built-in model needs nothing else; a custom model (``package.module:function``) needs its
    module importable, as it was for the run.
    """
    from fedpart.common.ml.algorithms import build_algorithm
    from fedpart.common.models.zoo import build_model

    metadata = read_export_metadata(path)
    model_section, algorithm_section = metadata["model"], metadata["algorithm"]
    model = build_model(model_section["name"], num_classes=int(metadata["num_classes"]),
                        input_shape=tuple(metadata["input_shape"]), seed=0, **model_section["options"])
    build_algorithm(algorithm_section["name"], algorithm_section["options"]).add_parts(model)
    model.load_state_dict(load_tensors(path))
    return model.to(device).eval()
