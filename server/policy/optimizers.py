"""Server optimizers: the step that turns a round's combined delta into the new global tensors.

The aggregator (``fedpart.server.policy.aggregation``) combines the round's deltas ``d_i = w_i - w``
into one delta per tensor, ``d`` (the weighted mean, or a robust combination); a server
optimizer then moves the global model along it. With ``-d`` as the pseudo-gradient this is the
FedOpt framework of Reddi et al. (ICLR 2021): plain averaging is server SGD with learning rate 1.

Every optimizer has the same interface: :meth:`ServerOptimizer.step` returns the new value of
each global tensor that has a delta (in its dtype; the arithmetic is float64), and
:meth:`ServerOptimizer.state` / :meth:`ServerOptimizer.load_state` carry its state as named
float64 tensors in the run state (``fedpart.server.engine.run_state``), so a resumed run continues
with the same numbers. A stateful optimizer keeps a tensor's old state when that tensor's new
value is not finite: the round engine never installs such a value, and the state stays that of
the global tensor that is kept.

Each optimizer is declared in :data:`fedpart.common.components.registry.SERVER_OPTIMIZERS` with its options
and capabilities (:mod:`fedpart.common.components.server_parts`, which the run config's check reads) and
implemented here (its constructor's defaults are the declared ones); ``server_optimizer`` in the
run config selects one by name or by ``package.module:name`` (a new optimizer from outside fedpart
is one module). FedDyn's step is not chosen there: the FedDyn objective term declares it
(``Algorithm.server_step``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedpart.common.components.registry import SERVER_OPTIMIZERS


@dataclass(frozen=True)
class RoundDelta:
    """What a server optimizer sees of one round."""

    mean: Mapping[str, torch.Tensor]  # the combined delta of each tensor (float64)
    results: Mapping[str, int]        # how many results sent each tensor
    second_moment: float | None = None
    """``sum_i p_i ||d_i||^2`` over the round's results, ``p_i`` their aggregation weights
    normalised to sum 1; recorded only for an optimizer that ``needs_result_norms``."""


def apply_deltas(global_state: Mapping[str, torch.Tensor], directions: Mapping[str, torch.Tensor],
                 scale: float) -> dict[str, torch.Tensor]:
    """``new = old + scale * direction`` in float64 for the tensors that have a direction, each
    new tensor in its old tensor's dtype."""
    updated = {}
    for name, direction in directions.items():
        old = global_state[name]
        new = old.to(torch.float64, copy=True)  # added to in place (a scale of 1.0 is not multiplied)
        new.add_(direction if scale == 1.0 else scale * direction)
        updated[name] = new.to(old.dtype)
    return updated


def _finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


