"""What a run config may name for the parts only the server runs: the server optimizers and the
robust aggregators, with their options and capabilities (:meth:`Registry.declare`).

The configuration checks a run config against these declarations, so validating it imports no
server module; the server implements each (``fedpart.server.policy.optimizers``,
``fedpart.server.policy.robust``: :meth:`Registry.implement`), and an implementation whose defaults or
capabilities disagree with its declaration is refused when it registers. A new built-in server
optimizer or robust aggregator is declared here and implemented in the server; one from outside
fedpart is a single module (docs/plugins.md).
"""

from __future__ import annotations

from fedpart.common.components.registry import REQUIRED, ROBUST_AGGREGATORS, SERVER_OPTIMIZERS, Option, finite_positive

_POSITIVE = "must be a finite number > 0"


def _lr(default: float) -> Option:
    return Option("lr", float, "server learning rate", finite_positive, _POSITIVE, default)


def _beta(name: str, help: str, default: float) -> Option:
    return Option(name, float, help, lambda value: 0 <= value < 1, "must be in [0, 1)", default)


_ADAPTIVE = (_lr(0.01), _beta("beta1", "first-moment decay", 0.9), _beta("beta2", "second-moment decay", 0.99),
             Option("tau", float, "adaptivity: added to the root of the second moment", finite_positive, _POSITIVE,
                    1e-3))

SERVER_OPTIMIZERS.declare("plain", "new = old + lr * d: FedAvg's averaging at lr 1.", _lr(1.0))
SERVER_OPTIMIZERS.declare("fedavgm", "Server momentum (FedAvgM, Hsu et al. 2019).", _lr(1.0),
                          _beta("beta", "momentum", 0.9))
SERVER_OPTIMIZERS.declare("fedadam", "FedAdam (Reddi et al., ICLR 2021), without bias correction.", *_ADAPTIVE)
SERVER_OPTIMIZERS.declare("fedyogi", "FedYogi (Reddi et al., ICLR 2021): FedAdam with Yogi's second moment.",
                          *_ADAPTIVE)
SERVER_OPTIMIZERS.declare("fedexp", "FedExP (Jhunjhunwala et al., ICLR 2023): an extrapolated step size.",
                          Option("eps", float, "added to the squared norm of the mean", finite_positive, _POSITIVE,
                                 1e-3),
                          capabilities=("needs_result_norms",))
SERVER_OPTIMIZERS.declare("feddyn", "FedDyn's server step (Acar et al., ICLR 2021).",
                          Option("alpha", float, "FedDyn's alpha", finite_positive, _POSITIVE, REQUIRED),
                          capabilities=("needs_result_counts",),
                          not_by_name="FedDyn's server step comes with its objective term, algorithm.objective.feddyn")

ROBUST_AGGREGATORS.declare("mean", "The streaming weighted mean (train.weighting), folded as results arrive.",
                           capabilities=("linear",))
ROBUST_AGGREGATORS.declare("median", "The coordinate-wise median of the round's deltas (Yin et al., ICML 2018).")
ROBUST_AGGREGATORS.declare(
    "trimmed_mean", "The coordinate-wise mean without the largest and smallest values (Yin et al., ICML 2018).",
    Option("trim_fraction", float, "robust.trim_fraction: share cut at each end of every coordinate",
           lambda value: 0 <= value < 0.5, "must be in [0, 0.5)", REQUIRED))
