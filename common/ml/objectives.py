"""Client objectives: the local loss and the local update, built from small composable pieces.

In the spirit of FedJAX's client_init / client_step / client_final, a local training run calls

- ``begin(ctx)`` on every term and the step rule (anchors, per-client state),
- per batch, the step rule's ``step``: it asks the loop for gradients of the objective (the data
  loss, plus each term's ``loss``, then each term's ``adjust_gradients`` after the backward pass)
  and updates the parameters,
- ``end(ctx)`` on every term and the step rule (update per-client state).

A **term** changes the loss: FedProx's proximal pull, FedDyn's linear and quadratic terms,
FedDecorr's decorrelation penalty, FedRoD's balanced softmax (a term may replace the data loss).
A **step rule** changes the update: a plain optimizer step, Per-FedAvg's meta step, Ditto's
extra personal step. Per-client state (FedDyn's gradient estimate, Ditto's personal model) lives
in ``ctx.state`` under ``<term>.<tensor>`` keys and persists between rounds on the client.

An algorithm declares its own terms and step rule; ``algorithm.objective`` in the run config adds
terms to any algorithm. Each term and step rule declares its options (:data:`TERMS`,
:data:`STEP_RULES`), read by :meth:`~fedpart.common.components.registry.Registry.read`. Nothing here travels
in the protocol: the client builds the same objective from the run config it receives at join.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedpart.common.components.registry import STEP_RULES, TERMS, Option, describe, finite_positive, non_negative
from fedpart.common.ml.split_model import ModelOutput, SplitModel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Gradients = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> loss, grads in .grad


@dataclass
class ObjectiveContext:
    """What the pieces of an objective see during one local training run."""

    model: SplitModel
    anchors: dict[str, torch.Tensor]  # global values (on the device) of the tensors uploaded as deltas
    state: dict[str, torch.Tensor]    # the client's persistent objective state (``<term>.<tensor>``)
    y_train: torch.Tensor
    lr: float
    loss_fn: LossFn
    parameters: dict[str, nn.Parameter] = field(init=False)

    def __post_init__(self) -> None:
        self.parameters = dict(self.model.named_parameters())

    def anchored(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, global value) of every anchored parameter."""
        return [(n, self.parameters[n], a) for n, a in self.anchors.items() if n in self.parameters]


class Term:
    """A piece of the local loss; every hook is optional. ``couples_examples`` says why the
    term's gradient is not a sum of per-example gradients ("" where it is)."""

    name = ""
    replaces_data_loss = False
    server_step: tuple[str, dict[str, Any]] | None = None  # the server step the term needs
    couples_examples = ""

    def begin(self, ctx: ObjectiveContext) -> None:
        """Before the first step (anchors, per-client state)."""

    def data_loss(self, ctx: ObjectiveContext, out: ModelOutput, y: torch.Tensor) -> torch.Tensor:
        """Replacement of ``loss_fn(prediction, y)`` (only where ``replaces_data_loss``)."""
        raise NotImplementedError

    def loss(self, ctx: ObjectiveContext, out: ModelOutput, y: torch.Tensor) -> torch.Tensor | None:
        """An extra differentiable term of the batch loss."""
        return None

    def adjust_gradients(self, ctx: ObjectiveContext) -> None:
        """A cheap correction of the gradients after the backward pass."""

    def end(self, ctx: ObjectiveContext) -> None:
        """After the last step (update per-client state)."""


class Proximal(Term):
    """FedProx (Li et al., MLSys 2020): ``mu/2 ||w - w_global||^2`` on the anchored tensors,
    applied as the gradient ``mu (w - w_global)``."""

    name = "proximal"

    def __init__(self, mu: float = 0.01) -> None:
        self.mu = mu

    def begin(self, ctx: ObjectiveContext) -> None:
        self.pairs = [(p, a) for _, p, a in ctx.anchored()] if self.mu else []

    def adjust_gradients(self, ctx: ObjectiveContext) -> None:
        for parameter, anchor in self.pairs:
            if parameter.grad is not None:
                parameter.grad.add_(parameter.detach() - anchor, alpha=self.mu)


