"""Record-level differential privacy's bookkeeping on the client (``privacy.dp_sgd``): local
training runs DP-SGD (:mod:`fedpart.client.dp_sgd`, turned on through the training options), and
each training reply adds the run to the client's privacy ledger and reports the client's epsilon
over every round it trained (``dp_sgd_epsilon``, ``dp_sgd_delta``, ``dp_sgd_steps``)."""

from __future__ import annotations

from fedpart.client import dp_sgd
from fedpart.client.mods import Execute, Reply, WorkerContext
from fedpart.common.wire.plans import TaskInfo, TaskKind


def build(context: WorkerContext) -> Ledger | None:
    return Ledger(context) if context.config.privacy.dp_sgd.enabled else None


class Ledger:
    """Spends each training run in the client's ledger and says what it has spent so far."""

    def __init__(self, context: WorkerContext) -> None:
        self.config = context.config.privacy.dp_sgd
        self.root = context.store.root
        self.log = context.log
        self.train_options: dict[str, object] = {"dp_sgd": self.config}

    def __call__(self, task: TaskInfo, call_next: Execute) -> Reply:
        reply = call_next(task)
        report = reply.train_report
        if task.kind != TaskKind.TRAIN or report is None:
            return reply
        spent = dp_sgd.spend(self.root, task.client_id, task.round, report.dp_sgd, self.config)
        if spent:
            self.log(f"client {task.client_id} round {task.round}: trained under DP-SGD epsilon "
                     f"{spent.get('dp_sgd_epsilon', float('inf')):.4g} at delta {spent['dp_sgd_delta']:.3g} "
                     "(every round it trained so far)")
        reply.metrics.update(spent)
        return reply
