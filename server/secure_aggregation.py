"""The server's side of secure aggregation (``privacy.secure_aggregation``, docs/privacy.md).

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning" (CCS
2017), with the sparse neighbourhoods of SecAgg+ (Bell et al., CCS 2020) where
``privacy.secure_aggregation_neighbours`` is set. A securely aggregated round runs four steps over
the task board, each a dispatch and a wait like the training itself (:meth:`Coordinator.run_round`):

1. ADVERTISE, on the TRAIN task: each client trains, keeps its update and answers two public keys
   (U1: the clients that answered);
2. SHARE: each client of U1 gets its neighbours' keys and answers a share of its two secrets
   sealed to each neighbour (U2: the clients that answered);
3. MASK: each client of U2 gets the shares sealed to it and answers its update clipped, quantized
   into the ring of 2**32 and masked (U3: the clients whose masked update arrived). The masked
   updates are summed modulo 2**32 as they arrive (:class:`SecureSum`);
4. UNMASK: each client of U3 is told which neighbours masked and which dropped out, and answers
   the shares that remove the survivors' own masks and the dropped clients' pairwise masks.

The server sees keys, sealed shares it cannot open, masked updates, and from the last step the
shares that remove the masks of the sum: never one client's update (the unmasked sum alone). It
routes every message, so it checks each answer's shape before keeping it (a result is never
trusted for more than its shape): keys of the right length, sealed shares for exactly the
neighbours asked, revealed shares only for the clients asked.

Cost: the steps' messages (keys, sealed shares, the lists and revealed shares, and the headers of
the three extra tasks) are the ledger's part ``secagg``; the masked update is as large as the
plain float32 update and is counted under its tensors' parts.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping

import numpy as np
import torch

from fedpart.common.config import RunConfig
from fedpart.common.plans import ResultInfo, SecAggAnswer, SecAggStage, SecAggStep
from fedpart.common.protocol import InvalidResult
from fedpart.common.secagg import (
    SecAggError,
    default_threshold,
    dequantize,
    neighbours,
    quantization_step,
    round_tag,
    unmask,
)

KEY_BYTES = 32             # an X25519 public key
MAX_SEALED_BYTES = 1024    # one sealed pair of shares (two 70-byte shares, ids, nonce and tag, with room)
MAX_SHARE_BYTES = 256      # one revealed share
MIN_SURVIVORS = 2          # a sum of one masked update would be that client's update


class SecureRoundFailed(RuntimeError):
    """Too few clients got through a step for the round's sum to be unmasked; says which step."""


