"""Training losses: cross-entropy for classifiers, MSE for regression, or a custom import path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedpart.common.components.importing import import_callable

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(spec: str | None, classification: bool) -> LossFn:
    """The loss named by ``train.loss`` (``package.module:function`` returning a loss callable)."""
    if spec is None:
        return torch.nn.CrossEntropyLoss() if classification else torch.nn.MSELoss()
    loss = import_callable(spec, "train.loss")()
    if not callable(loss):
        raise TypeError(f"train.loss {spec}: the factory must return a callable (prediction, target) -> loss")
    return loss
