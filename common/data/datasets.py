"""Dataset loaders: the embedded digits set and real datasets in their standard on-disk formats.

Every loader returns an :class:`~fedpart.common.data.types.ArrayDataset` whose images keep their
stored dtype (``uint8`` stays ``uint8``); scaling and per-channel normalisation happen in
``ArrayDataset.features`` when a client slices its partition.

Each built-in dataset is one :class:`DatasetSpec` (files, input shape, samples per class,
normalisation, reader) registered in :data:`fedpart.common.components.registry.DATASETS`: a new dataset is one
spec. The names (:data:`DATASET_NAMES`) and the files read under the data root (``data.root``):

- ``digits``: the 8x8 digits scikit-learn bundles, shipped in this package (no root needed).
- ``mnist``: ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` (gzipped IDX).
- ``cifar10``: ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch`` (python pickles).
- ``cifar100``: ``cifar-100-python/train`` and ``test`` (python pickles, fine labels).
- ``tiny-imagenet``: ``tiny-imagenet-200/`` (JPEG folders; the ``val`` split is the test split).
- ``package.module:function``: a custom loader called as ``function(root=root, **options)``.

Every built-in dataset also takes ``train_samples`` / ``test_samples``: keep only that many
samples of the split, a class-stratified subset drawn with the fixed seed :data:`SUBSET_SEED` (part
of the dataset, like the digits split, so every run and process sees the same subset), for runs
sized to a small machine.

CIFAR pickles are read with :class:`RestrictedUnpickler`, which only resolves the globals numpy
arrays need, so a tampered file cannot run code.
"""

from __future__ import annotations

import codecs
import gzip
import os
import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedpart.common.components.importing import import_callable
from fedpart.common.components.registry import DATASETS, Option, at_least_one
from fedpart.common.data.types import ArrayDataset

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct

DIGITS_TEST_FRACTION = 0.2
DIGITS_FILE = "digits.npz"  # images (uint8, 1797 x 8 x 8) and labels (uint8), in scikit-learn's order
# Fixed seed of the digits train/test split: the split is part of the dataset, not of a run.
DIGITS_SPLIT_SEED = 0
# Fixed seed of the ``train_samples`` / ``test_samples`` subsets (part of the dataset, not of a run).
SUBSET_SEED = 0
SUBSET_OPTIONS = ("train_samples", "test_samples")

_IDX_UINT8 = 0x08

Root = str | os.PathLike[str]


Stats = tuple[tuple[float, ...], tuple[float, ...]]  # per-channel (mean, std) after scaling to [0, 1]


