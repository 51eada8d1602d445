"""Built-in models, each cut into body units and a head (see :class:`SplitModel`).

Every builder takes ``num_classes``, ``input_shape`` (one sample, e.g. ``(3, 32, 32)``) and its own
keyword options; each registers in :data:`fedpart.common.components.registry.MODELS` with those options.
:func:`build_model` seeds the initialisation, so the same seed always gives
bit-identical weights, and also loads custom models from ``package.module:function`` import paths.
The head is always the final ``nn.Linear`` with its bias and PyTorch's default initialisation.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeAlias

import torch
from torch import nn

from fedpart.common.components.importing import import_callable
from fedpart.common.components.registry import MODELS, Option, at_least_one
from fedpart.common.ml.split_model import SplitModel

Units: TypeAlias = "OrderedDict[str, nn.Module]"


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``input_shape`` as ``(channels, height, width)``, or a ``ValueError`` for model ``name``."""
    if len(input_shape) != 3 or any(int(d) < 1 for d in input_shape):
        raise ValueError(
            f"model {name!r} needs an image input_shape (C, H, W), got {tuple(input_shape)}"
        )
    channels, height, width = (int(d) for d in input_shape)
    return channels, height, width


def _flat_features(name: str, units: Units, input_shape: tuple[int, ...]) -> int:
    """Size of the flattened output of ``units`` for one sample (a dry run on zeros)."""
    try:
        with torch.no_grad():
            x = torch.zeros(2, *input_shape)
            for unit in units.values():
                x = unit(x)
    except RuntimeError as exc:
        raise ValueError(
            f"input_shape {tuple(input_shape)} is too small for model {name!r}: {exc}"
        ) from exc
    return int(x[0].numel())


@MODELS.register("mlp", "Two-hidden-layer perceptron, the 2NN of McMahan et al. 2017; any input shape (flattened).",
                 Option("hidden", int, "width of both hidden layers", at_least_one, "must be a positive integer"))
def mlp(num_classes: int, input_shape: tuple[int, ...], *, hidden: int = 200) -> SplitModel:
    """Two-hidden-layer perceptron, the "2NN" of McMahan et al. 2017 (AISTATS, FedAvg).

    Units ``fc1`` (Flatten + Linear(in, hidden) + ReLU) and ``fc2`` (Linear(hidden, hidden) + ReLU);
    head Linear(hidden, C). Any input shape works; it is flattened.
    """
    if not input_shape or any(int(d) < 1 for d in input_shape):
        raise ValueError(f"model 'mlp' needs a non-empty positive input_shape, got {input_shape}")
    in_features = math.prod(int(d) for d in input_shape)
    units = OrderedDict(
        fc1=nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU()),
        fc2=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
    )
    return SplitModel(units, nn.Linear(hidden, num_classes))


@MODELS.register("cnn2", "Two-conv CNN of the layer-expansion paper (PFLlib's FedAvgCNN).")
def cnn2(num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """Two-conv CNN of the layer-expansion paper; PFLlib's ``FedAvgCNN``.

    Units ``conv1`` Conv2d(c, 32, 5) + ReLU + MaxPool2, ``conv2`` Conv2d(32, 64, 5) + ReLU +
    MaxPool2, ``fc1`` Flatten + Linear(., 512) + ReLU; head Linear(512, C). MNIST: 582,026
    parameters.
    """
    channels, _, _ = _image_shape("cnn2", input_shape)
    units = OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2)),
        conv2=nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2)),
    )
    flat = _flat_features("cnn2", units, input_shape)
    units["fc1"] = nn.Sequential(nn.Flatten(), nn.Linear(flat, 512), nn.ReLU())
    return SplitModel(units, nn.Linear(512, num_classes))


