"""The cryptography of secure aggregation, with no transport and no model in it.

The protocol is Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning" (CCS 2017), semi-honest variant: each client advertises two X25519 public keys (one
encrypts the Shamir shares it sends to its peers, one agrees the pairwise mask seeds), splits a
random self-mask seed and its mask private key among its neighbours, adds to its quantized update
its self mask and, for every neighbour v it masks with, ``+PRG(s_uv)`` if ``u < v`` else
``-PRG(s_uv)``; the pairwise masks cancel in the server's sum, and the server removes what is
left with the secrets the survivors reveal: the self-mask seed of every client that sent a masked
update, the mask private key of every client that shared but did not. Neighbourhoods are the
SecAgg+ graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead"
(CCS 2020): a random circulant graph of even degree instead of the complete graph.

What one lying client can break in that protocol, it cannot break silently here: every secret is
bound to its dealer by SHA-256 commitments made before anyone masks (the self-mask seed's with
the keys, every share's with the sealed shares), so a revealed share that was altered, or a
dealer whose shares do not rebuild what it committed to, is found and named (:func:`unmask`);
and each client checks the shares sealed to it before masking (:meth:`ClientParty.check`), so
that a pair that disputes its shares leaves the round's graph instead of the honest side
dropping out (:func:`mask_graph`). A well-formed false update is beyond any of this: the
protocol hides inputs, it cannot vouch for them.

Arithmetic is modulo ``2**RING_BITS``: updates are quantized to integers (:func:`quantize`), and a
masked update is a ``uint32`` vector that travels as ``int32`` (the same bits).
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF


class SecAggError(ValueError):
    """A step of secure aggregation cannot be done (says why); ``culprits``: the clients whose
    messages made it fail, where that is known (empty for dropouts alone)."""

    def __init__(self, message: str, culprits: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.culprits = tuple(sorted(set(culprits)))


RING_BITS = 32  # masked updates are sums modulo 2**32; on the wire as int32 (two's complement view)

_INT32_MAX = 2**31 - 1
_PRIME = 2**521 - 1  # a Mersenne prime: a secret of up to 64 bytes is one field element
_MAX_SECRET_BYTES = 64
_X_BYTES = 8  # share layout: x = holder id + 1 (unsigned, big-endian) ...
_Y_BYTES = 66  # ... then y = f(x) mod p (unsigned, big-endian); 74 bytes in all
_SHARE_BYTES = _X_BYTES + _Y_BYTES
_NONCE_BYTES = 12
_TAG_BYTES = 16
_KEY_BYTES = 32
_CIPHER_PURPOSE = b"fedpart secagg cipher\x00"
_MASK_PURPOSE = b"fedpart secagg mask\x00"
_SHARES_LABEL = b"fedpart secagg shares\x00"
_SEED_COMMITMENT = b"fedpart secagg seed commitment\x00"
_SHARE_COMMITMENT = b"fedpart secagg share commitment\x00"
SEED, KEY = 0, 1  # the two secrets a client deals: its self-mask seed and its mask private key


def _check_id(client: int, what: str = "client id") -> int:
    if not isinstance(client, (int, np.integer)) or not 0 <= int(client) < 2 ** (8 * _X_BYTES) - 1:
        raise SecAggError(f"{what} {client!r} is not an integer in [0, 2**64 - 2]")
    return int(client)


# --- keys and authenticated encryption ---------------------------------------------------------


def _public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_pair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 private key and its raw 32-byte public key."""
    private = X25519PrivateKey.generate()
    return private, _public_bytes(private)


def shared_key(private: X25519PrivateKey, peer_public: bytes, purpose: bytes) -> bytes:
    """X25519 agreement with ``peer_public``, then HKDF-SHA256 (``info=purpose``) to 32 bytes.

    Both ends get the same key (Bonawitz et al. §4: Diffie-Hellman key agreement). A public key of
    the wrong length, or one whose agreement is all zeros (a low-order point), is a SecAggError.
    """
    if not isinstance(peer_public, bytes) or len(peer_public) != _KEY_BYTES:
        raise SecAggError(f"a public key must be {_KEY_BYTES} bytes, not {len(peer_public)!r}")
    try:
        secret = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:
        raise SecAggError(f"unusable public key ({error})") from error
    return HKDF(algorithm=hashes.SHA256(), length=_KEY_BYTES, salt=None, info=purpose).derive(secret)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM with a random 12-byte nonce, returned as ``nonce + ciphertext + tag``."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of :func:`seal`; SecAggError if it is malformed or does not authenticate."""
    if len(sealed) < _NONCE_BYTES + _TAG_BYTES:
        raise SecAggError(f"sealed message of {len(sealed)} bytes is too short")
    try:
        return AESGCM(key).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], associated)
    except (InvalidTag, ValueError) as error:
        raise SecAggError("sealed message does not authenticate") from error


