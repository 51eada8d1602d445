"""Batch augmentation on the device (``fedpart.common.data.augment``): crop offsets, flips and
zero padding on hand-made batches, the distribution of the draws, determinism, shapes and
devices, and a CIFAR-shaped local training run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import small_config
from fedpart.client.local_data import ClientData
from fedpart.client.training import train_local
from fedpart.common.config.run_config import ConfigError, config_from_dict, load_config
from fedpart.common.data.augment import PADDING, CropFlip, build_augment, crop_flip
from fedpart.common.models.zoo import build_model, unit_forward_flops
from fedpart.common.wire.plans import Phase, TrainPlan
from fedpart.cli.main import resolve_config_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CIFAR = (3, 32, 32)


def _positions(batch: int, height: int = 32, width: int = 32) -> torch.Tensor:
    """One-channel images whose pixel (r, c) holds 1 + r * width + c (zero only in padding)."""
    return (torch.arange(height * width, dtype=torch.float32) + 1).view(1, 1, height, width).repeat(batch, 1, 1, 1)


def test_crop_offsets_flip_and_zero_padding_by_hand():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]]])  # one image, 2 channels, 2 x 2
    def one(row: int, col: int, flip: bool) -> list:
        return crop_flip(x, torch.tensor([row]), torch.tensor([col]), torch.tensor([flip]), padding=1)[0].tolist()
    assert one(1, 1, False) == x[0].tolist(), "offset = padding is the image itself"
    assert one(0, 0, False) == [[[0, 0], [0, 1]], [[0, 0], [0, 5]]]   # padded rows/columns above and left
    assert one(2, 1, False) == [[[3, 4], [0, 0]], [[7, 8], [0, 0]]]   # one row down: the bottom is padding
    assert one(1, 1, True) == [[[2, 1], [4, 3]], [[6, 5], [8, 7]]]    # mirrored left-right
    assert one(2, 2, True) == [[[0, 4], [0, 0]], [[0, 8], [0, 0]]]    # cropped, then mirrored


def test_matches_pad_crop_flip_image_by_image():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, *CIFAR, generator=gen)
    rows, cols = torch.randint(0, 2 * PADDING + 1, (2, 16), generator=gen)
    flips = torch.randint(0, 2, (16,), generator=gen).bool()
    padded = F.pad(x, (PADDING,) * 4)
    expected = torch.stack([padded[b, :, rows[b]:rows[b] + 32, cols[b]:cols[b] + 32] for b in range(16)])
    expected = torch.where(flips[:, None, None, None], expected.flip(-1), expected)
    assert torch.equal(crop_flip(x, rows, cols, flips), expected)


def test_offsets_are_uniform_and_half_the_images_are_flipped():
    """The offset and flip of each image, read back from its pixels: offsets uniform on 0..8 per
    axis, flips with probability 1/2 (counts within 5 standard deviations)."""
    count = 9000
    out = CropFlip(seed=3)(_positions(count))[:, 0]
    flipped = out[:, 4, 5] < out[:, 4, 4]                       # pixels inside the image for any offset
    source = torch.where(flipped, out[:, 4, 27], out[:, 4, 4]) - 1  # the pixel that came from (dy, dx)
    rows, cols = source.long() // 32, source.long() % 32
    for drawn in (rows, cols):
        counts = torch.bincount(drawn, minlength=9)
        assert len(counts) == 9 and counts.sum() == count
        assert (counts - count / 9).abs().max() <= 5 * (count / 9 * 8 / 9) ** 0.5, counts.tolist()
    assert abs(int(flipped.sum()) - count / 2) <= 5 * (count / 4) ** 0.5
    padding = out == 0
    assert bool(padding[(rows == 4) & (cols == 4)].logical_not().all()), "offset 4 crops the image itself"
    assert bool(padding[rows == 0][:, :4].all()), "offset 0 takes four rows of zeros"


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_dtype_device_and_determinism(device):
    x = torch.randn(50, *CIFAR, generator=torch.Generator().manual_seed(0)).to(device)
    before = x.clone()
    out = CropFlip(seed=7)(x)
    assert torch.equal(x, before), "the input is left alone"
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device and out.is_contiguous()
    assert torch.equal(out, CropFlip(seed=7)(x)), "the same seed, the same batch"
    assert not torch.equal(out, CropFlip(seed=8)(x))
    transform = CropFlip(seed=7)
    assert not torch.equal(transform(x), transform(x)), "successive batches draw anew"
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        CropFlip(seed=7)(x.flatten(1))


def test_build_augment_and_the_config_switch():
    assert build_augment("none", 1) is None
    assert isinstance(build_augment("crop_flip", 1), CropFlip)
    assert config_from_dict(small_config()).train.augment == "none"
    with pytest.raises(ConfigError, match="train.augment must be one of none, crop_flip"):
        config_from_dict(small_config(train={"augment": "mixup"}))
    custom = {"dataset": "pkg.mod:load", "input_shape": [20], "num_classes": 2}
    with pytest.raises(ConfigError, match=r"train.augment transforms images: data.input_shape"):
        config_from_dict(small_config(train={"augment": "crop_flip"}, data=custom))
    for name in ("fedbabu_cifar10_cnn4", "fedbabu_cifar100_mobilenet", "fedbug_cifar100_cnn5",
                 "fedftha_cifar10_lenet5", "layer_expansion_cifar100_cnn2"):
        assert load_config(resolve_config_path(name)).train.augment == "crop_flip", name


class _Recorder:
    """An augmentation that records the batches it is given and hands them to ``inner``."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.seen: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return self.inner(x) if self.inner else x


def _cifar_run(augment) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(30, *CIFAR, generator=gen), torch.randint(0, 10, (30,), generator=gen),
                      torch.randn(10, *CIFAR, generator=gen), torch.randint(0, 10, (10,), generator=gen))
    model = build_model("cnn4", num_classes=10, input_shape=CIFAR, seed=0)
    plan = TrainPlan(phases=(Phase(2, tuple(model.schedule_units)),), lr=0.05, momentum=0.9, batch_size=10, seed=11)
    outcome = train_local(model, data, plan, F.cross_entropy, {}, unit_forward_flops(model, CIFAR), augment=augment)
    assert outcome.steps == 6 and outcome.loss > 0
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_cifar_shaped_run_through_train_local():
    """cnn4 on CIFAR-shaped batches: augmentation changes the trained model, repeats exactly with
    the plan's seed, and leaves the batch order as it is without it."""
    plain, augmented = _Recorder(), _Recorder(CropFlip(seed=11))
    without = _cifar_run(plain)
    first = _cifar_run(augmented)
    assert len(plain.seen) == len(augmented.seen) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain.seen, augmented.seen)), "the same batches, in the same order"
    assert any(not torch.equal(first[n], without[n]) for n in first)
    again = _cifar_run(CropFlip(seed=11))
    assert all(torch.equal(first[n], again[n]) for n in first)