@dataclass(frozen=True)
class DatasetSpec:
    """What fedpart knows of a built-in dataset without reading it, and how it reads it.

    ``files``: what it reads under the data root, per split (a folder where it reads one; empty:
    shipped in this package, no root needed). ``class_counts``: samples per class (train, test),
    what a partition is checked against before any data is read (tests/test_data.py checks them
    against the files). ``normalization``: per-channel statistics that the ``normalize`` option
    applies (None: no such option), on by ``normalize_default``. ``read(spec, base, root,
    normalize)`` reads the files under ``base`` (the expanded ``root``)."""

    name: str
    description: str
    input_shape: tuple[int, ...]
    class_counts: tuple[tuple[int, ...], tuple[int, ...]]
    read: Callable[[DatasetSpec, Path | None, Root | None, bool], ArrayDataset]
    files: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    normalization: Stats | None = None
    normalize_default: bool = False

    @property
    def num_classes(self) -> int:
        return len(self.class_counts[0])

    def stats(self, normalize: bool) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """(mean, std) to normalise with, or (None, None)."""
        return self.normalization if normalize and self.normalization is not None else (None, None)

    def __call__(self, root: Root | None = None, normalize: bool | None = None, train_samples: int | None = None,
                 test_samples: int | None = None) -> ArrayDataset:
        """The dataset read under ``root``, normalised or not, subsets drawn (options checked)."""
        base = None
        if self.files:
            if root is None:
                raise ValueError(f"data.root must be set to load dataset {self.name!r}")
            base = Path(root).expanduser()
        chosen = self.normalize_default if normalize is None else normalize
        return stratified_subset(self.read(self, base, root, chosen), train_samples, test_samples)


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    """Register ``spec`` in :data:`~fedpart.common.components.registry.DATASETS` with its loader options."""
    options = tuple(Option(key, int, f"keep a class-stratified subset of this many {split} samples", at_least_one,
                           "must be a positive integer", None)
                    for key, split in zip(SUBSET_OPTIONS, ("training", "test")))
    if spec.normalization is not None:
        options += (Option("normalize", bool, "normalise each channel with the dataset's mean and std",
                           default=spec.normalize_default),)
    DATASETS.add(DATASETS.component(spec.name, spec.description, spec, *options))
    return spec


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of built-in dataset ``name`` (a ValueError naming the known ones otherwise)."""
    if name not in DATASETS.builtin():
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS.builtin())} "
                         "or a custom 'package.module:function'")
    return DATASETS.builtin()[name].build


def load_dataset(name: str, root: Root | None, **options: Any) -> ArrayDataset:
    """Load dataset ``name`` (see :data:`DATASET_NAMES`, or ``package.module:function``).

    ``root`` is the data root (the ``data.root`` setting); ``options`` are loader options:
    ``normalize`` (bool) where the spec has statistics; ``train_samples`` / ``test_samples`` (int)
    for every built-in dataset (see :func:`stratified_subset`); anything for a custom loader.
    """
    if ":" in name:
        return _load_custom(name, root, options)
    typed = DATASETS.read(name, options, "data.options.", "data.dataset")
    return DATASETS[name].build(root, **typed)


def stratified_subset(dataset: ArrayDataset, train_samples: int | None = None,
                      test_samples: int | None = None) -> ArrayDataset:
    """``dataset`` with only ``train_samples`` / ``test_samples`` samples of its splits (``None``:
    the whole split). Each class keeps its share (largest remainders, ties to the lower class),
    the samples of a class drawn with :data:`SUBSET_SEED`; the kept samples stay in file order."""
    rng = np.random.default_rng(SUBSET_SEED)
    x_train, y_train = _subset("train_samples", dataset.x_train, dataset.y_train, train_samples, rng)
    x_test, y_test = _subset("test_samples", dataset.x_test, dataset.y_test, test_samples, rng)
    return replace(dataset, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


def _subset(key: str, x: np.ndarray, y: np.ndarray, size: int | None,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if size is None:
        return x, y
    if y.dtype.kind not in "iu":
        raise ValueError(f"dataset option {key} needs integer class labels, the split has {y.dtype}")
    classes, counts = np.unique(y, return_counts=True)
    quota = _stratified_quota(key, counts, size)
    keep = np.sort(np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k]
                                   for c, k in zip(classes, quota)]))
    return x[keep], y[keep]


def _stratified_quota(key: str, counts: np.ndarray, size: int) -> np.ndarray:
    """Samples kept per class when a split with ``counts`` per class keeps ``size``: each class
    its share, the remainder to the largest fractional parts (ties to the lower class)."""
    total = int(np.sum(counts))
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= total:
        raise ValueError(f"dataset option {key} must be an integer in 1..{total} (the split's size), "
                         f"got {size!r}")
    exact = np.asarray(counts) * size / total
    quota = np.floor(exact).astype(np.int64)
    remainder = size - int(quota.sum())
    quota[np.argsort(-(exact - quota), kind="stable")[:remainder]] += 1
    return quota


def class_counts(name: str, options: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Samples per class (train, test) of built-in dataset ``name`` loaded with ``options``
    (after ``train_samples`` / ``test_samples``), without reading the data."""
    counts = dataset_spec(name).class_counts
    return tuple(tuple(int(k) for k in (split if options.get(key) is None
                                        else _stratified_quota(key, np.asarray(split), options[key])))
                 for key, split in zip(SUBSET_OPTIONS, counts))