# --- Shamir secret sharing ----------------------------------------------------------------------


def split_secret(secret: bytes, threshold: int, holders: Sequence[int]) -> dict[int, bytes]:
    """Shamir shares of ``secret`` (at most 64 bytes, read big-endian) over GF(2**521 - 1).

    Any ``threshold`` shares rebuild it, fewer reveal nothing (Bonawitz et al. §3.1). The share of
    holder ``h`` is the point ``x = h + 1``, 74 bytes: x as 8 unsigned big-endian bytes, then
    ``y = f(x) mod p`` as 66 unsigned big-endian bytes.
    """
    if len(secret) > _MAX_SECRET_BYTES:
        raise SecAggError(f"a secret is at most {_MAX_SECRET_BYTES} bytes, not {len(secret)}")
    ids = [_check_id(h, "holder id") for h in holders]
    if len(set(ids)) != len(ids):
        raise SecAggError(f"holder ids repeat: {sorted(ids)}")
    if not 1 <= threshold <= len(ids):
        raise SecAggError(f"threshold {threshold} is not between 1 and the {len(ids)} holders")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(_PRIME) for _ in range(threshold - 1)]
    shares = {}
    for holder in ids:
        x = holder + 1
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % _PRIME
        shares[holder] = x.to_bytes(_X_BYTES, "big") + y.to_bytes(_Y_BYTES, "big")
    return shares


def _share_point(holder: int, share: bytes) -> tuple[int, int]:
    holder = _check_id(holder, "holder id")
    if not isinstance(share, bytes) or len(share) != _SHARE_BYTES:
        raise SecAggError(f"the share of holder {holder} is not {_SHARE_BYTES} bytes")
    x = int.from_bytes(share[:_X_BYTES], "big")
    y = int.from_bytes(share[_X_BYTES:], "big")
    if x != holder + 1 or y >= _PRIME:
        raise SecAggError(f"the share of holder {holder} is malformed")
    return x, y


def combine_shares(shares: Mapping[int, bytes], threshold: int, secret_bytes: int = 32) -> bytes:
    """The secret of ``secret_bytes`` bytes, by Lagrange interpolation at 0 of ``threshold`` shares.

    ``shares`` maps holder id -> share; the ``threshold`` lowest holder ids are used. SecAggError
    when there are fewer, a share is malformed, or the result does not fit ``secret_bytes`` (mixing
    shares of different polynomials gives a uniformly random field element, which fits 32 bytes
    with probability 2**-265; a share altered by a small amount is not detected here).
    """
    if threshold < 1:
        raise SecAggError(f"threshold {threshold} is below 1")
    if not 1 <= secret_bytes <= _MAX_SECRET_BYTES:
        raise SecAggError(f"secret_bytes {secret_bytes} is not between 1 and {_MAX_SECRET_BYTES}")
    if len(shares) < threshold:
        raise SecAggError(f"{len(shares)} shares, fewer than the threshold {threshold}")
    points = [_share_point(h, s) for h, s in sorted(shares.items())][:threshold]
    denominator, secret = 1, 0
    # sum_i y_i * prod_{j != i} x_j / (x_j - x_i), over one common denominator (one inversion)
    for i, (xi, yi) in enumerate(points):
        num, den = yi, 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num = num * xj % _PRIME
                den = den * (xj - xi) % _PRIME
        secret = (secret * den + num * denominator) % _PRIME
        denominator = denominator * den % _PRIME
    secret = secret * pow(denominator, -1, _PRIME) % _PRIME
    if secret >= 256**secret_bytes:
        raise SecAggError(f"the shares do not combine to a {secret_bytes}-byte secret (inconsistent shares)")
    return secret.to_bytes(secret_bytes, "big")


# --- masks and neighbourhoods -------------------------------------------------------------------


