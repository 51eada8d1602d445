"""Aggregation: weighted per-tensor means, coordinate-wise median and trimmed mean, order
independence, server step, FedHA heads."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpart.server.policy import aggregation
from fedpart.server.policy.aggregation import (
    FOLD_BLOCK_ELEMENTS,
    CompensatedSum,
    CoordinateMedian,
    CoordinateTrimmedMean,
    HeadDictionary,
    WeightedMean,
)
from fedpart.server.policy.optimizers import apply_deltas


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_weighted_mean_by_hand():
    mean = WeightedMean()
    mean.add({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0])}, 1)
    mean.add({"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([-2.0])}, 3)
    mean.add({"w": torch.tensor([0.5, 0.0]), "b": torch.tensor([4.0])}, 4)
    got = mean.result()
    assert set(got) == {"w", "b"}
    # w: (1*[1,2] + 3*[3,6] + 4*[0.5,0]) / 8 = [12/8, 20/8]
    assert got["w"].dtype == torch.float64
    assert torch.equal(got["w"], torch.tensor([1.5, 2.5], dtype=torch.float64))
    # b: (10 - 6 + 16) / 8
    assert torch.equal(got["b"], torch.tensor([2.5], dtype=torch.float64))
    assert len(mean) == 2


def test_per_tensor_mean_over_the_clients_that_sent_it():
    mean = WeightedMean()
    mean.add({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0])}, 1)
    mean.add({"w": torch.tensor([3.0, 6.0])}, 3)            # no "b"
    mean.add({"b": torch.tensor([20.0]), "c": torch.full((2, 2), 7.0)}, 2)  # no "w"
    got = mean.result()
    assert torch.equal(got["w"], torch.tensor([2.5, 5.0], dtype=torch.float64))        # weights 1+3
    assert got["b"].item() == pytest.approx(50.0 / 3.0, rel=1e-15)                     # weights 1+2
    assert torch.equal(got["c"], torch.full((2, 2), 7.0, dtype=torch.float64))         # weight 2 only
    assert got["c"].shape == (2, 2)


def test_uniform_weights_give_plain_average():
    mean = WeightedMean()
    for value in (1.0, 2.0, 6.0):
        mean.add({"x": torch.tensor([value])}, 1.0)
    assert mean.result()["x"].item() == 3.0


@pytest.mark.parametrize("weight", [0, 0.0, -1, -3.5])
def test_non_positive_weight_rejected(weight):
    mean = WeightedMean()
    mean.add({"x": torch.ones(2)}, 2)
    with pytest.raises(ValueError):
        mean.add({"x": torch.ones(2)}, weight)
    # The rejected result left no trace.
    assert torch.equal(mean.result()["x"], torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("weight", [float("nan"), float("inf")])
def test_non_finite_weight_rejected(weight):
    mean = WeightedMean()
    with pytest.raises(ValueError):
        mean.add({"x": torch.ones(2)}, weight)


def test_compensated_sum_survives_cancellation_in_every_order():
    terms = [torch.tensor([1e16, 3.0], dtype=torch.float64), torch.tensor([1.0, 1e-20], dtype=torch.float64),
             torch.tensor([-1e16, -3.0], dtype=torch.float64)]
    for order in itertools.permutations(terms):
        total = CompensatedSum(terms[0].shape)
        for term in order:
            total.add(term)
        assert total.result().tolist() == [1.0, 1e-20]
    # A plain float64 sum gets this wrong in at least one order.
    plain = {float(sum(order, torch.zeros(2, dtype=torch.float64))[0]) for order in itertools.permutations(terms)}
    assert plain != {1.0}


def _random_round(seed: int, clients: int = 10, size: int = 100_000):
    gen = torch.Generator().manual_seed(seed)
    deltas = []
    for client in range(clients):
        scale = 10.0 ** (client % 4 - 3)  # deltas of very different magnitudes
        deltas.append({"a": torch.randn(size, generator=gen) * scale,
                       "b": torch.randn(7, 3, generator=gen) * scale})
    weights = torch.randint(1, 600, (clients,), generator=gen).tolist()
    old = {"a": torch.randn(size, generator=gen), "b": torch.randn(7, 3, generator=gen)}
    return deltas, weights, old


def test_fold_order_does_not_change_the_result():
    deltas, weights, old = _random_round(0)
    rng = np.random.default_rng(1)
    orders = [list(range(10)), list(range(9, -1, -1))] + [rng.permutation(10).tolist() for _ in range(3)]
    results, means = [], []
    for order in orders:
        mean = WeightedMean()
        for client in order:
            mean.add(deltas[client], weights[client])
        means.append(mean.result())
        results.append(apply_deltas(old, means[-1], 1.0))
    for result in results[1:]:
        for name in old:
            assert result[name].dtype == torch.float32
            assert torch.equal(result[name].view(torch.int32), results[0][name].view(torch.int32))

    # Float64 reference: exact products, plain sum (relative error ~1e-15).
    total_weight = float(sum(weights))
    for name in old:
        reference = sum(d[name].double() * w for d, w in zip(deltas, weights)) / total_weight
        got_mean = means[0][name]
        assert got_mean.dtype == torch.float64
        assert float((got_mean - reference).abs().max()) <= 1e-12 * float(reference.abs().max())
        expected = old[name].double() + reference
        got = results[0][name].double()
        assert float((got - expected).abs().max()) <= 1e-7 * max(1.0, float(expected.abs().max()))
        # Within float32 rounding of the exact value: at most half an ulp (plus float64 noise).
        ulp = torch.finfo(torch.float32).eps * expected.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert bool(((got - expected).abs() <= 0.5 * ulp + 1e-12).all())


# SHA-256 of the means of _pinned_round() (float64 bytes, tensors in name order), computed with
# the unblocked one-result-at-a-time fold of commit 152867a: the arithmetic must never change.
PINNED_MEANS_SHA256 = "2efd4ac023040f8586ab70d7f6ef5c7cc437fd8262f6e84f97a86871bff94190"
PINNED_SHAPES = {"cnn2_sized": (582_026,), "odd": (7, 3), "one": (1,), "not_a_block_multiple": (65_537,),
                 "conv": (32, 1, 5, 5)}
PINNED_WEIGHTS = [1, 600, 37, 512, 3, 999]


def _wide_float32(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values built bit by bit from PCG64's raw output (no library sampling algorithm that
    could change): random sign and mantissa, exponent in [-40, 0]. Times weights below 2**10 and
    summed over six results, the exact sums span about 77 bits: more than float64 holds (a plain
    float64 sum differs), less than the double-double holds, so the exact mean is computed and its
    bits do not depend on the order of the terms."""
    raw = np.random.PCG64(seed).random_raw(math.prod(shape))
    sign = (raw >> np.uint64(63)) << np.uint64(31)
    exponent = (np.uint64(127) - (raw >> np.uint64(32)) % np.uint64(41)) << np.uint64(23)
    bits = (sign | exponent | (raw & np.uint64(0x7FFFFF))).astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32).copy()).reshape(shape)


