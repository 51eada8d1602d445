"""Record-level differential privacy on the client: DP-SGD (Abadi et al., "Deep Learning with
Differential Privacy", CCS 2016) through Opacus, for ``privacy.dp_sgd`` (docs/privacy.md).

What :func:`~fedpart.client.training.train_local` does under it, per local step:

- **Poisson sampling.** The batch is Opacus' own Poisson sample
  (:class:`opacus.utils.uniform_sampler.UniformWithReplacementSampler`, what its ``DPDataLoader``
  uses): each of the client's ``n`` training examples is in it independently with probability
  ``q = min(1, batch_size / n)``, so a batch may be of any size, empty included; an epoch is
  ``ceil(n / batch_size)`` such steps, as many as the plain loop takes. This is the sampled
  Gaussian mechanism that Opacus' RDP accountant assumes: the accounting matches the loop. The
  sampling and the noise come from a generator seeded with a secret per local training run
  (``privacy.dp_sgd.noise_seed`` fixes it for experiments only: amplification by sampling and the
  noise both need the server not to know them).
- **Per-example gradients** come from Opacus' hooks (:class:`opacus.GradSampleModule`), put on the
  modules that train at that step (a freeze schedule's frozen units get none, and stay frozen;
  FedBug's unfreezing puts them on again for the new set).
- **Clip and noise** are Opacus' :class:`opacus.optimizers.DPOptimizer` (its ``pre_step``): each
  example's gradient is clipped to ``max_grad_norm`` in L2 over all the trained parameters, the
  clipped gradients are summed, Gaussian noise of standard deviation ``noise_multiplier *
  max_grad_norm`` is added and the sum divided by the expected batch size ``q * n``. The objective's
  gradient adjustments (FedProx, FedDyn: functions of the parameters and the global model, not of
  the data) and the optimizer's momentum and weight decay act on that noised gradient
  (post-processing).

Accounting: each client's spending is the list of its local training runs (noise multiplier,
sampling rate, steps), kept in ``<state_dir>/<run_id>/client_<id>/dp_sgd.json`` beside its
personal parts, so that it cumulates over every round the client trained, process restarts
included; epsilon is Opacus' :class:`~opacus.accountants.RDPAccountant` over that history at
``delta`` (``privacy.dp_sgd.delta``, default ``1 / n ** 1.1``). A round trained again (a task sent
again) counts again: its first result may have reached a server, so both are spent.

What it does not cover: the training loss and the evaluation metrics the client reports, and the
fine-tuning of the final evaluation, are not privatized.
"""

from __future__ import annotations

import importlib.util
import json
import math
import secrets
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedpart.common.config.dp_sgd import DP_SGD_INSTALL, DPSGDConfig

LEDGER_FILE = "dp_sgd.json"
CLIENT_DIR_PREFIX = "client_"  # as fedpart.client.store lays the state dir out


class DPSGDError(ValueError):
    """DP-SGD cannot run here (Opacus is missing, or the model cannot have per-example gradients)."""


def require_opacus() -> None:
    """Raise DPSGDError, with the install command, where Opacus is not importable."""
    if importlib.util.find_spec("opacus") is None:
        raise DPSGDError(f"privacy.dp_sgd needs Opacus on the client, which is not installed: {DP_SGD_INSTALL}")


