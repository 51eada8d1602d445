"""The server's side of secure aggregation (``privacy.secure_aggregation``, docs/secure-aggregation.md).

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning" (CCS
2017), with the sparse neighbourhoods of SecAgg+ (Bell et al., CCS 2020) where
``privacy.secure_aggregation_neighbours`` is set. A securely aggregated round runs five steps over
the task board, each a dispatch and a wait like the training itself (:meth:`Coordinator.run_round`):

1. ADVERTISE, on the TRAIN task: each client trains, keeps its update and answers two public keys
   and a commitment to its self-mask seed (U1: the clients that answered);
2. SHARE: each client of U1 gets its neighbours' keys and answers a share of its two secrets
   sealed to each neighbour, and a commitment to every share it dealt (U2: the clients that
   answered);
3. CHECK: each client of U2 gets the shares sealed to it with their commitments and answers the
   senders whose shares do not open or do not match. Every disputed pair leaves the round's graph;
   a client in more disputes than the threshold leaves room for is dropped and named
   (:func:`~fedpart.common.privacy.secagg.mask_graph`);
4. MASK: each client left gets the peers it masks with and answers its update clipped, quantized
   into the ring of 2**32 and masked (U3: the clients whose masked update arrived). The masked
   updates are summed modulo 2**32 as they arrive (:class:`SecureSum`);
5. UNMASK: each client of U3 is told which of its peers masked and which dropped out, and answers
   the shares that remove the survivors' own masks and the dropped clients' pairwise masks. A
   revealed share that does not match its dealer's commitment is ignored and its holder named;
   the sum is rebuilt from the others (:func:`~fedpart.common.privacy.secagg.unmask`).

The server sees keys, commitments, sealed shares it cannot open, masked updates, and from the last
step the shares that remove the masks of the sum: never one client's update (the unmasked sum
alone). It routes every message, so it checks each answer's shape before keeping it (a result is
never trusted for more than its shape): keys and commitments of the right length, sealed shares
and commitments for exactly the neighbours asked, disputes only of senders it routed, revealed
shares only for the clients asked. A client named for its messages is a failure of the run (a
line in ``summary.json``, exit code 3); an honest client is never named for another's lie.

Cost: the steps' messages (keys, commitments, sealed shares, disputes, the lists and revealed
shares, and the headers of the four extra tasks) are the ledger's part ``secagg``; the masked
update is as large as the plain float32 update and is counted under its tensors' parts.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping

import numpy as np
import torch

from fedpart.common.config.run_config import RunConfig
from fedpart.common.process.console import Log
from fedpart.common.wire.plans import ResultInfo, SecAggAnswer, SecAggStage, SecAggStep
from fedpart.common.wire.protocol import InvalidResult
from fedpart.server.policy.base import RoundFailed
from fedpart.common.privacy.secagg import (
    Commitments,
    MaskGraph,
    SecAggError,
    default_threshold,
    dequantize,
    mask_graph,
    neighbours,
    quantization_step,
    round_tag,
    unmask,
)

KEY_BYTES = 32             # an X25519 public key, and a SHA-256 commitment
MAX_SEALED_BYTES = 1024    # one sealed pair of shares (two 70-byte shares, ids, nonce and tag, with room)
MAX_SHARE_BYTES = 256      # one revealed share
MIN_SURVIVORS = 2          # a sum of one masked update would be that client's update


class SecureRoundFailed(RoundFailed):
    """Too few clients got through a step for the round's sum to be unmasked; says which step."""


