"""The typed run records (fedpart.common.records): a line of metrics.jsonl and summary.json read
into RoundRecord and RunSummary and written back give the same JSON, key for key and in the same
order, for records a real run wrote and for older files that lack keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_fedpart, small_config
from fedpart.common.records import RoundRecord, RunSummary, read_rounds, read_summary

FULL_ROUND = RoundRecord(
    round=2, sampled=[3, 1], completed=[1], train_loss=0.5, lr=0.05, seconds=1.25, train_samples=40,
    client_compute_seconds=0.75, trainable_parameters=1234.0, train_flops=1e6, bytes_down=2000, bytes_up=1000,
    bytes_by_part={"body": {"down": 1500, "up": 800}}, logical={"down": 2100, "up": 1000, "by_part": {}},
    bytes_by_unit={"fc1": {"down": 1500, "up": 800}},
    clients={"1": {"down": 900, "up": 500, "compute_seconds": 0.75}, "3": {"down": 0, "up": 0, "compute_seconds": None}},
    robust={"clipped": 0, "rejected": 0, "samples_capped": 0, "non_finite": []}, delivery={"tasks_resent": 1},
    server_step={}, gpu_peak_bytes={"process_0": 7_000_000}, privacy={"epsilon": 1.5},
    global_metrics={"acc": 0.8, "loss": 0.6})


def test_a_round_record_reads_back_what_it_writes() -> None:
    line = FULL_ROUND.to_json()
    assert list(line)[-3:] == ["gpu_peak_bytes", "privacy", "global"]
    assert RoundRecord.from_json(json.loads(json.dumps(line))) == FULL_ROUND
    bare = RoundRecord(round=1)
    assert RoundRecord.from_json(bare.to_json()) == bare
    assert bare.to_json()["train_loss"] is None  # a null loss is written; absent parts are not
    assert "global" not in bare.to_json() and "logical" not in bare.to_json()


def test_a_run_summary_reads_back_what_it_writes() -> None:
    summary = RunSummary(status="completed", rounds_completed=2, algorithm="fedavg", model="mlp", dataset="digits",
                         rounds=2, clients=4, accuracy={"metric": "acc"}, bytes={"down": 1, "up": 2}, seconds=3.0,
                         failures=[], per_client=[], exit_code=0)
    assert RunSummary.from_json(json.loads(json.dumps(summary.to_json()))) == summary
    assert "note" not in summary.to_json() and "privacy" not in summary.to_json()
    assert RunSummary.from_json({"status": "interrupted"}).to_json() == {"status": "interrupted"}


def test_older_lines_read_with_what_they_have_and_bad_ones_are_refused() -> None:
    older = {"round": 1, "sampled": [0, 1], "completed": [1], "bytes_down": 10, "bytes_up": 5, "future_key": 1}
    record = RoundRecord.from_json(older)
    assert (record.completed, record.logical, record.clients, record.bytes_in("up")) == ([1], None, None, 5)
    assert "clients" not in record.to_json() and "future_key" not in record.to_json()
    for bad in ({"sampled": []}, {"round": "1"}, [1]):
        with pytest.raises(ValueError):
            RoundRecord.from_json(bad)


def _same_lines(path: Path) -> None:
    for line in path.read_text().splitlines():
        assert json.dumps(RoundRecord.from_json(json.loads(line)).to_json()) == line


def test_the_files_of_a_real_run_read_back_unchanged(tmp_path: Path) -> None:
    """A run with the optional parts (global accuracy every round, differential privacy): each
    line and the summary, read and written again, are the same text the server wrote."""
    train = {**small_config()["train"], "weighting": "uniform"}
    config = small_config(rounds=2, train=train, evaluate={"finetune_epochs": [1], "batch_size": 50, "global_every": 1},
                          privacy={"dp": {"enabled": True, "clip_norm": 1.0, "noise_multiplier": 0.5}})
    result, out = run_fedpart(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    _same_lines(out / "metrics.jsonl")
    rounds = read_rounds(out / "metrics.jsonl")
    assert [r.round for r in rounds] == [1, 2]
    assert all(r.global_metrics is not None and r.privacy is not None and r.clients for r in rounds)
    text = (out / "summary.json").read_text()
    summary = read_summary(out / "summary.json")
    assert json.dumps(summary.to_json(), indent=1) == text
    assert (summary.status, summary.exit_code, summary.rounds_completed) == ("completed", 0, 2)
    assert summary.privacy is not None and summary.compute["train_flops"] == sum(r.train_flops for r in rounds)