def missing_dataset_files(name: str, root: Root, splits: tuple[str, ...] = ("train", "test")) -> list[Path]:
    """The files (or folders) of built-in dataset ``name``'s ``splits`` that are not under
    ``root``."""
    base = Path(root).expanduser()
    files = dataset_spec(name).files
    wanted = dict.fromkeys(f for split in splits for f in files.get(split, ()))
    return [base / f for f in wanted if not (base / f).exists()]


def _require(path: Path, root: Root) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found (data.root = {str(root)!r})")
    return path


# ----------------------------------------------------------------------------------------- digits


def _read_digits(spec: DatasetSpec, base: Path | None, root: Root | None, normalize: bool) -> ArrayDataset:
    """The 8x8 digits (1,797 samples, values 0..16; the test set of the UCI "Optical Recognition
    of Handwritten Digits" data, as scikit-learn bundles it) as float32 ``(N, 1, 8, 8)``, read from
    :data:`DIGITS_FILE` in this package, so no client needs scikit-learn.

    There is no official test split: 20% of every class goes to the test set, chosen by a
    permutation with the fixed seed :data:`DIGITS_SPLIT_SEED` (independent of any run seed), so
    every run and every process sees the same split. Both splits keep file order.
    """
    with np.load(Path(__file__).with_name(DIGITS_FILE)) as arrays:
        x = arrays["images"].astype(np.float32).reshape(-1, 1, 8, 8)
        y = arrays["labels"].astype(np.int64)
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    test_mask = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test_mask[members[: int(round(DIGITS_TEST_FRACTION * len(members)))]] = True
    return ArrayDataset(name=spec.name, x_train=x[~test_mask], y_train=y[~test_mask],
                        x_test=x[test_mask], y_test=y[test_mask], num_classes=spec.num_classes, scale=1.0 / 16)


register_dataset(DatasetSpec(
    "digits", "The 8x8 digits scikit-learn bundles (1,797 samples), shipped in this package.", (1, 8, 8),
    ((142, 146, 142, 146, 145, 146, 145, 143, 139, 144), (36, 36, 35, 37, 36, 36, 36, 36, 35, 36)), _read_digits))


# ------------------------------------------------------------------------------------------ MNIST


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """Parse a gzipped IDX file of unsigned bytes with ``ndim`` dimensions (LeCun's format)."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from exc
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes)")
    if data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: bad IDX magic number {data[:4].hex()}")
    if data[2] != _IDX_UINT8:
        raise ValueError(f"{path}: IDX dtype code 0x{data[2]:02x}, expected 0x08 (unsigned byte)")
    if data[3] != ndim:
        raise ValueError(f"{path}: IDX file has {data[3]} dimensions, expected {ndim}")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims))
    if len(data) != expected:
        raise ValueError(f"{path}: IDX size mismatch: header dims {dims} need {expected} bytes, "
                         f"file has {len(data)}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims).copy()  # writable


def _mnist_split(spec: DatasetSpec, base: Path, root: Root, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_path, labels_path = (_require(base / f, root) for f in spec.files[split])
    images = _read_idx(images_path, 3)
    labels = _read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} holds "
                         f"{len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} out of range 0..9")
    return images[:, None, :, :], labels.astype(np.int64)


def _read_mnist(spec: DatasetSpec, base: Path, root: Root, normalize: bool) -> ArrayDataset:
    """MNIST from the gzipped IDX files: uint8 ``(N, 1, 28, 28)``, scale 1/255."""
    x_train, y_train = _mnist_split(spec, base, root, "train")
    x_test, y_test = _mnist_split(spec, base, root, "test")
    mean, std = spec.stats(normalize)
    return ArrayDataset(name=spec.name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                        num_classes=spec.num_classes, scale=1.0 / 255, mean=mean, std=std)


register_dataset(DatasetSpec(
    "mnist", "MNIST handwritten digits, from the gzipped IDX files.", (1, 28, 28),
    ((5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
     (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)), _read_mnist,
    {"train": ("MNIST/raw/train-images-idx3-ubyte.gz", "MNIST/raw/train-labels-idx1-ubyte.gz"),
     "test": ("MNIST/raw/t10k-images-idx3-ubyte.gz", "MNIST/raw/t10k-labels-idx1-ubyte.gz")},
    ((0.1307,), (0.3081,))))


# ------------------------------------------------------------------------------------------ CIFAR


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals the CIFAR python pickles need.

    Those pickles hold dicts of bytes, lists and numpy arrays; reconstructing the arrays needs
    ``numpy.core.multiarray._reconstruct`` (``numpy._core`` in numpy 2), ``numpy.ndarray``,
    ``numpy.dtype`` and, for pickles written by Python 3 at protocol 2, ``_codecs.encode``. Any
    other global raises :class:`pickle.UnpicklingError` before it is resolved.
    """

    _ALLOWED: dict[tuple[str, str], Any] = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"global {module}.{name} is not allowed in a dataset pickle") from None


