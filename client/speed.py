"""Speed options of local training on the client's device: ``train.amp``, ``train.channels_last``
and ``train.compile`` (docs/gpus.md).

- **amp** (``bf16`` / ``fp16``): the forward pass and the loss run under ``torch.autocast`` on a
  GPU; parameters, gradients and optimizer state stay float32. ``fp16`` adds a gradient scaler
  (``torch.amp.GradScaler``) that skips a step whose gradients overflowed, and uses the fused SGD
  kernel, which takes the scaler's overflow flag on the device (no host synchronisation per step).
  On the CPU amp is off: autocast there would change the numbers of CPU runs for little speed.
- **channels_last**: a model with 2-D convolutions and image inputs keeps its weights, and the
  client its input images, in the channels-last memory format (on every device: same numbers up
  to float rounding; faster convolution kernels on GPUs and in oneDNN on CPUs).
- **compile**: ``torch.compile(model, dynamic=False)`` runs the full batches of local training;
  a last partial batch runs eagerly, so batch sizes never multiply the graphs. Dynamo guards on
  ``requires_grad``, so every trainable set a freeze schedule uses compiles once, on its first
  full batch in the process, and is reused in every later round; the recompile limit is raised
  to cover the sets a schedule of this model can produce.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from fedpart.client.local_data import ClientData
from fedpart.common.config.run_config import AMP_MODES
from fedpart.common.ml.split_model import SplitModel

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMPILED_SETS_PER_UNIT = 4  # recompile limit per schedule unit: a generous bound on the trainable sets


class SpeedError(ValueError):
    """A speed option this device cannot run (the message says why)."""


def is_conv_net(model: nn.Module, input_shape: Sequence[int]) -> bool:
    """Image inputs (C, H, W) into a model with 2-D convolutions: where channels_last applies."""
    return len(input_shape) == 3 and any(isinstance(m, nn.Conv2d) for m in model.modules())


class LossScaledOptimizer:
    """An optimizer whose gradients come from a scaled loss (fp16 autocast).

    :meth:`backward` scales the loss, back-propagates and unscales the gradients at once, so the
    objective's gradient adjustments, clipping and step rules all see true gradients. :meth:`step`
    lets the scaler skip a step whose gradients overflowed, then updates the scale. Gradients that
    fed no optimizer step (Per-FedAvg's inner step) end their scaler iteration at the next backward.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self._unscaled = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        if self._unscaled:
            self.scaler.update()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._unscaled = False


class PlainSGD:
    """SGD with momentum and weight decay, step for step torch's ``torch.optim.SGD`` on a CPU (its
    single-tensor path, no dampening or Nesterov: the same operations in the same order, so the
    same numbers), for plain float32 training on a CPU.

    torch's optimizers wrap their methods in its compiler's disable decorator, which imports
    ``torch._dynamo`` at the first call: about as much CPU as importing torch itself, paid by every
    client process that trains. Gradient scalers (fp16) and Opacus' DPOptimizer need a torch
    optimizer and get one (:meth:`TrainingSpeed.sgd`)."""

    def __init__(self, parameters: Iterable[nn.Parameter], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.param_groups = [{"params": list(parameters), "lr": lr, "momentum": momentum,
                              "weight_decay": weight_decay}]
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for parameter in group["params"]:
                if set_to_none:
                    parameter.grad = None
                elif parameter.grad is not None:
                    parameter.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter that has a gradient (the others, frozen, keep their value
        and their momentum)."""
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                grad = parameter.grad
                if weight_decay != 0:
                    grad = grad.add(parameter, alpha=weight_decay)
                if momentum != 0:
                    buffer = self.state[parameter].get("momentum_buffer")
                    if buffer is None:
                        buffer = self.state[parameter]["momentum_buffer"] = grad.detach().clone()
                    else:
                        buffer.mul_(momentum).add_(grad, alpha=1)
                    grad = buffer
                parameter.add_(grad, alpha=-lr)


@dataclass
class TrainingSpeed:
    """How local training runs on ``device``; the defaults are plain float32 eager training."""

    device: torch.device
    amp_dtype: torch.dtype | None = None   # autocast dtype (GPU only)
    channels_last: bool = False            # inputs in the channels-last memory format
    compiled: nn.Module | None = None      # the client's model compiled (full batches)

    @classmethod
    def configure(cls, model: SplitModel, device: torch.device, input_shape: Sequence[int], amp: str = "off",
                  channels_last: bool = False, compile: bool = False,
                  compile_backend: str = "inductor") -> "TrainingSpeed":
        """The options (``train.amp``, ``train.channels_last``, ``train.compile``) as they apply on
        ``device`` to ``model``, which is converted to channels-last in place where that applies.
        Raises SpeedError for an option the device cannot run."""
        if amp not in AMP_MODES:
            raise SpeedError(f"train.amp must be one of {', '.join(AMP_MODES)}, got {amp!r}")
        amp_dtype = AMP_DTYPES.get(amp) if device.type == "cuda" else None
        if amp_dtype == torch.bfloat16 and torch.cuda.get_device_properties(device).major < 8:
            raise SpeedError(f"train.amp bf16: {torch.cuda.get_device_name(device)} has no native bfloat16 "
                             "(compute capability 8.0 or newer); use fp16")
        layout = channels_last and is_conv_net(model, input_shape)
        if layout:
            model.to(memory_format=torch.channels_last)
        compiled = None
        if compile:
            limit = COMPILED_SETS_PER_UNIT * len(model.schedule_units)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            compiled = torch.compile(model, dynamic=False, backend=compile_backend)
        return cls(device, amp_dtype, layout, compiled)

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the memory format the model wants (itself when it already is)."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def place(self, data: ClientData) -> ClientData:
        """A client's data in that memory format; batches sliced from it keep it."""
        if not self.channels_last:
            return data
        return replace(data, x_train=self.layout(data.x_train), x_test=self.layout(data.x_test))

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward pass and the loss (a no-op without amp)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def sgd(self, parameters: list[nn.Parameter], lr: float, momentum: float, weight_decay: float,
            private: bool = False) -> torch.optim.SGD | PlainSGD:
        """The local optimizer: on a CPU without DP-SGD (``private``: Opacus wraps a torch
        optimizer), :class:`PlainSGD`; elsewhere torch's SGD (its multi-tensor kernels on a GPU),
        fused where a gradient scaler drives the step (fp16), so that the scaler's overflow flag is
        read on the device. The fused kernel needs a momentum buffer for every parameter once any
        has one (FedBug unfreezes parameters mid-round), so they start at zero, which gives the
        same first step as torch's missing buffer (no dampening) and a defined one after a skipped
        step."""
        fused = self.amp_dtype == torch.float16
        if self.device.type == "cpu" and not private and not fused:
            return PlainSGD(parameters, lr, momentum, weight_decay)
        optimizer = torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                    fused=True if fused else None)
        if fused and momentum:
            for parameter in parameters:
                optimizer.state[parameter]["momentum_buffer"] = torch.zeros_like(parameter)
        return optimizer

    def loss_scaled(self, optimizer: torch.optim.Optimizer) -> LossScaledOptimizer | None:
        """``optimizer`` behind a gradient scaler with fp16 (None otherwise)."""
        if self.amp_dtype != torch.float16:
            return None
        return LossScaledOptimizer(optimizer, torch.amp.GradScaler(self.device.type))

    def forward(self, model: SplitModel, full_batch: bool):
        """The module that runs a batch's forward pass: the compiled model for full batches."""
        return self.compiled if self.compiled is not None and full_batch else model