def mask_stream(seed: bytes, elements: int) -> np.ndarray:
    """``elements`` pseudorandom uint32 (little-endian words of the AES-256-CTR keystream).

    The PRG of Bonawitz et al. §4: key = the 32-byte ``seed``, nonce and counter start at zero.
    """
    if len(seed) != _KEY_BYTES:
        raise SecAggError(f"a mask seed must be {_KEY_BYTES} bytes, not {len(seed)}")
    if elements < 0:
        raise SecAggError(f"cannot make {elements} mask elements")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    buffer = bytearray(4 * elements + 15)  # update_into wants room for one block less a byte
    encryptor.update_into(bytes(4 * elements), buffer)
    return np.frombuffer(buffer, dtype="<u4", count=elements).astype(np.uint32, copy=False)


def neighbours(clients: Sequence[int], degree: int | None, seed: int) -> dict[int, tuple[int, ...]]:
    """The SecAgg+ neighbourhood graph (Bell et al. §3): client -> its sorted neighbours.

    The clients, sorted, are shuffled with ``random.Random(seed)`` and placed on a ring; each is
    joined to the ``degree / 2`` nearest on either side (a Harary-style circulant graph), so the
    graph is symmetric, has no self loops, and every client has exactly ``degree`` neighbours. An
    odd ``degree`` is rounded up to the next even number. ``None``, or a degree (after rounding) of
    at least ``len(clients) - 1``, gives the complete graph of plain SecAgg (Bonawitz et al.).
    Deterministic in (the set of clients, degree, seed).
    """
    ids = sorted(_check_id(c) for c in clients)
    if len(set(ids)) != len(ids):
        raise SecAggError(f"client ids repeat: {ids}")
    if degree is not None and degree < 1:
        raise SecAggError(f"neighbourhood degree {degree} is below 1")
    n = len(ids)
    if degree is None or degree + degree % 2 >= n - 1:
        return {c: tuple(v for v in ids if v != c) for c in ids}
    half = (degree + degree % 2) // 2  # 2 * half < n - 1: the 2 * half ring offsets are distinct
    ring = list(ids)
    random.Random(seed).shuffle(ring)
    graph = {c: tuple(sorted(ring[(i + k) % n] for k in range(-half, half + 1) if k != 0)) for i, c in enumerate(ring)}
    return dict(sorted(graph.items()))


def default_threshold(neighbourhood: int) -> int:
    """A strict majority of a neighbourhood (its neighbours and the client itself)."""
    if neighbourhood < 1:
        raise SecAggError(f"a neighbourhood of {neighbourhood} clients is empty")
    return neighbourhood // 2 + 1


# --- quantization -------------------------------------------------------------------------------


