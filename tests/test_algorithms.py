"""Algorithm declarations: roles, schedules, uploads, FedBug unfreezing and the lr schedule."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from fedpart.common.ml.algorithms import (
    ALGORITHMS,
    Role,
    RoundContext,
    build_algorithm,
    learning_rate,
    unfrozen_units,
)
from fedpart.common.wire.plans import Phase
from fedpart.common.ml.split_model import HEAD

UNITS = ("conv1", "conv2", "fc1")
CONV1 = ["body.conv1.0.weight", "body.conv1.0.bias"]
CONV2 = ["body.conv2.0.weight", "body.conv2.0.bias"]
FC1 = ["body.fc1.1.weight", "body.fc1.1.bias"]
HEAD_NAMES = ["head.weight", "head.bias"]
BODY_NAMES = CONV1 + CONV2 + FC1
NAMES = BODY_NAMES + HEAD_NAMES

EXPECTED_ROLES = {
    "fedavg": (Role.GLOBAL, Role.GLOBAL),
    "fedbabu": (Role.GLOBAL, Role.FIXED),
    "fedprox": (Role.GLOBAL, Role.GLOBAL),
    "fedprox_babu": (Role.GLOBAL, Role.FIXED),
    "fedbug": (Role.GLOBAL, Role.GLOBAL),
    "layer_expansion_vanilla": (Role.GLOBAL, Role.FIXED),
    "layer_expansion_anti": (Role.GLOBAL, Role.FIXED),
    "fedper": (Role.GLOBAL, Role.PERSONAL),
    "fedrep": (Role.GLOBAL, Role.PERSONAL),
    "lg_fedavg": (Role.PERSONAL, Role.GLOBAL),
    "fedftha": (Role.GLOBAL, Role.COLLECTED),
    "local_only": (Role.PERSONAL, Role.PERSONAL),
    "fedrod": (Role.GLOBAL, Role.GLOBAL),
    "perfedavg": (Role.GLOBAL, Role.GLOBAL),
    "ditto": (Role.GLOBAL, Role.GLOBAL),
}


def ctx(round_number: int = 1, rounds: int = 300, epochs: int = 2) -> RoundContext:
    return RoundContext(round=round_number, rounds=rounds, units=UNITS, epochs=epochs)


def uploads(name: str, round_number: int = 1, **options):
    algorithm = build_algorithm(name, options)
    return algorithm.uploads(NAMES, algorithm.schedule(ctx(round_number)))


def test_every_algorithm_is_covered():
    assert set(ALGORITHMS.builtin()) == set(EXPECTED_ROLES)


@pytest.mark.parametrize("name", sorted(ALGORITHMS.builtin()))
def test_build_and_roles(name):
    algorithm = build_algorithm(name)
    assert (algorithm.body, algorithm.head) == EXPECTED_ROLES[name]
    assert algorithm.name == name
    for tensor in BODY_NAMES:
        assert algorithm.role(tensor) is algorithm.body
    for tensor in HEAD_NAMES:
        assert algorithm.role(tensor) is algorithm.head
    # Tensors outside body and head follow the body.
    assert algorithm.role("temperature") is algorithm.body
    # Shared and personal names partition the state dict.
    shared, personal = algorithm.shared_names(NAMES), algorithm.personal_names(NAMES)
    assert sorted(shared + personal) == sorted(NAMES) and not set(shared) & set(personal)
    # Schedules address only known units, and uploads are disjoint and role-consistent.
    phases = algorithm.schedule(ctx())
    assert all(set(p.trainable) <= set(UNITS) | {HEAD} | set(algorithm.extra_parts) for p in phases)
    deltas, values = algorithm.uploads(NAMES, phases)
    assert not set(deltas) & set(values)
    assert all(algorithm.role(n) is Role.GLOBAL for n in deltas)
    assert all(algorithm.role(n) is Role.COLLECTED for n in values)


@pytest.mark.parametrize("name, parts", [
    ("fedavg", ()), ("fedbabu", ()), ("fedper", ("head",)), ("fedrep", ("head",)),
    ("lg_fedavg", ("body",)), ("fedftha", ("head",)), ("local_only", ("body", "head")),
])
def test_personal_parts(name, parts):
    assert build_algorithm(name).personal_parts == parts


def test_fedbabu_head_is_sent_but_never_personal():
    algorithm = build_algorithm("fedbabu")
    assert algorithm.shared_names(NAMES) == NAMES
    assert algorithm.personal_names(NAMES) == []


def test_fedavg_uploads_everything_as_deltas():
    assert uploads("fedavg") == (NAMES, [])
    assert build_algorithm("fedavg").schedule(ctx(epochs=3)) == (Phase(3, UNITS + (HEAD,)),)


def test_fedbabu_uploads_no_head():
    assert uploads("fedbabu") == (BODY_NAMES, [])
    assert build_algorithm("fedbabu").schedule(ctx(epochs=4)) == (Phase(4, UNITS),)


def test_fedper_and_fedrep_upload_the_body_only():
    assert uploads("fedper") == (BODY_NAMES, [])
    assert uploads("fedrep") == (BODY_NAMES, [])


def test_fedrep_schedule_head_then_body():
    phases = build_algorithm("fedrep", {"head_epochs": 3, "body_epochs": 2}).schedule(ctx())
    assert phases == (Phase(3, (HEAD,)), Phase(2, UNITS))
    assert build_algorithm("fedrep").schedule(ctx()) == (Phase(10, (HEAD,)), Phase(1, UNITS))


def test_lg_fedavg_uploads_the_head_only():
    assert uploads("lg_fedavg") == (HEAD_NAMES, [])


def test_fedftha_uploads_head_values_and_body_deltas():
    assert uploads("fedftha") == (BODY_NAMES, HEAD_NAMES)
    phases = build_algorithm("fedftha", {"tau_sync": 2, "tau_head": 7}).schedule(ctx())
    assert phases == (Phase(2, UNITS + (HEAD,)), Phase(7, (HEAD,)))


def test_local_only_uploads_nothing():
    assert uploads("local_only") == ([], [])


def proximal_mu(algorithm) -> float:
    return dict(algorithm.objective.terms).get("proximal", {"mu": 0.0})["mu"]


def test_fedprox_mu():
    assert proximal_mu(build_algorithm("fedprox")) == 0.01
    assert proximal_mu(build_algorithm("fedprox", {"mu": 1})) == 1.0
    assert proximal_mu(build_algorithm("fedprox_babu", {"mu": 0.5})) == 0.5
    assert proximal_mu(build_algorithm("fedavg")) == 0.0
    assert uploads("fedprox") == (NAMES, [])
    assert uploads("fedprox_babu") == (BODY_NAMES, [])


def test_fedbug_schedule_and_uploads():
    algorithm = build_algorithm("fedbug", {"gu_ratio": 0.4})
    assert algorithm.schedule(ctx(epochs=5)) == (Phase(5, UNITS + (HEAD,), {"unfreeze_fraction": 0.4}),)
    assert proximal_mu(algorithm) == 0.0
    assert uploads("fedbug") == (NAMES, [])
    assert build_algorithm("fedbug").schedule(ctx())[0].params == {"unfreeze_fraction": 0.2}


@pytest.mark.parametrize("round_number, expected", [
    (1, CONV1), (2, CONV1), (3, CONV1 + CONV2), (4, CONV1 + CONV2), (5, BODY_NAMES), (100, BODY_NAMES),
])
def test_layer_expansion_vanilla(round_number, expected):
    assert uploads("layer_expansion_vanilla", round_number, unfreeze_rounds=[0, 2, 4]) == (expected, [])


@pytest.mark.parametrize("round_number, expected", [
    (1, FC1), (3, CONV2 + FC1), (5, BODY_NAMES),
])
def test_layer_expansion_anti(round_number, expected):
    assert uploads("layer_expansion_anti", round_number, unfreeze_rounds=[0, 2, 4]) == (expected, [])


def test_layer_expansion_head_never_trains_during_rounds():
    for name in ("layer_expansion_vanilla", "layer_expansion_anti"):
        algorithm = build_algorithm(name, {"unfreeze_rounds": [0, 2, 4]})
        for round_number in range(1, 8):
            for phase in algorithm.schedule(ctx(round_number)):
                assert HEAD not in phase.trainable


def test_layer_expansion_nothing_started_uploads_nothing():
    algorithm = build_algorithm("layer_expansion_vanilla", {"unfreeze_rounds": [1, 2, 3]})
    phases = algorithm.schedule(ctx(1))
    assert all(p.trainable == () for p in phases)
    assert algorithm.uploads(NAMES, phases) == ([], [])


def test_layer_expansion_default_rounds():
    algorithm = build_algorithm("layer_expansion_vanilla")
    assert algorithm.schedule(ctx(100))[0].trainable == ("conv1",)
    assert algorithm.schedule(ctx(101))[0].trainable == ("conv1", "conv2")
    assert algorithm.schedule(ctx(201))[0].trainable == UNITS


def test_layer_expansion_unit_count_mismatch():
    algorithm = build_algorithm("layer_expansion_vanilla", {"unfreeze_rounds": [0, 2]})
    with pytest.raises(ValueError, match="unfreeze_rounds"):
        algorithm.schedule(ctx())


def test_untrained_units_are_not_uploaded():
    algorithm = build_algorithm("fedavg")
    deltas, values = algorithm.uploads(NAMES, (Phase(1, ("conv2",)),))
    assert (deltas, values) == (CONV2, [])
    # A tensor outside body and head goes back whenever anything trained.
    assert algorithm.uploads(["temperature"], (Phase(1, ("conv2",)),)) == (["temperature"], [])
    assert algorithm.uploads(["temperature"], (Phase(1, ()),)) == ([], [])


def _steps(units: tuple[str, ...]) -> list[tuple[str, ...]]:
    """One unfreezing step per unit (the head is a step of its own)."""
    return [(u,) for u in units]


def test_resnet_head_unfreezes_with_the_last_unit():
    from fedpart.common.models.zoo import build_model

    resnet = build_model("resnet18", num_classes=10, input_shape=(3, 32, 32), seed=0)
    steps = resnet.unfreeze_steps(resnet.schedule_units)
    assert steps == [("stage1",), ("stage2",), ("stage3",), ("stage4", "head")]
    assert unfrozen_units(steps, 0.2, 1, 100) == ("stage1",)
    assert unfrozen_units(steps, 0.2, 16, 100) == ("stage1", "stage2", "stage3", "stage4", "head")
    cnn5 = build_model("cnn5", num_classes=10, input_shape=(3, 32, 32), seed=0)
    assert len(cnn5.unfreeze_steps(cnn5.schedule_units)) == 5


def _exact_unfrozen(M: int, fraction: str, k: int, K: int) -> int:
    return min(M, math.ceil(Fraction(k * M) / (Fraction(fraction) * K)))


def test_fedbug_unfrozen_units_formula():
    units = ("u1", "u2", "u3", "u4", "u5")
    M, K, P = 5, 100, 0.2
    for k in range(1, K + 1):
        m = min(M, math.ceil(k * M / (P * K)))
        assert m == _exact_unfrozen(M, "0.2", k, K)
        assert unfrozen_units(_steps(units), P, k, K) == units[:m]
    # By hand: P*K = 20 GU steps, one more unit every 4 steps.
    assert unfrozen_units(_steps(units), P, 1, K) == ("u1",)
    assert unfrozen_units(_steps(units), P, 4, K) == ("u1",)
    assert unfrozen_units(_steps(units), P, 5, K) == ("u1", "u2")
    assert unfrozen_units(_steps(units), P, 16, K) == units[:4]
    assert unfrozen_units(_steps(units), P, 17, K) == units
    assert unfrozen_units(_steps(units), P, 20, K) == units
    assert unfrozen_units(_steps(units), P, 100, K) == units


def test_fedbug_unfrozen_units_grow_monotonically():
    units = tuple(f"u{i}" for i in range(8))
    for P in (0.2, 0.4, 1.0):
        counts = [len(unfrozen_units(_steps(units), P, k, 37)) for k in range(1, 38)]
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 8


def test_fedbug_zero_fraction_means_all_units():
    units = ("a", "b", "c")
    assert unfrozen_units(_steps(units), 0.0, 1, 10) == units


@pytest.mark.parametrize("fraction, total, step, expected", [
    ("0.7", 175, 49, 2), ("0.7", 175, 98, 4), ("0.35", 175, 49, 4), ("0.3", 48, 9, None),
])
def test_fedbug_unfrozen_units_exact_at_boundaries(fraction, total, step, expected):
    M = 8 if expected is None else 5
    units = tuple(f"u{i}" for i in range(M))
    exact = _exact_unfrozen(M, fraction, step, total)
    if expected is not None:
        assert exact == expected
    assert len(unfrozen_units(_steps(units), float(fraction), step, total)) == exact


def test_learning_rate_fedbabu_decay():
    rounds, base = 320, 0.1
    milestones = [0.5, 0.75]
    for index, expected in [(0, base), (1, base), (159, base), (160, base * 0.1), (200, base * 0.1),
                            (239, base * 0.1), (240, base * 0.01), (319, base * 0.01)]:
        assert learning_rate(base, index, rounds, milestones, 0.1) == pytest.approx(expected, rel=1e-12), index
    assert learning_rate(base, 5, rounds, [], 0.1) == base
    assert learning_rate(0.2, 90, 100, [0.5], 0.5) == 0.1


@pytest.mark.parametrize("tau", [1, 4, 10])
def test_learning_rate_decays_at_half_and_three_quarters(tau):
    rounds = 320 // tau
    lrs = [learning_rate(1.0, i, rounds, [0.5, 0.75], 0.1) for i in range(rounds)]
    first_decay = next(i for i, lr in enumerate(lrs) if lr < 1.0)
    second_decay = next(i for i, lr in enumerate(lrs) if lr < 0.1)
    assert first_decay == math.ceil(0.5 * rounds)
    assert second_decay == math.ceil(0.75 * rounds)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="unknown algorithm 'fedsgd'"):
        build_algorithm("fedsgd")


@pytest.mark.parametrize("name, options", [
    ("fedavg", {"mu": 0.1}),
    ("fedbabu", {"head_lr": 0.0}),
    ("fedrep", {"head_epochs": 2, "body_epoch": 1}),
    ("fedbug", {"gu": 0.2}),
])
def test_unknown_option(name, options):
    with pytest.raises(ValueError, match=f": not an option of algorithm '{name}'"):
        build_algorithm(name, options)


@pytest.mark.parametrize("name, options", [
    ("fedprox", {"mu": "0.1"}),
    ("fedprox", {"mu": True}),
    ("fedbug", {"gu_ratio": "0.2"}),
    ("fedrep", {"head_epochs": 2.5}),
    ("fedrep", {"body_epochs": "1"}),
    ("fedrep", {"head_epochs": True}),
    ("fedftha", {"tau_sync": 5.0}),
    ("layer_expansion_vanilla", {"unfreeze_rounds": 3}),
])
def test_wrong_option_type(name, options):
    with pytest.raises(ValueError, match=f"algorithm\\.{next(iter(options))}"):
        build_algorithm(name, options)


@pytest.mark.parametrize("name, options", [
    ("fedbug", {"gu_ratio": 0.0}),
    ("fedbug", {"gu_ratio": 1.5}),
    ("layer_expansion_anti", {"unfreeze_rounds": [0, 5, 3]}),
    ("layer_expansion_vanilla", {"unfreeze_rounds": [0, -1, 3]}),
    ("layer_expansion_vanilla", {"unfreeze_rounds": [0, 1.5, 3]}),
])
def test_invalid_option_value(name, options):
    with pytest.raises(ValueError):
        build_algorithm(name, options)