class SecureRound:
    """One round's secure aggregation: who is in each step, what each step asks of each client,
    and the unmasked mean at the end. Thread-safe: answers arrive from the service's threads.

    ``log`` gets a warning line for what the round works around (disputed pairs, clients left
    short of neighbours); ``blame`` gets one line per step naming the clients whose messages were
    refused or ignored (the coordinator records it as a failure)."""

    def __init__(self, config: RunConfig, run_id: str, round_number: int, uploads: Mapping[str, torch.Tensor],
                 log: Callable[[str], None], blame: Callable[[str], None]) -> None:
        privacy = config.privacy
        self.round_number = round_number
        self.round_tag = round_tag(run_id, round_number)
        self.bound = privacy.secure_aggregation_bound
        self.degree = privacy.secure_aggregation_neighbours
        self.configured_threshold = privacy.secure_aggregation_threshold
        self.shapes = {name: tuple(tensor.shape) for name, tensor in uploads.items()}
        self.elements = sum(int(np.prod(shape)) for shape in self.shapes.values())
        self.log = Log.of(log)
        self.blame = blame
        self.keys: dict[int, tuple[bytes, bytes, bytes]] = {}  # U1: cipher key, mask key, seed commitment
        self.weights: dict[int, int] = {}
        self.graph: dict[int, tuple[int, ...]] = {}
        self.threshold = 0
        self.sealed: dict[int, dict[int, bytes]] = {}       # U2: sender -> recipient -> sealed share
        self.dealt: dict[int, dict[int, tuple[bytes, bytes]]] = {}  # U2: dealer -> holder -> share commitments
        self.disputes: dict[int, frozenset[int]] = {}       # CHECK: client -> senders whose shares failed it
        self.mask_graph: dict[int, tuple[int, ...]] = {}    # who masks with whom
        self.masked: set[int] = set()                       # U3
        self.step = 0.0
        self.revealed: dict[int, dict[int, bytes]] = {}     # answering client -> owner -> share
        self._routed: dict[int, frozenset[int]] = {}        # CHECK: the senders whose shares each client got
        self._asked: dict[int, frozenset[int]] = {}         # UNMASK: the owners each client was asked about
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
            return {c: SecAggStep(SecAggStage.SHARE, peers={v: self.keys[v][:2] for v in self.graph[c]},
                                  threshold=self.threshold) for c in clients}

    def checking_steps(self) -> dict[int, SecAggStep]:
        """CHECK for each client of U2: the shares its neighbours in U2 sealed to it, and their
        commitments to those shares."""
        with self._lock:
            senders = sorted(self.sealed)
            if len(senders) < MIN_SURVIVORS:
                raise SecureRoundFailed(f"{len(senders)} client(s) shared their secrets: a sum needs {MIN_SURVIVORS}")
            steps = {}
            for c in senders:
                routed = [v for v in self.graph[c] if v in self.sealed]
                self._routed[c] = frozenset(routed)
                steps[c] = SecAggStep(SecAggStage.CHECK, sealed={v: self.sealed[v][c] for v in routed},
                                      commitments={v: self.dealt[v][c] for v in routed})
            return steps

    def masking_steps(self) -> dict[int, SecAggStep]:
        """MASK for each client left in the round's graph once the disputes are in: the peers it
        masks with, the bound, the quantization step and its weight (what screening counted it
        for: 1 under DP-FedAvg)."""
        with self._lock:
            graph = mask_graph(self.graph, self.sealed, self.disputes, self.disputes, self.threshold)
            self.mask_graph = graph.neighbours
        self._report_disputes(graph)
        with self._lock:
            maskers = sorted(self.mask_graph)
            if len(maskers) < MIN_SURVIVORS:
                named = f" (named: clients {list(graph.named)})" if graph.named else ""
                raise SecureRoundFailed(f"{len(maskers)} client(s) left to mask once the shares were checked: a sum "
                                        f"needs {MIN_SURVIVORS}{named}")
            weights = {c: self.weights[c] for c in maskers}
            self.step = quantization_step(self.bound, sum(weights.values()))
            return {c: SecAggStep(SecAggStage.MASK, mask_with=self.mask_graph[c], bound=self.bound, step=self.step,
                                  weight=weights[c]) for c in maskers}

    def _report_disputes(self, graph: MaskGraph) -> None:
        """The CHECK step's outcome: named clients to ``blame``, the rest to ``log``."""
        prefix = f"round {self.round_number}: secure aggregation:"
        if graph.named:
            counts = "; ".join(f"client {c}: {n} of its {len(self.graph[c])}" for c, n in graph.named.items())
            self.blame(f"{prefix} clients {list(graph.named)} dropped: in share disputes with more of their "
                       f"neighbours than the threshold of {self.threshold} leaves room for ({counts})")
        if graph.disputed:
            pairs = ", ".join(f"{a} and {b}" for a, b in graph.disputed)
            self.log.warning(f"{prefix} shares disputed between clients {pairs} (one side of each pair lies; the "
                     "server cannot tell which): those pairs do not mask together")
        if graph.short:
            self.log.warning(f"{prefix} clients {list(graph.short)} keep fewer than {self.threshold - 1} undisputed "
                     "neighbours that checked their shares: left out of this round's sum")

    def unmasking_steps(self) -> dict[int, SecAggStep]:
        """UNMASK for each client of U3: its peers (and itself) that masked, and its peers that
        were sent the MASK step but sent no masked update."""
        with self._lock:
            survivors = set(self.masked)
            if len(survivors) < MIN_SURVIVORS:
                raise SecureRoundFailed(f"{len(survivors)} masked update(s) arrived: a sum needs {MIN_SURVIVORS}")
            short = [c for c in sorted(survivors) if len(set(self.mask_graph[c]) & survivors) + 1 < self.threshold]
            if short:
                raise SecureRoundFailed(f"too few neighbours of client(s) {short[:5]} sent a masked update to reach "
                                        f"the threshold of {self.threshold} shares")
            steps = {}
            for c in sorted(survivors):
                near = set(self.mask_graph[c])
                alive = tuple(sorted((near & survivors) | {c}))
                dropped = tuple(sorted(near - survivors))
                self._asked[c] = frozenset(alive + dropped)
                steps[c] = SecAggStep(SecAggStage.UNMASK, survivors=alive, dropped=dropped)
            return steps

    # ------------------------------------------------------------------ answers

    def take_keys(self, client: int, result: ResultInfo, weight: int) -> None:
        """ADVERTISE's answer: two public keys and the seed commitment (a training result carries
        no tensors then)."""
        answer = _answer(result)
        if any(len(k) != KEY_BYTES for k in (answer.cipher_key, answer.mask_key, answer.seed_commitment)):
            raise InvalidResult(f"secure aggregation keys and the seed commitment must be {KEY_BYTES} bytes each")
        if answer.sealed or answer.revealed or answer.commitments or answer.disputed:
            raise InvalidResult("a training result under secure aggregation carries only its keys")
        if weight < 1:
            raise InvalidResult("a training result must report at least one training sample")
        with self._lock:
            self.keys[client] = (answer.cipher_key, answer.mask_key, answer.seed_commitment)
            self.weights[client] = weight

    def take(self, client: int, stage: SecAggStage, result: ResultInfo) -> None:
        """The answer to a SHARE, CHECK or UNMASK step."""
        {SecAggStage.SHARE: self._take_shares, SecAggStage.CHECK: self._take_disputes,
         SecAggStage.UNMASK: self._take_revealed}[stage](client, _answer(result))

    def _take_shares(self, client: int, answer: SecAggAnswer) -> None:
        """SHARE's answer: one sealed share for exactly each neighbour, and the commitments to the
        shares of each neighbour and of the client itself."""
        near = set(self.graph.get(client, ()))
        if set(answer.sealed) != near:
            raise InvalidResult("sealed shares must go to exactly the client's neighbours")
        if any(len(sealed) > MAX_SEALED_BYTES for sealed in answer.sealed.values()):
            raise InvalidResult(f"a sealed share is larger than {MAX_SEALED_BYTES} bytes")
        if set(answer.commitments) != near | {client}:
            raise InvalidResult("share commitments must be of exactly the client's neighbours and the client")
        if any(len(c) != KEY_BYTES for pair in answer.commitments.values() for c in pair):
            raise InvalidResult(f"a share commitment must be {KEY_BYTES} bytes")
        with self._lock:
            self.sealed[client] = dict(answer.sealed)
            self.dealt[client] = dict(answer.commitments)

    def _take_disputes(self, client: int, answer: SecAggAnswer) -> None:
        """CHECK's answer: the senders whose shares did not hold, among those routed to it."""
        disputed = frozenset(answer.disputed)
        if len(disputed) != len(answer.disputed) or not disputed <= self._routed.get(client, frozenset()):
            raise InvalidResult("disputes must name distinct senders of the shares the step carried")
        with self._lock:
            self.disputes[client] = disputed

    def take_masked(self, client: int) -> None:
        """MASK's answer has been folded into the :class:`SecureSum`."""
        with self._lock:
            self.masked.add(client)

    def _take_revealed(self, client: int, answer: SecAggAnswer) -> None:
        """UNMASK's answer: shares of exactly the clients it was asked about."""
        if set(answer.revealed) != self._asked.get(client, frozenset()):
            raise InvalidResult("revealed shares must be of exactly the clients the step named")
        if any(len(share) > MAX_SHARE_BYTES for share in answer.revealed.values()):
            raise InvalidResult(f"a revealed share is larger than {MAX_SHARE_BYTES} bytes")
        with self._lock:
            self.revealed[client] = dict(answer.revealed)

    # ------------------------------------------------------------------ the end

    def unmasked_total(self, total: np.ndarray) -> np.ndarray:
        """The sum of U3's quantized updates (uint32): ``total`` with every mask removed. Raises
        :class:`SecureRoundFailed` when too few shares came back or a dealer's shares do not
        rebuild its secret; names the clients whose revealed shares were ignored."""
        with self._lock:
            committed = {c: Commitments(self.keys[c][1], self.keys[c][2], self.dealt[c]) for c in self.mask_graph}
            try:
                unmasked = unmask(total, sorted(self.masked), committed, self.mask_graph, self.revealed,
                                  self.threshold, self.round_tag)
            except SecAggError as error:
                raise SecureRoundFailed(f"unmasking failed: {error}") from error
        if unmasked.liars:
            self.blame(f"round {self.round_number}: secure aggregation: clients {list(unmasked.liars)} revealed "
                       "shares that do not match their dealers' commitments: ignored, the sum is rebuilt without them")
        return unmasked.total

    def survivors_weight(self) -> int:
        with self._lock:
            return sum(self.weights[c] for c in self.masked)


def _answer(result: ResultInfo) -> SecAggAnswer:
    if result.secagg is None:
        raise InvalidResult("the result lacks its answer to the secure aggregation step")
    return result.secagg


class SecureSum:
    """The masked updates of one round summed modulo 2**32 as they arrive (an
    :class:`~fedpart.server.policy.aggregation.Aggregator` of int32 tensors); :meth:`result` removes the
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
