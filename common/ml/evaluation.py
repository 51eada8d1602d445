"""Test-set metrics shared by the clients (their own test split) and the server (global test set)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedpart.common.ml.split_model import SplitModel

EVAL_BATCH = 1000


@torch.no_grad()
def split_metrics(model: SplitModel, x: torch.Tensor, y: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  classification: bool) -> dict[str, float]:
    """Mean loss (and accuracy for classifiers) on ``(x, y)``."""
    model.eval()
    if x.shape[0] == 0:
        return {}
    loss_sum = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device)
    for start in range(0, x.shape[0], EVAL_BATCH):
        out = model(x[start:start + EVAL_BATCH])
        target = y[start:start + EVAL_BATCH]
        loss_sum += loss_fn(out, target) * target.shape[0]
        if classification:
            correct += (out.argmax(dim=1) == target).sum()
    metrics = {"loss": float(loss_sum) / x.shape[0]}
    if classification:
        metrics["acc"] = float(correct) / x.shape[0]
    return metrics