def quantization_step(bound: float, total_weight: int) -> float:
    """The step that keeps a weighted sum of quantized, clipped values inside int32.

    ``step = bound / K`` with ``K = floor((2**31 - 1) / total_weight)``. Proof: a clipped value c
    has ``|c| <= bound``, so ``|c / step| <= K``; round half to even is monotone and K an integer,
    so ``|rint(c / step)| <= K`` (the half a rounding may add never passes an integer bound), and
    ``sum_i w_i * |rint(c_i / step)| <= total_weight * K <= 2**31 - 1``. Floating-point error in
    ``bound / K`` and ``c / step`` is a few ulps of K < 2**31, far below the 1/2 that rint would
    need to go past K. The smallest step with the property is ``bound / (K + 1/2)`` (excluded when
    K is odd); ``bound / K`` is coarser by a factor ``1 + 1/(2K)`` and exact to reason about.
    SecAggError for ``bound <= 0`` or a ``total_weight`` outside ``[1, 2**31 - 1]``.
    """
    if not bound > 0 or not np.isfinite(bound):
        raise SecAggError(f"the element bound {bound} is not a positive number")
    if not 1 <= total_weight <= _INT32_MAX:
        raise SecAggError(f"the total weight {total_weight} is not between 1 and 2**31 - 1")
    return float(bound) / (_INT32_MAX // int(total_weight))


def quantize(values: np.ndarray, bound: float, step: float, weight: int) -> np.ndarray:
    """``weight * rint(clip(values, -bound, bound) / step)`` modulo 2**32, as uint32.

    Round half to even (``np.rint``), computed in float64. SecAggError for NaN values, a negative
    weight, or a step so small that ``bound / step`` reaches 2**31.
    """
    if not bound > 0 or not step > 0 or not bound / step < 2**31:
        raise SecAggError(f"bound {bound} and step {step} do not give levels inside int32")
    if not 0 <= weight <= _INT32_MAX:
        raise SecAggError(f"the weight {weight} is not between 0 and 2**31 - 1")
    x = np.asarray(values, dtype=np.float64)
    if np.isnan(x).any():
        raise SecAggError("cannot quantize NaN")
    levels = np.rint(np.clip(x, -bound, bound) / step).astype(np.int64)  # |levels| < 2**31
    return ((levels * int(weight)) & 0xFFFFFFFF).astype(np.uint32)


def dequantize(total: np.ndarray, step: float, total_weight: int) -> np.ndarray:
    """The weighted mean as float32: ``total`` read as int32, times ``step / total_weight``."""
    if total.dtype != np.uint32:
        raise SecAggError(f"a quantized sum is uint32, not {total.dtype}")
    if total_weight < 1:
        raise SecAggError(f"the total weight {total_weight} is below 1")
    return (total.view(np.int32).astype(np.float64) * (step / total_weight)).astype(np.float32)


# --- the protocol -------------------------------------------------------------------------------


def round_tag(run_id: str, round_number: int) -> bytes:
    """What binds a round's keys, shares and masks to one run and round (server and clients alike)."""
    return f"{run_id}/round-{round_number}".encode()


def _associated(round_tag: bytes, sender: int, recipient: int) -> bytes:
    """What a sealed pair of shares is bound to: the round, who sent it, to whom."""
    return (
        _SHARES_LABEL + len(round_tag).to_bytes(8, "big") + round_tag
        + sender.to_bytes(8, "big") + recipient.to_bytes(8, "big")
    )


def seed_commitment(round_tag: bytes, owner: int, seed: bytes) -> bytes:
    """SHA-256 of the self-mask seed of ``owner``, bound to the round and the owner.

    Advertised with the keys, before any share exists, so a rebuilt seed can be checked the way a
    rebuilt mask key is checked against its public key. Hiding because the seed is 32 random bytes.
    """
    owner = _check_id(owner, "owner id")
    return hashlib.sha256(_SEED_COMMITMENT + len(round_tag).to_bytes(8, "big") + round_tag
                          + owner.to_bytes(8, "big") + seed).digest()


def share_commitments(round_tag: bytes, owner: int, holder: int, pair: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
    """SHA-256 commitments to the two shares (seed share, key share) ``owner`` dealt ``holder``.

    Each binds the round, the dealer, the holder and which secret the share is of. The dealer
    sends them to the server with its sealed shares; the holder checks the shares it opens against
    them before masking (:meth:`ClientParty.check`) and the server checks every revealed share
    against them (:func:`unmask`): so a share that does not match was altered by its holder, and
    shares that match but do not rebuild the committed secret were dealt wrong by their dealer.
    Hiding because a share's y is uniform over a 521-bit field for any threshold of 2 or more.
    """
    return (_share_commitment(round_tag, owner, holder, SEED, pair[SEED]),
            _share_commitment(round_tag, owner, holder, KEY, pair[KEY]))


def _share_commitment(round_tag: bytes, owner: int, holder: int, kind: int, share: bytes) -> bytes:
    return hashlib.sha256(_SHARE_COMMITMENT + len(round_tag).to_bytes(8, "big") + round_tag
                          + _check_id(owner, "owner id").to_bytes(8, "big")
                          + _check_id(holder, "holder id").to_bytes(8, "big") + bytes([kind]) + share).digest()


def _pair_mask(private: X25519PrivateKey, peer_mask_key: bytes, round_tag: bytes, elements: int) -> np.ndarray:
    return mask_stream(shared_key(private, peer_mask_key, _MASK_PURPOSE + round_tag), elements)


@dataclass(frozen=True)
class Dealt:
    """A client's answer to the SHARE step: its shares sealed to each neighbour, and the
    commitments to every share it dealt (:func:`share_commitments`), by holder (the neighbours
    and the client itself)."""

    sealed: dict[int, bytes]
    commitments: dict[int, tuple[bytes, bytes]]


class ClientParty:
    """One client's side of one round (Bonawitz et al. Fig. 4, over a SecAgg+ neighbourhood)."""

    def __init__(self, client_id: int, round_tag: bytes) -> None:
        """Two fresh key pairs (cipher: seals shares; mask: pairwise masks) and a self-mask seed.

        ``round_tag`` binds the shares and pairwise masks to one run and round
        (e.g. ``b"run-id/round-3"``).
        """
        self.client_id = _check_id(client_id)
        self.round_tag = bytes(round_tag)
        self._cipher_private, self._cipher_public = key_pair()
        self._mask_private, self._mask_public = key_pair()
        self._seed = os.urandom(_KEY_BYTES)
        self._peers: dict[int, tuple[bytes, bytes]] | None = None
        self._threshold = 0
        self._own: tuple[bytes, bytes] | None = None  # this client's shares of its seed and key
        self._held: dict[int, tuple[bytes, bytes]] | None = None  # owner -> (seed, key) shares that checked
        self._masked_with: tuple[int, ...] | None = None  # the peers it masked with, once it has
        self._revealed: tuple[tuple[int, ...], tuple[int, ...], dict[int, bytes]] | None = None

    def public_keys(self) -> tuple[bytes, bytes]:
        """(cipher public key, mask public key), 32 raw bytes each."""
        return self._cipher_public, self._mask_public

    def seed_commitment(self) -> bytes:
        """The commitment to this client's self-mask seed (:func:`seed_commitment`), advertised
        with the public keys."""
        return seed_commitment(self.round_tag, self.client_id, self._seed)

    def _agree(self, private: X25519PrivateKey, peer: int, peer_key: bytes, purpose: bytes) -> bytes:
        try:
            return shared_key(private, peer_key, purpose + self.round_tag)
        except SecAggError as error:
            raise SecAggError(f"client {peer}: {error}") from error

    def share(self, peers: Mapping[int, tuple[bytes, bytes]], threshold: int) -> Dealt:
        """Split the self-mask seed and the mask private key among the neighbours and this client.

        ``peers``: each neighbour's (cipher key, mask key), without this client. Returns, for each
        neighbour, its two shares (seed share then key share, 148 bytes) sealed with the cipher
        key agreed with it, bound to the round, the sender and the recipient; and the commitments
        to every share, this client's own included.
        """
        if self._peers is not None:
            raise SecAggError(f"client {self.client_id} has already shared")
        ids = {_check_id(v): keys for v, keys in peers.items()}
        if self.client_id in ids:
            raise SecAggError(f"client {self.client_id} is among its own peers")
        for v, keys in ids.items():
            if len(keys) != 2 or any(not isinstance(k, bytes) or len(k) != _KEY_BYTES for k in keys):
                raise SecAggError(f"client {v}: keys are not two {_KEY_BYTES}-byte public keys")
        holders = [*sorted(ids), self.client_id]
        seed_shares = split_secret(self._seed, threshold, holders)
        mask_key = self._mask_private.private_bytes_raw()
        key_shares = split_secret(mask_key, threshold, holders)
        sealed = {
            v: seal(
                self._agree(self._cipher_private, v, keys[0], _CIPHER_PURPOSE),
                seed_shares[v] + key_shares[v],
                _associated(self.round_tag, self.client_id, v),
            )
            for v, keys in ids.items()
        }
        for v, keys in ids.items():  # a mask key that cannot agree would only fail in masked()
            self._agree(self._mask_private, v, keys[1], _MASK_PURPOSE)
        commitments = {h: share_commitments(self.round_tag, self.client_id, h, (seed_shares[h], key_shares[h]))
                       for h in holders}
        self._peers = ids
        self._threshold = threshold
        self._own = (seed_shares[self.client_id], key_shares[self.client_id])
        return Dealt(sealed, commitments)

    def check(self, sealed: Mapping[int, bytes], commitments: Mapping[int, tuple[bytes, bytes]]) -> dict[int, str]:
        """Open the shares sealed to this client and keep those that hold; returns the senders whose
        shares do not, with why (the CHECK step's answer: the server takes those pairs out of the
        round's graph, :func:`mask_graph`).

        ``sealed``: by sender; ``commitments``: each sender's commitments to the shares it dealt
        this client. A pair of shares holds when it authenticates under the key agreed with its
        sender and bound to the round, sender and recipient, is two well-formed shares of this
        client's point, and matches its commitments. Callable once; SecAggError (and nothing kept)
        for a sender that is not a peer or a box without its commitments.
        """
        if self._peers is None:
            raise SecAggError(f"client {self.client_id} has not shared yet")
        if self._held is not None:
            raise SecAggError(f"client {self.client_id} has already checked its shares")
        if set(sealed) != set(commitments):
            raise SecAggError("the sealed shares and their commitments name different senders")
        strangers = sorted(set(sealed) - set(self._peers))
        if strangers:
            raise SecAggError(f"clients {strangers} are not peers of client {self.client_id}")
        held, disputed = {self.client_id: self._own}, {}
        for v in sorted(sealed):
            try:
                held[v] = self._open(v, sealed[v], commitments[v])
            except SecAggError as error:
                disputed[v] = str(error)
        self._held = held
        return disputed

    def _open(self, sender: int, box: bytes, commitments: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
        """The pair of shares in ``box`` from ``sender``, checked; SecAggError says why not."""
        key = self._agree(self._cipher_private, sender, self._peers[sender][0], _CIPHER_PURPOSE)
        plain = unseal(key, box, _associated(self.round_tag, sender, self.client_id))
        if len(plain) != 2 * _SHARE_BYTES:
            raise SecAggError(f"the shares are {len(plain)} bytes instead of {2 * _SHARE_BYTES}")
        pair = (plain[:_SHARE_BYTES], plain[_SHARE_BYTES:])
        for part in pair:
            _share_point(self.client_id, part)
        if share_commitments(self.round_tag, sender, self.client_id, pair) != tuple(commitments):
            raise SecAggError("the shares do not match their commitments")
        return pair

    def masked(self, quantized: np.ndarray, peers: Collection[int]) -> np.ndarray:
        """The quantized update plus its self mask and the pairwise masks with ``peers``.

        ``peers``: the neighbours to mask with (the MASK step's), all of them peers whose shares
        held in :meth:`check`, and with this client at least the threshold (Bonawitz et al. Fig. 4:
        a client aborts with fewer than t peers left). The mask with peer v is ``+PRG(s_uv)`` when
        this id is below v, else ``-PRG(s_uv)``, so the pair cancels in the sum. Modulo 2**32;
        callable once.
        """
        if self._held is None:
            raise SecAggError(f"client {self.client_id} has not checked its shares yet")
        if self._masked_with is not None:
            raise SecAggError(f"client {self.client_id} has already sent its masked update")
        if not isinstance(quantized, np.ndarray) or quantized.dtype != np.uint32:
            raise SecAggError("a quantized update is a uint32 array")
        ids = sorted(set(peers))
        unheld = [v for v in ids if v == self.client_id or v not in self._held]
        if unheld:
            raise SecAggError(f"client {self.client_id} holds no checked shares of clients {unheld}")
        if len(ids) + 1 < self._threshold:
            raise SecAggError(f"client {self.client_id} would mask with {len(ids)} peers, fewer than the "
                              f"threshold {self._threshold} needs")
        out = quantized + mask_stream(self._seed, quantized.size).reshape(quantized.shape)
        for v in ids:
            pair = _pair_mask(self._mask_private, self._peers[v][1], self.round_tag, quantized.size)
            if self.client_id < v:
                out += pair.reshape(quantized.shape)
            else:
                out -= pair.reshape(quantized.shape)
        self._masked_with = tuple(ids)
        return out

    def reveal(self, survivors: Sequence[int], dropped: Sequence[int]) -> dict[int, bytes]:
        """The shares the server needs: owner -> this client's Shamir share.

        For each survivor (this client may be one) the share of its self-mask seed; for each
        dropped client the share of its mask private key; only of the peers it masked with. Never
        both for one client: a client in both lists, one it did not mask with, this client among
        the dropped, or a second call with other lists is a SecAggError and reveals nothing
        (Bonawitz et al. §4: a client's update stays hidden only if at most one of its secrets is
        ever revealed). The same lists again give the same answer (at-least-once delivery).
        """
        if self._masked_with is None:
            raise SecAggError(f"client {self.client_id} has not sent its masked update")
        alive, gone = tuple(sorted(survivors)), tuple(sorted(dropped))
        if self._revealed is not None:
            if (alive, gone) != self._revealed[:2]:
                raise SecAggError(f"client {self.client_id} has already revealed shares for other lists")
            return dict(self._revealed[2])
        for name, ids in (("survivors", alive), ("dropped", gone)):
            if len(set(ids)) != len(ids):
                raise SecAggError(f"the {name} list repeats a client: {list(ids)}")
        both = set(alive) & set(gone)
        if both:
            raise SecAggError(f"clients {sorted(both)} are listed both as survivors and as dropped")
        if self.client_id in gone:
            raise SecAggError(f"client {self.client_id} is listed as dropped")
        unknown = sorted(set(alive + gone) - {self.client_id, *self._masked_with})
        if unknown:
            raise SecAggError(f"client {self.client_id} did not mask with clients {unknown}")
        answer = {u: self._held[u][SEED] for u in alive} | {v: self._held[v][KEY] for v in gone}
        self._revealed = (alive, gone, answer)
        return dict(answer)


@dataclass(frozen=True)
class MaskGraph:
    """Who masks with whom once the CHECK step's disputes are in (:func:`mask_graph`)."""

    neighbours: dict[int, tuple[int, ...]]  # the clients that mask, each with the peers it masks with
    named: dict[int, int]                   # dropped for their own disputes (more than the threshold leaves room
                                            # for): client -> how many of its neighbours it disputes with
    short: tuple[int, ...]                  # dropped because too few undisputed neighbours remain to them
    disputed: tuple[tuple[int, int], ...]   # the pairs taken out between clients that stay


def mask_graph(graph: Mapping[int, Sequence[int]], shared: Collection[int], checked: Collection[int],
               disputes: Mapping[int, Collection[int]], threshold: int) -> MaskGraph:
    """The round's graph for masking: the SHARE graph ``graph`` among the clients that ``checked``
    (answered the CHECK step), less every pair one side disputes.

    ``shared``: the clients whose shares were routed (those that answered SHARE); ``disputes``:
    client -> the senders whose shares did not hold for it. The server cannot tell which side of a
    disputed pair lies (each box opens only to its recipient), so the pair stops masking together
    and holds no shares of each other; that is harmless while each side keeps ``threshold - 1``
    neighbours. A client in more disputes than its neighbourhood has room for (more than
    ``len(graph[c]) + 1 - threshold``) is dropped and named: the sender of bad shares to its
    neighbours, or a client that disputes theirs, isolates itself, while naming an honest client
    takes that many liars among its neighbours, as breaking the threshold does. Clients then left
    with fewer than ``threshold - 1`` neighbours drop out as well (named as short, not blamed),
    until every client that masks keeps enough holders of its secrets.
    """
    present = set(shared)
    pairs = {frozenset((c, v)) for c, senders in disputes.items() for v in senders if v != c}
    lost = {c: sum(frozenset((c, v)) in pairs for v in graph[c] if v in present) for c in present}
    named = {c: lost[c] for c in sorted(present) if lost[c] > len(graph[c]) + 1 - threshold}
    kept = set(checked) - set(named)
    near = {c: {v for v in graph[c] if v in kept and frozenset((c, v)) not in pairs} for c in kept}
    short: set[int] = set()
    while True:
        out = {c for c in near if len(near[c]) + 1 < threshold}
        if not out:
            break
        short |= out
        near = {c: vs - out for c, vs in near.items() if c not in out}
    disputed = sorted((min(p), max(p)) for p in pairs if p <= near.keys())
    return MaskGraph({c: tuple(sorted(near[c])) for c in sorted(near)}, named, tuple(sorted(short)), tuple(disputed))


@dataclass(frozen=True)
class Commitments:
    """What one client committed to before anyone masked: the public key of its pairwise masks,
    the commitment to its self-mask seed (:func:`seed_commitment`), and those to every share it
    dealt (:func:`share_commitments`), by holder."""

    mask_key: bytes
    seed: bytes
    shares: Mapping[int, tuple[bytes, bytes]]


@dataclass(frozen=True)
class Unmasked:
    """The unmasked sum, and the holders whose revealed shares did not match their commitments
    (ignored: the sum was rebuilt without them)."""

    total: np.ndarray
    liars: tuple[int, ...]


def unmask(
    total: np.ndarray,
    masked_by: Sequence[int],
    committed: Mapping[int, Commitments],
    graph: Mapping[int, Sequence[int]],
    revealed: Mapping[int, Mapping[int, bytes]],
    threshold: int,
    round_tag: bytes,
) -> Unmasked:
    """The server's last step (Bonawitz et al. Fig. 4, round 4): the unmasked uint32 sum.

    ``total``: the sum modulo 2**32 of the masked updates of ``masked_by`` (U3). ``committed``:
    what every client in the round's mask graph committed to (containing U3). ``graph``: who
    masked with whom (:func:`mask_graph`). ``revealed``: answering client -> owner -> share.
    Every revealed share is checked against its dealer's commitment first: one that does not
    match is ignored and its holder is a liar. Rebuilds the self-mask seed of each survivor and the
    mask private key of each dropped client (in the graph, not in U3) that has a surviving
    neighbour, checks each against the seed commitment or the public key, removes the survivors'
    self masks and the pairwise masks between dropped clients and their surviving neighbours
    (pairs inside U3 cancel in the sum). SecAggError when a secret has fewer than ``threshold``
    matching shares (naming the liars, if that is why, else the clients short of shares) or when
    matching shares do not rebuild what their dealer committed to (naming the dealer): its
    ``culprits`` are the liars and such dealers.
    """
    if not isinstance(total, np.ndarray) or total.dtype != np.uint32:
        raise SecAggError("the masked sum is a uint32 array")
    alive = {_check_id(u) for u in masked_by}
    outside = sorted(alive - set(committed))
    if outside:
        raise SecAggError(f"clients {outside} sent a masked update but are not in the round's graph")
    missing = sorted(c for c in committed if c not in graph)
    if missing:
        raise SecAggError(f"clients {missing} are not in the neighbourhood graph")
    gone = {v: sorted(u for u in graph[v] if u in alive) for v in committed if v not in alive}
    gone = {v: us for v, us in gone.items() if us}  # no surviving neighbour: no mask to remove
    shares, liars = _matching_shares(sorted(alive | set(gone)), alive, committed, revealed, round_tag)
    short = [c for c in shares if len(shares[c]) < threshold]
    if short and liars:
        raise SecAggError(f"clients {liars} revealed shares that do not match their commitments (ignored), and "
                          f"fewer than {threshold} matching shares remain of the secrets of {len(short)} client(s)",
                          liars)
    if short:
        raise SecAggError(f"fewer than {threshold} shares of the secrets of clients {short}")
    out = total.copy()
    flat = out.reshape(-1)
    dealers = {}
    for u in sorted(alive):
        try:
            seed = combine_shares(shares[u], threshold)
            if seed_commitment(round_tag, u, seed) != committed[u].seed:
                raise SecAggError("it does not match its commitment")
        except SecAggError as error:
            dealers[u] = f"self-mask seed: {error}"
            continue
        flat -= mask_stream(seed, flat.size)
    for v, survivors in sorted(gone.items()):
        try:
            private = X25519PrivateKey.from_private_bytes(combine_shares(shares[v], threshold))
            if _public_bytes(private) != committed[v].mask_key:
                raise SecAggError("it does not match its public key")
        except SecAggError as error:
            dealers[v] = f"mask key: {error}"
            continue
        for u in survivors:  # u added +PRG(s_uv) if u < v, else -PRG(s_uv)
            pair = _pair_mask(private, committed[u].mask_key, bytes(round_tag), flat.size)
            if u < v:
                flat -= pair
            else:
                flat += pair
    if dealers:
        why = "; ".join(f"client {c}'s {reason}" for c, reason in sorted(dealers.items()))
        also = f"; clients {liars} revealed shares that do not match their commitments (ignored)" if liars else ""
        raise SecAggError(f"clients {sorted(dealers)} dealt shares that match their commitments but do not rebuild "
                          f"the secret they committed to ({why}){also}", [*dealers, *liars])
    return Unmasked(out, tuple(liars))


def _matching_shares(owners: Sequence[int], alive: Collection[int], committed: Mapping[int, Commitments],
                     revealed: Mapping[int, Mapping[int, bytes]], round_tag: bytes
                     ) -> tuple[dict[int, dict[int, bytes]], list[int]]:
    """owner -> holder -> the revealed shares that match their dealer's commitments (of the seed
    of a survivor, of the mask key of any other owner), and the holders of any that do not."""
    shares: dict[int, dict[int, bytes]] = {c: {} for c in owners}
    liars = set()
    for holder, answer in revealed.items():
        for owner, share in answer.items():
            if owner not in shares:
                continue
            kind = SEED if owner in alive else KEY
            expected = committed[owner].shares.get(holder)
            if expected is None or _share_commitment(round_tag, owner, holder, kind, share) != expected[kind]:
                liars.add(holder)
                continue
            shares[owner][holder] = share
    return shares, sorted(liars)