class ServerOptimizer:
    """One server step per round over the combined delta; stateless unless a subclass says so."""

    name: ClassVar[str] = ""
    needs_result_norms: ClassVar[bool] = False  # whether ``step`` reads ``RoundDelta.second_moment``
    needs_result_counts: ClassVar[bool] = False  # whether ``step`` reads ``RoundDelta.results``

    def step(self, global_state: Mapping[str, torch.Tensor], delta: RoundDelta) -> dict[str, torch.Tensor]:
        """The new value of every global tensor in ``delta.mean``."""
        raise NotImplementedError

    def state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state as named tensors (``<kind>/<global tensor name>``)."""
        return {}

    def report(self) -> dict[str, float]:
        """What the last step chose, for the round's metrics (FedExp: its step size)."""
        return {}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from ``state``, as :meth:`state` returned it."""
        if state:
            raise ValueError(f"server optimizer {self.name} has no state, got {sorted(state)[:3]}")


@SERVER_OPTIMIZERS.implement("plain")
class Plain(ServerOptimizer):
    """``new = old + lr * d``: FedAvg's averaging at ``lr`` 1 (McMahan et al., AISTATS 2017), a
    server learning rate otherwise. No state."""

    name = "plain"

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = lr

    def step(self, global_state: Mapping[str, torch.Tensor], delta: RoundDelta) -> dict[str, torch.Tensor]:
        return apply_deltas(global_state, delta.mean, self.lr)


class StatefulOptimizer(ServerOptimizer):
    """A server optimizer with per-tensor state: float64 tensors named ``<kind>/<tensor>``,
    created at a tensor's first delta."""

    kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._state: dict[str, torch.Tensor] = {}

    def tensor_step(self, name: str, delta: torch.Tensor,
                    round_delta: RoundDelta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The float64 change of tensor ``name`` and its new state ``{kind: tensor}``."""
        raise NotImplementedError

    def initial(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        """The state ``kind`` of a tensor before its first delta (zeros unless overridden)."""
        return torch.zeros_like(like, dtype=torch.float64)

    def held(self, kind: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """The current state ``kind`` of tensor ``name``."""
        key = f"{kind}/{name}"
        return self._state[key] if key in self._state else self.initial(kind, like)

    def step(self, global_state: Mapping[str, torch.Tensor], delta: RoundDelta) -> dict[str, torch.Tensor]:
        changes, states = {}, {}
        for name, mean in delta.mean.items():
            changes[name], states[name] = self.tensor_step(name, mean, delta)
        updated = apply_deltas(global_state, changes, 1.0)
        for name, state in states.items():
            if _finite(updated[name]):  # a new value the round engine refuses leaves the state as it was
                self._state.update({f"{kind}/{name}": value for kind, value in state.items()})
        return updated

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self._state)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(key for key in state if key.split("/", 1)[0] not in self.kinds)
        if unknown:
            raise ValueError(f"server optimizer {self.name} has no state {unknown[:3]} (its state: {list(self.kinds)})")
        self._state = {key: value.to(torch.float64) for key, value in state.items()}


@SERVER_OPTIMIZERS.implement("fedavgm")
class FedAvgM(StatefulOptimizer):
    """Server momentum (FedAvgM, Hsu et al., "Measuring the Effects of Non-Identical Data
    Distribution for Federated Visual Classification", 2019): ``v <- beta v + d``,
    ``new = old + lr v``; ``v`` starts at zero."""

    name = "fedavgm"
    kinds = ("momentum",)

    def __init__(self, lr: float = 1.0, beta: float = 0.9) -> None:
        super().__init__()
        self.lr = lr
        self.beta = beta

    def tensor_step(self, name: str, delta: torch.Tensor,
                    round_delta: RoundDelta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        momentum = self.held("momentum", name, delta) * self.beta + delta
        return self.lr * momentum, {"momentum": momentum}


@SERVER_OPTIMIZERS.implement("fedadam")
class FedAdam(StatefulOptimizer):
    """FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
    ``m <- beta1 m + (1 - beta1) d``, ``v <- beta2 v + (1 - beta2) d^2``,
    ``new = old + lr m / (sqrt(v) + tau)``, elementwise and without bias correction, from
    ``m = 0`` and ``v = tau^2`` (the paper asks ``v >= tau^2``). ``beta1`` 0.9 and ``beta2`` 0.99
    are the values the paper fixes; it tunes ``lr`` and ``tau`` per task, so the defaults here
    (0.01 and 1e-3) are a starting point."""

    name = "fedadam"
    kinds = ("m", "v")

    def __init__(self, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau

    def initial(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        start = super().initial(kind, like)
        return start.fill_(self.tau ** 2) if kind == "v" else start

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        """Adam's ``v`` update."""
        return v * self.beta2 + squared * (1 - self.beta2)

    def tensor_step(self, name: str, delta: torch.Tensor,
                    round_delta: RoundDelta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m = self.held("m", name, delta) * self.beta1 + delta * (1 - self.beta1)
        v = self.second_moment(self.held("v", name, delta), delta.square())
        return self.lr * m / (v.sqrt() + self.tau), {"m": m, "v": v}


@SERVER_OPTIMIZERS.implement("fedyogi")
class FedYogi(FedAdam):
    """FedYogi (Reddi et al., ICLR 2021, Algorithm 2): FedAdam with Yogi's second moment
    ``v <- v - (1 - beta2) d^2 sign(v - d^2)``, which grows ``v`` only as fast as ``d^2`` needs;
    same options and defaults as :class:`FedAdam`."""

    name = "fedyogi"

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        return v - squared * (1 - self.beta2) * torch.sign(v - squared)


@SERVER_OPTIMIZERS.implement("fedexp")
class FedExp(ServerOptimizer):
    """FedExp (Jhunjhunwala, Wang & Joshi, "FedExP: Speeding Up Federated Averaging via
    Extrapolation", ICLR 2023): ``new = old + eta d`` with the adaptive step size
    ``eta = max(1, sum_i ||d_i||^2 / (2 M (||d||^2 + eps)))`` over the round's M results, the
    norms taken over all delta tensors of a result together. No state.

    With sample weighting (``train.weighting: samples``) ``d`` is the weighted mean and the
    average ``(1/M) sum_i ||d_i||^2`` is weighted the same way, ``sum_i p_i ||d_i||^2`` with
    ``p_i = n_i / sum_j n_j``, as in the authors' code; with uniform weights it is the paper's
    formula. By Jensen's inequality the weighted average of the squared norms is at least the
    squared norm of the weighted mean, so ``eta`` measures how far the clients' updates disagree.
    ``eps`` 1e-3 is the authors' value for CIFAR; their code also multiplies it by M and decays
    it by 0.998^2 per round, and it evaluates the average of the last two global models (neither
    is done here)."""

    name = "fedexp"
    needs_result_norms = True

    def __init__(self, eps: float = 1e-3) -> None:
        self.eps = eps
        self.last_step_size: float | None = None

    def step_size(self, delta: RoundDelta) -> float:
        """``eta`` of the round (1 for a round without results)."""
        if delta.second_moment is None:
            raise ValueError("FedExp needs the squared norms of the round's deltas")
        mean_squared = math.fsum(float(t.square().sum()) for t in delta.mean.values())
        return max(1.0, delta.second_moment / (2 * (mean_squared + self.eps)))

    def step(self, global_state: Mapping[str, torch.Tensor], delta: RoundDelta) -> dict[str, torch.Tensor]:
        self.last_step_size = self.step_size(delta)
        return apply_deltas(global_state, delta.mean, self.last_step_size)

    def report(self) -> dict[str, float]:
        return {} if self.last_step_size is None else {"step_size": self.last_step_size}


@SERVER_OPTIMIZERS.implement("feddyn")
class FedDyn(StatefulOptimizer):
    """FedDyn's server step (Acar et al., "Federated Learning Based on Dynamic Regularization",
    ICLR 2021, Algorithm 1): ``h <- h - alpha (|P| / m) d``, ``new = old + d - h / alpha``, with
    ``|P|`` the results that sent the tensor and ``m`` all clients of the run; ``h`` starts at
    zero. The paper averages uniformly: with ``train.weighting: samples``, ``d`` is the sample-
    weighted mean. Selected by the FedDyn objective term (``Term.server_step``), with its ``alpha``."""

    name = "feddyn"
    kinds = ("h",)
    needs_result_counts = True

    def __init__(self, alpha: float, clients: int) -> None:
        super().__init__()
        if not alpha > 0:
            raise ValueError(f"FedDyn's server step needs alpha > 0, got {alpha}")
        self.alpha = alpha
        self.clients = clients

    def tensor_step(self, name: str, delta: torch.Tensor,
                    round_delta: RoundDelta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        share = round_delta.results[name] / self.clients
        h = self.held("h", name, delta) - delta * (self.alpha * share)
        return delta - h / self.alpha, {"h": h}


OPTIMIZERS = SERVER_OPTIMIZERS
"""Every server step by name; all but ``feddyn`` can be chosen with ``server_optimizer.name``."""


def build_server_optimizer(name: str, options: Mapping[str, object], declared: tuple[str, Mapping[str, object]] | None,
                           clients: int) -> ServerOptimizer:
    """The run's server optimizer: the step an objective term ``declared`` (FedDyn's, given
    ``clients``, the number of clients of the run), else ``name`` (a name or a plug-in's path)
    with ``options`` (the ``server_optimizer`` section, validated by the config)."""
    if declared is not None:
        step, step_options = declared
        return SERVER_OPTIMIZERS[step](**step_options, clients=clients)
    return SERVER_OPTIMIZERS.resolve(name, "server_optimizer.name")(**options)
