"""Server optimizers (``fedpart.server.policy.optimizers``): each step against a hand-computed case over
two rounds, FedExp's step size, FedDyn's ``h``, the state round trip, the ``server_optimizer``
config section and FedDyn's automatic selection."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from conftest import FIXTURES, small_config
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.process.records import RoundRecord
from fedpart.server.policy.aggregation import CoordinateMedian, WeightedMean
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.policy.optimizers import (
    OPTIMIZERS,
    FedAdam,
    FedAvgM,
    FedDyn,
    FedExp,
    FedYogi,
    Plain,
    RoundDelta,
)
from fedpart.server.policy import RoundAggregate, build_policy
from fedpart.server.policy.combine import Combine
from fedpart.server.engine.run_state import read_run_state, write_run_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F64 = torch.float64


def _delta(values: list[float], results: int = 2) -> RoundDelta:
    return RoundDelta({"w": torch.tensor(values, dtype=F64)}, {"w": results})


def _two_rounds(optimizer, first: list[float], second: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The change of ``w`` (from zero) in each of two rounds."""
    start = {"w": torch.zeros(len(first), dtype=F64)}
    one = optimizer.step(start, _delta(first))["w"]
    two = optimizer.step({"w": one}, _delta(second))["w"]
    return one, two - one


def _step(**sections) -> Combine:
    """The core of the server's policy for a small config with ``sections``."""
    return build_policy(config_from_dict(small_config(**sections)), log=lambda line: None).find(Combine)


# ------------------------------------------------------------------------------------- the steps


def test_plain_is_bit_identical_to_the_old_server_step():
    """``(old.double() + server_lr * delta).to(old.dtype)``, the server step before optimizers."""
    gen = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(1000, generator=gen), "h": torch.randn(7, generator=gen).half(),
           "d": torch.randn(3, generator=gen, dtype=F64)}
    delta = {name: torch.randn(t.shape, generator=gen, dtype=F64) * 1e-3 for name, t in old.items()}
    for lr in (1.0, 0.7, 1.5):
        new = Plain(lr).step(old, RoundDelta(delta, {name: 3 for name in delta}))
        for name, tensor in old.items():
            reference = (tensor.to(F64) + lr * delta[name]).to(tensor.dtype)
            assert new[name].dtype == tensor.dtype
            assert torch.equal(new[name].view(torch.uint8), reference.view(torch.uint8))
    assert Plain().lr == 1.0


def test_fedavgm_by_hand():
    # v1 = d1 = [1, -2]; step 2 v1. v2 = 0.5 [1, -2] + [0.5, 1] = [1, 0]; step 2 v2.
    optimizer = FedAvgM(lr=2.0, beta=0.5)
    one, two = _two_rounds(optimizer, [1.0, -2.0], [0.5, 1.0])
    assert one.tolist() == [2.0, -4.0]
    assert two.tolist() == [2.0, 0.0]
    assert optimizer.state()["momentum/w"].tolist() == [1.0, 0.0]


def test_fedadam_by_hand():
    # beta1 0.5, beta2 0.5, tau 1, lr 1; m0 = 0, v0 = tau^2 = 1.
    # round 1, d = [1, 7]: m = [0.5, 3.5], v = 0.5 + 0.5 d^2 = [1, 25]; step m / (sqrt v + 1) = [0.25, 3.5 / 6]
    # round 2, d = [-1, 1]: m = [-0.25, 2.25], v = [1, 13]; step [-0.125, 2.25 / (sqrt 13 + 1)]
    optimizer = FedAdam(lr=1.0, beta1=0.5, beta2=0.5, tau=1.0)
    one, two = _two_rounds(optimizer, [1.0, 7.0], [-1.0, 1.0])
    assert one.tolist() == pytest.approx([0.25, 3.5 / 6], rel=1e-15)
    assert two.tolist() == pytest.approx([-0.125, 2.25 / (math.sqrt(13) + 1)], rel=1e-14)
    assert optimizer.state()["m/w"].tolist() == [-0.25, 2.25]
    assert optimizer.state()["v/w"].tolist() == [1.0, 13.0]


