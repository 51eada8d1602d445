"""Built-in models: exact parameter counts, unit layout, seeding, custom factories and FLOPs."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from fedpart.common.models.zoo import MODEL_NAMES, build_model, unit_forward_flops
from fedpart.common.ml.split_model import HEAD, SplitModel, count_parameters

MNIST = (1, 28, 28)
CIFAR = (3, 32, 32)
DIGITS = (1, 8, 8)

# (name, num_classes, typical input shape, options)
TYPICAL: list[tuple[str, int, tuple[int, ...], dict[str, str]]] = [
    ("mlp", 10, DIGITS, {}),
    ("cnn2", 10, MNIST, {}),
    ("cnn4", 10, CIFAR, {}),
    ("mobilenet", 100, CIFAR, {}),
    ("cnn5", 100, CIFAR, {}),
    ("resnet18", 100, CIFAR, {}),
    ("resnet34", 100, CIFAR, {"units": "block"}),
    ("lenet5", 10, CIFAR, {}),
]


def conv(cin: int, cout: int, k: int, bias: bool = True, groups: int = 1) -> int:
    """Parameters of a Conv2d."""
    return cout * (cin // groups) * k * k + (cout if bias else 0)


def linear(fin: int, fout: int) -> int:
    """Parameters of a Linear with bias."""
    return fin * fout + fout


def norm(channels: int) -> int:
    """Affine parameters of a BatchNorm2d / GroupNorm."""
    return 2 * channels


def unit_counts(model: SplitModel) -> dict[str, int]:
    """Parameter count of every schedule unit."""
    return {u: sum(p.numel() for p in model.unit_parameters(u)) for u in model.schedule_units}


def body_count(model: SplitModel) -> int:
    """Parameters of all body units."""
    return count_parameters(model) - count_parameters(model.head)


def hand_resnet(depths: tuple[int, ...], num_classes: int) -> int:
    """Hand count of a CIFAR ResNet with GroupNorm (affine like BatchNorm) and a 3-channel input."""
    total = conv(3, 64, 3, bias=False) + norm(64)
    in_planes = 64
    for stage, (planes, depth) in enumerate(zip((64, 128, 256, 512), depths)):
        for index in range(depth):
            stride = 2 if stage > 0 and index == 0 else 1
            total += conv(in_planes, planes, 3, bias=False) + norm(planes)
            total += conv(planes, planes, 3, bias=False) + norm(planes)
            if stride != 1 or in_planes != planes:
                total += conv(in_planes, planes, 1, bias=False) + norm(planes)
            in_planes = planes
    return total + linear(512, num_classes)


def test_model_names() -> None:
    assert set(MODEL_NAMES) == {
        "mlp", "cnn2", "cnn4", "mobilenet", "cnn5", "resnet18", "resnet34", "lenet5"
    }


def test_cnn2_mnist_counts_and_keys() -> None:
    model = build_model("cnn2", 10, MNIST, seed=0)
    counts = unit_counts(model)
    assert counts == {"conv1": 832, "conv2": 51_264, "fc1": 524_800, HEAD: 5_130}
    assert counts["fc1"] == linear(64 * 4 * 4, 512)
    assert count_parameters(model) == 582_026
    assert list(model.state_dict()) == [
        "body.conv1.0.weight", "body.conv1.0.bias", "body.conv2.0.weight", "body.conv2.0.bias",
        "body.fc1.1.weight", "body.fc1.1.bias", "head.weight", "head.bias",
    ]


def test_cnn4_cifar10_counts() -> None:
    model = build_model("cnn4", 10, CIFAR, seed=0)
    assert model.unit_names == ["conv1", "conv2", "conv3", "conv4"]
    assert body_count(model) == 113_088
    assert body_count(model) == conv(3, 64, 3) + norm(64) + 3 * (conv(64, 64, 3) + norm(64))
    assert count_parameters(model.head) == 2_570
    assert model.features(torch.zeros(2, *CIFAR)).shape == (2, 256)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 4 and not any(m.track_running_stats for m in norms)


def test_mobilenet_cifar100_counts() -> None:
    model = build_model("mobilenet", 100, CIFAR, seed=0)
    assert model.unit_names == ["stem"] + [f"block{i}" for i in range(1, 14)]
    assert count_parameters(model.head) == 102_500
    cfg = [64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024]
    hand = conv(3, 32, 3, bias=False) + norm(32)
    in_planes = 32
    for entry in cfg:
        out_planes = entry[0] if isinstance(entry, tuple) else entry
        hand += conv(in_planes, in_planes, 3, bias=False, groups=in_planes) + norm(in_planes)
        hand += conv(in_planes, out_planes, 1, bias=False) + norm(out_planes)
        in_planes = out_planes
    assert body_count(model) == hand == 3_206_976
    assert isinstance(model.body["block13"][-1], nn.AvgPool2d)
    assert model.features(torch.zeros(2, *CIFAR)).shape == (2, 1024)
    assert not any(
        m.track_running_stats for m in model.modules() if isinstance(m, nn.BatchNorm2d)
    )


def test_cnn5_counts() -> None:
    model = build_model("cnn5", 10, CIFAR, seed=0)
    assert model.schedule_units == ["conv1", "conv2", "fc1", "fc2", HEAD]
    hand = conv(3, 64, 5) + conv(64, 64, 5) + linear(1600, 384) + linear(384, 192)
    assert body_count(model) == hand == 796_032
    assert count_parameters(model) == hand + linear(192, 10) == 797_962
    assert count_parameters(build_model("cnn5", 100, CIFAR, seed=0)) == 815_332


def test_lenet5_counts() -> None:
    model = build_model("lenet5", 10, CIFAR, seed=0)
    assert model.schedule_units == ["conv1", "conv2", "fc1", "fc2", HEAD]
    hand = conv(3, 6, 5) + conv(6, 16, 5) + linear(16 * 5 * 5, 120) + linear(120, 84)
    assert count_parameters(model) == hand + linear(84, 10) == 62_006
    mnist = build_model("lenet5", 10, MNIST, seed=0)
    hand = conv(1, 6, 5) + conv(6, 16, 5) + linear(16 * 4 * 4, 120) + linear(120, 84)
    assert count_parameters(mnist) == hand + linear(84, 10) == 44_426


def test_mlp_counts_and_hidden_option() -> None:
    digits = build_model("mlp", 10, DIGITS, seed=0)
    assert unit_counts(digits) == {"fc1": 13_000, "fc2": 40_200, HEAD: 2_010}
    assert count_parameters(build_model("mlp", 10, (64,), seed=0)) == 55_210
    assert count_parameters(build_model("mlp", 10, MNIST, seed=0)) == 199_210
    narrow = build_model("mlp", 10, (64,), seed=0, hidden=32)
    assert count_parameters(narrow) == linear(64, 32) + linear(32, 32) + linear(32, 10)


@pytest.mark.parametrize(
    ("name", "depths", "blocks", "total_c10", "total_c100"),
    [
        ("resnet18", (2, 2, 2, 2), 8, 11_173_962, 11_220_132),
        ("resnet34", (3, 4, 6, 3), 16, 21_282_122, 21_328_292),
    ],
)
def test_resnet_counts_and_units(
    name: str, depths: tuple[int, ...], blocks: int, total_c10: int, total_c100: int
) -> None:
    by_stage = build_model(name, 100, CIFAR, seed=0)
    by_block = build_model(name, 10, CIFAR, seed=0, units="block")
    assert by_stage.unit_names == ["stage1", "stage2", "stage3", "stage4"]
    assert by_block.unit_names == [f"block{i}" for i in range(1, blocks + 1)]
    assert count_parameters(by_stage) == hand_resnet(depths, 100) == total_c100
    assert count_parameters(by_block) == hand_resnet(depths, 10) == total_c10
    assert count_parameters(by_stage.head) == linear(512, 100)
    for model in (by_stage, by_block):
        assert hasattr(model.body[model.unit_names[0]], "stem")
        assert isinstance(model.body[model.unit_names[-1]][-1], nn.AdaptiveAvgPool2d)
        assert not any(isinstance(m, (nn.BatchNorm2d, nn.MaxPool2d)) for m in model.modules())
        assert all(m.num_groups == 2 for m in model.modules() if isinstance(m, nn.GroupNorm))


def test_resnet_max_pool_only_for_large_inputs() -> None:
    large = build_model("resnet18", 10, (3, 96, 96), seed=0)
    assert any(isinstance(m, nn.MaxPool2d) for m in large.body["stage1"].stem)


@pytest.mark.parametrize(("name", "num_classes", "shape", "options"), TYPICAL)
def test_forward_shape_and_head(
    name: str, num_classes: int, shape: tuple[int, ...], options: dict[str, str]
) -> None:
    model = build_model(name, num_classes, shape, seed=0, **options)
    assert isinstance(model, SplitModel)
    assert type(model.head) is nn.Linear and model.head.bias is not None
    assert model.head.out_features == num_classes
    assert model(torch.randn(2, *shape)).shape == (2, num_classes)


def test_head_has_default_init_bounds() -> None:
    head = build_model("cnn2", 10, MNIST, seed=3).head
    bound = 1 / 512**0.5
    assert head.weight.abs().max() <= bound and head.bias.abs().max() <= bound


@pytest.mark.parametrize("name", ["cnn2", "cnn4", "mlp"])
def test_seeding_is_deterministic_and_isolated(name: str) -> None:
    shape = DIGITS if name == "mlp" else CIFAR if name == "cnn4" else MNIST
    rng_before = torch.get_rng_state()
    first = build_model(name, 10, shape, seed=7).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)
    torch.rand(5)  # moving the global RNG must not matter
    second = build_model(name, 10, shape, seed=7).state_dict()
    other = build_model(name, 10, shape, seed=8).state_dict()
    assert list(first) == list(second)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_unknown_model_lists_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'.*cnn2.*resnet18"):
        build_model("vgg", 10, CIFAR, seed=0)


@pytest.mark.parametrize(
    ("name", "options", "pattern"),
    [
        ("cnn2", {"hidden": 10}, "model.hidden: not an option of model 'cnn2'"),
        ("mlp", {"width": 10}, r"model.width: not an option of model 'mlp'; known: \['hidden'\]"),
        ("mlp", {"hidden": 0}, "model.hidden must be a positive integer"),
        ("resnet18", {"units": "layer"}, "model.units must be 'stage' or 'block'"),
    ],
)
def test_bad_options(name: str, options: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build_model(name, 10, MNIST if name != "resnet18" else CIFAR, seed=0, **options)


def test_bad_input_shapes_and_classes() -> None:
    with pytest.raises(ValueError, match="cnn2.*input_shape"):
        build_model("cnn2", 10, (64,), seed=0)
    with pytest.raises(ValueError, match="too small"):
        build_model("cnn5", 10, (3, 8, 8), seed=0)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("cnn2", 0, MNIST, seed=0)


FACTORY_SOURCE = '''
from collections import OrderedDict
from torch import nn
from fedpart.common.ml.split_model import SplitModel

def tiny(num_classes, input_shape, width=4):
    units = OrderedDict(fc=nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], width)))
    return SplitModel(units, nn.Linear(width, num_classes))

def not_split(num_classes, input_shape):
    return nn.Linear(input_shape[-1], num_classes)

def broken(num_classes, input_shape):
    raise RuntimeError("factory exploded")
'''


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Name of a fresh importable module holding test factories."""
    name = f"fedpart_test_factories_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(FACTORY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_custom_factory(factory_module: str) -> None:
    model = build_model(f"{factory_module}:tiny", 3, (6,), seed=1, width=5)
    assert model.schedule_units == ["fc", HEAD]
    assert model(torch.zeros(2, 6)).shape == (2, 3)
    again = build_model(f"{factory_module}:tiny", 3, (6,), seed=1, width=5)
    assert torch.equal(model.head.weight, again.head.weight)


