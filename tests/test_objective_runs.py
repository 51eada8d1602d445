"""Algorithms built on client objectives end to end, with their byte patterns (digits mlp, see
tests/test_algorithm_runs.py for the layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from fedpart.common.process.checkpoint import load_tensors
from test_algorithm_runs import CLIENTS, SIZES, _about, _run, _tensor_bytes

BODY = SIZES["fc1"] + SIZES["fc2"]


def _state(out: Path, kind: str) -> list[dict[str, torch.Tensor]]:
    files = sorted(out.glob(f"state/process_*/*/{kind}client_*/personal.safetensors"))
    assert len(files) == CLIENTS, files
    return [load_tensors(p) for p in files]


def test_fedrod_uploads_body_and_generic_head_never_the_personal_head(tmp_path: Path) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "fedrod"}, rounds=2)
    for record in metrics:
        assert _about(_tensor_bytes(record, "body", "up"), CLIENTS * BODY, pieces=CLIENTS * 4)
        assert _about(_tensor_bytes(record, "head", "up"), CLIENTS * SIZES["head"], pieces=CLIENTS * 2)
    personal = _state(out, "")
    assert all(set(p) == {"parts.personal_head.weight", "parts.personal_head.bias"} for p in personal)
    assert not torch.equal(personal[0]["parts.personal_head.weight"], personal[1]["parts.personal_head.weight"])
    last = load_tensors(out / "checkpoints/round_0002.safetensors")
    assert torch.count_nonzero(last["parts.personal_head.weight"]) == 0, "the server's personal head stays at zero"
    assert summary["accuracy"]["initial"]["mean"] > 0


def test_ditto_uploads_full_deltas_and_evaluates_its_personal_model(tmp_path: Path) -> None:
    metrics, summary, out = _run(tmp_path, {"name": "ditto", "lambda": 0.1}, rounds=2)
    for record in metrics:
        assert _about(_tensor_bytes(record, "body", "up"), CLIENTS * BODY, pieces=CLIENTS * 4)
        assert _about(_tensor_bytes(record, "head", "up"), CLIENTS * SIZES["head"], pieces=CLIENTS * 2)
    personal = _state(out, "objective/")
    last = load_tensors(out / "checkpoints/round_0002.safetensors")
    assert set(personal[0]) == {f"ditto.{name}" for name in last}
    assert not torch.equal(personal[0]["ditto.head.weight"], last["head.weight"]), "v is the client's own model"
    assert summary["accuracy"]["initial"]["mean"] > 0


def test_fedbug_composes_with_feddyn_and_feddecorr(tmp_path: Path) -> None:
    objective = {"feddyn": {"alpha": 0.01}, "feddecorr": {"beta": 0.1}}
    metrics, summary, out = _run(tmp_path, {"name": "fedbug", "gu_ratio": 0.5, "objective": objective}, rounds=2)
    assert all(_tensor_bytes(r, "head", "up") > 0 for r in metrics)
    state = _state(out, "objective/")
    last = load_tensors(out / "checkpoints/round_0002.safetensors")
    assert set(state[0]) == {f"feddyn.{name}" for name in last}
    assert any(torch.count_nonzero(t) for t in state[0].values()), "g_k moved away from zero"
    assert summary["accuracy"]["initial"]["mean"] > 0
