"""Secure aggregation, a layer of the server's policy (``privacy.secure_aggregation``; Bonawitz
et al., CCS 2017, with SecAgg+'s neighbourhoods): the server sees no single update, only the
round's sum. The mechanism and its steps are :mod:`fedpart.server.policy.secagg_protocol`'s; this
layer runs them in the round:

- every training task carries the ADVERTISE step: the client keeps its update and answers its
  keys, which the layer takes with the weight screening counted the result for;
- once the training is in, SHARE, CHECK, MASK and UNMASK run as tasks of the round, each
  dispatched to the clients the previous step left (:class:`~fedpart.server.policy.base.RoundSteps`);
  a masked update is folded into the round's modular sum (:class:`SecureSum`, which takes the
  noise of the layer inside where DP-FedAvg is on);
- only the clients whose masked update is in the sum count as completed; a sum that cannot be
  unmasked fails the round (:class:`~fedpart.server.policy.base.RoundFailed`), which keeps the
  global model.

With the buffered engine (``server.engine: buffered``) a training result only enters its version's
buffer: the keys are asked for again, bound to the version, by an ADVERTISE step of the version's
own, and each client masks the update it kept when it trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from fedpart.common.config.run_config import RunConfig
from fedpart.common.wire.plans import ResultInfo, SecAggStage, SecAggStep, TaskKind
from fedpart.common.wire.protocol import Rejected
from fedpart.server.policy.base import Folding, Policy, RoundSteps
from fedpart.server.policy.aggregate import RoundAggregate
from fedpart.server.policy.robust import ResultRefused
from fedpart.server.policy.secagg_protocol import SecureRound, SecureRoundFailed, SecureSum
from fedpart.server.engine.task_board import Task


def applies(config: RunConfig) -> bool:
    """Where ``privacy.secure_aggregation`` is on."""
    return config.privacy.secure_aggregation


def wrap(inner: Policy, config: RunConfig, log: Callable[[str], None], run_id: Callable[[], str],
         blame: Callable[[str], None], round_uploads: Callable[[int], Iterable[str]]) -> Policy:
    """The secure aggregation layer around ``inner``: ``run_id`` gives the run's id (a resumed
    server takes its run's), ``blame`` records a client named for what it sent, ``round_uploads``
    names the tensors a round's results upload deltas of. Raises ValueError where the buffered
    engine would mask different tensors in one buffer."""
    if config.server.engine == "buffered":
        uploads = {tuple(round_uploads(r)) for r in range(1, config.rounds + 1)}
        if len(uploads) > 1:
            raise ValueError(f"privacy.secure_aggregation with server.engine buffered masks one set of tensors "
                             f"per buffer, and algorithm {config.algorithm.name}'s schedule uploads different "
                             "tensors in different rounds: use server.engine sync")
    return SecureAggregation(inner, config, log, run_id, blame)


class SecureAggregation(Policy):
    """Runs a round's secure aggregation around the inner policy (see the module)."""

    def __init__(self, inner: Policy, config: RunConfig, log: Callable[[str], None], run_id: Callable[[], str],
                 blame: Callable[[str], None]) -> None:
        super().__init__(inner)
        self.config = config
        self.log = log
        self.run_id = run_id
        self.blame = blame
        self.readvertise = config.server.engine == "buffered"
        self.secure: SecureRound | None = None  # the open round's
        self.weights: dict[int, int] = {}         # the weight each client's training result was counted for

    def open_round(self, round_number: int, uploads: Mapping[str, torch.Tensor]) -> RoundAggregate:
        aggregate = self.inner.open_round(round_number, uploads)
        self.secure = SecureRound(self.config, self.run_id(), round_number, uploads, self.log, self.blame)
        self.weights = {}
        aggregate.combiner = SecureSum(self.secure, self.inner.sum_noise(round_number))
        return aggregate

    def task_fields(self) -> dict[str, object]:
        return {**self.inner.task_fields(), "secagg": SecAggStep(SecAggStage.ADVERTISE)}

    def owns(self, task: Task) -> bool:
        return task.secagg is not None or self.inner.owns(task)

    def expected_uploads(self, task: Task) -> Mapping[str, torch.Tensor] | None:
        """The MASK step's masked update: int32, in the uploaded tensors' shapes."""
        if task.secagg is not None and task.secagg.stage == SecAggStage.MASK and self.secure is not None:
            return {name: torch.empty(shape, dtype=torch.int32) for name, shape in self.secure.shapes.items()}
        return self.inner.expected_uploads(task)

    def accept(self, task: Task, result: ResultInfo, tensors: Mapping[str, torch.Tensor], folding: Folding) -> None:
        """A training result (its keys, metrics and samples), the answer to a later step, or the
        masked update, folded into the round's modular sum."""
        if task.secagg is None:
            self.inner.accept(task, result, tensors, folding)
            return
        secure, stage = self.secure, task.secagg.stage
        # a buffered engine folds a training result in a later version (its keys are asked for again)
        stale_is_fine = task.kind == TaskKind.TRAIN and self.readvertise
        if secure is None or (secure.round_number != task.round and not stale_is_fine):
            raise Rejected(f"task {task.task_id} belongs to a secure aggregation that is over")
        if task.kind == TaskKind.TRAIN:
            try:
                screened = self.screen(task.client_id, {}, int(result.num_samples))
            except ResultRefused as error:
                raise Rejected(str(error)) from error
            weight = int(screened.weight)
            if not self.readvertise:
                secure.take_keys(task.client_id, result, weight)

            def record(results) -> None:
                self.weights[task.client_id] = weight
                folding.record_training(results, result, screened)

            folding.fold(lambda results: None, record)
            return
        if stage == SecAggStage.ADVERTISE:
            secure.take_keys(task.client_id, result, self.weights.get(task.client_id, 0))
        elif stage != SecAggStage.MASK:
            secure.take(task.client_id, stage, result)

        def fold(results) -> None:
            if stage == SecAggStage.MASK:
                results.deltas.add(tensors, 1.0)
                secure.take_masked(task.client_id)

        folding.fold(fold, lambda results: None)

    def close_round(self, steps: RoundSteps) -> str | None:
        """ADVERTISE again where the engine asks for keys bound to the version, then SHARE, CHECK,
        MASK and UNMASK, each to the clients the previous step left; why the sum cannot be
        unmasked (None: it can)."""
        failed = self.inner.close_round(steps)
        if failed is not None:
            return failed
        secure = self.secure
        asks: list[Callable[[], Mapping[int, SecAggStep]]] = [
            secure.sharing_steps, secure.checking_steps, secure.masking_steps, secure.unmasking_steps]
        if self.readvertise:
            advertise = SecAggStep(SecAggStage.ADVERTISE)
            asks.insert(0, lambda: {client: advertise for client in sorted(self.weights)})
        for make_asks in asks:
            try:
                ask = make_asks()
            except SecureRoundFailed as error:
                return f"secure aggregation failed: {error}"
            steps.run(lambda client, task_id, session, chunk_bytes: Task(
                TaskKind.SECAGG, task_id, steps.round_number, client, secagg=ask[client], session=session,
                result_chunk_bytes=chunk_bytes), ask)
        return None

    def counted(self, clients: Iterable[int]) -> set[int]:
        return self.inner.counted(clients) & (self.secure.masked if self.secure is not None else set())

    def new_global(self, global_state, aggregate: RoundAggregate, heads) -> dict[str, torch.Tensor]:
        try:
            return self.inner.new_global(global_state, aggregate, heads)
        except SecureRoundFailed as error:
            raise SecureRoundFailed(f"secure aggregation failed: {error}") from error