def test_custom_factory_errors(factory_module: str) -> None:
    with pytest.raises(TypeError, match=f"{factory_module}:not_split.*SplitModel"):
        build_model(f"{factory_module}:not_split", 3, (6,), seed=0)
    with pytest.raises(ImportError, match=f"{factory_module}:missing"):
        build_model(f"{factory_module}:missing", 3, (6,), seed=0)
    with pytest.raises(ImportError, match="no_such_module_xyz:tiny"):
        build_model("no_such_module_xyz:tiny", 3, (6,), seed=0)
    with pytest.raises(ValueError, match="package.module:function"):
        build_model(":tiny", 3, (6,), seed=0)
    with pytest.raises(RuntimeError, match="factory exploded"):
        build_model(f"{factory_module}:broken", 3, (6,), seed=0)


def test_unit_forward_flops_cnn2() -> None:
    model = build_model("cnn2", 10, MNIST, seed=0)
    model.train()
    flops = unit_forward_flops(model, MNIST)
    # conv1: 32x24x24 outputs, 1x5x5 MACs each; conv2: 64x8x8 outputs, 32x5x5 MACs each.
    assert flops == {
        "conv1": 2 * 32 * 24 * 24 * 1 * 25 + 32 * 24 * 24,
        "conv2": 2 * 64 * 8 * 8 * 32 * 25 + 64 * 8 * 8,
        "fc1": 2 * 1024 * 512 + 512,
        HEAD: 2 * 512 * 10 + 10,
    }
    assert flops["conv1"] == 940_032 and flops["conv2"] == 6_557_696
    assert model.training
    assert all(not module._forward_hooks for module in model.modules())


def test_unit_forward_flops_counts_depthwise_groups() -> None:
    flops = unit_forward_flops(build_model("mobilenet", 100, CIFAR, seed=0), CIFAR)
    # block1 at 32x32: depthwise 32 channels x 9 taps, pointwise 32 -> 64, no biases.
    assert flops["block1"] == 2 * 32 * 32 * 32 * 9 + 2 * 64 * 32 * 32 * 32
    assert list(flops) == ["stem"] + [f"block{i}" for i in range(1, 14)] + [HEAD]
