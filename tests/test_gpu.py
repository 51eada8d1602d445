"""The GPU path on a CUDA device (every test here is marked ``gpu`` and skips, saying why, where
torch sees no CUDA device): a run on cuda:0 ends where the same run on the CPU ends, frozen tensors
stay bit-identical under every speed option, the training loop never makes the host wait, tensors
cross the bus once, and peak memory reaches the round records."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import WAIT, child_env, fedpart_command, read_metrics, read_summary, small_config, write_config
from fedpart.client.local_data import ClientData
from fedpart.client.placement import Transfers, resolve_device, resolve_devices
from fedpart.client.speed import TrainingSpeed
from fedpart.client.training import train_local
from fedpart.common.ml.algorithms import UNFREEZE_FRACTION, gradual_unfreezing
from fedpart.common.process.checkpoint import load_tensors
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.data.augment import build_augment
from fedpart.common.config.experiment import build_run_model
from fedpart.common.models.zoo import build_model, unit_forward_flops
from fedpart.common.wire.plans import Phase, TrainPlan
from fedpart.common.wire.tensors import make_spec
from test_speed import IMAGE, make_data

pytestmark = pytest.mark.gpu

GPU = torch.device("cuda", 0)
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}  # float32 matmuls and convolutions in full float32, as on the CPU
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_on(tmp_path: Path, name: str, config: dict, devices: str) -> Path:
    """``fedpart run --devices DEVICES`` of ``config``; returns the run directory."""
    path = write_config(tmp_path / f"{name}.yaml", config)
    out = tmp_path / name
    done = subprocess.run(fedpart_command("run", str(path), "--out", str(out), "--devices", devices),
                          capture_output=True, text=True, env={**child_env(), **NO_TF32}, cwd=tmp_path,
                          timeout=WAIT)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def final_weights(out: Path, rounds: int) -> dict[str, torch.Tensor]:
    return load_tensors(out / "checkpoints" / f"round_{rounds:04d}.safetensors")


def test_auto_is_the_first_gpu():
    assert resolve_device("auto") == GPU
    assert resolve_devices("auto") == [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def test_a_run_on_cuda_ends_where_the_same_run_on_the_cpu_ends(tmp_path):
    config = small_config(rounds=3, processes=1, evaluate={"finetune_epochs": [1], "batch_size": 50})
    on_gpu = run_on(tmp_path, "gpu", config, "cuda:0")
    on_cpu = run_on(tmp_path, "cpu", config, "cpu")
    gpu, cpu = final_weights(on_gpu, 3), final_weights(on_cpu, 3)
    assert gpu.keys() == cpu.keys()
    for name in cpu:
        torch.testing.assert_close(gpu[name], cpu[name], rtol=1e-4, atol=1e-5, msg=name)
    for g, c in zip(read_metrics(on_gpu), read_metrics(on_cpu)):
        assert g["train_loss"] == pytest.approx(c["train_loss"], rel=1e-4)
        assert g["bytes_up"] == c["bytes_up"]
    assert "on cuda:0 (" in (on_gpu / "logs" / "client_0.log").read_text()


def test_peak_gpu_memory_per_process_reaches_the_round_records_and_the_summary(tmp_path):
    out = run_on(tmp_path, "peaks", small_config(rounds=2, processes=2), "cuda:0,cuda:0")
    for record in read_metrics(out):
        peaks = record["gpu_peak_bytes"]
        assert len(peaks) == 2 and all(isinstance(v, int) and v > 0 for v in peaks.values())
    assert read_summary(out)["compute"]["gpu_peak_bytes"] == max(
        v for r in read_metrics(out) for v in r["gpu_peak_bytes"].values())


def test_fedbabu_on_cuda_leaves_the_global_head_bit_identical(tmp_path):
    config = small_config(rounds=2, processes=1, algorithm={"name": "fedbabu"})
    out = run_on(tmp_path, "babu", config, "cuda:0")
    initial = build_run_model(config_from_dict(config)).state_dict()
    final = final_weights(out, 2)
    for name in ("head.weight", "head.bias"):
        assert torch.equal(final[name], initial[name])
    assert not torch.equal(final["body.fc1.1.weight"], initial["body.fc1.1.weight"])


SPEEDS = {
    "float32": {},
    "bf16": {"amp": "bf16"},
    "fp16": {"amp": "fp16"},
    "channels_last": {"channels_last": True},
    "compile": {"compile": True},
}


def speed_for(model, options: dict) -> TrainingSpeed:
    if options.get("compile") and not HAS_TRITON:
        pytest.skip("torch.compile on a GPU needs triton")
    if options.get("amp") == "bf16" and torch.cuda.get_device_properties(GPU).major < 8:
        pytest.skip("bf16 needs compute capability 8.0")
    return TrainingSpeed.configure(model, GPU, IMAGE, **options)


def gpu_data(n: int) -> ClientData:
    data = make_data(IMAGE, n=n)
    return ClientData(*(getattr(data, f.name).to(GPU) for f in dataclasses.fields(data)))


def babu_plan(epochs: int = 2) -> TrainPlan:
    """FedBABU: the body trains (momentum and weight decay), the head stays frozen."""
    return TrainPlan(phases=(Phase(epochs, ("conv1", "conv2", "conv3", "conv4")),), lr=0.05, momentum=0.9,
                     weight_decay=1e-3, batch_size=10, seed=5)


@pytest.mark.parametrize("options", SPEEDS.values(), ids=SPEEDS.keys())
def test_frozen_tensors_stay_bit_identical_on_the_gpu(options):
    model = build_model("cnn4", num_classes=10, input_shape=IMAGE, seed=0).to(GPU)
    speed = speed_for(model, options)
    head = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
    body = model.body["conv1"][0].weight.detach().clone()
    data = speed.place(gpu_data(45))
    outcome = train_local(model, data, babu_plan(), F.cross_entropy, {}, unit_forward_flops(model, IMAGE),
                          augment=build_augment("crop_flip", 1), speed=speed)
    assert outcome.steps == 10 and torch.isfinite(torch.tensor(outcome.loss))
    assert all(torch.equal(v, head[k]) for k, v in model.head.state_dict().items())
    assert not torch.equal(model.body["conv1"][0].weight, body)


@pytest.mark.parametrize("options", SPEEDS.values(), ids=SPEEDS.keys())
def test_the_training_loop_never_waits_for_the_gpu_per_step(options):
    """CUDA's sync debug mode warns at every synchronising call: 1 epoch and 4 epochs of FedBug's
    unfreezing with clipping and augmentation warn equally often (the loss, read once)."""
    def synchronisations(epochs: int) -> int:
        model = build_model("cnn4", num_classes=10, input_shape=IMAGE, seed=0).to(GPU)
        speed = speed_for(model, options)
        data = speed.place(gpu_data(40))
        plan = TrainPlan(phases=(Phase(epochs, tuple(model.schedule_units), {UNFREEZE_FRACTION: 0.5}),), lr=0.05,
                         momentum=0.9,
                         batch_size=10, seed=5, grad_clip=1.0)
        flops = unit_forward_flops(model, IMAGE)
        train_local(model, data, plan, F.cross_entropy, {}, flops, speed=speed,  # warm-up (compiles, allocates)
                    unit_schedule=gradual_unfreezing)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_local(model, data, plan, F.cross_entropy, {}, flops, speed=speed,
                            augment=build_augment("crop_flip", 1), unit_schedule=gradual_unfreezing)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert synchronisations(1) == synchronisations(4) <= 2


def test_received_tensors_cross_once_through_reused_pinned_buffers():
    transfers = Transfers(GPU)
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    specs = [make_spec(n, t) for n, t in tensors.items()]
    staged = transfers.staging(specs)
    assert all(buffer.is_pinned() for buffer in staged.values())
    for name, tensor in tensors.items():
        staged[name].copy_(tensor)
    on_device = transfers.to_device(staged)
    assert all(t.device == GPU and torch.equal(t.cpu(), tensors[n]) for n, t in on_device.items())
    again = transfers.staging(specs)  # the next version decodes into the same buffers
    assert all(again[n].data_ptr() == staged[n].data_ptr() for n in tensors)
    (back,) = transfers.to_host({n: t * 2 for n, t in on_device.items()})
    assert all(t.is_pinned() and torch.equal(t, tensors[n] * 2) for n, t in back.items())
