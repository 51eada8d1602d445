"""Global accuracy: the global model (global body + global head; FedHA: the averaged head) on a
test set the server holds itself (the dataset's whole test split, never client data)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from fedpart.common.config.experiment import Experiment
from fedpart.common.config.run_config import DataConfig
from fedpart.common.data.datasets import load_dataset
from fedpart.common.ml.evaluation import split_metrics
from fedpart.common.ml.losses import build_loss
from fedpart.common.process.records import ModelMetrics


class GlobalEvaluator:
    """Tests global states on the server-held test set."""

    def __init__(self, data: DataConfig, loss: str | None, experiment: Experiment) -> None:
        """The test split of ``data`` (its whole, read by the server), scored with ``loss``."""
        try:
            dataset = load_dataset(data.dataset, data.root, **data.options)
        except (OSError, ValueError) as error:
            raise ValueError(f"evaluate.global_test needs the test set on the server: {error} "
                             "(set evaluate.global_test: false if the server holds no data)") from error
        self.x = dataset.features(dataset.x_test)
        self.y = dataset.targets(dataset.y_test)
        self.classification = experiment.classification
        self.loss_fn = build_loss(loss, self.classification)
        self.model = experiment.new_model()

    def evaluate(self, state: Mapping[str, torch.Tensor]) -> ModelMetrics:
        """The loss (and a classifier's accuracy) of ``state`` on the whole test split."""
        self.model.load_state_dict(dict(state))
        metrics = split_metrics(self.model, self.x, self.y, self.loss_fn, self.classification)
        return ModelMetrics(loss=metrics.get("loss"), acc=metrics.get("acc"))
