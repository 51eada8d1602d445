"""Local training under a freeze schedule, with the algorithm's client objective.

Freezing is exact: a frozen parameter has ``requires_grad=False``, so its gradient stays ``None``
and the optimizer skips it entirely (no momentum, no weight decay). One optimizer covers every
unit the plan ever trains in the round; the algorithm's unit schedule says which of a phase's
units train at each local step (FedBug's gradual unfreezing, from the phase's ``params``), and
the longest frozen prefix of body units runs under ``torch.no_grad()``, so its backward pass is
never built. The loss and the update come from the
:class:`~fedpart.common.ml.objectives.Objective` (terms and a step rule); the loop has no branch
for any algorithm. The loop never waits for the device: the loss is summed on the device and
read once at the end, batches are index slices of on-device tensors, and the speed options
(mixed precision, channels-last, a compiled forward; :mod:`fedpart.client.speed`) apply per step.
Under ``privacy.dp_sgd`` the batches are Poisson samples and every step's gradient is clipped per
example and noised (Opacus; :mod:`fedpart.client.dp_sgd`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fedpart.client import dp_sgd as dpsgd
from fedpart.client.local_data import ClientData
from fedpart.client.speed import TrainingSpeed
from fedpart.common.ml.algorithms import UnitSchedule, every_unit
from fedpart.common.config.dp_sgd import DPSGDConfig
from fedpart.common.ml.objectives import Objective, ObjectiveContext, ObjectiveSpec
from fedpart.common.wire.plans import TrainPlan
from fedpart.common.ml.split_model import SplitModel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Augment = Callable[[torch.Tensor], torch.Tensor]
StepsDone = Callable[[int, int], None]  # (local steps done, local steps in all) of the current task

PROGRESS_STEPS = 10  # the progress callback is told every this many local steps (and at the end)


@dataclass
class TrainOutcome:
    """What one local training run reports."""

    loss: float
    steps: int
    samples: int
    compute_seconds: float
    trainable_parameters: int
    flops: float
    dp_sgd: dpsgd.DPSGDUsage | None = None  # what DP-SGD spent (None: it was off)


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
    """Shuffled index batches covering ``size`` samples once. The order is drawn on the host (the
    same on every device) and copied to a GPU from pinned memory, without blocking the host."""
    order = torch.randperm(size, generator=generator)
    if device.type == "cuda":
        order = order.pin_memory().to(device, non_blocking=True)
    for start in range(0, size, batch_size):
        yield order[start:start + batch_size]


def train_local(model: SplitModel, data: ClientData, plan: TrainPlan, loss_fn: LossFn,
                reference: Mapping[str, torch.Tensor], unit_flops: Mapping[str, int],
                objective: Objective | None = None, state: dict[str, torch.Tensor] | None = None,
                augment: Augment | None = None, speed: TrainingSpeed | None = None,
                on_steps: StepsDone | None = None, dp_sgd: DPSGDConfig | None = None,
                unit_schedule: UnitSchedule = every_unit) -> TrainOutcome:
    """Train ``model`` in place following ``plan``; ``reference`` holds the global values of the
    shared tensors (the anchors of objective terms), ``state`` the client's objective state
    (updated in place), ``augment`` a transform of each training batch's inputs, ``speed`` the
    speed options (configured for this ``model``; default plain float32), ``unit_schedule`` the
    algorithm's choice of a phase's units at each local step (``Algorithm.unit_schedule``). ``on_steps`` is told the
    local step count every :data:`PROGRESS_STEPS` steps (a count: no device sync). ``dp_sgd``
    (enabled): DP-SGD steps on Poisson batches (:mod:`fedpart.client.dp_sgd`; raises DPSGDError
    where Opacus is missing or the model cannot have per-example gradients)."""
    started = time.perf_counter()
    device = data.x_train.device
    speed = speed or TrainingSpeed(device)
    order = model.schedule_units
    used = [u for u in order if any(u in phase.trainable for phase in plan.phases)]
    parameters = [p for u in used for p in model.unit_parameters(u)]
    generator = torch.Generator().manual_seed(int(plan.seed))
    n = data.train_size
    if not parameters or n == 0:
        return TrainOutcome(0.0, 0, n, time.perf_counter() - started, 0, 0.0)
    objective = objective or ObjectiveSpec().build()
    ctx = ObjectiveContext(model, {k: r.to(device) for k, r in reference.items()},
                           {} if state is None else state, data.y_train, plan.lr, loss_fn)
    per_example = dp_sgd is not None and dp_sgd.enabled
    optimizer = speed.sgd(parameters, plan.lr, plan.momentum, plan.weight_decay, private=per_example)
    scaled = speed.loss_scaled(optimizer)
    backward = scaled.backward if scaled is not None else torch.Tensor.backward
    private = None
    if per_example:
        dpsgd.check_model(model)
        rate = dpsgd.sample_rate(n, plan.batch_size)
        seed = dpsgd.run_seed(dp_sgd, plan.seed)
        sampling = torch.Generator().manual_seed(seed)  # the Poisson batches (on the host, as Opacus draws them)
        noise = torch.Generator(device=device).manual_seed(seed + 1)
        private = dpsgd.PrivateGradients(model, optimizer, dp_sgd, min(plan.batch_size, n), noise)

    autocast = speed.autocast()  # made once, entered every step

    def gradients(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if private is not None:
            private.clear()
            if x.shape[0] == 0:  # an empty Poisson batch: the step is noise only
                private.empty_batch()
                private.privatize()
                objective.adjust_gradients(ctx)
                return torch.zeros((), device=device)
        forward = speed.forward(model, full_batch=x.shape[0] == plan.batch_size)
        with autocast:
            loss = objective.batch_loss(ctx, forward(speed.layout(x), pieces=True), y)
        backward(loss)
        if private is not None:
            private.privatize()
        objective.adjust_gradients(ctx)
        if plan.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], plan.grad_clip)
        return loss.detach()

    model.train()
    objective.begin(ctx)
    total_loss = torch.zeros((), device=device)
    seen = steps = 0
    flops = 0.0
    all_steps = plan.local_steps(n)
    for phase in plan.phases:
        if not phase.trainable or phase.epochs == 0:
            continue
        steps_of_unfreezing = model.unfreeze_steps(list(phase.trainable))
        steps_per_epoch = math.ceil(n / plan.batch_size)
        total = phase.epochs * steps_per_epoch
        current: tuple[str, ...] | None = None
        step = 0
        for _ in range(phase.epochs):
            epoch = (dpsgd.poisson_batches(n, rate, steps_per_epoch, sampling, device) if private is not None
                     else batches(n, plan.batch_size, generator, device))
            for index in epoch:
                step += 1
                wanted = unit_schedule(steps_of_unfreezing, phase.params, step, total)
                if wanted != current:
                    model.set_trainable(wanted)
                    current = wanted
                    if private is not None:
                        private.attach()  # Opacus' hooks on the units that train now
                    sample_flops = step_flops(unit_flops, order, set(wanted), 1)
                x, y = data.x_train[index], data.y_train[index]
                loss = objective.step_rule.step(ctx, augment(x) if augment else x, y, gradients, scaled or optimizer)
                size = index.shape[0]
                total_loss.add_(loss, alpha=size)  # one op; `loss * size` would first convert, copy and multiply
                seen += size
                steps += 1
                flops += sample_flops * size
                if on_steps is not None and steps % PROGRESS_STEPS == 0:
                    on_steps(steps, all_steps)
    if on_steps is not None:
        on_steps(steps, all_steps)
    objective.end(ctx)
    usage = None
    if private is not None:
        private.close()
        usage = dpsgd.DPSGDUsage(dp_sgd.noise_multiplier, rate, private.steps, n)
    model.set_trainable(order)
    mean_loss = float(total_loss) / max(seen, 1)  # the loop's one wait for the device, before the clock stops
    trainable = sum(p.numel() for p in parameters)
    return TrainOutcome(mean_loss, steps, n, time.perf_counter() - started, trainable, flops, usage)