def _pinned_round() -> list[tuple[dict[str, torch.Tensor], int]]:
    """Six results with integer weights; the third does not send "odd"."""
    return [({name: _wide_float32(1000 * index + position, shape)
              for position, (name, shape) in enumerate(PINNED_SHAPES.items()) if (name, index) != ("odd", 2)},
             weight)
            for index, weight in enumerate(PINNED_WEIGHTS)]


def _means_sha256(means: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(means):
        digest.update(name.encode())
        digest.update(means[name].to(torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("block_elements", [FOLD_BLOCK_ELEMENTS, 32_000])
@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [3, 1, 5, 0, 2, 4]])
def test_fold_gives_the_pinned_bits(order, block_elements):
    results = _pinned_round()
    mean = WeightedMean(block_elements)
    for index in order:
        mean.add(*results[index])
    means = mean.result()
    assert {name: tuple(tensor.shape) for name, tensor in means.items()} == PINNED_SHAPES
    assert _means_sha256(means) == PINNED_MEANS_SHA256


def test_pinned_round_needs_the_compensation():
    results = _pinned_round()
    plain = {name: sum(tensors[name].double() * weight for tensors, weight in results if name in tensors)
             / sum(weight for tensors, weight in results if name in tensors) for name in PINNED_SHAPES}
    assert _means_sha256(plain) != PINNED_MEANS_SHA256


def _fold_from_threads(aggregator, results, threads: int, seed: int) -> None:
    """``threads`` threads, started together, each add an interleaved share of ``results`` (the
    whole list shuffled with ``seed`` first) to ``aggregator``."""
    order = np.random.default_rng(seed).permutation(len(results)).tolist()
    start = threading.Barrier(threads)
    errors = []

    def fold(share: list[int]) -> None:
        try:
            start.wait(timeout=120)
            for index in share:
                aggregator.add(*results[index])
        except Exception as error:  # reported by the test thread below
            errors.append(error)

    workers = [threading.Thread(target=fold, args=(order[offset::threads],)) for offset in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    assert not any(worker.is_alive() for worker in workers) and not errors


@pytest.mark.parametrize("block_elements", [FOLD_BLOCK_ELEMENTS, 32_000, 1000, 7])
def test_concurrent_folds_give_the_bits_of_a_sequential_fold(block_elements):
    results = _pinned_round()
    results += [({name: tensor.flip(0) for name, tensor in tensors.items()}, weight + 5)
                for tensors, weight in results]              # 12 results, so 4 threads fold 3 each
    if block_elements == 7:                                  # a tiny block: many blocks, cheap tensors only
        results = [({name: t for name, t in tensors.items() if t.numel() < 1000}, w) for tensors, w in results]
    sequential = WeightedMean(block_elements)
    for tensors, weight in results:
        sequential.add(tensors, weight)
    expected = _means_sha256(sequential.result())
    for seed in range(3):
        mean = WeightedMean(block_elements)
        _fold_from_threads(mean, results, threads=4, seed=seed)
        assert _means_sha256(mean.result()) == expected


def test_fractional_weights_give_the_same_bits_in_every_order():
    # The total weight is summed exactly rounded, so it too does not depend on the order.
    results = [({"x": torch.tensor([1.0, -3.0])}, 0.1), ({"x": torch.tensor([2.0, 0.5])}, 0.7),
               ({"x": torch.tensor([4.0, 8.0])}, 0.2), ({"x": torch.tensor([-1.0, 1.0])}, 1e-3)]
    assert len({sum(w for _, w in order) for order in itertools.permutations(results)}) > 1  # plain sums differ
    bits = set()
    for order in itertools.permutations(results):
        mean = WeightedMean()
        for tensors, weight in order:
            mean.add(tensors, weight)
        bits.add(mean.result()["x"].numpy().tobytes())
    assert len(bits) == 1


def test_a_fold_skips_a_busy_block_and_comes_back_to_it():
    total = CompensatedSum((10,), block_elements=3)          # blocks of 3, 3, 3 and 1 elements
    first, last = total._blocks[0], total._blocks[-1]
    last_folded = threading.Event()
    fold_last = last.fold
    last.fold = lambda *args: (fold_last(*args), last_folded.set())
    first.lock.acquire()                                     # as if another thread were folding it
    worker = threading.Thread(target=total.add, args=(torch.arange(10.0), 2.0))
    worker.start()
    assert last_folded.wait(timeout=120)                     # it went past the busy block
    assert all(block.current == 1 for block in total._blocks[1:])
    assert first.current == 0 and worker.is_alive()          # and waits for the busy one's lock
    first.lock.release()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert torch.equal(total.result(), torch.arange(10.0, dtype=torch.float64) * 2)


def test_weighted_mean_refuses_a_changed_shape_or_a_complex_tensor_and_changes_nothing():
    mean = WeightedMean()
    mean.add({"w": torch.ones(2, 3), "b": torch.ones(2)}, 1)
    with pytest.raises(ValueError, match=r"'w' has shape \[3, 2\], earlier results sent \[2, 3\]"):
        mean.add({"b": torch.full((2,), 5.0), "w": torch.ones(3, 2)}, 1)
    with pytest.raises(ValueError, match="'c': cannot average dtype torch.complex64"):
        mean.add({"b": torch.full((2,), 5.0), "c": torch.ones(2, dtype=torch.complex64)}, 1)
    got = mean.result()
    assert set(got) == {"w", "b"} and torch.equal(got["b"], torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                                   torch.bool])
def test_every_real_dtype_folds_as_its_float64_value(dtype):
    values = torch.randn(3, 70_000, generator=torch.Generator().manual_seed(5)) * 1000
    tensors = [(values[row] if dtype.is_floating_point else values[row].round()).to(dtype) for row in range(3)]
    if dtype == torch.bool:
        tensors = [values[row] > 0 for row in range(3)]
    mean, reference = WeightedMean(32_000), WeightedMean(32_000)
    for weight, tensor in zip([3, 600, 17], tensors):
        mean.add({"x": tensor}, weight)
        reference.add({"x": tensor.to(torch.float64)}, weight)
    assert torch.equal(mean.result()["x"], reference.result()["x"])


def test_non_contiguous_tensors_and_parameters_fold_like_their_contiguous_values():
    generator = torch.Generator().manual_seed(6)
    matrices = [torch.randn(300, 500, generator=generator) for _ in range(2)]
    mean, reference = WeightedMean(32_000), WeightedMean(32_000)
    mean.add({"w": matrices[0].t()}, 2)                                     # a transposed view
    mean.add({"w": torch.nn.Parameter(matrices[1].t().contiguous())}, 5)  # requires grad
    reference.add({"w": matrices[0].t().contiguous()}, 2)
    reference.add({"w": matrices[1].t().contiguous()}, 5)
    assert torch.equal(mean.result()["w"], reference.result()["w"])


READ_ONLY_CACHE_CHECK = """
import numba.core.caching, torch
from fedpart.server.policy.aggregation import WeightedMean, _fold_elements
mean = WeightedMean()
mean.add({"x": torch.tensor([1.0, 2.0])}, 3)
mean.add({"x": torch.tensor([2.0, 4.0])}, 1)
print("cache:", type(_fold_elements.compiled()._cache).__name__, "mean:", mean.result()["x"].tolist())
"""


def test_the_fold_compiles_in_its_process_where_no_cache_directory_can_be_written(tmp_path):
    # Numba refuses cache=True when no cache directory is writable (a read-only install and a
    # read-only home); made real with a mount namespace in which both are mounted read-only.
    if shutil.which("unshare") is None:
        pytest.skip("the unshare command (util-linux) is not installed")
    home = tmp_path / "home"
    home.mkdir()
    read_only = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && '
                 'mount --bind "$2" "$2" && mount -o remount,bind,ro "$2" && exec "$3" -c "$4"')
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home))
    run = subprocess.run(["unshare", "--mount", "sh", "-c", read_only, "sh", str(Path(aggregation.__file__).parent),
                          str(home), sys.executable, READ_ONLY_CACHE_CHECK],
                         env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and not run.stdout and ("unshare:" in run.stderr or "mount:" in run.stderr):
        pytest.skip(f"mount namespaces are not permitted here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["cache:", "NullCache", "mean:", "[1.25,", "2.5]"]


def test_weighted_mean_keeps_no_reference_to_the_tensors_it_folded():
    staging = {"w": torch.tensor([1.0, 2.0])}
    mean = WeightedMean()
    mean.add(staging, 1)
    staging["w"].copy_(torch.tensor([3.0, 6.0]))             # a reused staging buffer
    mean.add(staging, 1)
    staging["w"].fill_(1e9)
    assert torch.equal(mean.result()["w"], torch.tensor([2.0, 4.0], dtype=torch.float64))


def test_apply_deltas_by_hand():
    old = {"w": torch.tensor([1.0, 2.0, -4.0]), "untouched": torch.tensor([9.0])}
    delta = {"w": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)}
    full = apply_deltas(old, delta, 1.0)
    assert set(full) == {"w"}
    assert full["w"].dtype == torch.float32
    assert torch.equal(full["w"], torch.tensor([1.5, 1.0, -2.0]))
    half = apply_deltas(old, delta, 0.5)
    assert torch.equal(half["w"], torch.tensor([1.25, 1.5, -3.0]))
    # The old state is not modified in place.
    assert torch.equal(old["w"], torch.tensor([1.0, 2.0, -4.0]))


def test_apply_deltas_keeps_dtype_of_the_global_tensor():
    old = {"h": torch.tensor([1.0, 2.0], dtype=torch.float16), "d": torch.tensor([1.0], dtype=torch.float64)}
    new = apply_deltas(old, {"h": torch.tensor([0.25, 0.5], dtype=torch.float64),
                             "d": torch.tensor([1e-12], dtype=torch.float64)}, 2.0)
    assert new["h"].dtype == torch.float16 and new["h"].tolist() == [1.5, 3.0]
    assert new["d"].dtype == torch.float64 and new["d"].item() == 1.0 + 2e-12


def test_head_dictionary_latest_copy_per_client_weighted():
    heads = HeadDictionary()
    source = {"head.weight": torch.tensor([1.0, 1.0]), "head.bias": torch.tensor([0.0])}
    heads.store(1, source, 1)
    source["head.weight"].fill_(100.0)  # stored copies are independent of the caller's tensors
    heads.store(2, {"head.weight": torch.tensor([3.0, 3.0]), "head.bias": torch.tensor([4.0])}, 1)
    mean = heads.combine(WeightedMean())
    assert torch.equal(mean["head.weight"], torch.tensor([2.0, 2.0], dtype=torch.float64))
    assert torch.equal(mean["head.bias"], torch.tensor([2.0], dtype=torch.float64))
    # Client 1 uploads again: its old copy is replaced, not added.
    heads.store(1, {"head.weight": torch.tensor([5.0, 5.0]), "head.bias": torch.tensor([8.0])}, 3)
    assert len(heads) == 2
    mean = heads.combine(WeightedMean())
    assert torch.equal(mean["head.weight"], torch.tensor([4.5, 4.5], dtype=torch.float64))  # (15 + 3) / 4
    assert torch.equal(mean["head.bias"], torch.tensor([7.0], dtype=torch.float64))         # (24 + 4) / 4


def test_head_dictionary_mean_independent_of_store_order():
    gen = torch.Generator().manual_seed(3)
    entries = [(cid, {"head.weight": torch.randn(50, generator=gen)}, float(cid + 1)) for cid in range(6)]
    means = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4]):
        heads = HeadDictionary()
        for index in order:
            heads.store(*entries[index])
        means.append(heads.combine(WeightedMean())["head.weight"])
    assert torch.equal(means[0], means[1])