def _unpickle(path: Path) -> dict[Any, Any]:
    """Load a CIFAR pickle with :class:`RestrictedUnpickler`; ``ValueError`` naming a bad file."""
    try:
        with open(path, "rb") as f:
            obj = RestrictedUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, OverflowError, MemoryError) as exc:
        raise ValueError(f"{path}: not a valid dataset pickle ({exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    return obj


def _field(batch: dict[Any, Any], key: str, path: Path) -> Any:
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise ValueError(f"{path}: missing field {key!r}")


def _cifar_batch(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle(path)
    data = _field(batch, "data", path)
    labels = np.asarray(_field(batch, label_key, path))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: 'data' must be a uint8 array of shape (n, 3072)")
    if labels.shape != (len(data),) or labels.dtype.kind not in "iu":
        raise ValueError(f"{path}: {label_key!r} must hold {len(data)} integer labels")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{path}: labels out of range 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _cifar_reader(label_key: str) -> Callable[[DatasetSpec, Path, Root, bool], ArrayDataset]:
    """A reader of the CIFAR python pickles with labels under ``label_key``: uint8
    ``(N, 3, 32, 32)``, scale 1/255."""
    def read(spec: DatasetSpec, base: Path, root: Root, normalize: bool) -> ArrayDataset:
        train_files = [_require(base / f, root) for f in spec.files["train"]]
        test_file = _require(base / spec.files["test"][0], root)
        parts = [_cifar_batch(p, label_key, spec.num_classes) for p in train_files]
        x_test, y_test = _cifar_batch(test_file, label_key, spec.num_classes)
        mean, std = spec.stats(normalize)
        return ArrayDataset(name=spec.name, x_train=np.concatenate([x for x, _ in parts]),
                            y_train=np.concatenate([y for _, y in parts]), x_test=x_test, y_test=y_test,
                            num_classes=spec.num_classes, scale=1.0 / 255, mean=mean, std=std)
    return read


register_dataset(DatasetSpec(
    "cifar10", "CIFAR-10, from the python pickles.", (3, 32, 32), ((5000,) * 10, (1000,) * 10),
    _cifar_reader("labels"),
    {"train": tuple(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)),
     "test": ("cifar-10-batches-py/test_batch",)},
    ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)), normalize_default=True))
register_dataset(DatasetSpec(
    "cifar100", "CIFAR-100 (fine labels), from the python pickles.", (3, 32, 32), ((500,) * 100, (100,) * 100),
    _cifar_reader("fine_labels"), {"train": ("cifar-100-python/train",), "test": ("cifar-100-python/test",)},
    ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)), normalize_default=True))


