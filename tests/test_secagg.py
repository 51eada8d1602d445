"""The cryptography of secure aggregation (fedpart.common.privacy.secagg): Shamir, sealing, the SecAgg+
graph, quantization, commitments and the CHECK step, and whole simulated rounds with and without
dropouts and with one lying client (random sealed shares, altered revealed shares, a dealer of
wrong shares, a false input)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from fedpart.common.privacy.secagg import (
    ClientParty,
    Commitments,
    Dealt,
    MaskGraph,
    SecAggError,
    Unmasked,
    combine_shares,
    default_threshold,
    dequantize,
    key_pair,
    mask_graph,
    mask_stream,
    neighbours,
    quantization_step,
    quantize,
    seal,
    seed_commitment,
    share_commitments,
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


@dataclass
class Round:
    """One round as the server drives it, with each step's messages kept (for tests to alter)."""

    result: Unmasked
    masked: dict[int, np.ndarray]
    parties: dict[int, ClientParty]
    graph: MaskGraph
    disputes: dict[int, dict[int, str]]


def _round(
    clients: list[int],
    degree: int | None,
    updates: dict[int, np.ndarray],
    alive: set[int],
    quiet: frozenset[int] = frozenset(),
    alter: Callable[[str, dict], None] = lambda stage, messages: None,
) -> Round:
    """``quiet`` never share (U1 - U2); every client that shares checks the shares sealed to it;
    of those left in the mask graph only ``alive`` send masked updates (U3); every survivor
    answers UNMASK. ``alter(stage, messages)`` may change the messages of a stage in place
    before the server uses them: ``"dealt"`` (dealer -> Dealt), ``"revealed"`` (holder ->
    owner -> share), ``"committed"`` (client -> Commitments). Raises what ``unmask`` raises."""
    graph = neighbours(clients, degree, seed=11)
    t = default_threshold(len(graph[clients[0]]) + 1)
    parties = {c: ClientParty(c, TAG) for c in clients}
    keys = {c: p.public_keys() for c, p in parties.items()}
    dealt = {c: parties[c].share({v: keys[v] for v in graph[c]}, t) for c in clients if c not in quiet}
    alter("dealt", dealt)
    disputes = {c: parties[c].check({v: dealt[v].sealed[c] for v in graph[c] if v in dealt},
                                    {v: dealt[v].commitments[c] for v in graph[c] if v in dealt}) for c in dealt}
    pruned = mask_graph(graph, dealt, dealt, disputes, t)
    near = pruned.neighbours
    alive = alive & set(near)
    masked = {c: parties[c].masked(updates[c], near[c]) for c in sorted(alive)}
    total = np.zeros_like(updates[clients[0]])
    for vector in masked.values():
        total += vector
    revealed = {c: parties[c].reveal([u for u in (c, *near[c]) if u in alive], [v for v in near[c] if v not in alive])
                for c in sorted(alive)}
    alter("revealed", revealed)
    committed = {c: Commitments(keys[c][1], parties[c].seed_commitment(), dealt[c].commitments) for c in near}
    alter("committed", committed)
    result = unmask(total, sorted(alive), committed, near, revealed, t, TAG)
    return Round(result, masked, parties, pruned, disputes)


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
        (everyone - {clients[1], clients[6]}, frozenset()),  # 2 drop after checking, before masking
        (everyone - {clients[3]}, frozenset({clients[8]})),  # one never shares, one drops later
        (fewest, frozenset()),
    ]
    for alive, quiet in cases:
        done = _round(clients, degree, updates, alive, quiet)
        assert done.result.total.dtype == np.uint32 and done.result.liars == ()
        assert np.array_equal(done.result.total, _plain_sum(updates, alive - quiet))
    one_fewer = fewest - {min(fewest)}
    short = _shortfall(graph, everyone, one_fewer, t)
    assert short
    with pytest.raises(SecAggError, match="fewer than") as error:
        _round(clients, degree, updates, one_fewer)
    named = {int(x) for x in re.findall(r"\d+", str(error.value).split("clients", 1)[1])}
    assert named == short and error.value.culprits == ()  # dropouts alone: nobody to blame


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