def test_fedyogi_by_hand():
    # beta1 0.5, beta2 0.5, tau 1, lr 1; m0 = 0, v0 = 1; v <- v - 0.5 d^2 sign(v - d^2).
    # round 1, d = [1, 7]: d^2 = [1, 49], sign(v0 - d^2) = [0, -1]: v = [1, 25.5]; m = [0.5, 3.5]
    # round 2, d = [0.5, 1]: d^2 = [0.25, 1], sign = [1, 1]: v = [0.875, 25]; m = [0.5, 2.25]
    optimizer = FedYogi(lr=1.0, beta1=0.5, beta2=0.5, tau=1.0)
    one, two = _two_rounds(optimizer, [1.0, 7.0], [0.5, 1.0])
    assert one.tolist() == pytest.approx([0.25, 3.5 / (math.sqrt(25.5) + 1)], rel=1e-15)
    assert two.tolist() == pytest.approx([0.5 / (math.sqrt(0.875) + 1), 2.25 / 6], rel=1e-14)
    assert optimizer.state()["v/w"].tolist() == [0.875, 25.0]
    defaults = FedYogi()
    assert (defaults.lr, defaults.beta1, defaults.beta2, defaults.tau) == (0.01, 0.9, 0.99, 1e-3)


def test_feddyn_h_and_update_by_hand():
    # alpha 0.5, m = 4 clients. Round 1, |P| = 2, d = [1, -2]: h = -0.5 (2/4) d = [-0.25, 0.5];
    # change d - h / alpha = 1.5 d = [1.5, -3]. Round 2, |P| = 1, d = [2, 2]:
    # h = [-0.25, 0.5] - 0.5 (1/4) [2, 2] = [-0.5, 0.25]; change [2, 2] - [-1, 0.5] = [3, 1.5].
    optimizer = FedDyn(alpha=0.5, clients=4)
    start = {"w": torch.zeros(2, dtype=F64)}
    one = optimizer.step(start, _delta([1.0, -2.0], results=2))["w"]
    assert one.tolist() == [1.5, -3.0]
    assert optimizer.state()["h/w"].tolist() == [-0.25, 0.5]
    two = optimizer.step({"w": one}, _delta([2.0, 2.0], results=1))["w"]
    assert (two - one).tolist() == [3.0, 1.5]
    assert optimizer.state()["h/w"].tolist() == [-0.5, 0.25]


def _fedexp_round(weights: list[float], deltas: list[list[float]], combiner=None) -> tuple[FedExp, torch.Tensor]:
    recorder = RoundAggregate(WeightedMean() if combiner is None else combiner, record_norms=True)
    for weight, values in zip(weights, deltas):
        recorder.add({"a": torch.tensor(values[:1]), "b": torch.tensor(values[1:])}, weight)
    optimizer = FedExp(eps=1e-3)
    old = {"a": torch.zeros(1, dtype=F64), "b": torch.zeros(1, dtype=F64)}
    new = optimizer.step(old, recorder.round_delta())
    return optimizer, torch.cat([new["a"], new["b"]])


def test_fedexp_step_size_by_hand():
    # Uniform weights, d1 = [3, 4], d2 = [-1, 0] (norms over both tensors): mean [1, 2], ||mean||^2 = 5,
    # (||d1||^2 + ||d2||^2) / 2 = (25 + 1) / 2 = 13: eta = 13 / (2 (5 + 1e-3)).
    optimizer, new = _fedexp_round([1.0, 1.0], [[3.0, 4.0], [-1.0, 0.0]])
    eta = 13 / (2 * 5.001)
    assert optimizer.report() == {"step_size": pytest.approx(eta, rel=1e-15)}
    assert new.tolist() == pytest.approx([eta, 2 * eta], rel=1e-15)
    # Sample weights 3 and 1, d2 = [-5, 0]: mean [1, 3], ||mean||^2 = 10; (3 * 25 + 25) / 4 = 25:
    # eta = 25 / (2 (10 + 1e-3)).
    optimizer, _ = _fedexp_round([3.0, 1.0], [[3.0, 4.0], [-5.0, 0.0]])
    assert optimizer.report()["step_size"] == pytest.approx(25 / (2 * 10.001), rel=1e-15)
    # Clients that agree: eta = max(1, 25 / (2 (25 + eps))) = 1, plain averaging.
    optimizer, new = _fedexp_round([1.0, 2.0], [[3.0, 4.0], [3.0, 4.0]])
    assert optimizer.report() == {"step_size": 1.0} and new.tolist() == [3.0, 4.0]
    # Over the median of three results: the median [1, 0] is the combined delta, norms as before.
    optimizer, _ = _fedexp_round([1.0, 1.0, 1.0], [[3.0, 4.0], [-1.0, 0.0], [1.0, 0.0]], CoordinateMedian())
    assert optimizer.report()["step_size"] == pytest.approx((25 + 1 + 1) / 3 / (2 * 1.001), rel=1e-15)