class SecureRound:
    """One round's secure aggregation: who is in each step, what each step asks of each client,
    and the unmasked mean at the end. Thread-safe: answers arrive from the service's threads."""

    def __init__(self, config: RunConfig, run_id: str, round_number: int, uploads: Mapping[str, torch.Tensor]) -> None:
        privacy = config.privacy
        self.round_number = round_number
        self.round_tag = round_tag(run_id, round_number)
        self.bound = privacy.secure_aggregation_bound
        self.degree = privacy.secure_aggregation_neighbours
        self.configured_threshold = privacy.secure_aggregation_threshold
        self.shapes = {name: tuple(tensor.shape) for name, tensor in uploads.items()}
        self.elements = sum(int(np.prod(shape)) for shape in self.shapes.values())
        self.keys: dict[int, tuple[bytes, bytes]] = {}      # U1: (cipher, mask) public keys
        self.weights: dict[int, int] = {}
        self.graph: dict[int, tuple[int, ...]] = {}
        self.threshold = 0
        self.sealed: dict[int, dict[int, bytes]] = {}       # U2: sender -> recipient -> sealed share
        self.masked: set[int] = set()                       # U3
        self.step = 0.0
        self.revealed: dict[int, dict[int, bytes]] = {}     # answering client -> owner -> share
        self._asked: dict[int, frozenset[int]] = {}        # UNMASK: owners each client was asked about
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ each step's asks

    def advertise(self) -> SecAggStep:
        return SecAggStep(SecAggStage.ADVERTISE)

    def sharing_steps(self) -> dict[int, SecAggStep]:
        """SHARE for each client of U1: its neighbours' keys and the threshold."""
        with self._lock:
            clients = sorted(self.keys)
            if len(clients) < MIN_SURVIVORS:
                raise SecureRoundFailed(f"only {len(clients)} client(s) trained: a sum needs {MIN_SURVIVORS}")
            seed = int.from_bytes(hashlib.sha256(self.round_tag).digest()[:8], "little")
            self.graph = neighbours(clients, self.degree, seed)
            neighbourhood = min(len(n) for n in self.graph.values()) + 1
            self.threshold = self.configured_threshold or default_threshold(neighbourhood)
            if self.threshold > neighbourhood:
                raise SecureRoundFailed(f"privacy.secure_aggregation_threshold {self.threshold} is more than a "
                                        f"neighbourhood of {neighbourhood} clients this round")
            return {c: SecAggStep(SecAggStage.SHARE, peers={v: self.keys[v] for v in self.graph[c]},
                                  threshold=self.threshold) for c in clients}

    def masking_steps(self, dp_weight: bool) -> dict[int, SecAggStep]:
        """MASK for each client of U2: the shares sealed to it by neighbours in U2, the bound, the
        quantization step and its weight (1 under DP-FedAvg, ``dp_weight``)."""
        with self._lock:
            senders = sorted(self.sealed)
            if len(senders) < MIN_SURVIVORS:
                raise SecureRoundFailed(f"{len(senders)} client(s) shared their secrets: a sum needs {MIN_SURVIVORS}")
            self._check_neighbourhoods(set(senders), "shared their secrets")
            weights = {c: 1 if dp_weight else self.weights[c] for c in senders}
            self.step = quantization_step(self.bound, sum(weights.values()))
            return {c: SecAggStep(SecAggStage.MASK, sealed={v: self.sealed[v][c] for v in self.graph[c]
                                                            if v in self.sealed},
                                  bound=self.bound, step=self.step, weight=weights[c]) for c in senders}

    def unmasking_steps(self) -> dict[int, SecAggStep]:
        """UNMASK for each client of U3: its neighbours (and itself) that masked, and those that
        shared but dropped out before masking."""
        with self._lock:
            survivors = set(self.masked)
            if len(survivors) < MIN_SURVIVORS:
                raise SecureRoundFailed(f"{len(survivors)} masked update(s) arrived: a sum needs {MIN_SURVIVORS}")
            self._check_neighbourhoods(survivors, "sent a masked update")
            steps = {}
            for c in sorted(survivors):
                near = set(self.graph[c])
                alive = tuple(sorted((near & survivors) | {c}))
                dropped = tuple(sorted((near & set(self.sealed)) - survivors))
                self._asked[c] = frozenset(alive + dropped)
                steps[c] = SecAggStep(SecAggStage.UNMASK, survivors=alive, dropped=dropped)
            return steps

    def _check_neighbourhoods(self, present: set[int], what: str) -> None:
        short = [c for c in sorted(present) if len(set(self.graph[c]) & present) + 1 < self.threshold]
        if short:
            raise SecureRoundFailed(f"too few neighbours of client(s) {short[:5]} {what} to reach the threshold "
                                    f"of {self.threshold} shares")

    # ------------------------------------------------------------------ answers

    def take_keys(self, client: int, result: ResultInfo, weight: int) -> None:
        """ADVERTISE's answer: two public keys (a training result carries no tensors then)."""
        answer = _answer(result)
        if len(answer.cipher_key) != KEY_BYTES or len(answer.mask_key) != KEY_BYTES:
            raise InvalidResult(f"secure aggregation keys must be {KEY_BYTES} bytes each")
        if answer.sealed or answer.revealed:
            raise InvalidResult("a training result under secure aggregation carries only its keys")
        if weight < 1:
            raise InvalidResult("a training result must report at least one training sample")
        with self._lock:
            self.keys[client] = (answer.cipher_key, answer.mask_key)
            self.weights[client] = weight

    def take_shares(self, client: int, result: ResultInfo) -> None:
        """SHARE's answer: one sealed share for exactly each neighbour."""
        answer = _answer(result)
        if set(answer.sealed) != set(self.graph.get(client, ())):
            raise InvalidResult("sealed shares must go to exactly the client's neighbours")
        if any(len(sealed) > MAX_SEALED_BYTES for sealed in answer.sealed.values()):
            raise InvalidResult(f"a sealed share is larger than {MAX_SEALED_BYTES} bytes")
        with self._lock:
            self.sealed[client] = dict(answer.sealed)

    def take_masked(self, client: int) -> None:
        """MASK's answer has been folded into the :class:`SecureSum`."""
        with self._lock:
            self.masked.add(client)

    def take_revealed(self, client: int, result: ResultInfo) -> None:
        """UNMASK's answer: shares of exactly the clients it was asked about."""
        answer = _answer(result)
        if set(answer.revealed) != self._asked.get(client, frozenset()):
            raise InvalidResult("revealed shares must be of exactly the clients the step named")
        if any(len(share) > MAX_SHARE_BYTES for share in answer.revealed.values()):
            raise InvalidResult(f"a revealed share is larger than {MAX_SHARE_BYTES} bytes")
        with self._lock:
            self.revealed[client] = dict(answer.revealed)

    # ------------------------------------------------------------------ the end

    def unmasked_total(self, total: np.ndarray) -> np.ndarray:
        """The sum of U3's quantized updates (uint32): ``total`` with every mask removed. Raises
        :class:`SecureRoundFailed` when too few shares came back."""
        with self._lock:
            shared = {c: self.keys[c] for c in self.sealed}
            try:
                return unmask(total, sorted(self.masked), shared, self.graph, self.revealed, self.threshold,
                              self.round_tag)
            except SecAggError as error:
                raise SecureRoundFailed(f"unmasking failed: {error}") from error

    def survivors_weight(self) -> int:
        with self._lock:
            return sum(self.weights[c] for c in self.masked)


