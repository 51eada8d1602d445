"""Record-level DP-SGD on the client through Opacus (``privacy.dp_sgd``, fedpart.client.dp_sgd):
the step is plain SGD's without noise and clip, noise really changes it, frozen units stay frozen,
epsilon is Opacus' RDP accountant's over every round a client trained, the config check refuses
what per-example clipping cannot serve, and a digits run reports each client's epsilon."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedpart.client import dp_sgd as dpsgd
from fedpart.client.local_data import ClientData
from fedpart.client.training import train_local
from fedpart.common.ml.algorithms import UNFREEZE_FRACTION, gradual_unfreezing
from fedpart.common.config.dp_sgd import DPSGDConfig
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.models.zoo import build_model, unit_forward_flops
from fedpart.common.wire.plans import Phase, TrainPlan
from fedpart.common.ml.split_model import SplitModel

from conftest import read_metrics, run_fedpart, small_config

needs_opacus = pytest.mark.skipif(importlib.util.find_spec("opacus") is None,
                                  reason='Opacus is not installed (pip install -e ".[dp-sgd]")')

SHAPE = (16,)


def _data(n: int = 60, seed: int = 0) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    return ClientData(torch.randn(n, *SHAPE, generator=gen), torch.randint(0, 10, (n,), generator=gen),
                      torch.randn(8, *SHAPE, generator=gen), torch.randint(0, 10, (8,), generator=gen))


def _model():
    return build_model("mlp", num_classes=10, input_shape=SHAPE, seed=0, hidden=12)


def _train(model, data, plan, config: DPSGDConfig | None):
    outcome = train_local(model, data, plan, F.cross_entropy, {}, unit_forward_flops(model, SHAPE), dp_sgd=config,
                          unit_schedule=gradual_unfreezing)
    return outcome, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ the step


@needs_opacus
def test_one_step_without_noise_and_clip_is_plain_sgd():
    """Noise 0 and a clip no example reaches: Opacus' per-example gradients, summed and divided by
    the batch size, give the batch's mean gradient, so the step is plain SGD's (float rounding)."""
    data = _data(20)
    plain, private = _model(), _model()
    for model in (plain, private):
        model.set_trainable(model.schedule_units)
    x, y = data.x_train, data.y_train
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    F.cross_entropy(plain(x), y).backward()
    sgd.step()
    optimizer = torch.optim.SGD(private.parameters(), lr=0.1)
    gradients = dpsgd.PrivateGradients(private, optimizer, DPSGDConfig(enabled=True, noise_multiplier=0.0,
                                                                       max_grad_norm=1e9), 20, torch.Generator())
    gradients.attach()
    gradients.clear()
    F.cross_entropy(private(x), y).backward()
    gradients.privatize()
    optimizer.step()
    gradients.close()
    for (name, a), b in zip(plain.state_dict().items(), private.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not any(hasattr(p, "grad_sample") for p in private.parameters())


@needs_opacus
def test_a_local_run_without_noise_and_clip_is_plain_sgd_on_the_poisson_batches():
    """train_local under DP-SGD with noise 0 and a clip nobody reaches equals plain SGD (momentum
    included) on the same Poisson batches, each gradient the batch's sum over the expected batch
    size (DP-SGD's normalisation: a Poisson batch has no fixed size); an empty batch is a step
    of zero gradient."""
    data, batch = _data(60), 10
    config = DPSGDConfig(enabled=True, noise_multiplier=0.0, max_grad_norm=1e9, noise_seed=7)
    plan = TrainPlan(phases=(Phase(2, ("fc1", "fc2", "head")),), lr=0.1, momentum=0.5, batch_size=batch, seed=3)
    outcome, private = _train(_model(), data, plan, config)
    steps = 2 * math.ceil(60 / batch)
    assert outcome.steps == steps and outcome.dp_sgd == dpsgd.DPSGDUsage(0.0, batch / 60, steps, 60)

    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    sampling = torch.Generator().manual_seed(dpsgd.run_seed(config, plan.seed))
    for _ in range(2):
        for index in dpsgd.poisson_batches(60, batch / 60, steps // 2, sampling, torch.device("cpu")):
            optimizer.zero_grad()
            if len(index):
                F.cross_entropy(reference(data.x_train[index]), data.y_train[index], reduction="sum").div(batch).backward()
            else:
                for p in reference.parameters():
                    p.grad = torch.zeros_like(p)
            optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(private[name], value, rtol=1e-5, atol=1e-6, msg=name)


@needs_opacus
def test_noise_changes_the_update_and_the_clip_bounds_it():
    data = _data(40)
    plan = TrainPlan(phases=(Phase(1, ("fc1", "fc2", "head")),), lr=1.0, batch_size=40, seed=1)  # q = 1: one step
    start = _model().state_dict()

    def update(noise: float, clip: float) -> torch.Tensor:
        _, trained = _train(_model(), data, plan, DPSGDConfig(enabled=True, noise_multiplier=noise,
                                                               max_grad_norm=clip, noise_seed=2))
        return torch.cat([(trained[k] - start[k]).flatten() for k in start])

    quiet, noisy = update(0.0, 1e9), update(1.0, 1e9)
    assert not torch.allclose(quiet, noisy)
    # noise of std sigma * C on the sum, divided by the 40 examples, on every coordinate
    spread = (noisy - quiet).std().item()
    assert 0.5 * 1e9 / 40 < spread < 2 * 1e9 / 40
    # every example's gradient clipped to C: the mean of 40 of them is within C (lr 1: the update)
    assert update(0.0, 0.01).norm() <= 0.01 * (1 + 1e-5)
    assert quiet.norm() > 0.05


@needs_opacus
def test_frozen_units_stay_frozen_and_a_head_only_phase_trains():
    data = _data(50)
    start = _model().state_dict()
    plan = TrainPlan(phases=(Phase(2, ("head",)),), lr=0.1, batch_size=10, seed=4)
    model = _model()
    outcome, trained = _train(model, data, plan, DPSGDConfig(enabled=True, noise_seed=1))
    assert outcome.steps == 10
    for name in start:
        changed = not torch.equal(trained[name], start[name])
        assert changed == name.startswith("head."), name
    assert all(p.requires_grad for p in model.parameters())  # the loop leaves every unit trainable again
    leftovers = [name for name, p in model.named_parameters() if hasattr(p, "grad_sample") or hasattr(p, "summed_grad")]
    assert not leftovers and not any(hasattr(m, "activations") for m in model.modules())
    # FedBug's gradual unfreezing: the hooks follow the trainable set, every unit ends up trained
    plan = TrainPlan(phases=(Phase(2, ("head", "fc2", "fc1"), {UNFREEZE_FRACTION: 0.5}),), lr=0.1, batch_size=10, seed=4)
    _, trained = _train(_model(), data, plan, DPSGDConfig(enabled=True, noise_seed=1))
    assert all(not torch.equal(trained[name], start[name]) for name in start)


@needs_opacus
def test_a_batchnorm_model_is_refused_by_name():
    shape = (3, 16, 16)
    model = build_model("cnn4", num_classes=10, input_shape=shape, seed=0)
    data = ClientData(torch.randn(10, *shape), torch.randint(0, 10, (10,)), torch.randn(2, *shape),
                      torch.randint(0, 10, (2,)))
    plan = TrainPlan(phases=(Phase(1, tuple(model.schedule_units)),), lr=0.1, batch_size=5, seed=0)
    with pytest.raises(dpsgd.DPSGDError, match=r"BatchNorm layers \(body\.conv1\.1, .*GroupNorm"):
        train_local(model, data, plan, F.cross_entropy, {}, unit_forward_flops(model, shape),
                    dp_sgd=DPSGDConfig(enabled=True))


def test_without_opacus_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(dpsgd.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(dpsgd.DPSGDError, match=re.escape('pip install -e ".[dp-sgd]"')):
        dpsgd.require_opacus()


# ------------------------------------------------------------------ accounting


@needs_opacus
def test_epsilon_grows_with_the_rounds_and_is_opacus_rdp_accountant(tmp_path):
    from opacus.accountants import RDPAccountant

    config = DPSGDConfig(enabled=True, noise_multiplier=1.1)
    usage = dpsgd.DPSGDUsage(1.1, 0.05, 40, 200)
    spent = [dpsgd.spend(tmp_path, 3, r, usage, config) for r in (1, 2, 3)]
    epsilons = [s["dp_sgd_epsilon"] for s in spent]
    assert epsilons[0] < epsilons[1] < epsilons[2]
    delta = 1 / 200 ** 1.1
    assert all(s["dp_sgd_delta"] == delta for s in spent) and spent[-1]["dp_sgd_steps"] == 120
    for rounds, value in enumerate(epsilons, start=1):
        accountant = RDPAccountant()
        for _ in range(40 * rounds):
            accountant.step(noise_multiplier=1.1, sample_rate=0.05)
        assert value == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    # the ledger is on disk: a new process of the client goes on from it; other clients are apart
    assert len(json.loads(dpsgd.ledger_path(tmp_path, 3).read_text())["runs"]) == 3
    assert dpsgd.spend(tmp_path, 4, 1, usage, config)["dp_sgd_epsilon"] == pytest.approx(epsilons[0])
    # a stated delta; noise 0 has no finite epsilon, which stays out of the metrics
    assert dpsgd.spend(tmp_path, 5, 1, usage, DPSGDConfig(delta=1e-6))["dp_sgd_delta"] == 1e-6
    assert "dp_sgd_epsilon" not in dpsgd.spend(tmp_path, 6, 1, dpsgd.DPSGDUsage(0.0, 0.05, 40, 200), config)
    assert dpsgd.spend(tmp_path, 7, 1, None, config) == {}


# ------------------------------------------------------------------ config check


@pytest.mark.parametrize("raw, reason", [
    ({"train": {"grad_clip": 1.0}}, "train.grad_clip"),
    ({"train": {"amp": "fp16"}}, "train.amp"),
    ({"train": {"compile": True}}, "train.compile"),
    ({"algorithm": {"name": "fedavg", "objective": {"feddecorr": {}}}}, "feddecorr"),
    ({"algorithm": {"name": "fedrod"}}, "fedrod"),
    ({"algorithm": {"name": "ditto"}}, "ditto"),
    ({"algorithm": {"name": "perfedavg", "hessian": True}}, "hessian"),
])
def test_the_config_check_refuses_what_per_example_clipping_cannot_serve(raw, reason):
    with pytest.raises(ConfigError, match=f"privacy.dp_sgd: .*{re.escape(reason)}"):
        config_from_dict({**raw, "privacy": {"dp_sgd": {"enabled": True}}})
    config_from_dict(raw)  # fine without DP-SGD


@pytest.mark.parametrize("setting, message", [
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"delta": 1.0}, "delta"),
])
def test_the_config_check_validates_the_keys(setting, message):
    with pytest.raises(ConfigError, match=f"privacy.dp_sgd.{message}"):
        config_from_dict({"privacy": {"dp_sgd": setting}})


def test_dp_sgd_composes_with_server_side_dp_and_is_off_by_default():
    assert not config_from_dict({}).privacy.dp_sgd.enabled
    config_from_dict({"train": {"weighting": "uniform"}, "sampling": {"scheme": "poisson", "fraction": 0.5},
                      "privacy": {"dp": {"enabled": True}, "dp_sgd": {"enabled": True}}})


# ------------------------------------------------------------------ a run


@needs_opacus
def test_a_digits_run_reports_each_clients_epsilon_growing_over_the_rounds(tmp_path):
    config = small_config(privacy={"dp_sgd": {"enabled": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0}})
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    ledgers = {int(p.parent.name.split("_")[1]): json.loads(p.read_text())["runs"]
               for p in (out / "state").glob(f"process_*/*/client_*/{dpsgd.LEDGER_FILE}")}
    assert sorted(ledgers) == [0, 1, 2, 3]
    from opacus.accountants import RDPAccountant

    logged: dict[int, list[float]] = {}
    for log in (out / "logs").glob("client_*.log"):
        for client, value in re.findall(r"client (\d+) round \d+: trained .*DP-SGD epsilon ([0-9.e+-]+)", log.read_text()):
            logged.setdefault(int(client), []).append(float(value))
    for client, runs in ledgers.items():
        assert [r["round"] for r in runs] == [1, 2, 3]
        samples = round(runs[0]["sample_rate"] and 20 / runs[0]["sample_rate"])  # batch_size / q
        accountant = RDPAccountant()
        accountant.history = [(1.0, runs[0]["sample_rate"], sum(r["steps"] for r in runs))]
        assert logged[client][-1] == pytest.approx(accountant.get_epsilon(1 / samples ** 1.1), rel=1e-3)
        assert logged[client] == sorted(logged[client]) and logged[client][0] < logged[client][-1]
    records = read_metrics(out)
    for c in range(4):
        series = [r["clients"][str(c)]["dp_sgd_epsilon"] for r in records]
        assert series == pytest.approx(logged[c], rel=1e-3) and series == sorted(series)


def batchnorm_mlp(num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """A model with a BatchNorm layer (``model.name: test_dp_sgd:batchnorm_mlp``)."""
    features = math.prod(input_shape)
    units = OrderedDict(fc1=nn.Sequential(nn.Flatten(), nn.Linear(features, 16), nn.BatchNorm1d(16), nn.ReLU()))
    return SplitModel(units, nn.Linear(16, num_classes))


@needs_opacus
def test_a_run_of_a_batchnorm_model_stops_with_the_clients_reason(tmp_path, monkeypatch):
    """The config check builds no model (the server needs no Opacus): the client refuses at its
    first training task, and fedpart run stops at once with the client's log saying why."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the children import this module's model
    config = small_config(model={"name": "test_dp_sgd:batchnorm_mlp"}, rounds=1,
                          privacy={"dp_sgd": {"enabled": True}})
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode != 0
    assert re.search(r"DPSGDError: privacy.dp_sgd: .*BatchNorm layers \(body\.fc1\.2\)", result.stdout + result.stderr)
