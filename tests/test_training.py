"""Local training under freeze schedules: exact freezing, no_grad prefixes, phases, FedBug, FedProx, FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedpart.client.local_data import ClientData
from fedpart.client.training import step_flops, train_local
from fedpart.common.ml.algorithms import UNFREEZE_FRACTION, gradual_unfreezing
from fedpart.common.models.zoo import build_model, unit_forward_flops
from fedpart.common.ml.objectives import ObjectiveSpec
from fedpart.common.wire.plans import Phase, TrainPlan
from fedpart.common.ml.split_model import SplitModel

INPUT_SHAPE = (1, 4, 4)
UNITS = ("fc1", "fc2", "head")
TOY_FLOPS = {"fc1": 1, "fc2": 10, "head": 100}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(seed: int = 0) -> SplitModel:
    return build_model("mlp", num_classes=3, input_shape=INPUT_SHAPE, seed=seed)


def make_data(n: int = 40, seed: int = 0) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    return ClientData(
        x_train=torch.randn(n, *INPUT_SHAPE, generator=gen),
        y_train=torch.randint(0, 3, (n,), generator=gen),
        x_test=torch.randn(10, *INPUT_SHAPE, generator=gen),
        y_test=torch.randint(0, 3, (10,), generator=gen),
    )


def make_plan(*phases, lr=0.1, momentum=0.9, weight_decay=1e-2, batch_size=10, seed=1,
              grad_clip=0.0) -> TrainPlan:
    return TrainPlan(phases=tuple(Phase(epochs, tuple(units), {UNFREEZE_FRACTION: f for f in fraction})
                                  for epochs, units, *fraction in phases),
                     lr=lr, momentum=momentum, weight_decay=weight_decay, batch_size=batch_size, seed=seed,
                     grad_clip=grad_clip)


def snapshot(model: SplitModel) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unit_of(name: str) -> str:
    return "head" if name.startswith("head.") else name.split(".")[1]


def changed_units(before: dict[str, torch.Tensor], model: SplitModel) -> set[str]:
    after = dict(model.named_parameters())
    return {unit_of(n) for n, t in before.items() if not torch.equal(t, after[n].detach())}


def run(model, data, plan, reference=None, flops=None, proximal_mu=0.0):
    objective = ObjectiveSpec(terms=(("proximal", {"mu": proximal_mu}),)).build()
    return train_local(model, data, plan, F.cross_entropy, reference or {}, flops or TOY_FLOPS, objective,
                       unit_schedule=gradual_unfreezing)


def test_model_layout():
    model = make_model()
    assert model.schedule_units == list(UNITS)
    assert {unit_of(n) for n, _ in model.named_parameters()} == set(UNITS)


def test_exact_freezing_with_momentum_and_weight_decay():
    model, data = make_model(), make_data()
    before = snapshot(model)
    outcome = run(model, data, make_plan((3, ["fc2", "head"]), momentum=0.9, weight_decay=1e-2))
    assert changed_units(before, model) == {"fc2", "head"}
    for name, value in before.items():
        if name.startswith("body.fc1."):
            assert torch.equal(dict(model.named_parameters())[name].detach(), value)
    assert outcome.steps == 3 * 4
    assert outcome.samples == 40
    assert outcome.trainable_parameters == sum(p.numel() for u in ("fc2", "head") for p in model.unit_parameters(u))
    assert math.isfinite(outcome.loss) and outcome.loss > 0
    # Everything is trainable again afterwards.
    assert all(p.requires_grad for p in model.parameters())
    assert model.no_grad_prefix == 0


def test_frozen_unit_with_momentum_history_stays_put():
    """fc1 trains in phase 1 (building momentum), then freezes: with zeroed gradients instead of
    requires_grad=False, momentum and weight decay would keep moving it in phase 2."""
    data = make_data()
    reference_model = make_model()
    run(reference_model, data, make_plan((1, UNITS)))
    fc1_after_phase1 = {n: t for n, t in snapshot(reference_model).items() if n.startswith("body.fc1.")}

    model = make_model()
    before = snapshot(model)
    run(model, data, make_plan((1, UNITS), (2, ["fc2", "head"])))
    assert changed_units(before, model) == set(UNITS)
    params = dict(model.named_parameters())
    for name, value in fc1_after_phase1.items():
        assert torch.equal(params[name].detach(), value), name


def test_set_trainable_flags_and_no_grad_prefix():
    model = make_model()
    cases = [
        (["fc1", "fc2", "head"], 0), (["fc2", "head"], 1), (["head"], 2), (["fc1"], 0), (["fc2"], 1),
        (["fc1", "head"], 0), ([], 2),
    ]
    for units, prefix in cases:
        model.set_trainable(units)
        assert model.no_grad_prefix == prefix, units
        for unit in UNITS:
            for parameter in model.unit_parameters(unit):
                assert parameter.requires_grad == (unit in units), (units, unit)
    with pytest.raises(ValueError, match="unknown units"):
        model.set_trainable(["fc3"])


def test_frozen_prefix_runs_without_autograd():
    model, data = make_model(), make_data()
    grad_enabled: dict[str, list[bool]] = {"fc1": [], "fc2": [], "head": []}
    for unit in UNITS:
        module = model.head if unit == "head" else model.body[unit]
        module.register_forward_hook(lambda m, i, o, unit=unit: grad_enabled[unit].append(torch.is_grad_enabled()))
    model.set_trainable(["fc2", "head"])
    loss = F.cross_entropy(model(data.x_train), data.y_train)
    loss.backward()
    assert grad_enabled == {"fc1": [False], "fc2": [True], "head": [True]}
    assert all(p.grad is None for p in model.unit_parameters("fc1"))
    assert all(p.grad is not None for u in ("fc2", "head") for p in model.unit_parameters(u))


def test_frozen_prefix_never_gets_grad_during_training():
    model, data = make_model(), make_data()
    seen: list[bool] = []
    model.body["fc1"].register_forward_hook(lambda m, i, o: seen.append(torch.is_grad_enabled() or o.requires_grad))
    grads: list[bool] = []
    model.body["fc2"].register_forward_hook(
        lambda m, i, o: grads.append(any(p.grad is not None for p in model.unit_parameters("fc1"))))
    run(model, data, make_plan((2, ["fc2", "head"])))
    assert seen == [False] * 8
    assert grads == [False] * 8


def test_fedrep_like_plan_changes_head_and_body():
    model, data = make_model(), make_data()
    before = snapshot(model)
    outcome = run(model, data, make_plan((2, ["head"]), (1, ["fc1", "fc2"])))
    assert changed_units(before, model) == set(UNITS)
    assert outcome.steps == 3 * 4


def test_fedrep_head_phase_alone_changes_only_the_head():
    model, data = make_model(), make_data()
    before = snapshot(model)
    run(model, data, make_plan((2, ["head"])))
    assert changed_units(before, model) == {"head"}


def test_fedbabu_like_plan_keeps_head_bit_identical():
    model, data = make_model(), make_data()
    before = snapshot(model)
    run(model, data, make_plan((3, ["fc1", "fc2"])))
    assert changed_units(before, model) == {"fc1", "fc2"}


def test_fedbug_units_unfreeze_bottom_up(monkeypatch):
    calls: list[tuple[str, ...]] = []
    original = SplitModel.set_trainable

    def spy(self, units):
        calls.append(tuple(units))
        return original(self, units)

    monkeypatch.setattr(SplitModel, "set_trainable", spy)
    model, data = make_model(), make_data(n=80)
    per_step: list[tuple[str, ...]] = []
    model.register_forward_pre_hook(lambda m, i: per_step.append(
        tuple(u for u in UNITS if all(p.requires_grad for p in m.unit_parameters(u)))))
    before = snapshot(model)
    # 8 steps, GU over the first half: m = min(3, ceil(k*3/4)) -> 1, 2, 3, 3, ...
    outcome = run(model, data, make_plan((1, UNITS, 0.5)))
    assert per_step == [("fc1",), ("fc1", "fc2")] + [UNITS] * 6
    assert calls[:3] == [("fc1",), ("fc1", "fc2"), UNITS]
    assert calls[3:] == [UNITS]  # the final reset, nothing in between
    assert changed_units(before, model) == set(UNITS)
    expected = 10 * (step_flops(TOY_FLOPS, list(UNITS), {"fc1"}, 1) + step_flops(TOY_FLOPS, list(UNITS), {"fc1", "fc2"}, 1)
                     + 6 * step_flops(TOY_FLOPS, list(UNITS), set(UNITS), 1))
    assert outcome.flops == expected == 10 * (222 + 232 + 6 * 332)


def test_fedbug_first_step_trains_only_the_first_unit():
    """With 8 steps and unfreeze_fraction 0.5 only fc1 trains on step 1: the run's first update
    equals a one-step run that trains fc1 alone."""
    data = make_data(n=80)
    gu = make_model()
    seen_after_first: dict[str, torch.Tensor] = {}

    def capture(m, i):
        if not seen_after_first and len(captured) == 1:
            seen_after_first.update(snapshot(m))
        captured.append(1)

    captured: list[int] = []
    gu.register_forward_pre_hook(capture)
    run(gu, data, make_plan((1, UNITS, 0.5)))

    # One step of fc1 alone from the same start and the same first batch (10 of 80 samples).
    solo = make_model()
    order = torch.randperm(80, generator=torch.Generator().manual_seed(1))
    first = order[:10]
    solo_data = ClientData(data.x_train[first], data.y_train[first], data.x_test, data.y_test)
    run(solo, solo_data, make_plan((1, ["fc1"]), seed=0, batch_size=10))
    solo_params = snapshot(solo)
    start = snapshot(make_model())
    for name, value in seen_after_first.items():
        if name.startswith("body.fc1."):
            assert not torch.equal(value, start[name])
        else:
            assert torch.equal(value, start[name]), name
        # The one-step run saw the same samples (in another order within the batch: same mean loss).
        torch.testing.assert_close(value, solo_params[name], rtol=1e-6, atol=1e-7)


def test_proximal_term_pulls_towards_the_reference():
    data = make_data()
    start = snapshot(make_model())
    plan_kwargs = dict(lr=0.1, momentum=0.0, weight_decay=0.0)

    def distance(mu: float) -> float:
        model = make_model()
        run(model, data, make_plan((4, UNITS), **plan_kwargs), reference=start, proximal_mu=mu)
        after = snapshot(model)
        return math.sqrt(sum(float((after[n] - start[n]).pow(2).sum()) for n in start))

    free, mild, strong = distance(0.0), distance(1.0), distance(10.0)
    assert free > 0
    assert strong < mild < free
    assert strong < 0.5 * free


def test_proximal_term_only_on_reference_tensors():
    """Tensors outside the reference (personal parts) get no proximal pull: with a head-only plan
    and a body-only reference, mu changes nothing."""
    data = make_data()
    start = snapshot(make_model())
    body_reference = {n: t for n, t in start.items() if n.startswith("body.")}
    results = []
    for mu in (0.0, 50.0):
        model = make_model()
        run(model, data, make_plan((2, ["head"])), reference=body_reference, proximal_mu=mu)
        results.append(snapshot(model))
    for name in start:
        assert torch.equal(results[0][name], results[1][name]), name


def test_same_seed_same_result_and_seed_changes_batch_order():
    data = make_data()
    outcomes, states = [], []
    for plan_seed in (1, 1, 2):
        model = make_model()
        outcomes.append(run(model, data, make_plan((2, UNITS), seed=plan_seed)))
        states.append(snapshot(model))
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name])
    assert outcomes[0].loss == outcomes[1].loss
    assert outcomes[0].flops == outcomes[1].flops
    assert any(not torch.equal(states[0][n], states[2][n]) for n in states[0])


def test_step_flops_by_hand():
    order = list(UNITS)
    # forward 111 always; weight grads of trainable units; input grads of units above the first trainable.
    assert step_flops(TOY_FLOPS, order, set(UNITS), 1) == 111 + 111 + 110
    assert step_flops(TOY_FLOPS, order, {"fc2", "head"}, 1) == 111 + 110 + 100
    assert step_flops(TOY_FLOPS, order, {"head"}, 1) == 111 + 100 + 0
    assert step_flops(TOY_FLOPS, order, {"fc1"}, 1) == 111 + 1 + 110
    assert step_flops(TOY_FLOPS, order, {"fc1", "fc2"}, 1) == 111 + 11 + 110
    assert step_flops(TOY_FLOPS, order, {"fc2"}, 1) == 111 + 10 + 100
    assert step_flops(TOY_FLOPS, order, set(), 1) == 111
    assert step_flops(TOY_FLOPS, order, set(UNITS), 7) == 7 * 332
    assert isinstance(step_flops(TOY_FLOPS, order, set(UNITS), 7), float)


def test_unit_forward_flops_of_the_mlp():
    flops = unit_forward_flops(make_model(), INPUT_SHAPE)
    assert flops == {"fc1": 2 * 16 * 200 + 200, "fc2": 2 * 200 * 200 + 200, "head": 2 * 200 * 3 + 3}


def test_outcome_flops_is_the_sum_of_step_flops():
    model, data = make_model(), make_data(n=25)  # batches of 10, 10, 5
    flops = unit_forward_flops(model, INPUT_SHAPE)
    outcome = run(model, data, make_plan((2, ["fc2", "head"]), (1, ["head"])), flops=flops)
    order = list(UNITS)
    expected = 2 * sum(step_flops(flops, order, {"fc2", "head"}, b) for b in (10, 10, 5)) \
        + sum(step_flops(flops, order, {"head"}, b) for b in (10, 10, 5))
    assert outcome.flops == expected
    assert outcome.steps == 9
    per_sample = (6600 + 80200 + 1203) + (80200 + 1203) + 1203
    assert 2 * 25 * per_sample + 25 * ((6600 + 80200 + 1203) + 1203) == expected


def test_grad_clip_bounds_every_update():
    model, data = make_model(), make_data()
    start = snapshot(model)
    clip, lr = 1e-3, 0.5
    outcome = run(model, data, make_plan((2, UNITS), lr=lr, momentum=0.0, weight_decay=0.0, grad_clip=clip))
    after = snapshot(model)
    moved = math.sqrt(sum(float((after[n] - start[n]).pow(2).sum()) for n in start))
    assert 0 < moved <= outcome.steps * lr * clip * (1 + 1e-4)


def test_nothing_to_train():
    model, data = make_model(), make_data()
    before = snapshot(model)
    outcome = run(model, data, make_plan((2, [])))
    assert outcome.steps == 0 and outcome.flops == 0.0 and outcome.trainable_parameters == 0
    assert changed_units(before, model) == set()
    outcome = run(model, data, make_plan((0, UNITS)))
    assert outcome.steps == 0 and changed_units(before, model) == set()


def test_empty_client_data():
    model = make_model()
    empty = ClientData(torch.empty(0, *INPUT_SHAPE), torch.empty(0, dtype=torch.int64),
                       torch.empty(0, *INPUT_SHAPE), torch.empty(0, dtype=torch.int64))
    before = snapshot(model)
    outcome = run(model, empty, make_plan((1, UNITS)))
    assert outcome.steps == 0 and outcome.samples == 0
    assert changed_units(before, model) == set()