def test_only_fedexp_records_result_norms():
    assert _step(server_optimizer={"name": "fedexp"}).open_round(1, {}).record_norms
    plain = _step().open_round(1, {})
    assert not plain.record_norms
    plain.add({"w": torch.ones(3)}, 1.0)
    assert plain.round_delta().second_moment is None


def test_a_non_finite_new_value_leaves_the_state_as_it_was():
    optimizer = FedAvgM(lr=1.0, beta=0.5)
    old = {"w": torch.tensor([1.0, 2.0]), "big": torch.tensor([torch.finfo(torch.float32).max])}
    optimizer.step(old, RoundDelta({"w": torch.tensor([1.0, 1.0], dtype=F64),
                                    "big": torch.tensor([1.0], dtype=F64)}, {"w": 1, "big": 1}))
    before = optimizer.state()
    huge = torch.tensor([torch.finfo(torch.float32).max], dtype=F64)
    new = optimizer.step(old, RoundDelta({"w": torch.tensor([1.0, 1.0], dtype=F64), "big": huge},
                                         {"w": 1, "big": 1}))
    assert not torch.isfinite(new["big"]).all(), "the round engine will refuse this value"
    assert torch.equal(optimizer.state()["momentum/big"], before["momentum/big"])
    assert optimizer.state()["momentum/w"].tolist() == [1.5, 1.5], "the other tensors go on"


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "feddyn"])
def test_state_round_trip_continues_with_the_same_numbers(name):
    make = (lambda: FedDyn(alpha=0.1, clients=3)) if name == "feddyn" else OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(1)
    old = {"w": torch.randn(5, generator=gen), "b": torch.randn(2, generator=gen)}
    rounds = [RoundDelta({n: torch.randn(t.shape, generator=gen, dtype=F64) for n, t in old.items()},
                         {"w": 2, "b": 2}) for _ in range(2)]
    running = make()
    middle = running.step(old, rounds[0])
    saved = running.state()
    assert set(saved) == {f"{kind}/{n}" for kind in running.kinds for n in old}
    expected = running.step(middle, rounds[1])
    resumed = make()
    resumed.load_state(saved)
    got = resumed.step(middle, rounds[1])
    assert all(torch.equal(got[n], expected[n]) for n in old)
    with pytest.raises(ValueError, match="has no state"):
        make().load_state({"nonsense/w": torch.zeros(5)})


# ---------------------------------------------------------------------- configuration and selection


def test_every_optimizer_declares_its_constructors_options():
    for name, component in OPTIMIZERS.items():
        declared = {option.name for option in component.options}
        assert declared == set(inspect.signature(component.build).parameters) - {"clients"}, name
    assert OPTIMIZERS.selectable() == ["plain", "fedavgm", "fedadam", "fedyogi", "fedexp"]


def test_a_plug_in_server_optimizer_is_one_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    optimizer = _step(server_optimizer={"name": "plugin_optimizer:signed", "lr": 0.5}).optimizer
    assert type(optimizer).__name__ == "Signed" and optimizer.lr == 0.5
    assert torch.equal(optimizer.step({"w": torch.zeros(3)}, _delta([2.0, -1e-3, 0.0]))["w"], torch.tensor([0.5, -0.5, 0]))
    with pytest.raises(ConfigError, match="server_optimizer.lr must be > 0"):
        _step(server_optimizer={"name": "plugin_optimizer:signed", "lr": -1})


