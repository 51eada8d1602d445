"""On-device evaluation and personalization (FedBABU's protocol, Oh et al. ICLR 2022).

*initial*: the received global model (with the client's personal parts) on the client's test
split; *personalized*: fine-tune on the client's train split for each requested number of epochs
(one pass, checkpoints taken on the way) and test again; *head-less*: nearest class-mean body
feature (templates from the train split, classes the client lacks excluded).
"""

from __future__ import annotations

import torch

from fedpart.client.local_data import ClientData
from fedpart.client.speed import TrainingSpeed
from fedpart.client.training import Augment, LossFn, batches
from fedpart.common.ml.evaluation import EVAL_BATCH, split_metrics
from fedpart.common.wire.plans import EvalPlan
from fedpart.common.ml.split_model import HEAD, SplitModel


@torch.no_grad()
def headless_accuracy(model: SplitModel, data: ClientData, cosine: bool) -> float | None:
    """Accuracy of the nearest class template (mean train feature per class the client has)."""
    model.eval()
    if data.train_size == 0 or data.test_size == 0:
        return None
    train_features = torch.cat([model.features(data.x_train[s:s + EVAL_BATCH])
                                for s in range(0, data.train_size, EVAL_BATCH)])
    test_features = torch.cat([model.features(data.x_test[s:s + EVAL_BATCH])
                               for s in range(0, data.test_size, EVAL_BATCH)])
    classes = torch.unique(data.y_train)
    templates = torch.stack([train_features[data.y_train == c].mean(dim=0) for c in classes])
    if cosine:
        scores = torch.nn.functional.normalize(test_features, dim=1) @ torch.nn.functional.normalize(templates, dim=1).T
        nearest = scores.argmax(dim=1)
    else:
        nearest = torch.cdist(test_features, templates).argmin(dim=1)
    return float((classes[nearest] == data.y_test).float().mean())


def finetune_units(model: SplitModel, part: str) -> list[str]:
    """Schedule units a fine-tune of ``part`` (full, body or head) trains."""
    if part == "head":
        return [HEAD]
    if part == "body":
        return model.unit_names
    return model.schedule_units


def evaluate_and_personalize(model: SplitModel, data: ClientData, plan: EvalPlan, loss_fn: LossFn,
                             classification: bool, augment: Augment | None = None) -> dict[str, float]:
    """Report initial and per-epoch personalized metrics; ``model`` ends up personalized.
    ``augment`` transforms the fine-tune batches' inputs (FedBABU fine-tunes on its augmented
    train set)."""
    metrics: dict[str, float] = {"train_samples": data.train_size, "test_samples": data.test_size}
    initial = split_metrics(model, data.x_test, data.y_test, loss_fn, classification)
    metrics.update({f"initial_{k}": v for k, v in initial.items()})
    if plan.headless and classification:
        for cosine, key in ((False, "headless_acc"), (True, "headless_cosine_acc")):
            value = headless_accuracy(model, data, cosine)
            if value is not None:
                metrics[key] = value
    checkpoints = sorted(set(plan.finetune_epochs))
    if not checkpoints:
        return metrics
    units = finetune_units(model, plan.part)
    model.set_trainable(units)
    parameters = [p for u in units for p in model.unit_parameters(u)]
    optimizer = TrainingSpeed(data.x_train.device).sgd(parameters, plan.lr, plan.momentum, 0.0)
    generator = torch.Generator().manual_seed(int(plan.seed))
    epoch = 0
    for target in checkpoints:
        while epoch < target and data.train_size:
            model.train()
            for index in batches(data.train_size, plan.batch_size, generator, data.x_train.device):
                optimizer.zero_grad(set_to_none=True)
                x = data.x_train[index]
                loss_fn(model(augment(x) if augment else x), data.y_train[index]).backward()
                optimizer.step()
            epoch += 1
        result = split_metrics(model, data.x_test, data.y_test, loss_fn, classification)
        metrics.update({f"finetune_{target}_{k}": v for k, v in result.items()})
    model.set_trainable(model.schedule_units)
    return metrics