def test_the_server_sees_masked_vectors_only_and_never_both_secrets() -> None:
    clients = list(range(10))
    updates = _updates(clients, 5000)
    alive = set(clients) - {4, 7}
    done = _round(clients, None, updates, alive)
    for c, vector in done.masked.items():
        q = updates[c]
        assert np.mean(vector == q) < 0.01
        gap = np.abs(vector.view(np.int32).astype(np.int64) - q.view(np.int32).astype(np.int64))
        assert np.median(gap) > 2**28  # masks are uniform over 2**32: far from the update
    party = done.parties[0]
    survivors, dropped = sorted(alive), [4, 7]
    first = party.reveal(survivors, dropped)
    assert set(first) == set(survivors) | set(dropped)
    assert party.reveal(list(reversed(survivors)), dropped) == first  # at-least-once delivery
    with pytest.raises(SecAggError, match="other lists"):  # asking for 3's key share too
        party.reveal([u for u in survivors if u != 3], dropped + [3])


# --- one lying client ---------------------------------------------------------------------------


def test_commitments_bind_the_round_the_dealer_the_holder_and_the_secret() -> None:
    seed = bytes(range(32))
    one = seed_commitment(TAG, 3, seed)
    assert len(one) == 32 and one == seed_commitment(TAG, 3, seed)
    assert len({one, seed_commitment(TAG, 4, seed), seed_commitment(b"run-test/round-2", 3, seed),
                seed_commitment(TAG, 3, seed[::-1])}) == 4
    pair = (b"s" * 74, b"k" * 74)
    seed_c, key_c = share_commitments(TAG, 3, 5, pair)
    assert seed_c != key_c  # a key share cannot pass for a seed share of the same bytes
    assert share_commitments(TAG, 3, 5, (pair[1], pair[1]))[0] != key_c
    assert share_commitments(TAG, 5, 3, pair) != (seed_c, key_c)
    assert share_commitments(TAG, 3, 6, pair) != (seed_c, key_c)


def test_check_keeps_the_shares_that_hold_and_names_the_senders_of_the_others() -> None:
    parties = {c: ClientParty(c, TAG) for c in (1, 2, 3, 4, 5)}
    keys = {c: p.public_keys() for c, p in parties.items()}
    dealt = {c: p.share({v: k for v, k in keys.items() if v != c}, 3) for c, p in parties.items()}
    sealed = {v: dealt[v].sealed[1] for v in (2, 3, 4, 5)}
    commitments = {v: dealt[v].commitments[1] for v in (2, 3, 4, 5)}
    sealed[3] = bytes(len(sealed[3]))                   # random bytes: does not open
    sealed[4] = dealt[4].sealed[2]                      # 4's box to 2, presented as 4's to 1
    commitments[5] = dealt[5].commitments[2]            # commitments to other shares
    disputed = parties[1].check(sealed, commitments)
    assert sorted(disputed) == [3, 4, 5]
    assert "authenticate" in disputed[3] and "authenticate" in disputed[4] and "commitments" in disputed[5]
    with pytest.raises(SecAggError, match="already checked"):
        parties[1].check(sealed, commitments)
    with pytest.raises(SecAggError, match="holds no checked shares of clients \\[3, 4, 5\\]"):
        parties[1].masked(np.zeros(4, np.uint32), [2, 3, 4, 5])


def test_check_and_mask_refusals() -> None:
    a, b, c = ClientParty(1, TAG), ClientParty(2, TAG), ClientParty(3, TAG)
    keys = {p.client_id: p.public_keys() for p in (a, b, c)}
    with pytest.raises(SecAggError, match="not shared"):
        a.check({}, {})
    dealt = {p.client_id: p.share({v: k for v, k in keys.items() if v != p.client_id}, 3) for p in (a, b, c)}
    with pytest.raises(SecAggError, match="not checked"):
        a.masked(np.zeros(4, np.uint32), [2, 3])
    with pytest.raises(SecAggError, match="different senders"):
        a.check({2: dealt[2].sealed[1]}, {})
    with pytest.raises(SecAggError, match="not peers"):
        a.check({9: dealt[2].sealed[1]}, {9: dealt[2].commitments[1]})
    assert a.check({v: dealt[v].sealed[1] for v in (2, 3)}, {v: dealt[v].commitments[1] for v in (2, 3)}) == {}
    with pytest.raises(SecAggError, match="fewer than the threshold"):  # Bonawitz et al.: abort below t
        a.masked(np.zeros(4, np.uint32), [2])
    with pytest.raises(SecAggError, match="uint32"):
        a.masked(np.zeros(4, np.int64), [2, 3])
    with pytest.raises(SecAggError, match="not sent"):
        a.reveal([1], [])
    a.masked(np.zeros(4, np.uint32), [2, 3])
    with pytest.raises(SecAggError, match="already sent"):
        a.masked(np.zeros(4, np.uint32), [2, 3])
    for survivors, dropped, why in (
        ([1, 2], [2], "both"),
        ([1, 9], [], "did not mask with"),
        ([2], [1], "listed as dropped"),
        ([1, 1], [], "repeats"),
    ):
        with pytest.raises(SecAggError, match=why):
            a.reveal(survivors, dropped)
    assert set(a.reveal([1, 2], [3])) == {1, 2, 3}


