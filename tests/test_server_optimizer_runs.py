"""Server optimizers end to end (digits mlp, two rounds, see tests/test_algorithm_runs.py for the
layout): the last round's change of the global model, read from the checkpoints, is the step the
saved optimizer state says it is; FedExp's step size is in the round's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpart.common.process.checkpoint import load_tensors
from fedpart.server.policy.insiders import InsiderMonitor
from fedpart.server.policy.robust import AdaptiveBound
from test_algorithm_runs import CLIENTS, _run

NON_IID = {"dataset": "digits", "partition": {"scheme": "shards", "shards_per_client": 5}}


def _checkpoints(out: Path) -> list[dict[str, torch.Tensor]]:
    """The global model before round 1 and after rounds 1 and 2, in float64."""
    files = [out / f"checkpoints/round_{r:04d}.safetensors" for r in (0, 1, 2)]
    return [{name: tensor.double() for name, tensor in load_tensors(path).items()} for path in files]


def _optimizer_state(out: Path) -> dict[str, torch.Tensor]:
    """The server optimizer's state after the last round, from the run state (without the
    adaptive norm bound's medians and the insider monitor's history, saved beside it)."""
    tensors = load_tensors(out / "server_state/round_0002.safetensors")
    prefix = "server_optimizer/"
    beside = (prefix + AdaptiveBound.STATE_PREFIX, prefix + InsiderMonitor.STATE_PREFIX)
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and not k.startswith(beside)}


def _close(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> None:
    """Equal up to a few float32 roundings of tensors of magnitude ``scale``."""
    tolerance = 4 * torch.finfo(torch.float32).eps * float(scale.abs().max())
    torch.testing.assert_close(got, expected.to(got.dtype), rtol=0, atol=tolerance)


@pytest.mark.parametrize("name, options", [("fedavgm", {"lr": 1.0, "beta": 0.9}),
                                           ("fedadam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3})])
def test_fedavg_with_a_stateful_server_optimizer(tmp_path: Path, name: str, options: dict) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "fedavg"}, rounds=2, server_optimizer={"name": name, **options})
    assert [r["completed"] for r in metrics] == [list(range(CLIENTS))] * 2
    _, first, second = _checkpoints(out)
    state = _optimizer_state(out)
    kinds = {"fedavgm": ("momentum",), "fedadam": ("m", "v")}[name]
    assert set(state) == {f"{kind}/{tensor}" for kind in kinds for tensor in first}
    for tensor in first:
        if name == "fedavgm":
            step = options["lr"] * state[f"momentum/{tensor}"]
        else:
            m, v = state[f"m/{tensor}"], state[f"v/{tensor}"]
            step = options["lr"] * m / (v.sqrt() + options["tau"])
        _close(second[tensor] - first[tensor], step, second[tensor])
    assert summary["accuracy"]["initial"]["mean"] > 0


def test_fedbug_with_feddyns_server_step(tmp_path: Path) -> None:
    """Every client takes part (|P| = m), so h1 = -alpha d1, new1 = old + 2 d1, and after round 2
    h2 = (alpha / 2) ((new1 + old) / 2 - new2)."""
    alpha = 0.01
    algorithm = {"name": "fedbug", "gu_ratio": 0.5, "objective": {"feddyn": {"alpha": alpha}}}
    metrics, summary, out = _run(tmp_path, algorithm, rounds=2)
    assert [r["completed"] for r in metrics] == [list(range(CLIENTS))] * 2
    old, first, second = _checkpoints(out)
    state = _optimizer_state(out)
    assert set(state) == {f"h/{tensor}" for tensor in first}
    for tensor in first:
        expected = alpha / 2 * ((first[tensor] + old[tensor]) / 2 - second[tensor])
        _close(state[f"h/{tensor}"], expected, alpha * second[tensor])
        assert torch.count_nonzero(state[f"h/{tensor}"]), "h moved away from zero"
    assert summary["accuracy"]["initial"]["mean"] > 0


def test_fedbug_with_fedexp_records_its_step_size(tmp_path: Path) -> None:
    """Label shards make the clients' updates disagree: FedExp extrapolates (step size > 1)."""
    algorithm = {"name": "fedbug", "gu_ratio": 0.5}
    metrics, summary, out = _run(tmp_path, algorithm, rounds=2, data=NON_IID, server_optimizer={"name": "fedexp"})
    sizes = [r["server_step"]["step_size"] for r in metrics]
    assert all(size >= 1 for size in sizes) and sizes[0] > 1, sizes
    assert _optimizer_state(out) == {}, "FedExp keeps no state"
    assert summary["accuracy"]["initial"]["mean"] > 0