def model_problems(model: nn.Module) -> list[str]:
    """Why Opacus cannot give ``model`` per-example gradients (its ModuleValidator: BatchNorm,
    which mixes a batch's examples, and other unsupported layers), one line per kind; empty
    where it can."""
    require_opacus()
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return []
    problems = []
    batch_norms = [name for name, module in model.named_modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    if batch_norms:
        problems.append(f"BatchNorm layers ({', '.join(batch_norms)}) make each example's output depend on the other "
                        "examples of its batch, so no example has a gradient of its own (use a model with GroupNorm "
                        "or LayerNorm instead)")
    for error in errors:
        text = str(error)
        if "BatchNorm" not in text.split(".", 1)[0] and text not in problems:
            problems.append(text)
    return problems


def check_model(model: nn.Module) -> None:
    """Raise DPSGDError naming what Opacus' ModuleValidator refuses in ``model``."""
    problems = model_problems(model)
    if problems:
        raise DPSGDError("privacy.dp_sgd: the model cannot have per-example gradients (Opacus' ModuleValidator): "
                         + "; ".join(problems))


def sample_rate(samples: int, batch_size: int) -> float:
    """The Poisson sampling rate q of a local step: batch_size / samples, at most 1."""
    return min(1.0, batch_size / samples)


def run_seed(config: DPSGDConfig, plan_seed: int) -> int:
    """The seed of one local training run's sampling and noise: secret unless ``noise_seed`` is set."""
    if config.noise_seed is None:
        return secrets.randbits(63)
    return (config.noise_seed * 1_000_003 + int(plan_seed)) % (1 << 63)


def poisson_batches(samples: int, rate: float, steps: int, generator: torch.Generator,
                    device: torch.device) -> Iterator[torch.Tensor]:
    """``steps`` Poisson-sampled index batches (Opacus' sampler: each example with probability
    ``rate``), on ``device``; a batch may be empty."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = UniformWithReplacementSampler(num_samples=samples, sample_rate=rate, generator=generator, steps=steps)
    for indices in sampler:
        yield torch.tensor(indices, dtype=torch.long).to(device)


@dataclass(frozen=True)
class DPSGDUsage:
    """What one local training run spent: ``steps`` noised steps at sampling rate ``sample_rate``
    and ``noise_multiplier``, on ``samples`` training examples."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    samples: int


class PrivateGradients:
    """Per-example clipped and noised gradients for one local training run (Opacus' hooks and
    DPOptimizer around the run's optimizer). :meth:`attach` after every change of the trainable
    set; :meth:`clear` before a batch's backward pass, :meth:`privatize` after it (it puts the
    noised mean into ``.grad``); :meth:`close` at the end."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: DPSGDConfig,
                 expected_batch_size: int, generator: torch.Generator) -> None:
        require_opacus()
        from opacus.optimizers import DPOptimizer

        self.model = model
        self.dp_optimizer = DPOptimizer(optimizer, noise_multiplier=config.noise_multiplier,
                                        max_grad_norm=config.max_grad_norm, expected_batch_size=expected_batch_size,
                                        loss_reduction="mean", generator=generator)
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.hooks = None
        self.steps = 0

    def attach(self) -> None:
        """Opacus' per-example gradient hooks on the modules whose parameters train now."""
        from opacus import GradSampleModule

        self._detach()
        # the lowest trained module's input needs no gradient: torch says its full backward hook
        # then fires on the module's outputs only, which is all Opacus' hook reads
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                                  "respect to module outputs")
        if any(p.requires_grad for p in self.parameters):
            self.hooks = GradSampleModule(self.model, batch_first=True, loss_reduction="mean", strict=False)

    def clear(self) -> None:
        """Forget the previous batch's per-example and summed gradients."""
        for p in self.parameters:
            p.grad_sample = None
            p.summed_grad = None

    def empty_batch(self) -> None:
        """An empty Poisson batch: no example, zero per-example gradients (the step still adds noise)."""
        for p in self.parameters:
            if p.requires_grad:
                p.grad_sample = p.new_zeros((0, *p.shape))

    def privatize(self) -> None:
        """Clip each example's gradient, sum, add the noise, divide by the expected batch size:
        the trained parameters' ``.grad`` (frozen ones keep none)."""
        self.dp_optimizer.pre_step()
        self.steps += 1

    def _detach(self) -> None:
        if self.hooks is not None:
            self.hooks.remove_hooks()
            self.hooks = None

    def close(self) -> None:
        """Take the hooks off and every attribute Opacus put on the parameters."""
        self._detach()
        for p in self.model.parameters():
            for attribute in ("grad_sample", "summed_grad", "_forward_counter", "_current_grad_sample"):
                if hasattr(p, attribute):
                    delattr(p, attribute)
        for module in self.model.modules():
            for attribute in ("activations", "max_batch_len"):
                if hasattr(module, attribute):
                    delattr(module, attribute)


def epsilon(history: Sequence[Sequence[float]], delta: float) -> float:
    """Epsilon of Opacus' RDP accountant over ``history`` ((noise multiplier, sampling rate,
    steps) per local training run) at ``delta``; infinite with a zero noise multiplier."""
    if any(float(sigma) == 0 and int(steps) > 0 for sigma, _, steps in history):
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(sigma), float(q), int(steps)) for sigma, q, steps in history if int(steps) > 0]
    return float(accountant.get_epsilon(delta)) if accountant.history else 0.0


def ledger_path(store_root: str | Path, client: int) -> Path:
    return Path(store_root) / f"{CLIENT_DIR_PREFIX}{client}" / LEDGER_FILE


def spend(store_root: str | Path, client: int, round_number: int, usage: DPSGDUsage | None,
          config: DPSGDConfig) -> dict[str, float]:
    """Add one local training run to the client's privacy ledger; returns its training metrics:
    ``dp_sgd_epsilon`` (over every run so far; left out where infinite, at noise 0),
    ``dp_sgd_delta`` and ``dp_sgd_steps`` (noised steps so far). Empty without a usage."""
    if usage is None:
        return {}
    path = ledger_path(store_root, client)
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    runs.append({"round": round_number, "noise_multiplier": usage.noise_multiplier,
                 "sample_rate": usage.sample_rate, "steps": usage.steps})
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"runs": runs}, indent=1))
    temporary.replace(path)
    delta = config.resolved_delta(usage.samples)
    value = epsilon([(r["noise_multiplier"], r["sample_rate"], r["steps"]) for r in runs], delta)
    metrics = {"dp_sgd_delta": delta, "dp_sgd_steps": float(sum(r["steps"] for r in runs))}
    if math.isfinite(value):
        metrics["dp_sgd_epsilon"] = value
    return metrics
