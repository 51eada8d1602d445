"""Speed options of local training on the CPU (train.amp, train.channels_last, train.compile), the
fp16 gradient-scaler path driven on the CPU, and the training loop's freedom from per-step host
synchronisation."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from conftest import REPO, child_env, small_config
from fedpart.client.local_data import ClientData
from fedpart.client.speed import LossScaledOptimizer, PlainSGD, TrainingSpeed
from fedpart.client.training import train_local
from fedpart.common.ml.algorithms import UNFREEZE_FRACTION, gradual_unfreezing
from fedpart.common.config.run_config import ConfigError, config_from_dict, load_config
from fedpart.common.data.augment import build_augment
from fedpart.common.models.zoo import build_model, unit_forward_flops
from fedpart.common.ml.objectives import ObjectiveSpec
from fedpart.common.wire.plans import Phase, TrainPlan
from fedpart.common.ml.split_model import SplitModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
IMAGE = (3, 16, 16)  # cnn4 needs four 2x2 poolings
VECTOR = (1, 4, 4)


def make_data(shape: tuple[int, ...], n: int = 45, classes: int = 10, seed: int = 0) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    return ClientData(torch.randn(n, *shape, generator=gen), torch.randint(0, classes, (n,), generator=gen),
                      torch.randn(10, *shape, generator=gen), torch.randint(0, classes, (10,), generator=gen))


def plan_for(model: SplitModel, epochs: int = 1, fraction: float = 0.0, batch_size: int = 10, **options) -> TrainPlan:
    """All units trainable (FedBug's gradual unfreezing over ``fraction`` of the steps)."""
    return TrainPlan(phases=(Phase(epochs, tuple(model.schedule_units), {UNFREEZE_FRACTION: fraction}),), lr=0.05,
                     momentum=0.9, weight_decay=1e-3, batch_size=batch_size, seed=3, **options)


def train(model: SplitModel, data: ClientData, plan: TrainPlan, speed: TrainingSpeed | None = None,
          shape: tuple[int, ...] = VECTOR, **kwargs):
    flops = unit_forward_flops(model, shape)
    return train_local(model, data, plan, F.cross_entropy, {}, flops, speed=speed, unit_schedule=gradual_unfreezing,
                       **kwargs)


def weights(model: SplitModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------ the config


@pytest.mark.parametrize("value, expected", [("off", "off"), (False, "off"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_amp_accepts_its_modes_and_yamls_off(value, expected):
    assert config_from_dict(small_config(train={"amp": value})).train.amp == expected


def test_amp_off_in_a_yaml_file_and_in_a_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  amp: off\n  channels_last: true\n  compile: false\n")
    config = load_config(path, ["train.amp=off"])
    assert (config.train.amp, config.train.channels_last, config.train.compile) == ("off", True, False)
    assert load_config(path, ["train.amp=bf16"]).train.amp == "bf16"


@pytest.mark.parametrize("train, message", [
    ({"amp": "fp8"}, "train.amp must be one of off, bf16, fp16, got 'fp8'"),
    ({"amp": True}, "train.amp: expected a string, got True"),
    ({"channels_last": "yes"}, "train.channels_last: expected true or false"),
    ({"compile": 1}, "train.compile: expected true or false"),
])
def test_bad_speed_options_name_the_key(train, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(small_config(train=train))


def test_defaults_are_plain_float32_eager_training():
    train = config_from_dict(small_config()).train
    assert (train.amp, train.channels_last, train.compile) == ("off", False, False)


# ------------------------------------------------------------------ the optimizer on the CPU


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.5, 1e-3)])
def test_plain_sgd_steps_exactly_as_torchs_sgd(momentum, weight_decay):
    """Bit for bit, through what training does to an optimizer: a parameter whose gradient only
    appears later (FedBug unfreezes mid-round), one that never gets one, and a new lr set in the
    group between steps (Per-FedAvg's second batch)."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in ((5, 3), (3,), (2,))]
    ours, theirs = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    optimizers = (PlainSGD(ours, 0.1, momentum, weight_decay),
                  torch.optim.SGD(theirs, lr=0.1, momentum=momentum, weight_decay=weight_decay))
    for step in range(6):
        inputs = torch.randn(4, 5, generator=generator)
        for parameters, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad(set_to_none=True)
            trained = parameters[:2] if step >= 2 else parameters[:1]
            loss = (inputs @ trained[0]).sin().sum() + (sum(trained[1].cos()) if len(trained) > 1 else 0)
            loss.backward()
            if step == 4:
                for group in optimizer.param_groups:
                    group["lr"] = 0.03
            optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), step
    assert torch.equal(ours[2], start[2]) and ours[2].grad is None


def test_a_cpu_client_trains_and_fine_tunes_without_importing_torchs_compiler():
    """torch's optimizers import torch._dynamo at their first call (about as much CPU as torch
    itself, in every client process): local training and personalization on a CPU do not."""
    script = """
import sys
import torch
from fedpart.client.evaluation import evaluate_and_personalize
from fedpart.client.local_data import ClientData
from fedpart.client.training import train_local
from fedpart.common.models.zoo import build_model, unit_forward_flops
from fedpart.common.wire.plans import EvalPlan, Phase, TrainPlan
model = build_model("mlp", num_classes=10, input_shape=(1, 4, 4), seed=0)
g = torch.Generator().manual_seed(0)
data = ClientData(torch.randn(20, 1, 4, 4, generator=g), torch.randint(0, 10, (20,), generator=g),
                  torch.randn(5, 1, 4, 4, generator=g), torch.randint(0, 10, (5,), generator=g))
plan = TrainPlan(phases=(Phase(1, tuple(model.schedule_units)),), lr=0.1, batch_size=10, momentum=0.9)
flops = unit_forward_flops(model, (1, 4, 4))
assert train_local(model, data, plan, torch.nn.functional.cross_entropy, {}, flops).steps == 2
evaluate_and_personalize(model, data, EvalPlan(finetune_epochs=(1,), lr=0.1, momentum=0.9, batch_size=10),
                         torch.nn.functional.cross_entropy, True)
print("torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


# ---------------------------------------------------------------------------- amp on the CPU


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_is_off_on_the_cpu_and_changes_nothing(amp):
    data = make_data(VECTOR)
    plain, mixed = (build_model("mlp", num_classes=10, input_shape=VECTOR, seed=0) for _ in range(2))
    speed = TrainingSpeed.configure(mixed, CPU, VECTOR, amp=amp)
    assert speed.amp_dtype is None and speed.loss_scaled(torch.optim.SGD(mixed.parameters())) is None
    first = train(plain, data, plan_for(plain))
    second = train(mixed, data, plan_for(mixed), speed)
    assert first.loss == second.loss
    assert all(torch.equal(a, b) for a, b in zip(weights(plain).values(), weights(mixed).values()))


# -------------------------------------------------------------------- the fp16 path, driven on the CPU


def fp16_speed() -> TrainingSpeed:
    """The GPU's fp16 configuration (autocast, gradient scaler, fused SGD) on the CPU, where
    torch runs all three: the wiring is tested here, the speed only on a GPU."""
    return TrainingSpeed(CPU, amp_dtype=torch.float16)


def test_fp16_training_steps_through_the_scaler_and_stays_close_to_float32():
    data = make_data(VECTOR)
    plain, mixed = (build_model("mlp", num_classes=10, input_shape=VECTOR, seed=0) for _ in range(2))
    start = weights(plain)
    first = train(plain, data, plan_for(plain, epochs=2))
    second = train(mixed, data, plan_for(mixed, epochs=2), fp16_speed())
    assert second.steps == first.steps == 10
    assert second.loss == pytest.approx(first.loss, rel=0.05)
    for name, value in weights(mixed).items():
        assert not torch.equal(value, start[name])
        torch.testing.assert_close(value, weights(plain)[name], rtol=0.05, atol=5e-3)


@pytest.mark.parametrize("step_rule", [("perfedavg", {}), ("perfedavg", {"hessian": True}), ("ditto", {})])
def test_fp16_runs_step_rules_that_take_gradients_twice_per_step(step_rule):
    """Per-FedAvg asks for gradients twice per optimizer step, Ditto steps a second model."""
    data = make_data(VECTOR)
    model = build_model("mlp", num_classes=10, input_shape=VECTOR, seed=0)
    start = weights(model)
    outcome = train(model, data, plan_for(model), fp16_speed(), objective=ObjectiveSpec(step_rule=step_rule).build(),
                    state={})
    assert outcome.steps == 5 and torch.isfinite(torch.tensor(outcome.loss))
    assert any(not torch.equal(v, start[k]) for k, v in weights(model).items())


def test_the_scaler_skips_a_step_whose_gradients_overflowed():
    parameter = torch.nn.Parameter(torch.ones(3))
    scaled = LossScaledOptimizer(torch.optim.SGD([parameter], lr=0.1), torch.amp.GradScaler("cpu", init_scale=4.0))
    scaled.zero_grad()
    scaled.backward((parameter * torch.tensor([1.0, float("inf"), 1.0])).sum())
    scaled.step()
    assert torch.equal(parameter.detach(), torch.ones(3))
    assert scaled.scaler.get_scale() == 2.0  # halved after the overflow
    scaled.zero_grad()
    scaled.backward((parameter * 2).sum())
    assert torch.equal(parameter.grad, torch.full((3,), 2.0))  # the step and its users see true gradients
    scaled.step()
    torch.testing.assert_close(parameter.detach(), torch.full((3,), 0.8))


# ------------------------------------------------------------------------------- channels_last


def test_channels_last_lays_out_a_conv_net_its_data_and_its_batches():
    data = make_data(IMAGE)
    plain, laid_out = (build_model("cnn4", num_classes=10, input_shape=IMAGE, seed=0) for _ in range(2))
    speed = TrainingSpeed.configure(laid_out, CPU, IMAGE, channels_last=True)
    assert speed.channels_last
    conv = laid_out.body["conv2"][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    placed = speed.place(data)
    assert placed.x_train.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(placed.x_train, data.x_train) and placed.y_train is data.y_train
    flops = unit_forward_flops(plain, IMAGE)
    formats = []
    laid_out.body["conv1"].register_forward_pre_hook(
        lambda module, args: formats.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    augment = build_augment("crop_flip", 3)  # its output is a new tensor in the default format
    first = train_local(plain, data, plan_for(plain), F.cross_entropy, {}, flops, augment=build_augment("crop_flip", 3))
    second = train_local(laid_out, placed, plan_for(laid_out), F.cross_entropy, {}, flops, augment=augment, speed=speed)
    assert formats == [True] * 5
    assert second.loss == pytest.approx(first.loss, rel=1e-4)
    for name, value in weights(laid_out).items():
        torch.testing.assert_close(value, weights(plain)[name], rtol=1e-4, atol=1e-5)


def test_channels_last_leaves_a_model_without_convolutions_alone():
    data = make_data(VECTOR)
    model = build_model("mlp", num_classes=10, input_shape=VECTOR, seed=0)
    speed = TrainingSpeed.configure(model, CPU, VECTOR, channels_last=True)
    assert not speed.channels_last and speed.place(data) is data


# ------------------------------------------------------------------------------------ compile


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters emptied around the test, its recompile limit restored (by
    assignment: monkeypatch's undo deletes the attribute, which hides a config entry)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit


def test_compile_makes_one_graph_per_trainable_set_and_reuses_it_next_round(fresh_dynamo):
    """FedBug's gradual unfreezing (fc1, then fc1+fc2, then all) over 45 samples in batches of
    10: three trainable sets, three graphs; the partial batch of 5 runs eagerly (no graph per
    size); the next round compiles nothing. Dynamo's eager backend: the same kernels as eager."""
    data = make_data(VECTOR)
    plain, compiled = (build_model("mlp", num_classes=10, input_shape=VECTOR, seed=0) for _ in range(2))
    speed = TrainingSpeed.configure(compiled, CPU, VECTOR, compile=True, compile_backend="eager")
    assert torch._dynamo.config.recompile_limit >= 4 * len(compiled.schedule_units)
    for _ in range(2):  # two rounds
        first = train(plain, data, plan_for(plain, epochs=2, fraction=0.5))
        second = train(compiled, data, plan_for(compiled, epochs=2, fraction=0.5), speed)
        assert fresh_dynamo["stats"]["unique_graphs"] == 3
        assert first.loss == second.loss
        assert all(torch.equal(a, b) for a, b in zip(weights(plain).values(), weights(compiled).values()))
    assert not fresh_dynamo["unimplemented"]  # no graph break, no recompile limit hit


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="torch.compile's CPU backend (inductor) needs a C++ compiler")
def test_inductor_compiled_training_matches_eager(fresh_dynamo):
    data = make_data(VECTOR)
    plain, compiled = (build_model("mlp", num_classes=10, input_shape=VECTOR, seed=0) for _ in range(2))
    speed = TrainingSpeed.configure(compiled, CPU, VECTOR, compile=True)
    first = train(plain, data, plan_for(plain, epochs=2))
    second = train(compiled, data, plan_for(compiled, epochs=2), speed)
    assert fresh_dynamo["stats"]["unique_graphs"] == 1
    assert second.loss == pytest.approx(first.loss, rel=1e-5)
    for name, value in weights(compiled).items():
        torch.testing.assert_close(value, weights(plain)[name], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- no per-step synchronisation


SYNCHRONISING = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero",
                 "unique", "bincount", "masked_select"}  # len(), shapes: no device read


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for the device (on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCHRONISING:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def host_reads(speed_of, epochs: int, **kwargs) -> list[str]:
    data = make_data(IMAGE, n=40)
    model = build_model("cnn4", num_classes=10, input_shape=IMAGE, seed=0)
    speed = speed_of(model)
    plan = plan_for(model, epochs=epochs, fraction=0.5, grad_clip=1.0,
                    upload_deltas=tuple(n for n, _ in model.named_parameters()))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    with HostReads() as reads:
        train_local(model, speed.place(data), plan, F.cross_entropy, reference, unit_forward_flops(model, IMAGE),
                    speed=speed, augment=build_augment("crop_flip", 1), unit_schedule=gradual_unfreezing, **kwargs)
    return reads.calls


@pytest.mark.parametrize("objective", [("sgd", {}, {}), ("sgd", {}, {"proximal": {"mu": 0.1}}),
                                       ("sgd", {}, {"feddyn": {"alpha": 0.1}}), ("perfedavg", {}, {}),
                                       ("ditto", {}, {})], ids=["sgd", "fedprox", "feddyn", "perfedavg", "ditto"])
@pytest.mark.parametrize("speed_of", [lambda m: TrainingSpeed(CPU),
                                      lambda m: TrainingSpeed.configure(m, CPU, IMAGE, channels_last=True),
                                      lambda m: fp16_speed()], ids=["float32", "channels_last", "fp16"])
def test_the_training_loop_reads_the_device_once_however_many_steps(objective, speed_of):
    """Gradual unfreezing, gradient clipping, augmentation and the objective's terms and step rule:
    1 epoch (4 steps) and 3 epochs (12 steps) read the device equally often: once, for the loss."""
    rule, rule_options, terms = objective

    def reads(epochs: int) -> list[str]:
        spec = ObjectiveSpec(step_rule=(rule, rule_options)).with_terms(terms)
        return host_reads(speed_of, epochs, objective=spec.build(), state={})

    once, thrice = reads(1), reads(3)
    assert once == thrice == ["__float__"]
