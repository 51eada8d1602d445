"""A client's side of secure aggregation (``privacy.secure_aggregation``, docs/privacy.md), a mod
around the worker (:mod:`fedpart.client.mods`).

The process keeps each hosted client's update of the current round here instead of sending it
(Bonawitz et al., CCS 2017): the TRAIN task's ADVERTISE step answers two public keys and a
commitment to the self-mask seed, SHARE answers a sealed share of the client's secrets for each
neighbour and a commitment to every share, CHECK answers the neighbours whose shares sealed to it
do not open or do not match their commitments, MASK answers the update clipped, quantized and
masked with the peers the step names (int32 tensors of the uploaded tensors' shapes), UNMASK
answers the shares the server needs to remove the masks of the sum. The steps themselves are
:class:`fedpart.common.privacy.secagg.ClientParty`'s; this module keeps one party per client and round.
A process that restarts loses its parties: its clients count as dropped out of that round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedpart.client.mods import Execute, Reply, WorkerContext
from fedpart.common.process.console import Log
from fedpart.common.wire.plans import SecAggAnswer, SecAggStage, SecAggStep, TaskInfo, TaskKind
from fedpart.common.privacy.secagg import ClientParty, SecAggError, quantize, round_tag


class SecureStepError(RuntimeError):
    """This process cannot answer a step (it lost the round's state, or the step is malformed)."""


@dataclass
class _Kept:
    party: ClientParty
    update: dict[str, torch.Tensor]   # the uploaded deltas, in the plan's order, on the host
    answers: dict[SecAggStage, SecAggAnswer | dict[str, torch.Tensor]] = field(default_factory=dict)


class SecureUpdates:
    """The parties and kept updates of the clients a process hosts, for the round in progress.
    Delivery is at least once: a step that arrives again gets the answer it got the first time.
    ``log`` gets a warning line for every neighbour whose shares do not hold. ``buffered``: the
    run's engine is the buffered one, whose clients keep their updates for a later version."""

    def __init__(self, run_id: str, log: Callable[[str], None] = print, buffered: bool = False) -> None:
        self.run_id = run_id
        self.log = Log.of(log)
        self.buffered = buffered
        self._kept: dict[tuple[int, int], _Kept] = {}

    def advertise(self, client: int, round_number: int, update: Mapping[str, torch.Tensor]) -> SecAggAnswer:
        """Keep ``update`` (the deltas the plan uploads) and answer the client's public keys and
        seed commitment. Parties of earlier rounds are dropped: of every client in a synchronous
        run (a round's steps end before the next round starts), of this client in a buffered one
        (the others' may wait for a later version)."""
        for key in [k for k in self._kept if k[1] < round_number and (k[0] == client or not self.buffered)]:
            del self._kept[key]
        if (client, round_number) in self._kept:
            return self._kept[(client, round_number)].answers[SecAggStage.ADVERTISE]
        party = ClientParty(client, round_tag(self.run_id, round_number))
        self._kept[(client, round_number)] = _Kept(party, {n: t.detach().to("cpu", torch.float32)
                                                           for n, t in update.items()})
        cipher_key, mask_key = party.public_keys()
        answer = SecAggAnswer(cipher_key=cipher_key, mask_key=mask_key, seed_commitment=party.seed_commitment())
        self._kept[(client, round_number)].answers[SecAggStage.ADVERTISE] = answer
        return answer

    def readvertise(self, client: int, round_number: int) -> SecAggAnswer:
        """A buffered version's ADVERTISE step: the update the client kept when it trained joins
        round ``round_number``'s sum under keys bound to that round (the keys it answered when it
        trained, if that was in the same round)."""
        if (client, round_number) in self._kept:
            return self._kept[(client, round_number)].answers[SecAggStage.ADVERTISE]
        earlier = [k for k in self._kept if k[0] == client and k[1] < round_number]
        if not earlier:
            raise SecureStepError(f"client {client} round {round_number}: no kept update to advertise (this process "
                                  "did not train it, or restarted since)")
        return self.advertise(client, round_number, self._kept[max(earlier)].update)

    def answer(self, client: int, round_number: int, step: SecAggStep) -> SecAggAnswer:
        """The answer to a SHARE, CHECK or UNMASK step."""
        steps = {SecAggStage.SHARE: self._share, SecAggStage.CHECK: self._check, SecAggStage.UNMASK: self._reveal}
        if step.stage not in steps:
            raise SecureStepError(f"client {client}: a SECAGG task with stage {step.stage.name}")
        kept = self._party(client, round_number)
        if step.stage not in kept.answers:
            try:
                kept.answers[step.stage] = steps[step.stage](kept.party, step)
            except SecAggError as error:
                raise SecureStepError(f"client {client} round {round_number}: {step.stage.name.lower()} "
                                      f"refused: {error}") from error
        return kept.answers[step.stage]

    @staticmethod
    def _share(party: ClientParty, step: SecAggStep) -> SecAggAnswer:
        dealt = party.share(step.peers, step.threshold)
        return SecAggAnswer(sealed=dealt.sealed, commitments=dealt.commitments)

    def _check(self, party: ClientParty, step: SecAggStep) -> SecAggAnswer:
        disputed = party.check(step.sealed, step.commitments)
        for sender, why in sorted(disputed.items()):
            self.log.warning(f"client {party.client_id}: the shares from client {sender} do not hold ({why}); "
                     "told the server")
        return SecAggAnswer(disputed=tuple(sorted(disputed)))

    @staticmethod
    def _reveal(party: ClientParty, step: SecAggStep) -> SecAggAnswer:
        return SecAggAnswer(revealed=party.reveal(step.survivors, step.dropped))

    def mask(self, client: int, round_number: int, step: SecAggStep) -> dict[str, torch.Tensor]:
        """The masked update: every element clipped to the step's bound, quantized with its step,
        times its weight, masked; int32 tensors of the kept update's names and shapes."""
        kept = self._party(client, round_number)
        if SecAggStage.MASK in kept.answers:
            return kept.answers[SecAggStage.MASK]
        flat = np.concatenate([t.reshape(-1).numpy() for t in kept.update.values()])
        try:
            masked = kept.party.masked(quantize(flat, step.bound, step.step, step.weight), step.mask_with)
        except SecAggError as error:
            raise SecureStepError(f"client {client} round {round_number}: masking failed: {error}") from error
        signed = torch.from_numpy(masked.view(np.int32))
        out, start = {}, 0
        for name, tensor in kept.update.items():
            out[name] = signed[start:start + tensor.numel()].reshape(tensor.shape).clone()
            start += tensor.numel()
        kept.answers[SecAggStage.MASK] = out
        return out

    def _party(self, client: int, round_number: int) -> _Kept:
        kept = self._kept.get((client, round_number))
        if kept is None:
            raise SecureStepError(f"client {client} round {round_number}: no secure aggregation state (this process "
                                  "did not train it, or restarted since)")
        return kept


def build(context: WorkerContext) -> SecureAggregation | None:
    if not context.config.privacy.secure_aggregation:
        return None
    return SecureAggregation(SecureUpdates(context.run_id, context.log, context.config.server.engine == "buffered"),
                             context.log)


class SecureAggregation:
    """Holds a training reply's deltas back and answers the round's public keys instead; answers
    the round's later steps (SECAGG tasks) itself, the MASK step with the masked update. A step
    this process cannot answer is answered empty: the server refuses it and counts the client as
    dropped out of the round."""

    train_options: dict[str, object] = {}

    def __init__(self, updates: SecureUpdates, log: Callable[[str], None]) -> None:
        self.updates = updates
        self.log = Log.of(log)

    def __call__(self, task: TaskInfo, call_next: Execute) -> Reply:
        if task.kind == TaskKind.SECAGG:
            return self._step(task)
        reply = call_next(task)
        if task.secagg is None or task.train is None:
            return reply
        held = {name: reply.uploads.pop(name) for name in task.train.upload_deltas}
        reply.step_answer = self.updates.advertise(task.client_id, task.round, held)
        return reply

    def _step(self, task: TaskInfo) -> Reply:
        client, step = task.client_id, task.secagg
        try:
            if step.stage == SecAggStage.ADVERTISE:
                return Reply(step_answer=self.updates.readvertise(client, task.round))
            if step.stage != SecAggStage.MASK:
                return Reply(step_answer=self.updates.answer(client, task.round, step))
            return Reply(uploads=self.updates.mask(client, task.round, step))
        except SecureStepError as error:
            self.log.warning(str(error))
            return Reply()
