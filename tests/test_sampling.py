"""Seeded per-round client sampling: fraction without replacement, or an independent probability."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from fedpart.server.engine.sampling import sample_clients


@pytest.mark.parametrize("num_clients, fraction, expected", [
    (100, 0.1, 10), (100, 1.0, 100), (10, 0.05, 1), (10, 0.01, 1), (20, 0.2, 4), (10, 0.3, 3),
    (10, 0.7, 7), (100, 0.29, 29), (100, 0.57, 57), (3, 0.5, 1), (1, 0.1, 1), (1, 1.0, 1),
])
def test_fraction_count_distinct_sorted(num_clients, fraction, expected):
    for round_number in (1, 2, 17):
        picked = sample_clients(num_clients, round_number, seed=5, fraction=fraction)
        assert len(picked) == expected == max(1, int(Fraction(str(fraction)) * num_clients))
        assert picked == sorted(set(picked))
        assert all(isinstance(c, int) and 0 <= c < num_clients for c in picked)


def test_fraction_count_matches_exact_formula_for_many_fractions():
    for num_clients in (7, 10, 20, 100, 1000):
        for percent in range(1, 101):
            fraction = percent / 100
            picked = sample_clients(num_clients, 1, seed=0, fraction=fraction)
            assert len(picked) == max(1, math.floor(Fraction(percent, 100) * num_clients)), (num_clients, fraction)


def test_full_participation_is_everyone():
    assert sample_clients(12, 3, seed=1, fraction=1.0) == list(range(12))


def test_same_seed_and_round_same_sample():
    for round_number in range(1, 6):
        first = sample_clients(100, round_number, seed=42, fraction=0.1)
        again = sample_clients(100, round_number, seed=42, fraction=0.1)
        assert first == again


def test_different_rounds_and_seeds_differ():
    samples = [tuple(sample_clients(100, r, seed=42, fraction=0.1)) for r in range(1, 21)]
    assert len(set(samples)) == len(samples)
    assert sample_clients(100, 1, seed=42, fraction=0.1) != sample_clients(100, 1, seed=43, fraction=0.1)


def test_fraction_sampling_is_roughly_uniform():
    counts = [0] * 20
    for round_number in range(1, 501):
        for client in sample_clients(20, round_number, seed=0, fraction=0.25):
            counts[client] += 1
    # Each client joins with probability 0.25 per round: 125 of 500 expected (std ~9.7).
    assert all(80 <= c <= 170 for c in counts), counts


def test_probability_mode_never_empty():
    for round_number in range(1, 301):
        picked = sample_clients(10, round_number, seed=3, fraction=1.0, probability=0.02)
        assert picked, round_number  # P(empty draw) = 0.98**10 ~ 0.82: resampling must happen
        assert picked == sorted(set(picked))
        assert all(0 <= c < 10 for c in picked)


def test_probability_mode_average_size_and_determinism():
    sizes = []
    for round_number in range(1, 2001):
        picked = sample_clients(50, round_number, seed=7, fraction=0.1, probability=0.3)
        assert picked == sample_clients(50, round_number, seed=7, fraction=0.1, probability=0.3)
        assert picked == sorted(set(picked))
        sizes.append(len(picked))
    mean = sum(sizes) / len(sizes)
    assert abs(mean - 15.0) < 0.5, mean   # p*N = 15; std of the mean ~0.07
    assert len(set(sizes)) > 5            # independent draws, not a fixed count


def test_probability_one_is_everyone():
    assert sample_clients(9, 4, seed=0, fraction=0.1, probability=1.0) == list(range(9))


def test_probability_mode_ignores_fraction():
    a = sample_clients(40, 2, seed=1, fraction=0.1, probability=0.5)
    b = sample_clients(40, 2, seed=1, fraction=1.0, probability=0.5)
    assert a == b
