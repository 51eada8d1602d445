"""Client objective terms and step rules against hand-computed cases, and their validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedpart.client.local_data import ClientData
from fedpart.client.training import train_local
from fedpart.common.ml.algorithms import build_algorithm
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.models.zoo import build_model
from fedpart.common.ml.objectives import ObjectiveContext, ObjectiveSpec, decorrelation_penalty
from fedpart.common.wire.plans import Phase, TrainPlan
from fedpart.common.ml.split_model import ModelOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(algorithm: str = "fedavg"):
    model = build_model("mlp", num_classes=3, input_shape=(1, 2, 2), seed=0)
    return build_algorithm(algorithm).add_parts(model)


def context(model, anchors=None, state=None, y=None, lr=0.1) -> ObjectiveContext:
    return ObjectiveContext(model, anchors or {}, {} if state is None else state,
                            torch.tensor([0, 0, 1]) if y is None else y, lr, F.cross_entropy)


def one_term(name: str, **options):
    return ObjectiveSpec(terms=((name, options),)).build()


def test_feddyn_gradient_and_state_update_by_hand():
    """grad = dL + alpha (w - w_global) - g_k; afterwards g_k <- g_k - alpha (w_k - w_global)."""
    model = tiny_model()
    weight = model.head.weight
    with torch.no_grad():
        weight.fill_(2.0)
    anchor = torch.full_like(weight, 1.5)
    state = {"feddyn.head.weight": torch.full_like(weight, 0.25)}
    ctx = context(model, {"head.weight": anchor}, state)
    objective = one_term("feddyn", alpha=0.1)
    objective.begin(ctx)
    weight.grad = torch.ones_like(weight)
    objective.adjust_gradients(ctx)
    torch.testing.assert_close(weight.grad, torch.full_like(weight, 1 + 0.1 * 0.5 - 0.25))
    objective.end(ctx)
    torch.testing.assert_close(state["feddyn.head.weight"], torch.full_like(weight, 0.25 - 0.1 * 0.5))


def test_feddyn_state_starts_at_zero_and_declares_its_server_step():
    model = tiny_model()
    ctx = context(model, {"head.bias": model.head.bias.detach().clone()})
    one_term("feddyn", alpha=0.5).begin(ctx)
    assert torch.equal(ctx.state["feddyn.head.bias"], torch.zeros(3))
    assert build_algorithm("fedbug", {}, {"feddyn": {"alpha": 0.5}}).server_step == ("feddyn", {"alpha": 0.5})
    assert build_algorithm("fedavg").server_step is None


def test_proximal_gradient_by_hand():
    model = tiny_model()
    bias = model.head.bias
    with torch.no_grad():
        bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    ctx = context(model, {"head.bias": torch.zeros(3)})
    objective = one_term("proximal", mu=0.5)
    objective.begin(ctx)
    bias.grad = torch.zeros(3)
    objective.adjust_gradients(ctx)
    torch.testing.assert_close(bias.grad, torch.tensor([0.5, 1.0, 1.5]))


def test_decorrelation_penalty_by_hand():
    """Two perfectly correlated dimensions: K = [[1, 1], [1, 1]], ||K||^2 / d^2 = 4 / 4 = 1;
    two uncorrelated ones: K = I, 2 / 4."""
    correlated = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    assert math.isclose(float(decorrelation_penalty(correlated, 0.0)), 1.0, rel_tol=1e-6)
    uncorrelated = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    assert math.isclose(float(decorrelation_penalty(uncorrelated, 0.0)), 0.5, rel_tol=1e-6)


def test_feddecorr_adds_beta_times_the_penalty():
    model = tiny_model()
    features = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    out = ModelOutput(features, torch.zeros(2, 3), {}, torch.zeros(2, 3))
    y = torch.tensor([0, 1])
    loss = one_term("feddecorr", beta=0.3).batch_loss(context(model), out, y)
    expected = F.cross_entropy(out.prediction, y) + 0.3 * decorrelation_penalty(features, 1e-5)
    torch.testing.assert_close(loss, expected)


def test_fedrod_balanced_softmax_and_personal_loss_by_hand():
    """Client prior (2/3, 1/3, 0): generic loss = CE(generic + log prior); personal loss =
    CE(generic.detach() + personal); the personal head gets no gradient from the generic loss."""
    model = tiny_model("fedrod")
    generic = torch.tensor([[1.0, 0.0, 5.0]], requires_grad=True)
    personal = torch.tensor([[0.0, 1.0, 0.0]], requires_grad=True)
    out = ModelOutput(torch.zeros(1, 2), generic, {"personal_head": personal}, generic + personal)
    objective = ObjectiveSpec(terms=(("fedrod", {}),)).build()
    ctx = context(model, y=torch.tensor([0, 0, 1]))
    objective.begin(ctx)
    loss = objective.batch_loss(ctx, out, torch.tensor([0]))
    # balanced: logits 1 + log 2/3, 0 + log 1/3, -inf -> p(0) = 2e / (2e + 1)
    balanced = -math.log(2 * math.e / (2 * math.e + 1))
    personal_ce = -math.log(math.exp(1) / (math.exp(1) + math.exp(1) + math.exp(5)))
    assert math.isclose(loss.item(), balanced + personal_ce, rel_tol=1e-6)
    loss.backward()
    assert generic.grad[0, 2] == 0  # an absent class gets no share of the balanced softmax
    torch.testing.assert_close(personal.grad, torch.softmax(torch.tensor([[1.0, 1.0, 5.0]]), 1) - torch.tensor([[1.0, 0, 0]]))


def test_fedrod_model_adds_a_zero_personal_head_on_detached_features():
    model = tiny_model("fedrod")
    assert [n for n in model.state_dict() if n.startswith("parts.")] == ["parts.personal_head.weight",
                                                                         "parts.personal_head.bias"]
    x = torch.randn(4, 1, 2, 2)
    out = model(x, pieces=True)
    assert torch.equal(out.prediction, out.head)  # the personal head starts at zero
    out.parts["personal_head"].sum().backward()
    assert all(p.grad is None for p in model.body.parameters())


def toy_data(n: int = 8) -> ClientData:
    gen = torch.Generator().manual_seed(0)
    return ClientData(torch.randn(n, 1, 2, 2, generator=gen), torch.randint(0, 3, (n,), generator=gen),
                      torch.randn(2, 1, 2, 2, generator=gen), torch.randint(0, 3, (2,), generator=gen))


def plan(batch_size: int, epochs: int = 1, lr: float = 0.1) -> TrainPlan:
    return TrainPlan(phases=(Phase(epochs, ("fc1", "fc2", "head")),), lr=lr, batch_size=batch_size, seed=3)


FLOPS = {"fc1": 1, "fc2": 1, "head": 1}


def test_perfedavg_first_order_meta_step_by_hand():
    """Two batches = one meta step: w' = w - alpha g(w; D1), w <- w - beta g(w'; D2)."""
    data = toy_data(n=8)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    first, second = order[:4], order[4:]
    expected = tiny_model()
    params = list(expected.parameters())
    saved = [p.detach().clone() for p in params]
    grads = torch.autograd.grad(F.cross_entropy(expected(data.x_train[first]), data.y_train[first]), params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(0.05 * g)
    grads = torch.autograd.grad(F.cross_entropy(expected(data.x_train[second]), data.y_train[second]), params)
    with torch.no_grad():
        for p, s, g in zip(params, saved, grads):
            p.copy_(s - 0.2 * g)
    model = tiny_model()
    objective = ObjectiveSpec(step_rule=("perfedavg", {"alpha": 0.05, "beta": 0.2})).build()
    train_local(model, data, plan(batch_size=4), F.cross_entropy, {}, FLOPS, objective)
    for (name, value), want in zip(model.named_parameters(), params):
        torch.testing.assert_close(value, want, msg=name)


def test_perfedavg_hessian_free_subtracts_alpha_times_the_hessian_vector_product():
    """HF direction (I - alpha H(w; D2)) g(w'; D2), the Hessian-vector product by double backward."""
    data = toy_data(n=8)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    first, second = order[:4], order[4:]
    expected = tiny_model()
    params = list(expected.parameters())
    saved = [p.detach().clone() for p in params]
    grads = torch.autograd.grad(F.cross_entropy(expected(data.x_train[first]), data.y_train[first]), params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(0.05 * g)
    outer = torch.autograd.grad(F.cross_entropy(expected(data.x_train[second]), data.y_train[second]), params)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    # H v forward-over-reverse (torch.func), independent of the double backward under test
    names = [n for n, _ in expected.named_parameters()]

    def loss_at(values: dict[str, torch.Tensor]) -> torch.Tensor:
        prediction = torch.func.functional_call(expected, values, (data.x_train[second],))
        return F.cross_entropy(prediction, data.y_train[second])

    _, product = torch.func.jvp(torch.func.grad(loss_at), (dict(zip(names, saved)),), (dict(zip(names, outer)),))
    want = [s - 0.2 * (v - 0.05 * product[n]) for n, s, v in zip(names, saved, outer)]
    model = tiny_model()
    objective = ObjectiveSpec(step_rule=("perfedavg", {"alpha": 0.05, "beta": 0.2, "hessian": True})).build()
    train_local(model, data, plan(batch_size=4), F.cross_entropy, {}, FLOPS, objective)
    for (name, value), expected_value in zip(model.named_parameters(), want):
        torch.testing.assert_close(value, expected_value, msg=name)


def test_ditto_personal_model_step_by_hand():
    """One batch: w takes the plain step; v <- v - lr (g(v) + lambda (v - w_global))."""
    data = toy_data(n=4)
    model = tiny_model()
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    v = {n: t + 0.1 for n, t in start.items()}
    state = {f"ditto.{n}": t.clone() for n, t in v.items()}
    order = torch.randperm(4, generator=torch.Generator().manual_seed(3))
    reference = tiny_model()
    reference.load_state_dict(v)
    params = dict(reference.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(reference(data.x_train[order]), data.y_train[order]),
                                list(params.values()))
    want = {n: v[n] - 0.1 * (g + 0.5 * (v[n] - start[n])) for n, g in zip(params, grads)}
    objective = ObjectiveSpec(step_rule=("ditto", {"lambda": 0.5})).build()
    train_local(model, data, plan(batch_size=4), F.cross_entropy, start, FLOPS, objective, state)
    for name, value in want.items():
        torch.testing.assert_close(state[f"ditto.{name}"], value, msg=name)
    assert not any(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters())
    assert objective.step_rule.evaluation_state(state).keys() == start.keys()


def test_augment_transforms_every_training_batch():
    seen = []

    def augment(x: torch.Tensor) -> torch.Tensor:
        seen.append(len(x))
        return x

    train_local(tiny_model(), toy_data(n=8), plan(batch_size=3, epochs=2), F.cross_entropy, {}, FLOPS,
                augment=augment)
    assert seen == [3, 3, 2] * 2


@pytest.mark.parametrize("objective, message", [
    ({"fedddyn": {}}, "unknown objective term 'fedddyn'"),
    ({"feddyn": {"alpah": 0.1}}, r"algorithm.objective.feddyn.alpah: not an option of objective term 'feddyn'"),
    ({"feddyn": {"alpha": "x"}}, r"algorithm.objective.feddyn.alpha"),
    ({"feddyn": {"alpha": 0}}, r"algorithm.objective.feddyn.alpha must be > 0"),
    ({"feddecorr": {"beta": -1.0}}, "must be >= 0"),
    ({"feddyn": 3}, "must be a mapping"),
])
def test_bad_objective_is_a_config_error(objective, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"algorithm": {"name": "fedbug", "objective": objective}})


def test_objective_composes_with_any_algorithm_but_not_twice():
    config = config_from_dict({"algorithm": {"name": "fedbug", "objective": {"feddyn": {"alpha": 0.1},
                                                                             "feddecorr": {}}}})
    assert config.algorithm.objective == {"feddyn": {"alpha": 0.1}, "feddecorr": {}}
    algorithm = build_algorithm("fedbug", {"mu": 0.1}, {"feddecorr": None})
    assert [name for name, _ in algorithm.objective.terms] == ["proximal", "feddecorr"]
    with pytest.raises(ValueError, match="already has the term"):
        build_algorithm("fedprox", {}, {"proximal": {"mu": 1.0}})
