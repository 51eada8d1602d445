"""What a task asks of a client and what a result reports, as plain values.

The round engine builds these, the client's training and evaluation read them, and neither side
touches protobuf: :mod:`fedpart.common.wire.serde` converts them to and from the wire messages at the
edges (the gRPC service and the client runtimes). Tensors are not here: their specs and bytes
stay with :mod:`fedpart.common.wire.tensors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum


class TaskKind(IntEnum):
    """What a task asks for; the values are the proto's ``TaskKind``."""

    IDLE = 0      # nothing yet: poll again
    TRAIN = 1
    EVALUATE = 2
    DONE = 3      # the run is over
    SECAGG = 4    # a step of secure aggregation (the task's ``secagg`` says which)


class SecAggStage(IntEnum):
    """The steps of a securely aggregated round (Bonawitz et al., CCS 2017); the values are the
    proto's ``SecAggStage``. ADVERTISE rides on the TRAIN task; the others are SECAGG tasks."""

    NONE = 0
    ADVERTISE = 1  # train, keep the update, answer two public keys and a seed commitment
    SHARE = 2      # the neighbours' keys: answer a sealed share of the secrets for each, and commitments
    MASK = 3       # the peers to mask with: answer the masked, quantized update
    UNMASK = 4     # who masked and who dropped out: answer the shares that remove the masks
    CHECK = 5      # between SHARE and MASK: the shares sealed to this client; answer those that fail


class RunOutcome(IntEnum):
    """How the run ended, told with DONE; the values are the proto's ``RunOutcome``."""

    COMPLETED = 0  # every round and the final evaluation ran
    ABORTED = 1    # the server ended the run early (interrupted, or it gave up)


@dataclass(frozen=True)
class Phase:
    """A stretch of local training in which the ``trainable`` schedule units (body units and/or
    ``head``) train. ``params``: named numbers the algorithm's unit schedule reads on the client
    (``fedpart.common.ml.algorithms.UnitSchedule``; FedBug's ``unfreeze_fraction``: the listed units
    unfreeze one by one, in order, over that fraction of the phase's steps)."""

    epochs: int
    trainable: tuple[str, ...]
    params: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainPlan:
    """One client's local training in one round: its phases, local SGD, and what to upload."""

    phases: tuple[Phase, ...]
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.0                # max gradient norm; 0 = off
    upload_deltas: tuple[str, ...] = ()   # tensors sent back as local - global
    upload_values: tuple[str, ...] = ()   # tensors sent back whole (FedHA's head dictionary)
    seed: int = 0                         # batch order

    @property
    def uploads(self) -> tuple[str, ...]:
        """Names of the tensors a result of this plan carries, in the order they are sent."""
        return self.upload_deltas + self.upload_values

    def local_steps(self, train_size: int) -> int:
        """The local steps this plan takes on ``train_size`` training samples: every epoch of a
        phase that trains anything, ``ceil(train_size / batch_size)`` steps each."""
        return sum(p.epochs for p in self.phases if p.trainable) * math.ceil(train_size / self.batch_size)


@dataclass(frozen=True)
class EvalPlan:
    """The final evaluation and personalization (FedBABU's protocol, Oh et al. ICLR 2022)."""

    finetune_epochs: tuple[int, ...]      # fine-tune checkpoints, e.g. (0, 1, 5)
    lr: float
    momentum: float
    batch_size: int
    part: str = "full"                    # what the fine-tune trains: full, body or head
    headless: bool = False                # also report nearest-class-template accuracy
    seed: int = 0


@dataclass(frozen=True)
class SecAggStep:
    """What one step of secure aggregation asks of a client (``fedpart.common.privacy.secagg``)."""

    stage: SecAggStage
    peers: Mapping[int, tuple[bytes, bytes]] = field(default_factory=dict)  # SHARE: neighbour -> (cipher, mask) keys
    threshold: int = 0                    # SHARE: shares that rebuild a secret
    sealed: Mapping[int, bytes] = field(default_factory=dict)  # CHECK: shares sealed to this client, by sender
    survivors: tuple[int, ...] = ()       # UNMASK: neighbours whose masked update arrived
    dropped: tuple[int, ...] = ()         # UNMASK: neighbours that shared but sent no masked update
    bound: float = 0.0                    # MASK: each element is clipped to [-bound, bound]
    step: float = 0.0                     # MASK: quantization step
    weight: int = 0                       # MASK: integer weight multiplied into the quantized update
    # CHECK: the commitments (seed share, key share) of the shares sealed to this client, by sender
    commitments: Mapping[int, tuple[bytes, bytes]] = field(default_factory=dict)
    mask_with: tuple[int, ...] = ()       # MASK: the peers this client masks with


@dataclass(frozen=True)
class SecAggAnswer:
    """A client's answer to a step of secure aggregation."""

    cipher_key: bytes = b""               # ADVERTISE
    mask_key: bytes = b""                 # ADVERTISE
    sealed: Mapping[int, bytes] = field(default_factory=dict)    # SHARE: by recipient
    revealed: Mapping[int, bytes] = field(default_factory=dict)  # UNMASK: shares held, by their owner
    seed_commitment: bytes = b""          # ADVERTISE
    # SHARE: the commitments (seed share, key share) of every share dealt, by holder
    commitments: Mapping[int, tuple[bytes, bytes]] = field(default_factory=dict)
    disputed: tuple[int, ...] = ()        # CHECK: senders whose shares do not open or do not match


@dataclass
class TaskInfo:
    """What a task header tells a client: which client, which round, what to do."""

    kind: TaskKind
    task_id: int
    round: int
    client_id: int
    train: TrainPlan | None = None
    evaluate: EvalPlan | None = None
    personal_init: tuple[str, ...] = ()   # parts the client initialises from the global copy
    outcome: RunOutcome = RunOutcome.COMPLETED  # DONE: how the run ended
    result_chunk_bytes: int = 0           # largest message its result may come in (0: server.result_chunk_bytes)
    secagg: SecAggStep | None = None      # under secure aggregation: TRAIN (ADVERTISE) and SECAGG tasks

    def uploads(self) -> tuple[str, ...]:
        """Names of the plain tensors its result must carry (none under secure aggregation: the
        update travels masked, in the MASK step's result)."""
        if self.secagg is not None:
            return ()
        return self.train.uploads if self.train is not None else ()


@dataclass(frozen=True)
class ResultInfo:
    """What a result header says besides its tensor specs."""

    session: str
    task_id: int
    client_id: int
    round: int
    num_samples: int = 0                  # local training samples (the aggregation weight)
    metrics: Mapping[str, float] = field(default_factory=dict)
    secagg: SecAggAnswer | None = None    # the answer to the task's step of secure aggregation


@dataclass(frozen=True)
class HostedClient:
    """A client a process hosts, with the personal parts it already keeps on disk."""

    id: int
    personal_parts: frozenset[str] = frozenset()  # parts (``head``, ...) the process reports holding


@dataclass(frozen=True)
class JoinInfo:
    """A client process's join: who it is and which clients it hosts."""

    protocol: int
    process_name: str
    clients: tuple[HostedClient, ...]
    state_run_id: str = ""                # the run the reported personal parts belong to

    @property
    def client_ids(self) -> list[int]:
        return [c.id for c in self.clients]