class FedDyn(Term):
    """FedDyn (Acar et al., ICLR 2021): local loss ``- <g_k, w> + alpha/2 ||w - w_global||^2``;
    after training the client's state ``g_k <- g_k - alpha (w_k - w_global)``."""

    name = "feddyn"

    def __init__(self, alpha: float = 0.01) -> None:
        self.alpha = alpha  # the server step divides by it
        self.server_step = ("feddyn", {"alpha": self.alpha})

    def begin(self, ctx: ObjectiveContext) -> None:
        self.triples = []
        for name, parameter, anchor in ctx.anchored():
            key = f"{self.name}.{name}"
            if key not in ctx.state:
                ctx.state[key] = torch.zeros_like(anchor)
            self.triples.append((parameter, anchor, ctx.state[key]))

    def adjust_gradients(self, ctx: ObjectiveContext) -> None:
        for parameter, anchor, linear in self.triples:
            if parameter.grad is not None:
                parameter.grad.add_(parameter.detach() - anchor, alpha=self.alpha).sub_(linear)

    def end(self, ctx: ObjectiveContext) -> None:
        with torch.no_grad():
            for parameter, anchor, linear in self.triples:
                linear.add_(parameter - anchor, alpha=-self.alpha)


class FedDecorr(Term):
    """FedDecorr (Shi et al., ICLR 2023): ``beta ||K||_F^2 / d^2`` where ``K`` is the correlation
    matrix of the batch's body features (each dimension standardized over the batch)."""

    name = "feddecorr"
    EPS = 1e-5
    couples_examples = "its penalty couples the examples of a batch, so no example has a gradient of its own"

    def __init__(self, beta: float = 0.1) -> None:
        self.beta = beta

    def loss(self, ctx: ObjectiveContext, out: ModelOutput, y: torch.Tensor) -> torch.Tensor | None:
        return self.beta * decorrelation_penalty(out.features, self.EPS) if len(out.features) > 1 else None


def decorrelation_penalty(features: torch.Tensor, eps: float) -> torch.Tensor:
    """``||K||_F^2 / d^2`` of the correlation matrix ``K`` of ``features`` ([batch, d])."""
    count, dims = features.shape
    centered = features - features.mean(dim=0, keepdim=True)
    standardized = centered / torch.sqrt(centered.pow(2).mean(dim=0, keepdim=True) + eps)
    correlation = standardized.T @ standardized / count
    return correlation.pow(2).sum() / dims ** 2


class FedRoDLoss(Term):
    """FedRoD (Chen & Chao, ICLR 2022): the generic head learns with the balanced softmax
    (logits + log class prior of the client), the personal head (extra part ``personal_head``,
    on detached features) with cross-entropy on ``generic.detach() + personal``."""

    name = "fedrod"
    replaces_data_loss = True
    PART = "personal_head"
    couples_examples = ("its balanced softmax reads the class counts of all the client's examples, which the "
                        "per-example clip does not cover")

    def begin(self, ctx: ObjectiveContext) -> None:
        if self.PART not in ctx.model.parts:
            raise ValueError(f"the {self.name} term needs the model's extra part {self.PART!r} "
                             "(algorithm.name: fedrod)")
        self.log_prior: torch.Tensor | None = None

    def data_loss(self, ctx: ObjectiveContext, out: ModelOutput, y: torch.Tensor) -> torch.Tensor:
        if self.log_prior is None:  # classes the client lacks get -inf: a zero share of the softmax
            counts = torch.bincount(ctx.y_train, minlength=out.head.shape[-1]).to(out.head.dtype)
            self.log_prior = torch.log(counts / counts.sum())
        generic = F.cross_entropy(out.head + self.log_prior, y)
        personal = ctx.loss_fn(out.head.detach() + out.parts[self.PART], y)
        return generic + personal


