"""Client partitions: disjointness, coverage, determinism and each scheme's defining property."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from fedpart.common.data.types import ClientSplit
from fedpart.common.data.partition import PARTITION_SCHEMES, check_partition, make_partition

# CIFAR-10-sized labels: 5,000 train and 1,000 test samples per class, classes interleaved.
CIFAR_TRAIN = np.tile(np.arange(10), 5000)
CIFAR_TEST = np.tile(np.arange(10), 1000)
# An unbalanced 10-class set, in random order.
_rng = np.random.default_rng(123)
SKEWED_TRAIN = _rng.choice(10, size=6000, p=np.linspace(1, 3, 10) / 20)
SKEWED_TEST = _rng.choice(10, size=1500, p=np.linspace(1, 3, 10) / 20)

SCHEME_OPTIONS: dict[str, dict[str, Any]] = {
    "iid": {},
    "shards": {"shards_per_client": 2},
    "dirichlet": {"alpha": 0.3},
    "dirichlet_prior": {"alpha": 0.3},
    "contiguous": {"train_per_client": 250, "test_per_client": 60},
}


def _partition(scheme: str, seed: int = 0, y_train: np.ndarray = SKEWED_TRAIN,
               y_test: np.ndarray = SKEWED_TEST, num_clients: int = 20, **options: Any
               ) -> list[ClientSplit]:
    return make_partition(y_train, y_test, num_clients, scheme, seed, 10,
                          **(options or SCHEME_OPTIONS[scheme]))


def _assert_disjoint_sorted(splits: list[ClientSplit]) -> None:
    for part in ("train", "test"):
        arrays = [getattr(s, part) for s in splits]
        for a in arrays:
            assert a.dtype == np.int64 and np.all(np.diff(a) > 0)
        merged = np.concatenate(arrays)
        assert len(np.unique(merged)) == len(merged), f"{part} indices overlap across clients"


def _labels(splits: list[ClientSplit], y: np.ndarray, part: str) -> list[set[int]]:
    return [set(y[getattr(s, part)].tolist()) for s in splits]


def test_schemes_listed() -> None:
    assert set(PARTITION_SCHEMES) == set(SCHEME_OPTIONS)


@pytest.mark.parametrize("scheme", sorted(SCHEME_OPTIONS))
def test_disjoint_sorted_and_deterministic(scheme: str) -> None:
    splits = _partition(scheme, seed=7)
    assert len(splits) == 20
    _assert_disjoint_sorted(splits)
    again = _partition(scheme, seed=7)
    assert all(np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
               for a, b in zip(splits, again))
    if scheme != "contiguous":
        other = _partition(scheme, seed=8)
        assert any(not np.array_equal(a.train, b.train) for a, b in zip(splits, other))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_full_coverage(scheme: str) -> None:
    splits = _partition(scheme)
    assert sum(len(s.train) for s in splits) == len(SKEWED_TRAIN)
    assert sum(len(s.test) for s in splits) == len(SKEWED_TEST)


def test_iid_sizes_are_even() -> None:
    splits = make_partition(CIFAR_TRAIN[:1003], CIFAR_TEST[:101], 10, "iid", 0, 10)
    assert sorted({len(s.train) for s in splits}) == [100, 101]
    assert sorted({len(s.test) for s in splits}) == [10, 11]


def test_shards_cifar10_100_clients() -> None:
    splits = make_partition(CIFAR_TRAIN, CIFAR_TEST, 100, "shards", 0, 10, shards_per_client=2)
    assert all(len(s.train) == 500 and len(s.test) == 100 for s in splits)
    _assert_disjoint_sorted(splits)
    train_labels = _labels(splits, CIFAR_TRAIN, "train")
    assert train_labels == _labels(splits, CIFAR_TEST, "test")
    assert all(1 <= len(labels) <= 2 for labels in train_labels)
    assert sum(len(s.train) for s in splits) == 50000 and sum(len(s.test) for s in splits) == 10000
    # each class is cut into s*N/C = 20 shards of 250 train / 50 test samples
    for s, labels in zip(splits, train_labels):
        counts = np.bincount(CIFAR_TRAIN[s.train], minlength=10)
        assert set(counts[list(labels)].tolist()) <= {250, 500}
        assert np.array_equal(np.bincount(CIFAR_TEST[s.test], minlength=10) * 5, counts)


def test_shards_test_labels_match_train_labels_on_skewed_data() -> None:
    splits = _partition("shards", num_clients=30, shards_per_client=5)
    assert _labels(splits, SKEWED_TRAIN, "train") == _labels(splits, SKEWED_TEST, "test")


def test_shards_impossible_settings() -> None:
    with pytest.raises(ValueError, match=r"shards_per_client.*3 \* 7 = 21.*num_classes = 10"):
        _partition("shards", num_clients=7, shards_per_client=3)
    tiny = np.repeat(np.arange(10), 3)
    with pytest.raises(ValueError, match="class 0 has 3 train samples, fewer than its 4 shards"):
        make_partition(tiny, tiny, 20, "shards", 0, 10, shards_per_client=2)


def test_dirichlet_min_size_and_test_proportions() -> None:
    splits = make_partition(CIFAR_TRAIN, CIFAR_TEST, 100, "dirichlet", 3, 10, alpha=0.1,
                            min_size=50)
    assert min(len(s.train) for s in splits) >= 50
    _assert_disjoint_sorted(splits)
    assert sum(len(s.test) for s in splits) == len(CIFAR_TEST)
    sizes = [len(s.train) for s in splits]
    assert max(sizes) > 3 * min(sizes)  # alpha = 0.1 is strongly unbalanced
    for s in splits:
        train_counts = np.bincount(CIFAR_TRAIN[s.train], minlength=10)
        test_counts = np.bincount(CIFAR_TEST[s.test], minlength=10)
        # the test set has a fifth of the train set's samples of every class, up to rounding
        assert np.all(np.abs(test_counts - train_counts / 5) <= 1)


def test_dirichlet_impossible_min_size() -> None:
    with pytest.raises(ValueError, match="min_size=400"):
        _partition("dirichlet", alpha=0.3, min_size=400)
    with pytest.raises(ValueError, match=r"min_size=290.*max_tries=3.*alpha=0.01"):
        _partition("dirichlet", alpha=0.01, min_size=290, max_tries=3)


def test_dirichlet_prior_fixed_sizes_and_skew() -> None:
    start = time.perf_counter()
    splits = make_partition(CIFAR_TRAIN, CIFAR_TEST, 100, "dirichlet_prior", 0, 10, alpha=0.3)
    assert time.perf_counter() - start < 2.0
    assert all(len(s.train) == 500 and len(s.test) == 100 for s in splits)
    _assert_disjoint_sorted(splits)
    assert sum(len(s.train) for s in splits) == 50000  # every sample used: classes exhausted
    # a client's test classes follow its train classes (same prior)
    similarities = []
    for s in splits:
        p = np.bincount(CIFAR_TRAIN[s.train], minlength=10) / 500
        q = np.bincount(CIFAR_TEST[s.test], minlength=10) / 100
        similarities.append(np.minimum(p, q).sum())
    assert np.mean(similarities) > 0.7
    dominant = [np.bincount(CIFAR_TRAIN[s.train]).max() / 500 for s in splits]
    assert np.mean(dominant) > 0.3  # non-IID: an IID client would hold about 0.1 of each class


def test_dirichlet_prior_custom_sizes_and_limits() -> None:
    splits = _partition("dirichlet_prior", alpha=1.0, samples_per_client=100,
                        test_samples_per_client=0)
    assert all(len(s.train) == 100 and len(s.test) == 0 for s in splits)
    with pytest.raises(ValueError, match="samples_per_client=301"):
        _partition("dirichlet_prior", alpha=1.0, samples_per_client=301)
    with pytest.raises(ValueError, match="test_samples_per_client=76"):
        _partition("dirichlet_prior", alpha=1.0, test_samples_per_client=76)


def test_contiguous_exact_ranges() -> None:
    splits = _partition("contiguous", num_clients=3, train_per_client=5, test_per_client=2)
    assert [s.train.tolist() for s in splits] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9],
                                                  [10, 11, 12, 13, 14]]
    assert [s.test.tolist() for s in splits] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="train_per_client=301"):
        _partition("contiguous", train_per_client=301, test_per_client=1)
    with pytest.raises(ValueError, match="test_per_client=76"):
        _partition("contiguous", train_per_client=1, test_per_client=76)


def test_regression_targets_allowed_for_label_free_schemes() -> None:
    y = np.linspace(0, 1, 40, dtype=np.float32)
    splits = make_partition(y, y[:8], 4, "iid", 0, 0)
    assert sorted(np.concatenate([s.train for s in splits]).tolist()) == list(range(40))


@pytest.mark.parametrize("scheme, options, message", [
    ("pathological", {}, "unknown partition scheme 'pathological'"),
    ("iid", {"alpha": 1.0}, "data.partition.alpha: not an option of partition scheme 'iid'"),
    ("shards", {}, "shards_per_client: required by partition scheme 'shards'"),
    ("shards", {"shards_per_client": 0}, "shards_per_client must be >= 1"),
    ("shards", {"shards_per_client": 2.5}, "shards_per_client: expected an integer"),
    ("dirichlet", {}, "alpha: required by partition scheme 'dirichlet'"),
    ("dirichlet", {"alpha": 0}, "alpha must be a positive number"),
    ("dirichlet", {"alpha": float("nan")}, "alpha must be a positive number"),
    ("dirichlet", {"alpha": 1.0, "min_size": -1}, "min_size must be >= 0"),
    ("dirichlet", {"alpha": 1.0, "max_tries": 0}, "max_tries must be >= 1"),
    ("dirichlet_prior", {"alpha": -1.0}, "alpha must be a positive number"),
    ("contiguous", {"train_per_client": 5}, "test_per_client: required by partition scheme 'contiguous'"),
])
def test_bad_scheme_and_options(scheme: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_partition(SKEWED_TRAIN, SKEWED_TEST, 20, scheme, 0, 10, **options)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        make_partition(SKEWED_TRAIN, SKEWED_TEST, 0, "iid", 0, 10)
    with pytest.raises(ValueError, match="labels outside 0..4"):
        make_partition(SKEWED_TRAIN, SKEWED_TEST, 5, "shards", 0, 5, shards_per_client=2)
    with pytest.raises(ValueError, match="integer class labels"):
        make_partition(SKEWED_TRAIN.astype(float), SKEWED_TEST, 5, "dirichlet", 0, 10, alpha=1.0)
    with pytest.raises(ValueError, match="cannot cover"):
        make_partition(SKEWED_TRAIN[:3], SKEWED_TEST, 5, "iid", 0, 10)


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_a_partition_is_checked_from_the_class_counts_alone(scheme: str) -> None:
    """check_partition decides as make_partition on the real labels does, with the same message:
    from the samples per class, without the data (the skewed set's labels are in random order)."""
    counts = (np.bincount(SKEWED_TRAIN, minlength=10), np.bincount(SKEWED_TEST, minlength=10))
    outcomes = set()
    for clients in (5, 6, 30, 700):
        options = dict(SCHEME_OPTIONS[scheme])
        try:
            make_partition(SKEWED_TRAIN, SKEWED_TEST, clients, scheme, seed=0, num_classes=10, **options)
        except ValueError as error:
            with pytest.raises(ValueError) as checked:
                check_partition(scheme, options, clients, 0, counts)
            assert str(checked.value) == str(error)
            outcomes.add("refused")
        else:
            check_partition(scheme, options, clients, 0, counts)
            outcomes.add("cut")
    assert "cut" in outcomes


def test_shards_that_cannot_be_cut_are_refused_without_data() -> None:
    with pytest.raises(ValueError, match=r"2 \* 6 = 12 is not a multiple of num_classes = 10"):
        check_partition("shards", {"shards_per_client": 2}, 6, 0, ((100,) * 10, (20,) * 10))
    check_partition("shards", {"shards_per_client": 2}, 5, 0, ((100,) * 10, (20,) * 10))