@MODELS.register("cnn4", "FedBABU's 4convNet (Oh et al., ICLR 2022).")
def cnn4(num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """FedBABU's "4convNet" (Oh et al., ICLR 2022) for CIFAR-10.

    Units ``conv1``..``conv4``, each Conv2d(in, 64, 3, padding=1) + BatchNorm2d(64, no running
    stats) + ReLU + MaxPool2; 32x32 input gives 64x2x2 = 256 features; head Linear(256, C).
    """
    channels, _, _ = _image_shape("cnn4", input_shape)
    units: Units = OrderedDict()
    for index in range(4):
        units[f"conv{index + 1}"] = nn.Sequential(
            nn.Conv2d(channels if index == 0 else 64, 64, 3, padding=1),
            nn.BatchNorm2d(64, track_running_stats=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
    return SplitModel(units, nn.Linear(_flat_features("cnn4", units, input_shape), num_classes))


MOBILENET_CFG: tuple[int | tuple[int, int], ...] = (
    64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024,
)


@MODELS.register("mobilenet", "FedBABU's CIFAR MobileNet (Oh et al., ICLR 2022; after Howard et al. 2017).")
def mobilenet(num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """FedBABU's CIFAR MobileNet (Oh et al., ICLR 2022; after Howard et al. 2017).

    Unit ``stem``: Conv3x3(c, 32, bias=False) + BN + ReLU. Units ``block1``..``block13``: depthwise
    Conv3x3(in, in, stride, groups=in) + BN + ReLU, pointwise Conv1x1(in, out) + BN + ReLU, with
    :data:`MOBILENET_CFG`; ``block13`` ends with AvgPool2d(2). All convs are bias-free and all BNs
    keep no running stats. 32x32 input gives 1024 features; head Linear(1024, C).
    """
    channels, _, _ = _image_shape("mobilenet", input_shape)
    units: Units = OrderedDict(
        stem=nn.Sequential(
            nn.Conv2d(channels, 32, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(32, track_running_stats=False),
            nn.ReLU(),
        )
    )
    in_planes = 32
    for index, entry in enumerate(MOBILENET_CFG):
        out_planes, stride = entry if isinstance(entry, tuple) else (entry, 1)
        layers: list[nn.Module] = [
            nn.Conv2d(
                in_planes, in_planes, 3, stride=stride, padding=1, groups=in_planes, bias=False
            ),
            nn.BatchNorm2d(in_planes, track_running_stats=False),
            nn.ReLU(),
            nn.Conv2d(in_planes, out_planes, 1, bias=False),
            nn.BatchNorm2d(out_planes, track_running_stats=False),
            nn.ReLU(),
        ]
        if index == len(MOBILENET_CFG) - 1:
            layers.append(nn.AvgPool2d(2))
        units[f"block{index + 1}"] = nn.Sequential(*layers)
        in_planes = out_planes
    flat = _flat_features("mobilenet", units, input_shape)
    return SplitModel(units, nn.Linear(flat, num_classes))


def _two_conv_two_fc(name: str, num_classes: int, input_shape: tuple[int, ...], convs: tuple[int, int],
                     hidden: tuple[int, int]) -> SplitModel:
    """Units ``conv1``, ``conv2`` (Conv5x5 + ReLU + MaxPool2 each), ``fc1``, ``fc2`` (Linear + ReLU)."""
    channels, _, _ = _image_shape(name, input_shape)
    units = OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(channels, convs[0], 5), nn.ReLU(), nn.MaxPool2d(2)),
        conv2=nn.Sequential(nn.Conv2d(convs[0], convs[1], 5), nn.ReLU(), nn.MaxPool2d(2)),
    )
    flat = _flat_features(name, units, input_shape)
    units["fc1"] = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden[0]), nn.ReLU())
    units["fc2"] = nn.Sequential(nn.Linear(hidden[0], hidden[1]), nn.ReLU())
    return SplitModel(units, nn.Linear(hidden[1], num_classes))


@MODELS.register("cnn5", "FedBug's standard CNN (Kao & Wang 2023).")
def cnn5(num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """FedBug's standard CNN (Kao & Wang 2023; the CNN of FedDyn-style CIFAR experiments).

    Units ``conv1`` Conv2d(c, 64, 5) + ReLU + MaxPool2, ``conv2`` Conv2d(64, 64, 5) + ReLU +
    MaxPool2, ``fc1`` Flatten + Linear(1600, 384) + ReLU, ``fc2`` Linear(384, 192) + ReLU; head
    Linear(192, C). 32x32 input gives 1600 features.
    """
    return _two_conv_two_fc("cnn5", num_classes, input_shape, convs=(64, 64), hidden=(384, 192))


@MODELS.register("lenet5", "Modified LeNet-5 (LeCun et al. 1998), as in FedFTHA-style experiments.")
def lenet5(num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """Modified LeNet-5 (LeCun et al. 1998) as used in FedFTHA-style CIFAR-10 experiments.

    Units ``conv1`` Conv2d(c, 6, 5) + ReLU + MaxPool2, ``conv2`` Conv2d(6, 16, 5) + ReLU +
    MaxPool2, ``fc1`` Flatten + Linear(16*5*5, 120) + ReLU (16*4*4 on 28x28), ``fc2``
    Linear(120, 84) + ReLU; head Linear(84, C).
    """
    return _two_conv_two_fc("lenet5", num_classes, input_shape, convs=(6, 16), hidden=(120, 84))


def _norm(channels: int) -> nn.GroupNorm:
    """FedBug's normalisation for ResNets: GroupNorm with two groups."""
    return nn.GroupNorm(2, channels)


class BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016): two Conv3x3 + norm, identity or 1x1 projection."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm(planes)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), _norm(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


RESNET_WIDTHS = (64, 128, 256, 512)
RESNET_UNIT_MODES = ("stage", "block")


def _resnet(
    name: str, depths: tuple[int, ...], num_classes: int, input_shape: tuple[int, ...], units: str
) -> SplitModel:
    """CIFAR-style ResNet with GroupNorm(2, C), cut into units by ``stage`` or residual ``block``.

    Stem Conv3x3(c, 64, stride 1, bias=False) + norm + ReLU, plus MaxPool(3, 2, 1) only for inputs
    larger than 64 px; stages of ``depths`` basic blocks of widths 64..512 (stride 2 from stage 2);
    adaptive average pool to 512 features. The stem joins the first unit, the pool the last.
    """
    if units not in RESNET_UNIT_MODES:
        raise ValueError(f"option 'units' must be one of {RESNET_UNIT_MODES}, got {units!r}")
    channels, height, width = _image_shape(name, input_shape)
    stem: list[nn.Module] = [
        nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False), _norm(64), nn.ReLU()
    ]
    if max(height, width) > 64:
        stem.append(nn.MaxPool2d(3, stride=2, padding=1))
    stages: list[list[nn.Module]] = []
    in_planes = 64
    for stage, (planes, depth) in enumerate(zip(RESNET_WIDTHS, depths)):
        blocks: list[nn.Module] = []
        for index in range(depth):
            blocks.append(BasicBlock(in_planes, planes, 2 if stage > 0 and index == 0 else 1))
            in_planes = planes
        stages.append(blocks)
    groups = stages if units == "stage" else [[block] for blocks in stages for block in blocks]
    body: Units = OrderedDict()
    for index, group in enumerate(groups):
        parts: list[tuple[str, nn.Module]] = []
        if index == 0:
            parts.append(("stem", nn.Sequential(*stem)))
        if units == "stage":
            parts += [(f"block{i + 1}", block) for i, block in enumerate(group)]
        else:
            parts.append(("block", group[0]))
        if index == len(groups) - 1:
            parts.append(("pool", nn.AdaptiveAvgPool2d(1)))
        body[f"{units}{index + 1}"] = nn.Sequential(OrderedDict(parts))
    # FedBug (Kao & Wang 2023) unfreezes ResNets by stage or block, the head with the last one.
    return SplitModel(body, nn.Linear(RESNET_WIDTHS[-1], num_classes), head_joins_last_unit=True)


_UNITS = Option("units", str, "body units: each 'stage' or each residual 'block'",
                lambda value: value in ("stage", "block"), "must be 'stage' or 'block'")


@MODELS.register("resnet18", "ResNet-18 with GroupNorm(2, C), as in FedBug (Kao & Wang 2023).",
                 _UNITS)
def resnet18(num_classes: int, input_shape: tuple[int, ...], *, units: str = "stage") -> SplitModel:
    """ResNet-18 (He et al. 2016) with GroupNorm(2, C) as in FedBug (Kao & Wang 2023).

    ``units="stage"``: ``stage1``..``stage4``; ``units="block"``: ``block1``..``block8``.
    """
    return _resnet("resnet18", (2, 2, 2, 2), num_classes, input_shape, units)


@MODELS.register("resnet34", "ResNet-34 with GroupNorm(2, C), as in FedBug (Kao & Wang 2023).",
                 _UNITS)
def resnet34(num_classes: int, input_shape: tuple[int, ...], *, units: str = "stage") -> SplitModel:
    """ResNet-34 (He et al. 2016) with GroupNorm(2, C) as in FedBug (Kao & Wang 2023).

    ``units="stage"``: ``stage1``..``stage4``; ``units="block"``: ``block1``..``block16``.
    """
    return _resnet("resnet34", (3, 4, 6, 3), num_classes, input_shape, units)


MODEL_NAMES: tuple[str, ...] = tuple(MODELS.builtin())
"""The built-in models' names."""


def build_model(
    name: str, num_classes: int, input_shape: tuple[int, ...], seed: int, **options: object
) -> SplitModel:
    """Build model ``name`` with weights initialised from ``seed`` (global RNG state untouched).

    ``name`` is one of :data:`MODEL_NAMES` or a ``package.module:function`` path to a factory
    called as ``function(num_classes=..., input_shape=..., **options)`` that returns a
    :class:`SplitModel`. The same seed gives bit-identical weights.
    """
    input_shape = tuple(int(d) for d in input_shape)
    custom = ":" in name
    if custom:
        factory = import_callable(name, "model.name")
    else:
        options = MODELS.read(name, options, "model.", "model.name")
        factory = MODELS[name].build
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = factory(num_classes=num_classes, input_shape=input_shape, **options)
    if custom and not isinstance(model, SplitModel):
        raise TypeError(
            f"custom model {name!r} returned {type(model).__name__}, expected a SplitModel"
        )
    return model


def unit_forward_flops(model: SplitModel, input_shape: tuple[int, ...]) -> dict[str, int]:
    """Forward FLOPs of one sample per schedule unit (body units, ``head``, extra parts).

    Counts Conv2d (``2*Cout*Hout*Wout*(Cin/groups)*k*k``, plus one per output with a bias) and
    Linear (``2*in*out``, plus ``out`` with a bias) layers through forward hooks on a zero input;
    norms, activations and pools are ignored. The model's train/eval modes are left as found.
    """
    flops = dict.fromkeys(model.schedule_units, 0)
    batch = 2  # norms that use batch statistics need more than one value per channel

    def hook(unit: str) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def count(layer: nn.Module, _inputs: object, output: torch.Tensor) -> None:
            outputs = output.numel() // batch
            if isinstance(layer, nn.Conv2d):
                per_output = 2 * (layer.in_channels // layer.groups) * math.prod(layer.kernel_size)
            else:
                per_output = 2 * layer.in_features
            flops[unit] += outputs * per_output + (outputs if layer.bias is not None else 0)

        return count

    handles = []
    for unit in model.schedule_units:
        for layer in model.unit_module(unit).modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                handles.append(layer.register_forward_hook(hook(unit)))
    modes = {module: module.training for module in model.modules()}
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(batch, *input_shape, device=device))
    finally:
        for module, training in modes.items():
            module.training = training
        for handle in handles:
            handle.remove()
    return flops