class StepRule:
    """One local update per batch; ``begin``/``end`` as for terms, ``couples_examples`` too (why
    its update is not built from per-example gradients alone; "" where it is)."""

    name = ""
    couples_examples = ""

    def begin(self, ctx: ObjectiveContext) -> None:
        """Before the first step."""

    def step(self, ctx: ObjectiveContext, x: torch.Tensor, y: torch.Tensor, gradients: Gradients,
             optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Update the model on batch ``(x, y)``; returns the batch loss."""
        loss = gradients(x, y)
        optimizer.step()
        return loss

    def end(self, ctx: ObjectiveContext) -> None:
        """After the last step."""

    def evaluation_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model tensors evaluation and personalization start from instead of the received model."""
        return {}


class SGDStep(StepRule):
    """The plain step of the configured optimizer (SGD with the plan's momentum and weight decay)."""

    name = "sgd"


class PerFedAvgStep(StepRule):
    """Per-FedAvg (Fallah et al., NeurIPS 2020): batches come in pairs; the first takes a step of
    size ``alpha`` to ``w'``, the second's gradient at ``w'`` updates ``w`` with step size ``beta``
    (the configured optimizer, its lr set to ``beta``). ``hessian: true`` is the Hessian-free
    variant: the update direction is ``(I - alpha H(w)) g(w')``, with the Hessian-vector product
    taken by double backward (autograd) on the second batch. A last unpaired batch is undone."""

    name = "perfedavg"

    def __init__(self, alpha: float = 0.01, beta: float = 0.001, hessian: bool = False) -> None:
        self.alpha = alpha
        self.beta = beta
        self.hessian = hessian
        self.couples_examples = ("with hessian: true takes a Hessian-vector product of the batch outside the "
                                 "per-example clip and noise: set hessian: false") if hessian else ""

    def begin(self, ctx: ObjectiveContext) -> None:
        self.saved: list[torch.Tensor] | None = None

    def step(self, ctx: ObjectiveContext, x: torch.Tensor, y: torch.Tensor, gradients: Gradients,
             optimizer: torch.optim.Optimizer) -> torch.Tensor:
        trainable = [p for p in ctx.parameters.values() if p.requires_grad]
        loss = gradients(x, y)
        with torch.no_grad():
            if self.saved is None:
                self.saved = [p.detach().clone() for p in trainable]
                for p in trainable:
                    if p.grad is not None:
                        p.sub_(p.grad, alpha=self.alpha)
                return loss
            for p, saved in zip(trainable, self.saved):
                p.copy_(saved)
        self.saved = None
        if self.hessian:
            self._hessian_correction(ctx, trainable, x, y)
        for group in optimizer.param_groups:
            group["lr"] = self.beta
        optimizer.step()
        return loss

    def _hessian_correction(self, ctx: ObjectiveContext, trainable: list[nn.Parameter],
                            x: torch.Tensor, y: torch.Tensor) -> None:
        """``grad <- grad - alpha H(w) grad`` on batch ``(x, y)`` (autograd Hessian-vector product)."""
        with_grad = [p for p in trainable if p.grad is not None]
        vector = [p.grad.detach().clone() for p in with_grad]
        loss = ctx.loss_fn(ctx.model(x), y)
        first = torch.autograd.grad(loss, with_grad, create_graph=True)
        product = torch.autograd.grad(first, with_grad, grad_outputs=vector)
        for p, hv in zip(with_grad, product):
            p.grad.sub_(hv, alpha=self.alpha)

    def end(self, ctx: ObjectiveContext) -> None:
        if self.saved is not None:
            with torch.no_grad():
                trainable = [p for p in ctx.parameters.values() if p.requires_grad]
                for p, saved in zip(trainable, self.saved):
                    p.copy_(saved)


class DittoStep(StepRule):
    """Ditto (Li et al., ICML 2021): the received model trains as in FedAvg (its delta goes up);
    on the same batches the client's personal model ``v`` takes a plain step of the plan's lr on
    ``loss(v) + lambda/2 ||v - w_global||^2``. ``v`` starts as the first model received, stays on
    the client, and evaluation and personalization start from it."""

    name = "ditto"
    couples_examples = "trains its personal model with gradients of its own, outside the per-example clip and noise"

    def __init__(self, lam: float) -> None:
        self.lam = lam

    def begin(self, ctx: ObjectiveContext) -> None:
        prefix = f"{self.name}."
        for name, tensor in ctx.model.state_dict().items():
            ctx.state.setdefault(prefix + name, tensor.detach().clone())
        self.personal = {name: ctx.state[prefix + name] for name in ctx.model.state_dict()}
        self.trained = {name: self.personal[name].requires_grad_(True) for name in ctx.parameters}

    def step(self, ctx: ObjectiveContext, x: torch.Tensor, y: torch.Tensor, gradients: Gradients,
             optimizer: torch.optim.Optimizer) -> torch.Tensor:
        loss = super().step(ctx, x, y, gradients, optimizer)
        personal_loss = ctx.loss_fn(torch.func.functional_call(ctx.model, self.personal, (x,)), y)
        grads = torch.autograd.grad(personal_loss, list(self.trained.values()))
        with torch.no_grad():
            for (name, value), grad in zip(self.trained.items(), grads):
                if name in ctx.anchors:
                    grad = grad.add(value - ctx.anchors[name], alpha=self.lam)
                value.sub_(grad, alpha=ctx.lr)
        return loss

    def end(self, ctx: ObjectiveContext) -> None:
        for value in self.trained.values():
            value.requires_grad_(False)

    def evaluation_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        prefix = f"{self.name}."
        return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}


_NON_NEGATIVE = "must be >= 0"
MU = Option("mu", float, "weight of the proximal pull towards the global model", non_negative, _NON_NEGATIVE)
"""FedProx's ``mu`` (the proximal term's, and the option of the algorithms that bring it)."""
PERFEDAVG_OPTIONS = (
    Option("alpha", float, "step size of the first batch of a pair (to w')", non_negative, _NON_NEGATIVE),
    Option("beta", float, "step size of the update of w", non_negative, _NON_NEGATIVE),
    Option("hessian", bool, "the Hessian-free variant: (I - alpha H(w)) g(w')"))