def test_share_refusals() -> None:
    a, b, c = ClientParty(1, TAG), ClientParty(2, TAG), ClientParty(3, TAG)
    keys = {p.client_id: p.public_keys() for p in (a, b, c)}
    with pytest.raises(SecAggError, match="own peers"):
        a.share(keys, 2)
    with pytest.raises(SecAggError, match="client 2"):
        a.share({2: (keys[2][0][:5], keys[2][1]), 3: keys[3]}, 2)
    with pytest.raises(SecAggError, match="client 3"):
        a.share({2: keys[2], 3: (keys[3][0], bytes(32))}, 2)
    dealt = a.share({2: keys[2], 3: keys[3]}, 2)
    assert sorted(dealt.sealed) == [2, 3] and sorted(dealt.commitments) == [1, 2, 3]
    with pytest.raises(SecAggError, match="already shared"):
        a.share({2: keys[2], 3: keys[3]}, 2)


def test_mask_graph_isolates_the_liar_and_never_names_an_honest_client() -> None:
    clients = list(range(10))
    graph = neighbours(clients, None, seed=1)
    t = default_threshold(10)  # 6: each client's neighbourhood leaves room for 4 disputes
    calm = mask_graph(graph, clients, clients, {}, t)
    assert calm.neighbours == graph and calm.named == {} and calm.short == () and calm.disputed == ()
    # 0 sends bad shares to everyone: each neighbour disputes 0
    garbage = mask_graph(graph, clients, clients, {c: {0} for c in clients if c != 0}, t)
    assert garbage.named == {0: 9} and garbage.short == () and garbage.disputed == ()
    assert garbage.neighbours == {c: tuple(v for v in clients if v not in (0, c)) for c in clients if c != 0}
    # 0 disputes everyone's shares: the same, it isolates only itself
    complainer = mask_graph(graph, clients, clients, {0: set(range(1, 10))}, t)
    assert complainer.neighbours == garbage.neighbours and complainer.named == {0: 9}
    # a few disputes fit the slack: the pairs leave, nobody is named, 0 stays
    few = mask_graph(graph, clients, clients, {3: {0}, 0: {5, 7}}, t)
    assert few.named == {} and few.disputed == ((0, 3), (0, 5), (0, 7))
    assert few.neighbours[0] == (1, 2, 4, 6, 8, 9) and 0 not in few.neighbours[3]
    # named though it never answered CHECK itself; a client that did not check is out unnamed
    silent = mask_graph(graph, clients, [c for c in clients if c not in (0, 9)], {c: {0} for c in range(1, 9)}, t)
    assert silent.named == {0: 8} and sorted(silent.neighbours) == list(range(1, 9))


def test_mask_graph_drops_clients_left_short_without_blaming_them() -> None:
    clients = list(range(8))
    graph = neighbours(clients, 4, seed=2)  # 4 neighbours each
    t = 4                                   # room for 1 dispute each
    a = clients[0]
    b, c = graph[a][:2]
    pruned = mask_graph(graph, clients, clients, {a: {b}, c: {a}}, t)
    assert pruned.named == {a: 2}          # a disputes with two neighbours: beyond its slack
    assert a not in pruned.neighbours
    for v, near in pruned.neighbours.items():
        assert len(near) + 1 >= t and a not in near
        assert all(v in pruned.neighbours[u] for u in near)
    assert set(pruned.short) | set(pruned.neighbours) | {a} == set(clients)
    assert not set(pruned.short) & {a}