def test_head_dictionary_empty_mean():
    assert HeadDictionary().combine(WeightedMean()) == {}


def test_head_dictionary_non_positive_weight_fails_at_mean():
    heads = HeadDictionary()
    heads.store(1, {"head.bias": torch.ones(1)}, 1)
    try:
        heads.store(2, {"head.bias": torch.ones(1)}, 0)
    except ValueError:
        return  # rejected at store time (preferred)
    with pytest.raises(ValueError):
        heads.combine(WeightedMean())


@pytest.mark.parametrize("weight", [0, -2.0])
def test_head_dictionary_store_rejects_non_positive_weight(weight):
    heads = HeadDictionary()
    with pytest.raises(ValueError):
        heads.store(1, {"head.bias": torch.ones(1)}, weight)


def test_weights_are_exact_for_large_sample_counts():
    # float32 deltas times integer weights up to 2**29 are exact in float64; mean of identical
    # deltas must reproduce the delta exactly.
    delta = torch.tensor([0.1, -3.3, 1e-30], dtype=torch.float32)
    mean = WeightedMean()
    for weight in (1, 2**29 - 1, 12345):
        mean.add({"x": delta}, weight)
    assert torch.equal(mean.result()["x"].to(torch.float32), delta)
    assert math.isclose(mean.result()["x"][0].item(), float(delta[0]), rel_tol=0, abs_tol=0)