"""Per-FedAvg's options (the step rule's, and the algorithm's)."""
DITTO_LAMBDA = Option("lambda", float, "pull of the personal model towards the global one", non_negative,
                      _NON_NEGATIVE, 0.1)
"""Ditto's ``lambda`` (the step rule's, and the algorithm's; a keyword in Python, so declared with its default)."""

TERMS.register(Proximal.name, describe(Proximal), MU)(Proximal)
TERMS.register(FedDyn.name, describe(FedDyn),
               Option("alpha", float, "weight of the dynamic regularizer; the server step divides by it",
                      finite_positive, "must be > 0"))(FedDyn)
TERMS.register(FedDecorr.name, describe(FedDecorr),
               Option("beta", float, "weight of the decorrelation penalty", non_negative, _NON_NEGATIVE))(FedDecorr)
TERMS.register(FedRoDLoss.name, describe(FedRoDLoss))(FedRoDLoss)
STEP_RULES.register(SGDStep.name, describe(SGDStep))(SGDStep)
STEP_RULES.register(PerFedAvgStep.name, describe(PerFedAvgStep), *PERFEDAVG_OPTIONS)(PerFedAvgStep)
STEP_RULES.register(DittoStep.name, describe(DittoStep), DITTO_LAMBDA)(lambda **o: DittoStep(o["lambda"]))


@dataclass
class Objective:
    """The terms and the step rule of one local training run (fresh per run)."""

    terms: tuple[Term, ...]
    step_rule: StepRule

    def begin(self, ctx: ObjectiveContext) -> None:
        for term in self.terms:
            term.begin(ctx)
        self.step_rule.begin(ctx)

    def batch_loss(self, ctx: ObjectiveContext, out: ModelOutput, y: torch.Tensor) -> torch.Tensor:
        """The data loss (or a term's replacement of it) plus every term's extra loss."""
        replacing = [t for t in self.terms if t.replaces_data_loss]
        loss = replacing[0].data_loss(ctx, out, y) if replacing else ctx.loss_fn(out.prediction, y)
        for term in self.terms:
            extra = term.loss(ctx, out, y)
            if extra is not None:
                loss = loss + extra
        return loss

    def adjust_gradients(self, ctx: ObjectiveContext) -> None:
        for term in self.terms:
            term.adjust_gradients(ctx)

    def end(self, ctx: ObjectiveContext) -> None:
        self.step_rule.end(ctx)
        for term in self.terms:
            term.end(ctx)


@dataclass(frozen=True)
class ObjectiveSpec:
    """A validated objective declaration: terms with their options, and a step rule."""

    terms: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    step_rule: tuple[str, Mapping[str, Any]] = ("sgd", {})

    def build(self) -> Objective:
        """Fresh term and step-rule objects for one local training run (the options as
        :func:`checked` read them)."""
        return Objective(tuple(TERMS.build(name, options) for name, options in self.terms),
                         STEP_RULES.build(*self.step_rule))

    def with_terms(self, terms: Mapping[str, Mapping[str, Any] | None]) -> "ObjectiveSpec":
        """This objective plus ``terms`` (``algorithm.objective`` of the run config), validated."""
        have = {name for name, _ in self.terms}
        clash = sorted(have & set(terms))
        if clash:
            raise ValueError(f"algorithm.objective: the algorithm already has the term(s) {clash}")
        return checked(ObjectiveSpec(self.terms + tuple((n, {} if o is None else o) for n, o in terms.items()),
                                     self.step_rule))

    @property
    def server_step(self) -> tuple[str, dict[str, Any]] | None:
        """The server step a term needs (FedDyn's), if any."""
        steps = [t.server_step for t in self.build().terms if t.server_step is not None]
        return steps[0] if steps else None


def checked(spec: ObjectiveSpec) -> ObjectiveSpec:
    """``spec`` with the options of every term (at ``algorithm.objective.<term>``) and of the step
    rule (at ``algorithm``, whose options they are) read by their registries, once the pieces
    combine (else a ValueError naming the setting)."""
    rule, rule_options = spec.step_rule
    spec = ObjectiveSpec(tuple((name, TERMS.read(name, options, f"algorithm.objective.{name}.",
                                                 f"algorithm.objective.{name}"))
                               for name, options in spec.terms),
                         (rule, STEP_RULES.read(rule, rule_options, "algorithm.", "algorithm")))
    objective = spec.build()
    if sum(t.replaces_data_loss for t in objective.terms) > 1:
        raise ValueError("algorithm.objective: at most one term may replace the data loss "
                         f"({[t.name for t in objective.terms if t.replaces_data_loss]})")
    if sum(t.server_step is not None for t in objective.terms) > 1:
        raise ValueError("algorithm.objective: at most one term may choose the server step")
    return spec
