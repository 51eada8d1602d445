"""Seeded partitions of a dataset's train and test splits over federated clients.

:func:`make_partition` returns one :class:`~fedpart.common.data.types.ClientSplit` per client:
sorted int64 indices into ``y_train`` / ``y_test``, disjoint across clients, identical for the same
seed. Each scheme is a component of :data:`fedpart.common.components.registry.PARTITIONS` that declares its
options (:data:`PARTITION_SCHEMES`: their names):

- ``iid``: a seeded permutation cut into equal parts.
- ``shards`` (``shards_per_client``): pathological non-IID shards of McMahan et al. 2017 as used by
  LG-FedAvg (Liang et al. 2020) and FedBABU (Oh et al. 2022); one shuffled label matrix assigns the
  classes of both the train and the test shards, so a client's test labels are its train labels.
- ``dirichlet`` (``alpha``, ``min_size`` = 10, ``max_tries`` = 1000): per-class Dirichlet split over
  clients (Yurochkin et al. 2019, as in FedBABU / PFLlib) with a minimum-size retry; each client's
  test data follows its train class proportions.
- ``dirichlet_prior`` (``alpha``, ``samples_per_client``, ``test_samples_per_client``): per-client
  class priors (Hsu et al. 2019, as used by FedBug) with fixed client sizes.
- ``contiguous`` (``train_per_client``, ``test_per_client``): consecutive blocks in file order.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np

from fedpart.common.data.types import ClientSplit
from fedpart.common.components.registry import PARTITIONS, REQUIRED, Option, at_least_one, finite_positive, non_negative



def check_partition(scheme: str, options: dict[str, Any], num_clients: int, seed: int,
                    class_counts: tuple[Sequence[int], Sequence[int]]) -> None:
    """Raise ``ValueError`` when the partition cannot be cut from a dataset with these samples
    per class (train, test), e.g. ``shards`` that do not divide into the classes. Runs
    :func:`make_partition` itself on labels with the same class counts: every scheme decides
    from the counts alone, so the answer is the one the clients would get, without the data."""
    train, test = (np.repeat(np.arange(len(counts)), counts) for counts in class_counts)
    make_partition(train, test, num_clients, scheme, seed, num_classes=len(class_counts[0]), **options)


def make_partition(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, scheme: str,
                   seed: int, num_classes: int, **options: Any) -> list[ClientSplit]:
    """Split the train and test sets of a dataset with labels ``y_train`` / ``y_test`` over clients.

    Deterministic for ``seed`` (``np.random.default_rng(seed)``). Raises ``ValueError`` for an
    unknown scheme, an option the scheme does not declare, is missing or refuses (named as
    ``data.partition.<option>``), or settings the data cannot satisfy.
    """
    typed = PARTITIONS.read(scheme, options, "data.partition.", "data.partition.scheme")
    num_clients = _integer("num_clients", num_clients, 1)
    y_train = _labels("y_train", y_train)
    y_test = _labels("y_test", y_test)
    rng = np.random.default_rng(seed)
    train, test = PARTITIONS[scheme](y_train=y_train, y_test=y_test, num_clients=num_clients,
                                     num_classes=num_classes, rng=rng, **typed)
    return [ClientSplit(train=np.sort(tr).astype(np.int64), test=np.sort(te).astype(np.int64))
            for tr, te in zip(train, test)]


def _class_labels(scheme: str, y_train: np.ndarray, y_test: np.ndarray,
                  num_classes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Integer class labels in ``0..num_classes - 1`` as int64, for a scheme that splits by class."""
    num_classes = _integer("num_classes", num_classes, 1)
    for name, y in (("y_train", y_train), ("y_test", y_test)):
        if y.dtype.kind not in "iu":
            raise ValueError(f"scheme {scheme!r} needs integer class labels, "
                             f"{name} is {y.dtype}")
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{name} has labels outside 0..{num_classes - 1}")
    return y_train.astype(np.int64), y_test.astype(np.int64), num_classes


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _labels(name: str, y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {y.shape}")
    return y


def _by_class(y: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """Indices of each class, in file order."""
    order = np.argsort(y, kind="stable")
    counts = np.bincount(y, minlength=num_classes)
    return np.split(order, np.cumsum(counts)[:-1])


def _shards(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
            rng: np.random.Generator, shards_per_client: int
            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """LG-FedAvg / FedBABU shards: ``s * N / C`` shards per class and one shared label matrix.

    The list ``[0..C-1] * (s*N/C)`` is shuffled into an ``(N, s)`` label matrix; the j-th
    occurrence of class c (row-major) takes the j-th shard of class c, in the train set and in the
    test set alike.
    """
    total = shards_per_client * num_clients
    if total % num_classes:
        raise ValueError(f"shards: shards_per_client * num_clients = {shards_per_client} * "
                         f"{num_clients} = {total} is not a multiple of "
                         f"num_classes = {num_classes}")
    per_class = total // num_classes
    labels = rng.permutation(np.tile(np.arange(num_classes), per_class))
    rank = np.empty(total, dtype=np.int64)  # occurrence number of each entry within its class
    rank[np.argsort(labels, kind="stable")] = np.arange(total) % per_class
    labels = labels.reshape(num_clients, shards_per_client)
    rank = rank.reshape(num_clients, shards_per_client)

    def cut(y: np.ndarray, split: str) -> list[np.ndarray]:
        shards = []
        for c, members in enumerate(_by_class(y, num_classes)):
            if len(members) < per_class:
                raise ValueError(f"shards: class {c} has {len(members)} {split} samples, "
                                 f"fewer than its {per_class} shards "
                                 f"(shards_per_client={shards_per_client}, "
                                 f"num_clients={num_clients})")
            shards.append(np.array_split(rng.permutation(members), per_class))
        return [np.concatenate([shards[c][r] for c, r in zip(labels[i], rank[i])])
                for i in range(num_clients)]

    return cut(y_train, "train"), cut(y_test, "test")


def _dirichlet(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
               rng: np.random.Generator, alpha: float, min_size: int, max_tries: int
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Yurochkin et al. 2019 per-class ``Dir(alpha)`` split over clients (FedBABU / PFLlib style).

    For each class, proportions over clients are drawn from ``Dir(alpha)``; clients already
    holding ``>= len(y_train) / N`` samples get no share. The draw is repeated until every client
    has ``min_size`` samples. A client's share of each class's test samples equals its share of
    that class's train samples.
    """
    n = len(y_train)
    if min_size * num_clients > n:
        raise ValueError(f"dirichlet: min_size={min_size} x {num_clients} clients exceeds the "
                         f"{n} training samples")
    train_classes = _by_class(y_train, num_classes)
    class_sizes = [len(members) for members in train_classes]
    counts = None
    for _ in range(max_tries):
        draw = _dirichlet_counts(class_sizes, num_clients, n / num_clients, alpha, rng)
        if draw is not None and draw.sum(axis=0).min() >= min_size:
            counts = draw
            break
    if counts is None:
        raise ValueError(f"dirichlet: no draw gave every client >= min_size={min_size} training "
                         f"samples in max_tries={max_tries} tries (alpha={alpha}); raise alpha or "
                         "lower min_size")

    train: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    test: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, (members, test_members) in enumerate(zip(train_classes, _by_class(y_test, num_classes))):
        ends = np.cumsum(counts[c])
        for i, part in enumerate(np.split(rng.permutation(members), ends[:-1])):
            train[i].append(part)
        if class_sizes[c]:
            test_ends = ends * len(test_members) // class_sizes[c]
            for i, part in enumerate(np.split(rng.permutation(test_members), test_ends[:-1])):
                test[i].append(part)
    return [np.concatenate(parts) for parts in train], [np.concatenate(parts) for parts in test]


def _dirichlet_counts(class_sizes: list[int], num_clients: int, cap: float, alpha: float,
                      rng: np.random.Generator) -> np.ndarray | None:
    """One draw of the (class, client) sample counts; ``None`` if a class found no client left."""
    counts = np.zeros((len(class_sizes), num_clients), dtype=np.int64)
    held = np.zeros(num_clients, dtype=np.int64)
    concentration = np.full(num_clients, alpha)
    for c, n_c in enumerate(class_sizes):
        shares = rng.dirichlet(concentration) * (held < cap)
        total = shares.sum()
        if total <= 0:  # the shares of every client below the cap underflowed to zero
            return None
        bounds = np.minimum((np.cumsum(shares / total) * n_c).astype(np.int64), n_c)
        bounds[-1] = n_c
        counts[c] = np.diff(bounds, prepend=0)
        held += counts[c]
    return counts


def _dirichlet_prior(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
                     rng: np.random.Generator, alpha: float, train_size: int, test_size: int
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Hsu et al. 2019 per-client class priors with fixed client sizes (FedBug's partition).

    Each client draws ``q ~ Dir(alpha * 1)`` over the classes (the symmetric form used by the
    FedDyn / FedBug / FedLab code) and fills ``train_size`` train and ``test_size`` test slots by
    drawing a class from ``q`` and taking an unused sample of it; exhausted classes drop out of
    ``q`` (which is renormalised over the classes left).
    """
    for split, size, y in (("samples_per_client", train_size, y_train),
                           ("test_samples_per_client", test_size, y_test)):
        if size * num_clients > len(y):
            raise ValueError(f"dirichlet_prior: {split}={size} x {num_clients} clients exceeds "
                             f"the {len(y)} samples available")
    priors = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    return (_prior_sample(priors, _by_class(y_train, num_classes), train_size, rng),
            _prior_sample(priors, _by_class(y_test, num_classes), test_size, rng))


def _prior_sample(priors: np.ndarray, by_class: list[np.ndarray], size: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """Fill ``size`` slots per client from its class prior; clients' slots in seeded order."""
    num_clients, num_classes = priors.shape
    owner = rng.permutation(np.repeat(np.arange(num_clients), size))
    uniforms = rng.random(len(owner)).tolist()
    remaining = [len(members) for members in by_class]
    weights = priors * (np.asarray(remaining) > 0)
    cumulative = np.cumsum(weights, axis=1).tolist()
    chosen = np.empty(len(owner), dtype=np.int64)
    for k, client in enumerate(owner.tolist()):
        row = cumulative[client]
        total = row[-1]
        if total > 0:
            c = bisect_right(row, uniforms[k] * total)
            if c >= num_classes:  # rounding put the draw on the total: take the last live class
                c = bisect_left(row, total)
        else:  # the prior's mass is all on exhausted classes: any class left, uniformly
            live = [j for j, left in enumerate(remaining) if left]
            c = live[int(uniforms[k] * len(live))]
        chosen[k] = c
        remaining[c] -= 1
        if not remaining[c]:
            weights[:, c] = 0.0
            cumulative = np.cumsum(weights, axis=1).tolist()

    sample = np.empty(len(owner), dtype=np.int64)
    for c, members in enumerate(by_class):
        slots = np.flatnonzero(chosen == c)
        sample[slots] = rng.permutation(members)[: len(slots)]
    order = np.argsort(owner, kind="stable")
    return np.split(sample[order], np.arange(1, num_clients) * size)


def _contiguous(n_train: int, n_test: int, num_clients: int, train_per_client: int,
                test_per_client: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Client i gets train ``[i*a, (i+1)*a)`` and test ``[i*b, (i+1)*b)`` in file order."""
    for name, per, n in (("train_per_client", train_per_client, n_train),
                         ("test_per_client", test_per_client, n_test)):
        if per * num_clients > n:
            raise ValueError(f"contiguous: {name}={per} x {num_clients} clients exceeds the {n} "
                             "samples available")
    return ([np.arange(i * train_per_client, (i + 1) * train_per_client)
             for i in range(num_clients)],
            [np.arange(i * test_per_client, (i + 1) * test_per_client) for i in range(num_clients)])


Parts = tuple[list[np.ndarray], list[np.ndarray]]  # each client's train and test indices
_ALPHA = Option("alpha", float, "concentration: smaller is more skewed", finite_positive, "must be a positive number",
                REQUIRED)


def _count(name: str, help: str, minimum: int, default: Any) -> Option:
    return Option(name, int, help, at_least_one if minimum else non_negative, f"must be >= {minimum}", default)


@PARTITIONS.register("iid", "A seeded permutation cut into equal parts.")
def _iid(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
         rng: np.random.Generator) -> Parts:
    if len(y_train) < num_clients:
        raise ValueError(f"iid: {len(y_train)} training samples cannot cover "
                         f"{num_clients} clients")
    return (np.array_split(rng.permutation(len(y_train)), num_clients),
            np.array_split(rng.permutation(len(y_test)), num_clients))


@PARTITIONS.register("shards", "Pathological non-IID shards (McMahan et al. 2017, as LG-FedAvg and FedBABU use).",
                     _count("shards_per_client", "shards (of one class each) per client", 1, REQUIRED))
def _shards_scheme(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
                   rng: np.random.Generator, shards_per_client: int) -> Parts:
    y_train, y_test, num_classes = _class_labels("shards", y_train, y_test, num_classes)
    return _shards(y_train, y_test, num_clients, num_classes, rng, shards_per_client)


@PARTITIONS.register("dirichlet", "Per-class Dirichlet split over clients (Yurochkin et al. 2019) with a minimum size.",
                     _ALPHA, _count("min_size", "least training samples a client gets (draws again below)", 0, 10),
                     _count("max_tries", "draws before giving up on min_size", 1, 1000))
def _dirichlet_scheme(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
                      rng: np.random.Generator, alpha: float, min_size: int = 10, max_tries: int = 1000) -> Parts:
    y_train, y_test, num_classes = _class_labels("dirichlet", y_train, y_test, num_classes)
    return _dirichlet(y_train, y_test, num_clients, num_classes, rng, alpha=alpha, min_size=min_size,
                      max_tries=max_tries)


@PARTITIONS.register("dirichlet_prior", "Per-client Dirichlet class priors with fixed client sizes (Hsu et al. 2019).",
                     _ALPHA, _count("samples_per_client", "training samples per client (default: an equal share)", 1,
                                    None),
                     _count("test_samples_per_client", "test samples per client (default: an equal share)", 0, None))
def _dirichlet_prior_scheme(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
                            rng: np.random.Generator, alpha: float, samples_per_client: int | None = None,
                            test_samples_per_client: int | None = None) -> Parts:
    y_train, y_test, num_classes = _class_labels("dirichlet_prior", y_train, y_test, num_classes)
    train_size = len(y_train) // num_clients if samples_per_client is None else samples_per_client
    test_size = len(y_test) // num_clients if test_samples_per_client is None else test_samples_per_client
    return _dirichlet_prior(y_train, y_test, num_clients, num_classes, rng, alpha=alpha,
                            train_size=_integer("samples_per_client", train_size, 1),
                            test_size=_integer("test_samples_per_client", test_size, 0))


@PARTITIONS.register("contiguous", "Consecutive blocks in file order.",
                     _count("train_per_client", "training samples per client", 1, REQUIRED),
                     _count("test_per_client", "test samples per client", 0, REQUIRED))
def _contiguous_scheme(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, num_classes: int,
                       rng: np.random.Generator, train_per_client: int, test_per_client: int) -> Parts:
    return _contiguous(len(y_train), len(y_test), num_clients, train_per_client, test_per_client)


PARTITION_SCHEMES: tuple[str, ...] = tuple(PARTITIONS.builtin())
"""The partition schemes' names."""
