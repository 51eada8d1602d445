"""DP-SGD's config on the client (``privacy.dp_sgd``; Abadi et al., "Deep Learning with
Differential Privacy", CCS 2016): its section, its values' check, and what it refuses to run
with. The code it checks for is :mod:`fedpart.client.dp_sgd` and
:mod:`fedpart.client.mods.dp_sgd_ledger`; the registration is :data:`fedpart.common.config.run_config.FEATURE_CHECKS`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedpart.common.config.feature_checks import failed, set_while_disabled

if TYPE_CHECKING:
    from fedpart.common.config.run_config import RunConfig
    from fedpart.common.ml.algorithms import Algorithm

DP_SGD_INSTALL = 'pip install -e ".[dp-sgd]"  (Opacus; or pip install "opacus>=1.5")'


@dataclass
class DPSGDConfig:
    """Record-level differential privacy on the client, DP-SGD (Abadi et al., "Deep Learning with
    Differential Privacy", CCS 2016) through Opacus (``fedpart.client.dp_sgd``): every local step
    takes a Poisson sample of the client's training examples (each with probability batch_size /
    samples), clips each example's gradient to ``max_grad_norm`` in L2 over the trained parameters,
    adds Gaussian noise of standard deviation ``noise_multiplier * max_grad_norm`` to their sum and
    divides by the expected batch size. Each client's epsilon, over every round it trained, comes
    from Opacus' RDP accountant and goes into its training metrics (``dp_sgd_epsilon``)."""

    enabled: bool = False
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float | None = None            # None: 1 / (the client's training samples) ** 1.1
    noise_seed: int | None = None         # None: a secret seed per local training run (noise and
                                          # Poisson batches); set only for experiments (no privacy)

    def resolved_delta(self, samples: int) -> float:
        """``delta``, or 1 / samples ** 1.1 where it is unset."""
        return self.delta if self.delta is not None else 1.0 / max(samples, 1) ** 1.1


KEY = "privacy.dp_sgd"


def enabled(config: RunConfig) -> bool:
    """Whether the run's clients train with DP-SGD."""
    return config.privacy.dp_sgd.enabled


def value_errors(config: RunConfig) -> list[str]:
    """What is wrong with the values of ``privacy.dp_sgd`` (none set while it is off, each in
    range), each a sentence naming the key."""
    dp_sgd = config.privacy.dp_sgd
    return set_while_disabled(dp_sgd, KEY) + failed([
        (math.isfinite(dp_sgd.noise_multiplier) and dp_sgd.noise_multiplier >= 0,
         "privacy.dp_sgd.noise_multiplier must be a finite number >= 0"),
        (math.isfinite(dp_sgd.max_grad_norm) and dp_sgd.max_grad_norm > 0,
         "privacy.dp_sgd.max_grad_norm must be a finite number > 0"),
        (dp_sgd.delta is None or 0 < dp_sgd.delta < 1, "privacy.dp_sgd.delta must be in (0, 1)"),
    ])


def refusals(config: RunConfig, algorithm: Algorithm, server_parts: bool = True) -> list[str]:
    """Why ``config`` cannot run with ``privacy.dp_sgd`` on (empty: it can). DP-SGD bounds each
    example's influence on a step by clipping its own gradient; every setting below needs the
    whole batch's gradient, or changes it outside the clip: among them each objective term and
    step rule that says its update couples the examples (``couples_examples``). (Models with
    BatchNorm, which mixes a batch's examples, are refused by the client when it first trains:
    Opacus' ModuleValidator.) ``algorithm``: the run's, as the config check built it. DP-SGD
    asks nothing of the server's parts."""
    train = config.train
    refusals = []
    if train.grad_clip > 0:
        refusals.append("train.grad_clip clips the batch's gradient, which is redundant beside the per-example clip "
                        "privacy.dp_sgd.max_grad_norm: set train.grad_clip: 0")
    if train.amp != "off":
        refusals.append(f"train.amp {train.amp!r}: mixed precision is not combined with Opacus' per-example gradients "
                        "here (fp16's gradient scaler would scale them before the clip): set train.amp: off")
    if train.compile:
        refusals.append("train.compile: the compiled forward does not run Opacus' per-example gradient hooks: set "
                        "train.compile: false")
    objective = algorithm.objective.build()
    refusals += [f"the objective term {term.name}: {term.couples_examples}"
                 for term in objective.terms if term.couples_examples]
    if objective.step_rule.couples_examples:
        refusals.append(f"algorithm {config.algorithm.name} {objective.step_rule.couples_examples}")
    return refusals