def test_coordinate_median_by_hand():
    median = CoordinateMedian()
    for w, b in (([1.0, -5.0], 7.0), ([100.0, 2.0], -1.0), ([3.0, 0.5], 2.0)):
        median.add({"w": torch.tensor(w), "b": torch.tensor([b])}, 1)
    got = median.result()
    assert got["w"].dtype == torch.float64
    assert got["w"].tolist() == [3.0, 0.5]   # per coordinate: {1, 100, 3} -> 3, {-5, 2, 0.5} -> 0.5
    assert got["b"].tolist() == [2.0]
    median.add({"w": torch.tensor([4.0, 1e30]), "b": torch.tensor([3.0])}, 1)
    got = median.result()                   # an even count: mean of the two middle values
    assert got["w"].tolist() == [3.5, 1.25]  # {1, 3, 4, 100}, {-5, 0.5, 2, 1e30}
    assert got["b"].tolist() == [2.5]        # {-1, 2, 3, 7}


def test_coordinate_median_ignores_weights_and_tensors_a_result_did_not_send():
    median = CoordinateMedian()
    median.add({"w": torch.tensor([1.0]), "b": torch.tensor([10.0])}, 1)
    median.add({"w": torch.tensor([2.0])}, 2**62)   # a claimed sample count does not buy influence
    median.add({"w": torch.tensor([9.0]), "b": torch.tensor([20.0])}, 1)
    got = median.result()
    assert got["w"].tolist() == [2.0]
    assert got["b"].tolist() == [15.0]               # over the two results that sent "b"


