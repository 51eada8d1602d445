"""The cryptography of secure aggregation (fedpart.common.secagg): Shamir, sealing, the SecAgg+
graph, quantization, and whole simulated rounds with and without dropouts."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from fedpart.common.secagg import (
    ClientParty,
    SecAggError,
    combine_shares,
    default_threshold,
    dequantize,
    key_pair,
    mask_stream,
    neighbours,
    quantization_step,
    quantize,
    seal,
    shared_key,
    split_secret,
    unmask,
    unseal,
)

TAG = b"run-test/round-1"
INT32_MAX = 2**31 - 1


# --- Shamir -------------------------------------------------------------------------------------


def test_shamir_any_threshold_subset_rebuilds_the_secret() -> None:
    secret = bytes(range(1, 33))
    holders = [0, 4, 9, 10, 2**40]
    shares = split_secret(secret, 3, holders)
    assert sorted(shares) == sorted(holders)
    assert {len(s) for s in shares.values()} == {74}
    for subset in itertools.combinations(holders, 3):
        assert combine_shares({h: shares[h] for h in subset}, 3) == secret
    assert combine_shares(shares, 3) == secret  # more than threshold: fine
    long_secret = b"\xff" * 64
    assert combine_shares(split_secret(long_secret, 5, range(5)), 5, 64) == long_secret
    assert combine_shares(split_secret(b"\x00" * 32, 1, [7]), 1) == b"\x00" * 32


def test_shamir_refuses_too_few_malformed_and_bad_parameters() -> None:
    shares = split_secret(b"k" * 32, 3, [1, 2, 3, 4])
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        combine_shares({1: shares[1], 2: shares[2]}, 3)
    with pytest.raises(SecAggError, match="not 74 bytes"):
        combine_shares({1: shares[1], 2: shares[2], 3: shares[3][:-1]}, 3)
    with pytest.raises(SecAggError, match="malformed"):  # x coordinate of another holder
        combine_shares({1: shares[1], 2: shares[2], 4: shares[3]}, 3)
    with pytest.raises(SecAggError, match="malformed"):  # y not below p
        combine_shares({1: shares[1], 2: shares[2], 3: shares[3][:8] + b"\xff" * 66}, 3)
    other = split_secret(b"k" * 32, 3, [1, 2, 3, 4])  # a share of another polynomial
    with pytest.raises(SecAggError, match="inconsistent"):
        combine_shares({1: shares[1], 2: shares[2], 3: other[3]}, 3)
    for threshold in (0, 5):
        with pytest.raises(SecAggError, match="threshold"):
            split_secret(b"k" * 32, threshold, [1, 2, 3, 4])
    with pytest.raises(SecAggError, match="repeat"):
        split_secret(b"k" * 32, 2, [1, 2, 2])
    with pytest.raises(SecAggError, match="at most 64"):
        split_secret(b"k" * 65, 2, [1, 2])
    with pytest.raises(SecAggError, match="holder id"):
        split_secret(b"k", 1, [-1])


# --- keys and sealing ---------------------------------------------------------------------------


def test_shared_key_is_symmetric_per_purpose_and_refuses_malformed_keys() -> None:
    a, a_public = key_pair()
    b, b_public = key_pair()
    assert len(a_public) == 32
    assert shared_key(a, b_public, b"x") == shared_key(b, a_public, b"x")
    assert shared_key(a, b_public, b"x") != shared_key(a, b_public, b"y")
    with pytest.raises(SecAggError, match="32 bytes"):
        shared_key(a, b_public[:31], b"x")
    with pytest.raises(SecAggError, match="unusable"):  # a low-order point: all-zero agreement
        shared_key(a, bytes(32), b"x")


def test_seal_round_trip_and_refusals() -> None:
    key = bytes(range(32))
    box = seal(key, b"shares", b"ad")
    assert unseal(key, box, b"ad") == b"shares"
    assert seal(key, b"shares", b"ad") != box  # a fresh nonce each time
    with pytest.raises(SecAggError):
        unseal(key, box, b"other ad")
    with pytest.raises(SecAggError):
        unseal(key, box[:-1] + bytes([box[-1] ^ 1]), b"ad")
    with pytest.raises(SecAggError):
        unseal(bytes(32), box, b"ad")
    with pytest.raises(SecAggError, match="too short"):
        unseal(key, box[:20], b"ad")


def test_mask_stream_is_deterministic_and_seed_dependent() -> None:
    a = mask_stream(b"a" * 32, 1000)
    assert a.dtype == np.uint32 and a.shape == (1000,)
    assert np.array_equal(a, mask_stream(b"a" * 32, 1000))
    assert np.array_equal(a[:10], mask_stream(b"a" * 32, 10))
    assert np.mean(a == mask_stream(b"b" * 32, 1000)) < 0.01
    assert mask_stream(b"a" * 32, 0).shape == (0,)
    with pytest.raises(SecAggError):
        mask_stream(b"short", 4)


# --- the SecAgg+ graph --------------------------------------------------------------------------


@pytest.mark.parametrize("n,degree,expected", [(12, 4, 4), (12, 3, 4), (20, 6, 6), (9, 7, 8), (9, 8, 8), (9, None, 8)])
def test_neighbours_symmetric_regular_and_deterministic(n: int, degree: int | None, expected: int) -> None:
    clients = [3 * i + 1 for i in range(n)]
    graph = neighbours(clients, degree, seed=5)
    assert sorted(graph) == clients
    for u, near in graph.items():
        assert len(near) == expected and u not in near and list(near) == sorted(set(near))
        assert all(u in graph[v] for v in near)
    assert neighbours(list(reversed(clients)), degree, seed=5) == graph
    if degree is None or expected >= n - 1:
        assert all(set(near) == set(clients) - {u} for u, near in graph.items())
    else:
        assert neighbours(clients, degree, seed=6) != graph


def test_neighbours_refusals_and_threshold() -> None:
    with pytest.raises(SecAggError, match="repeat"):
        neighbours([1, 1, 2], None, 0)
    with pytest.raises(SecAggError, match="below 1"):
        neighbours([1, 2, 3], 0, 0)
    assert neighbours([4], None, 0) == {4: ()}
    assert [default_threshold(k) for k in (1, 2, 3, 5, 10, 11)] == [1, 2, 2, 3, 6, 6]


# --- quantization -------------------------------------------------------------------------------


@pytest.mark.parametrize("coarse", [False, True])
def test_dequantized_sum_is_the_weighted_mean_within_half_a_step(coarse: bool) -> None:
    """|dequantize(sum quantize) - sum w_i clip(x_i) / W| <= step / 2 per element, plus the float32
    rounding of the result (at most one ulp of it here): each client's rint moves its value by at
    most step / 2, and the weighted mean of such moves stays within step / 2."""
    rng = np.random.default_rng(0)
    bound, clients, elements = 0.5, 7, 5000
    weights = rng.integers(1, 40, clients)
    total_weight = int(weights.sum())
    step = 0.01 if coarse else quantization_step(bound, total_weight)
    values = [rng.normal(0, 0.4, elements).astype(np.float32) for _ in range(clients)]
    total = np.zeros(elements, np.uint32)
    for x, w in zip(values, weights):
        total += quantize(x, bound, step, int(w))
    mean = dequantize(total, step, total_weight)
    assert mean.dtype == np.float32
    expected = sum(w * np.clip(x.astype(np.float64), -bound, bound) for x, w in zip(values, weights)) / total_weight
    error = np.abs(mean.astype(np.float64) - expected)
    assert np.all(error <= step / 2 * (1 + 1e-9) + np.spacing(np.abs(mean)).astype(np.float64))
    if coarse:
        assert error.max() > step / 10  # the bound is not vacuous


@pytest.mark.parametrize("total_weight", [1, 2, 7, 1000, 2**20 + 3, 2**30, INT32_MAX])
def test_no_wraparound_at_the_extremes(total_weight: int) -> None:
    bound = 3.0
    step = quantization_step(bound, total_weight)
    weights = [total_weight] if total_weight > 1000 else [1] * total_weight
    for sign in (1, -1):
        values = np.array([sign * bound, sign * bound * 2, sign * np.inf], np.float32)
        total = np.zeros(3, np.uint32)
        for w in weights:
            total += quantize(values, bound, step, w)
        signed = total.view(np.int32).astype(np.int64)
        assert np.all(signed == sign * total_weight * (INT32_MAX // total_weight))
        assert np.all(np.abs(signed) <= INT32_MAX)
        assert np.allclose(dequantize(total, step, total_weight), sign * bound, rtol=1e-6)


def test_quantization_refusals() -> None:
    for bound, weight in ((0.0, 1), (-1.0, 1), (1.0, 0), (1.0, 2**31)):
        with pytest.raises(SecAggError):
            quantization_step(bound, weight)
    with pytest.raises(SecAggError, match="NaN"):
        quantize(np.array([np.nan]), 1.0, 0.1, 1)
    with pytest.raises(SecAggError):
        quantize(np.array([1.0]), 1.0, 1e-12, 1)
    with pytest.raises(SecAggError):
        quantize(np.array([1.0]), 1.0, 0.1, -1)
    with pytest.raises(SecAggError):
        dequantize(np.zeros(2, np.int32), 0.1, 1)


# --- whole rounds -------------------------------------------------------------------------------


def _shortfall(graph: dict[int, tuple[int, ...]], shared: set[int], alive: set[int], t: int) -> set[int]:
    """The clients whose secret would have fewer than t shares among the survivors."""
    short = {u for u in alive if len(({u} | set(graph[u])) & alive) < t}
    for v in shared - alive:
        holders = set(graph[v]) & alive
        if holders and len(holders) < t:
            short.add(v)
    return short


def _fewest_survivors(graph: dict[int, tuple[int, ...]], t: int) -> set[int]:
    """A survivor set no client can leave without some secret falling below t shares."""
    everyone = set(graph)
    alive = set(everyone)
    for c in sorted(everyone):
        if not _shortfall(graph, everyone, alive - {c}, t):
            alive.remove(c)
    return alive


def _round(
    clients: list[int],
    degree: int | None,
    updates: dict[int, np.ndarray],
    alive: set[int],
    quiet: frozenset[int] = frozenset(),
) -> tuple[np.ndarray, dict[int, np.ndarray], dict[int, ClientParty], dict]:
    """A round as the server drives it: ``quiet`` never share (U1 - U2); of those who share, only
    ``alive`` send masked updates (U3); every survivor answers UNMASK. Returns the unmasked sum,
    the masked vectors, the parties and what unmask was given."""
    graph = neighbours(clients, degree, seed=11)
    t = default_threshold(len(graph[clients[0]]) + 1)
    parties = {c: ClientParty(c, TAG) for c in clients}
    keys = {c: p.public_keys() for c, p in parties.items()}
    shared = {c: keys[c] for c in clients if c not in quiet}
    outbox = {c: parties[c].share({v: keys[v] for v in graph[c]}, t) for c in shared}
    alive = alive - quiet
    masked = {
        c: parties[c].masked(updates[c], {v: outbox[v][c] for v in graph[c] if v in shared})
        for c in sorted(alive)
    }
    total = np.zeros_like(updates[clients[0]])
    for vector in masked.values():
        total += vector
    revealed = {
        c: parties[c].reveal(
            [u for u in (c, *graph[c]) if u in alive], [v for v in graph[c] if v in shared and v not in alive]
        )
        for c in sorted(alive)
    }
    given = dict(masked_by=sorted(alive), shared=shared, graph=graph, revealed=revealed, threshold=t, round_tag=TAG)
    return unmask(total, **given), masked, parties, given


def _updates(clients: list[int], elements: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(3)
    step = quantization_step(1.0, len(clients))
    return {c: quantize(rng.normal(0, 0.3, elements), 1.0, step, 1) for c in clients}


def _plain_sum(updates: dict[int, np.ndarray], alive: set[int]) -> np.ndarray:
    total = np.zeros_like(next(iter(updates.values())))
    for c in alive:
        total += updates[c]
    return total


@pytest.mark.parametrize("n,degree", [(10, None), (12, 4)])
def test_rounds_recover_the_exact_sum_with_and_without_dropouts(n: int, degree: int | None) -> None:
    clients = [5 * i + 2 for i in range(n)]
    updates = _updates(clients, 2000)
    graph = neighbours(clients, degree, seed=11)
    t = default_threshold(len(graph[clients[0]]) + 1)
    everyone = set(clients)
    fewest = _fewest_survivors(graph, t)
    if degree is None:
        assert len(fewest) == t
    cases = [
        (everyone, frozenset()),
        (everyone - {clients[1], clients[6]}, frozenset()),  # 2 drop after sharing, before masking
        (everyone - {clients[3]}, frozenset({clients[8]})),  # one never shares, one drops later
        (fewest, frozenset()),
    ]
    for alive, quiet in cases:
        total, _, _, _ = _round(clients, degree, updates, alive, quiet)
        assert total.dtype == np.uint32
        assert np.array_equal(total, _plain_sum(updates, alive - quiet))
    one_fewer = fewest - {min(fewest)}
    short = _shortfall(graph, everyone, one_fewer, t)
    assert short
    with pytest.raises(SecAggError, match="fewer than") as error:
        _round(clients, degree, updates, one_fewer)
    named = {int(x) for x in re.findall(r"\d+", str(error.value).split("clients", 1)[1])}
    assert named == short


def test_the_server_sees_masked_vectors_only_and_never_both_secrets() -> None:
    clients = list(range(10))
    updates = _updates(clients, 5000)
    alive = set(clients) - {4, 7}
    _, masked, parties, _ = _round(clients, None, updates, alive)
    for c, vector in masked.items():
        q = updates[c]
        assert np.mean(vector == q) < 0.01
        gap = np.abs(vector.view(np.int32).astype(np.int64) - q.view(np.int32).astype(np.int64))
        assert np.median(gap) > 2**28  # masks are uniform over 2**32: far from the update
    party = parties[0]
    survivors, dropped = sorted(alive), [4, 7]
    first = party.reveal(survivors, dropped)
    assert set(first) == set(survivors) | set(dropped)
    assert party.reveal(list(reversed(survivors)), dropped) == first  # at-least-once delivery
    with pytest.raises(SecAggError, match="other lists"):  # asking for 3's key share too
        party.reveal([u for u in survivors if u != 3], dropped + [3])


def test_client_party_refusals() -> None:
    a, b, c = ClientParty(1, TAG), ClientParty(2, TAG), ClientParty(3, TAG)
    keys = {p.client_id: p.public_keys() for p in (a, b, c)}
    with pytest.raises(SecAggError, match="not shared"):
        a.masked(np.zeros(4, np.uint32), {})
    with pytest.raises(SecAggError, match="own peers"):
        a.share(keys, 2)
    with pytest.raises(SecAggError, match="client 2"):
        a.share({2: (keys[2][0][:5], keys[2][1]), 3: keys[3]}, 2)
    with pytest.raises(SecAggError, match="client 3"):
        a.share({2: keys[2], 3: (keys[3][0], bytes(32))}, 2)
    out = {p.client_id: p.share({v: k for v, k in keys.items() if v != p.client_id}, 2) for p in (a, b, c)}
    with pytest.raises(SecAggError, match="already shared"):
        a.share({2: keys[2], 3: keys[3]}, 2)
    with pytest.raises(SecAggError, match="not a peer"):
        a.masked(np.zeros(4, np.uint32), {9: out[2][1]})
    with pytest.raises(SecAggError, match="client 3"):  # 2's box to 1 presented as 3's
        a.masked(np.zeros(4, np.uint32), {2: out[2][1], 3: out[2][1]})
    with pytest.raises(SecAggError, match="client 2"):  # 2's box to 3 presented to 1
        a.masked(np.zeros(4, np.uint32), {2: out[2][3]})
    with pytest.raises(SecAggError, match="not sent"):
        a.reveal([1], [])
    a.masked(np.zeros(4, np.uint32), {2: out[2][1]})  # 3 dropped before masking
    with pytest.raises(SecAggError, match="already sent"):
        a.masked(np.zeros(4, np.uint32), {2: out[2][1]})
    for survivors, dropped, why in (
        ([1, 2], [2], "both"),
        ([1], [3], "no shares"),  # a.masked got nothing from 3
        ([2], [1], "listed as dropped"),
        ([1, 1], [], "repeats"),
    ):
        with pytest.raises(SecAggError, match=why):
            a.reveal(survivors, dropped)
    assert set(a.reveal([1], [2])) == {1, 2}