def test_defaults_reproduce_the_plain_step():
    step = _step()
    assert type(step.optimizer) is Plain and step.optimizer.lr == 1.0
    record = RoundRecord(round=1)
    step.round_record(record)
    assert record.server_step == {} and step.optimizer.state() == {}


def test_server_optimizer_options_reach_the_optimizer():
    optimizer = _step(server_optimizer={"name": "fedadam", "lr": 1, "tau": 0.01}).optimizer
    assert type(optimizer) is FedAdam
    assert (optimizer.lr, optimizer.beta1, optimizer.beta2, optimizer.tau) == (1.0, 0.9, 0.99, 0.01)
    assert _step(server_optimizer={"lr": 0.5}).optimizer.lr == 0.5


def test_the_feddyn_term_selects_feddyns_server_step():
    optimizer = _step(algorithm={"name": "fedbug", "objective": {"feddyn": {"alpha": 0.2}}}).optimizer
    assert type(optimizer) is FedDyn and optimizer.alpha == 0.2 and optimizer.clients == 4


@pytest.mark.parametrize("raw, message", [
    ({"train": {"server_lr": 2.0}}, "train.server_lr has moved: set server_optimizer.lr instead"),
    ({"server_optimizer": {"name": "sgd"}}, "server_optimizer.name: unknown server optimizer 'sgd'"),
    ({"server_optimizer": {"name": "feddyn"}}, "comes with its objective term, algorithm.objective.feddyn"),
    ({"server_optimizer": {"name": "fedexp", "lr": 2.0}},
     "server_optimizer.lr: not an option of server optimizer 'fedexp'"),
    ({"server_optimizer": {"name": "fedavgm", "beta": 1.0}}, r"server_optimizer.beta must be in \[0, 1\)"),
    ({"server_optimizer": {"name": "fedadam", "tau": 0}}, "server_optimizer.tau must be a finite number > 0"),
    ({"server_optimizer": {"lr": "fast"}}, "server_optimizer.lr: expected a number"),
    ({"server_optimizer": {"lr": -1.0}}, "server_optimizer.lr must be a finite number > 0"),
    ({"server_optimizer": {"name": "fedadam"}, "algorithm": {"name": "fedbug", "objective": {"feddyn": {}}}},
     "server_optimizer.name 'fedadam' cannot be combined with algorithm.objective.feddyn"),
    ({"server_optimizer": {"lr": 2.0}, "algorithm": {"name": "fedavg", "objective": {"feddyn": {}}}},
     "server_optimizer.lr cannot be combined with algorithm.objective.feddyn"),
    ({"server_optimizer": {"name": "fedadam"}, "algorithm": {"name": "fedbug", "gu_ratio": 2.0}},
     "algorithm.gu_ratio must be in"),
])
def test_bad_server_optimizer_settings_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(small_config(**raw))


def test_the_optimizer_state_is_part_of_the_run_state(tmp_path):
    # the adaptive bound and the insider monitor off: their medians and history would be in the state too
    # (tests/test_robust.py and tests/test_insiders.py cover them)
    config = config_from_dict(small_config(server_optimizer={"name": "fedadam"},
                                           robust={"adaptive_bound": 0, "monitor_rounds": 0}))
    coordinator = Coordinator(config, log=lambda line: None)
    name = next(iter(coordinator.global_state))
    deltas = coordinator.policy.open_round(1, {name: coordinator.global_state[name]})
    deltas.add({name: torch.full_like(coordinator.global_state[name], 0.5)}, 3.0)
    coordinator.global_state.update(coordinator.policy.new_global(coordinator.global_state, deltas, None))
    write_run_state(tmp_path, coordinator.snapshot(1, 1.0))

    restored = Coordinator(config, log=lambda line: None)
    restored.restore(read_run_state(tmp_path, config.to_dict()))
    saved, loaded = coordinator.policy.state(), restored.policy.state()
    assert set(saved) == {f"m/{name}", f"v/{name}"} == set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) and loaded[k].dtype == F64 for k in saved)