def test_trimmed_mean_by_hand():
    trimmed = CoordinateTrimmedMean(0.2)             # 5 values: drop 1 at each end
    for value in (1.0, -1e6, 3.0, 5.0, 1e6):
        trimmed.add({"x": torch.tensor([value, -value])}, 1)
    assert trimmed.result()["x"].tolist() == [3.0, -3.0]  # mean of {1, 3, 5}
    assert CoordinateTrimmedMean(0.2).trimmed(4) == 0     # floor(0.8)
    assert CoordinateTrimmedMean(0.29).trimmed(100) == 29  # exact, although 0.29 * 100 < 29 in floats
    untrimmed = CoordinateTrimmedMean(0.0)
    for value in (1.0, 2.0, 6.0):
        untrimmed.add({"x": torch.tensor([value])}, 1)
    assert untrimmed.result()["x"].tolist() == [3.0]


@pytest.mark.parametrize("fraction", [-0.1, 0.5, 0.7])
def test_trimmed_mean_rejects_a_fraction_outside_its_range(fraction):
    with pytest.raises(ValueError, match="trim fraction"):
        CoordinateTrimmedMean(fraction)


@pytest.mark.parametrize("make", [CoordinateMedian, lambda: CoordinateTrimmedMean(0.2)],
                         ids=["median", "trimmed_mean"])