# ---------------------------------------------------------------------------------- Tiny-ImageNet


def _read_tiny_imagenet(spec: DatasetSpec, base: Path, root: Root, normalize: bool) -> ArrayDataset:
    """Tiny-ImageNet-200 as uint8 ``(N, 3, 64, 64)``; the labelled ``val`` split is the test set.

    Class ``k`` is the ``k``-th wnid of ``wnids.txt`` in sorted order (the order torchvision's
    ``ImageFolder`` uses). JPEGs are decoded with Pillow in a thread pool.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("loading tiny-imagenet needs Pillow: pip install pillow") from exc

    folder = base / "tiny-imagenet-200"
    wnids_path = _require(folder / "wnids.txt", root)
    wnids = sorted({line.strip() for line in wnids_path.read_text().splitlines() if line.strip()})
    index = {w: k for k, w in enumerate(wnids)}

    train_paths: list[Path] = []
    train_labels: list[int] = []
    for wnid in wnids:
        images_dir = folder / "train" / wnid / "images"
        if not images_dir.is_dir():
            raise FileNotFoundError(f"dataset folder {images_dir} not found "
                                    f"(data.root = {str(root)!r})")
        files = sorted(images_dir.glob("*.JPEG"))
        train_paths += files
        train_labels += [index[wnid]] * len(files)

    annotations = _require(folder / "val" / "val_annotations.txt", root)
    test_paths: list[Path] = []
    test_labels: list[int] = []
    for lineno, line in enumerate(annotations.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise ValueError(f"{annotations}:{lineno}: expected '<file>\\t<wnid>...' with a known "
                             f"wnid, got {line!r}")
        test_paths.append(_require(folder / "val" / "images" / fields[0], root))
        test_labels.append(index[fields[1]])

    def decode(path: Path) -> np.ndarray:
        try:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot decode image ({exc})") from exc
        if pixels.shape != (64, 64, 3):
            raise ValueError(f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]}, "
                             "expected 64x64")
        return pixels.transpose(2, 0, 1)

    def decode_all(paths: list[Path]) -> np.ndarray:
        out = np.empty((len(paths), 3, 64, 64), dtype=np.uint8)
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for i, pixels in enumerate(pool.map(decode, paths, chunksize=256)):
                out[i] = pixels
        return out

    mean, std = spec.stats(normalize)
    return ArrayDataset(name=spec.name, x_train=decode_all(train_paths),
                        y_train=np.asarray(train_labels, dtype=np.int64),
                        x_test=decode_all(test_paths),
                        y_test=np.asarray(test_labels, dtype=np.int64),
                        num_classes=len(wnids), scale=1.0 / 255, mean=mean, std=std)


register_dataset(DatasetSpec(
    "tiny-imagenet", "Tiny-ImageNet-200 from its JPEG folders (the labelled val split is the test split).",
    (3, 64, 64), ((500,) * 200, (50,) * 200), _read_tiny_imagenet,
    {"train": ("tiny-imagenet-200/wnids.txt", "tiny-imagenet-200/train"),
     "test": ("tiny-imagenet-200/wnids.txt", "tiny-imagenet-200/val/val_annotations.txt",
              "tiny-imagenet-200/val/images")},
    ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), normalize_default=True))  # ImageNet's statistics, as is usual


DATASET_NAMES: tuple[str, ...] = tuple(DATASETS.builtin())
"""The built-in datasets' names."""


# ----------------------------------------------------------------------------------------- custom


def _load_custom(path: str, root: Root | None, options: dict[str, Any]) -> ArrayDataset:
    """Call the loader ``package.module:function`` as ``function(root=root, **options)``."""
    loader = import_callable(path, "data.dataset")
    dataset = loader(root=root, **options)
    if not isinstance(dataset, ArrayDataset):
        raise TypeError(f"custom dataset {path!r} returned {type(dataset).__name__}, "
                        "expected an ArrayDataset")
    return dataset