def test_random_sealed_shares_drop_their_sender_and_the_sum_is_exact() -> None:
    clients = list(range(10))
    updates = _updates(clients, 3000)

    def garbage(stage: str, messages: dict) -> None:
        if stage == "dealt":
            messages[4] = Dealt({v: os.urandom(len(box)) for v, box in messages[4].sealed.items()},
                                messages[4].commitments)

    done = _round(clients, None, updates, set(clients), alter=garbage)
    assert done.graph.named == {4: 9} and 4 not in done.graph.neighbours
    assert all(set(d) == {4} for c, d in done.disputes.items() if c != 4) and done.disputes[4] == {}
    assert np.array_equal(done.result.total, _plain_sum(updates, set(clients) - {4}))


@pytest.mark.parametrize("n,degree", [(10, None), (12, 4)])
def test_an_altered_revealed_share_is_ignored_its_holder_named_and_the_sum_exact(n: int, degree: int | None) -> None:
    clients = list(range(n))
    updates = _updates(clients, 3000)
    alive = set(clients) - {5}  # 5 dropped after checking: its mask key is rebuilt too

    def lie(stage: str, messages: dict) -> None:
        if stage == "revealed":
            for owner in list(messages[0]):  # 0 alters every share it reveals, seed and key shares alike
                messages[0][owner] = _nudged(messages[0][owner])

    done = _round(clients, degree, updates, alive, alter=lie)
    assert done.result.liars == (0,)
    assert np.array_equal(done.result.total, _plain_sum(updates, alive))


def test_lies_that_leave_too_few_shares_fail_the_round_naming_only_the_liars() -> None:
    clients = list(range(6))
    updates = _updates(clients, 100)
    t = default_threshold(6)  # 4 of 6

    def lie(stage: str, messages: dict) -> None:
        if stage == "revealed":
            for liar in (0, 1, 2):
                messages[liar] = {owner: _nudged(share) for owner, share in messages[liar].items()}

    with pytest.raises(SecAggError, match=f"fewer than {t} matching shares remain") as error:
        _round(clients, None, updates, set(clients), alter=lie)
    assert error.value.culprits == (0, 1, 2)
    assert re.findall(r"clients? \[?([\d, ]+)", str(error.value)) == ["0, 1, 2"]  # the honest go unnamed


@pytest.mark.parametrize("secret", ["seed", "key"])
def test_a_dealer_whose_shares_do_not_rebuild_its_secret_is_named_not_its_holders(secret: str) -> None:
    """Client 2's shares are not of the secret it committed to (the seed commitment it advertised,
    or, when it drops out, its mask public key): each holder's share matches 2's commitment to it,
    so the holders are cleared and 2 is named."""
    clients = list(range(8))
    updates = _updates(clients, 100)
    alive = set(clients) if secret == "seed" else set(clients) - {2}

    def commit_elsewhere(stage: str, messages: dict) -> None:
        if stage == "committed":
            mask_key, seed, shares = messages[2].mask_key, messages[2].seed, messages[2].shares
            if secret == "seed":
                seed = seed_commitment(TAG, 2, os.urandom(32))
            else:
                mask_key = key_pair()[1]
            messages[2] = Commitments(mask_key, seed, shares)

    with pytest.raises(SecAggError, match="do not rebuild") as error:
        _round(clients, None, updates, alive, alter=commit_elsewhere)
    assert error.value.culprits == (2,)
    assert re.findall(r"clients? \[?([\d, ]+)", str(error.value)) == ["2", "2"]


def test_whatever_a_client_masks_the_mean_stays_within_the_bound() -> None:
    """The limitation, and its bound: a well-formed false input is any vector of the ring, so the
    sum can be anything, but read as int32 and divided by the round's total weight it stays
    within +-bound per element (up to a factor 1 + W / 2**31): what one liar can do to the mean."""
    rng = np.random.default_rng(7)
    for bound, total_weight in ((1.0, 1437), (0.05, 10), (3.0, 2**20)):
        step = quantization_step(bound, total_weight)
        total = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
        total[:2] = (2**31, 2**31 - 1)  # the extremes of int32
        mean = dequantize(total, step, total_weight).astype(np.float64)
        assert np.abs(mean).max() <= bound * (1 + total_weight / 2**31) * (1 + 1e-6)
        assert np.abs(mean).max() >= bound * 0.999  # and it reaches it


def _nudged(share: bytes) -> bytes:
    """The same holder's point with y + 1 (mod p): well formed, on no dealer's polynomial."""
    y = (int.from_bytes(share[8:], "big") + 1) % (2**521 - 1)
    return share[:8] + y.to_bytes(66, "big")