def test_robust_aggregators_do_not_depend_on_arrival_order(make):
    deltas, weights, old = _random_round(0, clients=9, size=10_000)
    old["b"][0, 0] = -0.0                           # old + (-0.0) and old + 0.0 differ in their bits
    for client in range(9):                         # sorting leaves tied signed zeros in arrival order
        deltas[client]["b"][0, 0] = -0.0 if client % 3 else 0.0
    rng = np.random.default_rng(2)
    results = []
    for order in [list(range(9)), list(range(8, -1, -1))] + [rng.permutation(9).tolist() for _ in range(3)]:
        aggregator = make()
        for client in order:
            aggregator.add(deltas[client], weights[client])
        results.append(apply_deltas(old, aggregator.result(), 1.0))
    for result in results[1:]:
        for name in old:
            assert torch.equal(result[name].view(torch.int32), results[0][name].view(torch.int32))


@pytest.mark.parametrize("make", [CoordinateMedian, lambda: CoordinateTrimmedMean(0.2)],
                         ids=["median", "trimmed_mean"])
def test_robust_aggregators_take_results_from_several_threads(make):
    deltas, weights, _ = _random_round(0, clients=12, size=2_000)
    results = list(zip(deltas, weights))
    sequential = make()
    for tensors, weight in results:
        sequential.add(tensors, weight)
    expected = sequential.result()
    concurrent = make()
    _fold_from_threads(concurrent, results, threads=4, seed=5)
    got = concurrent.result()
    assert all(torch.equal(got[name].view(torch.int64), expected[name].view(torch.int64)) for name in expected)


def test_robust_aggregators_keep_copies_not_the_callers_buffers():
    median = CoordinateMedian()
    staging = {"w": torch.tensor([1.0])}
    for value in (1.0, 5.0, 2.0):
        staging["w"].fill_(value)                            # one reused staging buffer
        median.add(staging, 1)
    assert median.result()["w"].tolist() == [2.0]


def test_head_dictionary_combines_with_a_robust_aggregator():
    heads = HeadDictionary()
    for client, value in enumerate((1.0, 2.0, 1e9)):
        heads.store(client, {"head.bias": torch.tensor([value])}, 1)
    assert heads.combine(CoordinateMedian())["head.bias"].tolist() == [2.0]


