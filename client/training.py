"""Local training under a freeze schedule.

Freezing is exact: a frozen parameter has ``requires_grad=False``, so its gradient stays ``None``
and the optimizer skips it entirely (no momentum, no weight decay). One optimizer covers every
unit the plan ever trains in the round; the longest frozen prefix of body units runs under
``torch.no_grad()``, so its backward pass is never built.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fedpart.client.local_data import ClientData
from fedpart.common.algorithms import unfrozen_units
from fedpart.common.split_model import SplitModel
from fedpart.proto import fedpart_pb2 as pb

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainOutcome:
    """What one local training run reports."""

    loss: float
    steps: int
    samples: int
    compute_seconds: float
    trainable_parameters: int
    flops: float


def step_flops(unit_flops: Mapping[str, int], order: Sequence[str], trainable: set[str], batch: int) -> float:
    """Training FLOPs of one step: the forward of every unit, plus the backward actually run:
    weight gradients for trainable units and input gradients for every unit above the first
    trainable one (units below it run under no_grad and have no backward)."""
    forward = sum(unit_flops[u] for u in order)
    first = next((i for i, u in enumerate(order) if u in trainable), len(order))
    weight_grads = sum(unit_flops[u] for u in order if u in trainable)
    input_grads = sum(unit_flops[u] for u in order[first + 1:])
    return float(batch * (forward + weight_grads + input_grads))


def batches(size: int, batch_size: int, generator: torch.Generator, device: torch.device):
    """Shuffled index batches covering ``size`` samples once."""
    order = torch.randperm(size, generator=generator).to(device)
    for start in range(0, size, batch_size):
        yield order[start:start + batch_size]


def train_local(model: SplitModel, data: ClientData, plan: pb.TrainPlan, loss_fn: LossFn,
                reference: Mapping[str, torch.Tensor], unit_flops: Mapping[str, int]) -> TrainOutcome:
    """Train ``model`` in place following ``plan``; ``reference`` holds the global values of the
    shared tensors (FedProx's proximal term pulls towards them)."""
    started = time.perf_counter()
    device = data.x_train.device
    order = model.schedule_units
    used = [u for u in order if any(u in phase.trainable for phase in plan.phases)]
    parameters = [p for u in used for p in model.unit_parameters(u)]
    named = dict(model.named_parameters())
    proximal = [(named[n], r.to(device)) for n, r in reference.items() if n in named] if plan.proximal_mu else []
    generator = torch.Generator().manual_seed(int(plan.seed))
    n = data.train_size
    if not parameters or n == 0:
        return TrainOutcome(0.0, 0, n, time.perf_counter() - started, 0, 0.0)
    optimizer = torch.optim.SGD(parameters, lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay)
    model.train()
    total_loss = torch.zeros((), device=device)
    seen = steps = 0
    flops = 0.0
    for phase in plan.phases:
        if not phase.trainable or phase.epochs == 0:
            continue
        steps_of_unfreezing = model.unfreeze_steps(list(phase.trainable))
        steps_per_epoch = math.ceil(n / plan.batch_size)
        total = phase.epochs * steps_per_epoch
        current: tuple[str, ...] | None = None
        step = 0
        for _ in range(phase.epochs):
            for index in batches(n, plan.batch_size, generator, device):
                step += 1
                wanted = unfrozen_units(steps_of_unfreezing, phase.unfreeze_fraction, step, total)
                if wanted != current:
                    model.set_trainable(wanted)
                    current = wanted
                    sample_flops = step_flops(unit_flops, order, set(wanted), 1)
                optimizer.zero_grad(set_to_none=True)
                x, y = data.x_train[index], data.y_train[index]
                loss = loss_fn(model(x), y)
                loss.backward()
                if proximal:
                    for parameter, anchor in proximal:
                        if parameter.grad is not None:
                            parameter.grad.add_(parameter.detach() - anchor, alpha=plan.proximal_mu)
                if plan.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], plan.grad_clip)
                optimizer.step()
                size = len(index)
                total_loss += loss.detach() * size
                seen += size
                steps += 1
                flops += sample_flops * size
    model.set_trainable(order)
    trainable = sum(p.numel() for p in parameters)
    return TrainOutcome(float(total_loss) / max(seen, 1), steps, n, time.perf_counter() - started, trainable, flops)
