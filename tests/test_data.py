"""Dataset loaders: embedded digits, real MNIST, and the on-disk formats on tiny fake copies."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from fedpart.common.data.datasets import (
    DATASET_NAMES,
    RestrictedUnpickler,
    class_counts,
    dataset_spec,
    load_dataset,
    missing_dataset_files,
)
from fedpart.common.data.types import ArrayDataset

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# ----------------------------------------------------------------------------------------- digits


def test_digits_shapes_split_and_scale() -> None:
    ds = load_dataset("digits", None)
    assert ds.name == "digits" and ds.num_classes == 10
    assert ds.x_train.shape == (1438, 1, 8, 8) and ds.x_test.shape == (359, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.scale == pytest.approx(1 / 16) and ds.mean is None
    assert ds.x_train.min() == 0 and ds.x_train.max() == 16
    # stratified 20% test split: every class has about a fifth of its samples in the test set
    train_counts = np.bincount(ds.y_train, minlength=10)
    test_counts = np.bincount(ds.y_test, minlength=10)
    assert np.all(np.abs(test_counts / (train_counts + test_counts) - 0.2) < 0.01)
    features = ds.features(ds.x_test)
    assert features.shape == (359, 1, 8, 8) and 0.0 <= features.min() and features.max() <= 1.0


def test_digits_split_is_fixed() -> None:
    a, b = load_dataset("digits", None), load_dataset("digits", None)
    assert np.array_equal(a.y_train, b.y_train) and np.array_equal(a.x_test, b.x_test)


def test_shipped_digits_are_scikit_learns() -> None:
    # scikit-learn is a test requirement only: the package ships the arrays, in its order
    from sklearn.datasets import load_digits

    from fedpart.common.data import datasets

    reference = load_digits()
    with np.load(Path(datasets.__file__).with_name(datasets.DIGITS_FILE)) as shipped:
        assert np.array_equal(shipped["images"], reference.images)
        assert np.array_equal(shipped["labels"], reference.target)


def test_digits_rejects_options() -> None:
    with pytest.raises(ValueError, match="normalize"):
        load_dataset("digits", None, normalize=True)


# ------------------------------------------------------------------------------------------ MNIST


def test_real_mnist() -> None:
    if not (SHARED_DATA / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"no MNIST copy under {SHARED_DATA}")
    ds = load_dataset("mnist", str(SHARED_DATA))
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64
    assert set(np.unique(ds.y_train)) == set(range(10)) == set(np.unique(ds.y_test))
    assert ds.y_train[:5].tolist() == [5, 0, 4, 1, 9]
    assert ds.mean is None and ds.scale == pytest.approx(1 / 255)
    features = ds.features(ds.x_train[:256])
    assert features.dtype.is_floating_point
    assert float(features.min()) == 0.0 and float(features.max()) == 1.0
    assert load_dataset("mnist", SHARED_DATA, normalize=True).mean == pytest.approx((0.1307,))


def _idx(array: np.ndarray) -> bytes:
    return struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()


def _write_fake_mnist(root: Path, n_train: int = 6, n_test: int = 4) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(images)))
        (raw / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(_idx(np.arange(n) % 10)))
    return raw


def test_fake_mnist_loads(tmp_path: Path) -> None:
    _write_fake_mnist(tmp_path)
    ds = load_dataset("mnist", tmp_path)
    assert ds.x_train.shape == (6, 1, 28, 28) and ds.x_test.shape == (4, 1, 28, 28)
    assert ds.y_test.tolist() == [0, 1, 2, 3]
    assert ds.x_train.flags.writeable


def test_mnist_missing_file_names_path_and_root(tmp_path: Path) -> None:
    raw = _write_fake_mnist(tmp_path)
    missing = raw / "t10k-labels-idx1-ubyte.gz"
    missing.unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("mnist", str(tmp_path))
    assert str(missing) in str(info.value) and "data.root" in str(info.value)


def test_mnist_needs_root() -> None:
    with pytest.raises(ValueError, match="data.root must be set"):
        load_dataset("mnist", None)


@pytest.mark.parametrize("corruption", ["truncated_gzip", "bad_magic", "bad_dtype", "wrong_size",
                                        "not_gzip"])
def test_mnist_corrupt_file_names_it(tmp_path: Path, corruption: str) -> None:
    raw = _write_fake_mnist(tmp_path)
    target = raw / "train-images-idx3-ubyte.gz"
    payload = gzip.decompress(target.read_bytes())
    if corruption == "truncated_gzip":
        data = target.read_bytes()[:-20]
    elif corruption == "bad_magic":
        data = gzip.compress(b"\x12\x34" + payload[2:])
    elif corruption == "bad_dtype":
        data = gzip.compress(payload[:2] + b"\x0d" + payload[3:])
    elif corruption == "wrong_size":
        data = gzip.compress(payload[:-1])
    else:
        data = payload
    target.write_bytes(data)
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz"):
        load_dataset("mnist", tmp_path)


def test_mnist_image_label_count_mismatch(tmp_path: Path) -> None:
    raw = _write_fake_mnist(tmp_path)
    (raw / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(np.zeros(5))))
    with pytest.raises(ValueError, match="5 labels"):
        load_dataset("mnist", tmp_path)


# ------------------------------------------------------------------------------------------ CIFAR


def _batch(n: int, label_key: str, num_classes: int, seed: int, str_keys: bool = False) -> bytes:
    rng = np.random.default_rng(seed)
    batch = {b"batch_label": b"fake batch",
             b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             label_key.encode(): [int(v) for v in rng.integers(0, num_classes, n)],
             b"filenames": [b"img%d.png" % i for i in range(n)]}
    if str_keys:
        batch = {k.decode(): v for k, v in batch.items()}
    return pickle.dumps(batch, protocol=2)  # the CIFAR files are protocol-2 pickles


def _write_fake_cifar10(root: Path, legacy_numpy_path: bool = False) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(_batch(4, "labels", 10, seed=i))
    test = _batch(3, "labels", 10, seed=0)
    if legacy_numpy_path:  # the published files name numpy 1.x's module path
        test = test.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (folder / "test_batch").write_bytes(test)
    return folder


def test_fake_cifar10_loads(tmp_path: Path) -> None:
    folder = _write_fake_cifar10(tmp_path, legacy_numpy_path=True)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64 and ds.num_classes == 10
    first = pickle.loads((folder / "data_batch_1").read_bytes(), encoding="bytes")  # our own file
    assert np.array_equal(ds.x_train[0], first[b"data"][0].reshape(3, 32, 32))
    assert ds.y_train[:4].tolist() == first[b"labels"]
    assert ds.scale == pytest.approx(1 / 255) and ds.mean == pytest.approx((0.4914, 0.4822, 0.4465))
    assert ds.features(ds.x_test).shape == (3, 3, 32, 32)
    plain = load_dataset("cifar10", tmp_path, normalize=False)
    assert plain.mean is None and plain.std is None


def test_fake_cifar100_fine_labels_and_str_keys(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(_batch(7, "fine_labels", 100, seed=1))
    (folder / "test").write_bytes(_batch(2, "fine_labels", 100, seed=2, str_keys=True))
    ds = load_dataset("cifar100", str(tmp_path))
    assert ds.x_train.shape == (7, 3, 32, 32) and ds.x_test.shape == (2, 3, 32, 32)
    assert ds.num_classes == 100 and ds.mean == pytest.approx((0.5071, 0.4865, 0.4409))
    expected = pickle.loads((folder / "test").read_bytes())["fine_labels"]  # our own file
    assert ds.y_test.tolist() == expected


def test_cifar_missing_batch_names_path(tmp_path: Path) -> None:
    folder = _write_fake_cifar10(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3") as info:
        load_dataset("cifar10", tmp_path)
    assert "data.root" in str(info.value)


@pytest.mark.parametrize("content", [b"definitely not a pickle", "truncated", "wrong_shape",
                                     "not_a_dict"])
def test_cifar_bad_pickle_names_file(tmp_path: Path, content: bytes | str) -> None:
    folder = _write_fake_cifar10(tmp_path)
    if content == "truncated":
        content = (folder / "test_batch").read_bytes()[:100]
    elif content == "wrong_shape":
        content = pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]},
                               protocol=2)
    elif content == "not_a_dict":
        content = pickle.dumps([1, 2, 3], protocol=2)
    (folder / "test_batch").write_bytes(content)
    with pytest.raises(ValueError, match="test_batch"):
        load_dataset("cifar10", tmp_path)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    payload = pickle.dumps({b"data": _Exploit(marker)}, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        RestrictedUnpickler(io.BytesIO(payload), encoding="bytes").load()
    folder = _write_fake_cifar10(tmp_path / "root")
    (folder / "data_batch_2").write_bytes(payload)
    with pytest.raises(ValueError, match="data_batch_2.*system"):
        load_dataset("cifar10", tmp_path / "root")
    assert not marker.exists()


# ---------------------------------------------------------------------------------- Tiny-ImageNet


def test_fake_tiny_imagenet(tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    folder = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01"]  # file order differs from the sorted class order
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
    colors = {"n01": (250, 0, 0), "n02": (0, 0, 250)}
    for wnid in wnids:
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        for i in range(2):
            image_module.new("RGB", (64, 64), colors[wnid]).save(images / f"{wnid}_{i}.JPEG")
    image_module.new("L", (64, 64), 128).save(folder / "val" / "images" / "val_0.JPEG")
    image_module.new("RGB", (64, 64), colors["n02"]).save(folder / "val" / "images" / "val_1.JPEG")
    (folder / "val" / "val_annotations.txt").write_text(
        "val_0.JPEG\tn01\t0\t0\t63\t63\nval_1.JPEG\tn02\t0\t0\t63\t63\n")

    ds = load_dataset("tiny-imagenet", tmp_path)
    assert ds.x_train.shape == (4, 3, 64, 64) and ds.x_test.shape == (2, 3, 64, 64)
    assert ds.x_train.dtype == np.uint8 and ds.num_classes == 2
    assert ds.y_train.tolist() == [0, 0, 1, 1] and ds.y_test.tolist() == [0, 1]
    red = ds.x_train[0].reshape(3, -1).mean(axis=1)
    assert red[0] > 200 and red[2] < 50
    assert np.all(np.abs(ds.x_test[0].astype(int) - 128) <= 2)  # grayscale converted to RGB

    (folder / "val" / "images" / "val_1.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="val_1.JPEG"):
        load_dataset("tiny-imagenet", tmp_path)


# ----------------------------------------------------------------------------------------- custom


def test_custom_dataset_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_fake_datasets.py").write_text(
        "import numpy as np\n"
        "from fedpart.common.data.types import ArrayDataset\n"
        "def make(root, size):\n"
        "    x = np.zeros((size, 2), np.float32)\n"
        "    y = np.arange(size) % 2\n"
        "    return ArrayDataset('fake:' + str(root), x, y, x, y, 2)\n"
        "def wrong(root):\n"
        "    return {'x': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ds = load_dataset("my_fake_datasets:make", "/data", size=3)
    assert isinstance(ds, ArrayDataset) and ds.name == "fake:/data" and ds.x_train.shape == (3, 2)
    with pytest.raises(TypeError, match="my_fake_datasets:wrong.*ArrayDataset"):
        load_dataset("my_fake_datasets:wrong", None)
    with pytest.raises(ImportError, match="no_such_module_xyz:make"):
        load_dataset("no_such_module_xyz:make", None)
    with pytest.raises(ImportError, match="my_fake_datasets:missing"):
        load_dataset("my_fake_datasets:missing", None)
    sys.modules.pop("my_fake_datasets", None)


# ---------------------------------------------------------------------------------------- subsets


def test_subset_is_stratified_exact_and_fixed() -> None:
    full = load_dataset("digits", None)
    ds = load_dataset("digits", None, train_samples=500, test_samples=101)
    assert len(ds.y_train) == 500 and len(ds.y_test) == 101 and ds.scale == full.scale
    for subset, whole in ((ds.y_train, full.y_train), (ds.y_test, full.y_test)):
        share = np.bincount(whole, minlength=10) * len(subset) / len(whole)
        assert np.all(np.abs(np.bincount(subset, minlength=10) - share) < 1)  # each class keeps its share
    # the kept samples are samples of the split, in file order: each row is found at increasing positions
    rows = [int(np.flatnonzero((full.x_train == x).all(axis=(1, 2, 3)) & (full.y_train == y))[0])
            for x, y in zip(ds.x_train, ds.y_train)]
    assert rows == sorted(rows) and len(set(rows)) == 500
    again = load_dataset("digits", None, train_samples=500, test_samples=101)
    assert np.array_equal(ds.x_train, again.x_train) and np.array_equal(ds.y_test, again.y_test)
    whole_test = load_dataset("digits", None, train_samples=500)
    assert np.array_equal(whole_test.y_test, full.y_test)  # a split without a size is kept whole


def test_subset_class_counts_are_known_without_the_data() -> None:
    """What the config check cuts partitions from is what a subset really holds."""
    options = {"train_samples": 500, "test_samples": 101}
    ds = load_dataset("digits", None, **options)
    train, test = class_counts("digits", options)
    assert train == tuple(np.bincount(ds.y_train)) and test == tuple(np.bincount(ds.y_test))
    assert class_counts("digits", {}) == dataset_spec("digits").class_counts


def test_subset_sizes_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train_samples must be an integer in 1\.\.1438"):
        load_dataset("digits", None, train_samples=1439)
    for bad in (0, -3, 2.5, True, "10"):
        with pytest.raises(ValueError, match="test_samples( must be a positive integer|: expected an integer)"):
            load_dataset("digits", None, test_samples=bad)
    _write_fake_mnist(tmp_path, n_train=20, n_test=10)
    ds = load_dataset("mnist", tmp_path, train_samples=10, test_samples=5, normalize=True)
    assert ds.x_train.shape == (10, 1, 28, 28) and sorted(ds.y_train.tolist()) == list(range(10))
    assert ds.x_test.shape == (5, 1, 28, 28) and ds.mean is not None


def test_unknown_dataset_and_option() -> None:
    with pytest.raises(ValueError) as info:
        load_dataset("imagenet", "/data")
    assert all(name in str(info.value) for name in DATASET_NAMES)
    with pytest.raises(ValueError, match="colour"):
        load_dataset("mnist", "/data", colour=True)
    with pytest.raises(ValueError, match="normalize.*true or false"):
        load_dataset("cifar10", "/data", normalize="no")


# ------------------------------------------------------------------- what is known without the data


@pytest.mark.parametrize("name", ["digits", "mnist"])
def test_class_counts_are_those_of_the_files(name: str) -> None:
    """The samples per class a partition is checked against, before any data is read."""
    root = SHARED_DATA if name == "mnist" else None
    if name == "mnist" and not (SHARED_DATA / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"no MNIST copy under {SHARED_DATA}")
    ds = load_dataset(name, root)
    train, test = dataset_spec(name).class_counts
    assert tuple(np.bincount(ds.y_train, minlength=ds.num_classes)) == train
    assert tuple(np.bincount(ds.y_test, minlength=ds.num_classes)) == test


def test_every_builtin_dataset_has_its_facts() -> None:
    for name in DATASET_NAMES:
        spec = dataset_spec(name)
        train, test = spec.class_counts
        assert len(train) == len(test) == spec.num_classes and len(spec.input_shape) == 3, name
        assert bool(spec.files) == (name != "digits"), name  # digits ships in the package


def test_missing_files_are_listed_per_split(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (raw / name).write_bytes(b"")
    assert missing_dataset_files("mnist", tmp_path, ("test",)) == []
    assert missing_dataset_files("mnist", tmp_path) == [raw / "train-images-idx3-ubyte.gz",
                                                         raw / "train-labels-idx1-ubyte.gz"]