def test_the_torch_fold_gives_the_compiled_folds_bits():
    generator = np.random.default_rng(8)
    for dtype in (np.float32, np.float64):
        value = generator.standard_normal(70_000) * 1e3
        error = generator.standard_normal(70_000) * 1e-13
        source = (generator.standard_normal(70_000) * 1e-2).astype(dtype)
        results = []
        for fold in (aggregation._fold_elements.compiled(), aggregation._torch_two_sum_fold):
            total, carried = np.empty_like(value), error.copy()
            fold(value.copy(), total, carried, source, 600.0)
            results.append((total, carried))
        assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def test_a_first_fold_gives_the_bits_of_a_fold_into_zeros():
    generator = np.random.default_rng(9)
    for dtype in (np.float32, np.float64):
        source = (generator.standard_normal(70_000) * 1e-2).astype(dtype)
        source[:4] = [-0.0, 0.0, np.nan, -np.inf]            # signed zeros come out as a fold from +0.0 makes them
        zeroed = []
        for fold in (aggregation._fold_elements.compiled(), aggregation._torch_two_sum_fold):
            total, error = np.empty(70_000), np.zeros(70_000)
            fold(np.zeros(70_000), total, error, source, 600.0)
            zeroed.append((total, error))
        for first in (aggregation._first_fold_elements.compiled(), aggregation._torch_two_sum_first):
            total, error = np.full(70_000, 7.0), np.full(70_000, 3.0)  # whatever the rows held before
            first(np.full(70_000, 5.0), total, error, source, 600.0)
            for expected_total, expected_error in zeroed:
                assert total.tobytes() == expected_total.tobytes() and error.tobytes() == expected_error.tobytes()


def test_a_sum_that_nothing_was_folded_into_is_zero():
    assert torch.equal(CompensatedSum((5,), block_elements=2).result(), torch.zeros(5, dtype=torch.float64))


WITHOUT_NUMBA = """
import sys
sys.modules["numba"] = None  # as on a machine without the server extra: import numba raises ImportError
import torch
from fedpart.server.policy import aggregation
assert aggregation._fold_elements.compiled() is aggregation._torch_two_sum_fold
assert aggregation._first_fold_elements.compiled() is aggregation._torch_two_sum_first
mean = aggregation.WeightedMean(32_000)
generator = torch.Generator().manual_seed(9)
for weight in (3, 600, 17):
    mean.add({"x": torch.randn(70_000, generator=generator)}, weight)
torch.save(mean.result()["x"], sys.argv[1])
"""


SMALL_TENSORS = """
import sys, torch
from fedpart.server.policy.aggregation import COMPILED_FROM_ELEMENTS, WeightedMean, _fold_elements, prepare_kernels
mean = WeightedMean()
mean.add({"x": torch.ones(COMPILED_FROM_ELEMENTS - 1)}, 2)
mean.add({"x": torch.ones(COMPILED_FROM_ELEMENTS - 1)}, 3)
prepare_kernels(COMPILED_FROM_ELEMENTS - 1)
print("numba" in sys.modules, mean.result()["x"][0].item())
prepare_kernels(COMPILED_FROM_ELEMENTS)
print("numba" in sys.modules, _fold_elements.for_elements(1) is _fold_elements.compiled() is not _fold_elements.fallback)
"""


def test_numba_starts_only_for_a_tensor_large_enough_for_it_to_pay():
    """A server whose tensors are all smaller than COMPILED_FROM_ELEMENTS folds with the torch
    loops (the same bits) and never starts Numba; a larger tensor, or a server started with
    one, compiles the loops, which then take every call."""
    run = subprocess.run([sys.executable, "-c", SMALL_TENSORS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "1.0", "True", "True"]


def test_without_numba_the_server_folds_the_same_bits(tmp_path):
    out = tmp_path / "mean.pt"
    run = subprocess.run([sys.executable, "-c", WITHOUT_NUMBA, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    mean = WeightedMean(32_000)
    generator = torch.Generator().manual_seed(9)
    for weight in (3, 600, 17):
        mean.add({"x": torch.randn(70_000, generator=generator)}, weight)
    assert torch.equal(torch.load(out), mean.result()["x"])