def _answer(result: ResultInfo) -> SecAggAnswer:
    if result.secagg is None:
        raise InvalidResult("the result lacks its answer to the secure aggregation step")
    return result.secagg


class SecureSum:
    """The masked updates of one round summed modulo 2**32 as they arrive (an
    :class:`~fedpart.server.aggregation.Aggregator` of int32 tensors); :meth:`result` removes the
    masks and returns the weighted mean, or under DP-FedAvg the noised sum over the fixed
    denominator (``noise``: standard deviation, denominator and generator)."""

    def __init__(self, secure: SecureRound,
                 noise: tuple[float, float, torch.Generator] | None = None) -> None:
        self.secure = secure
        self.noise = noise
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, shape in secure.shapes.items():
            size = int(np.prod(shape))
            self._offsets[name] = (start, start + size)
            start += size
        self._total = np.zeros(secure.elements, dtype=np.uint32)
        self._count = 0
        self._lock = threading.Lock()

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold one masked update (its weight is inside it)."""
        if set(tensors) != set(self._offsets):
            raise ValueError("a masked update must cover every tensor the round uploads")
        with self._lock:
            for name, (start, stop) in self._offsets.items():
                view = tensors[name].reshape(-1).numpy().view(np.uint32)
                np.add(self._total[start:stop], view, out=self._total[start:stop])
            self._count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """The unmasked mean of every uploaded tensor (float64). Raises SecureRoundFailed."""
        total = self.secure.unmasked_total(self._total)
        if self.noise is None:
            flat = torch.from_numpy(dequantize(total, self.secure.step, self.secure.survivors_weight()))
            flat = flat.to(torch.float64)
        else:
            std, denominator, generator = self.noise
            flat = torch.from_numpy(dequantize(total, self.secure.step, 1)).to(torch.float64)
            if std:
                flat += torch.normal(0.0, std, flat.shape, generator=generator, dtype=torch.float64)
            flat /= denominator
        return {name: flat[start:stop].reshape(self.secure.shapes[name]).clone()
                for name, (start, stop) in self._offsets.items()}

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict.fromkeys(self._offsets, self._count)
