"""The typed run records (fedpart.common.process.records): a line of metrics.jsonl and summary.json read
into RoundRecord and RunSummary and written back give the same JSON, key for key and in the same
order, for records a real run wrote and for older files that lack keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import check_records, run_fedpart, small_config
from fedpart.common.process.records import (
    Accuracy,
    BufferedVersion,
    ByteCounts,
    BytesByPart,
    ClientResult,
    ClientStats,
    DeliveryCounts,
    Insiders,
    ModelMetrics,
    Outlier,
    Parameters,
    RoundClient,
    RoundPrivacy,
    RoundRecord,
    RoundRobust,
    RunDelivery,
    RunRobust,
    RunSummary,
    SumCheck,
    read_rounds,
    read_summary,
)

FULL_ROUND = RoundRecord(
    round=2, sampled=[3, 1], completed=[1], train_loss=0.5, lr=0.05, seconds=1.25, train_samples=40,
    client_compute_seconds=0.75, trainable_parameters=1234.0, train_flops=1e6, bytes_down=2000, bytes_up=1000,
    bytes_by_part={"body": ByteCounts(down=1500, up=800)},
    logical=BytesByPart(down=2100, up=1000, by_part={"body": ByteCounts(down=2000, up=900)}),
    bytes_by_unit={"fc1": ByteCounts(down=1500, up=800)},
    clients={"1": RoundClient(down=900, up=500, logical_down=950, logical_up=500, compute_seconds=0.75),
             "3": RoundClient(down=0, up=0)},
    robust=RoundRobust(clipped=1, non_finite=["head.weight"]),
    insiders=Insiders(median_norm=2.0, outliers={"1": Outlier(norm_ratio=9.0, cosine=None, streak=2)}),
    delivery=DeliveryCounts(tasks_sent_again=1), server_step={"eta": 0.5}, gpu_peak_bytes={"process_0": 7_000_000},
    privacy=RoundPrivacy(epsilon=1.5, clip_norm=0.8, unclipped_fraction=None),
    buffered=BufferedVersion(concurrency=4, buffer_size=2, dispatched=[1], staleness={"0": 1}),
    global_metrics=ModelMetrics(loss=0.6, acc=0.8))


def test_a_round_record_reads_back_what_it_writes() -> None:
    line = FULL_ROUND.to_json()
    assert list(line)[-3:] == ["privacy", "buffered", "global"]  # "global" last: the server adds it last
    assert RoundRecord.from_json(json.loads(json.dumps(line))) == FULL_ROUND
    assert line["clients"]["3"] == {"down": 0, "up": 0, "compute_seconds": None}  # a null time is written
    assert line["privacy"] == {"epsilon": 1.5, "clip_norm": 0.8, "unclipped_fraction": None}
    assert line["insiders"]["outliers"]["1"]["cosine"] is None
    assert RoundPrivacy(epsilon=None).to_json() == {"epsilon": None}  # no adaptive clip: no fraction
    sealed = Insiders(median_norm=1.0, revealed_sum=SumCheck(norm_ratio=3.0, streak=1))
    assert sealed.to_json() == {"median_norm": 1.0, "sum": {"norm_ratio": 3.0, "streak": 1}}
    assert Insiders.from_json(sealed.to_json()) == sealed
    bare = RoundRecord(round=1)
    assert RoundRecord.from_json(bare.to_json()) == bare
    assert bare.to_json()["train_loss"] is None  # a null loss is written; absent parts are not
    assert "global" not in bare.to_json() and "logical" not in bare.to_json()


def test_a_run_summary_reads_back_what_it_writes() -> None:
    stats = ClientStats(mean=0.5, std=0.1, weighted_mean=0.55, clients=2)
    summary = RunSummary(status="completed", rounds_completed=2, algorithm="fedavg", model="mlp", dataset="digits",
                         rounds=2, clients=2, parameters=Parameters(total=3, body=2, head=1),
                         accuracy=Accuracy(metric="acc", initial=stats, personalized={"1": stats, "5": stats},
                                           global_metrics=ModelMetrics(loss=1.0, acc=0.5)),
                         delivery=RunDelivery(rounds=DeliveryCounts(duplicates=1)), robust=RunRobust(),
                         seconds=3.0, failures=[], exit_code=0,
                         per_client=[ClientResult(id=0, bytes=ByteCounts(down=1, up=2), personalized={"1": None})])
    written = summary.to_json()
    assert RunSummary.from_json(json.loads(json.dumps(written))) == summary
    assert "note" not in written and "privacy" not in written
    assert written["delivery"] == {"rounds": {"tasks_sent_again": 0, "results_sent_again": 0, "streams_cut": 0,
                                              "cut_bytes": 0, "duplicates": 1, "given_up": 0}, "evaluation": {}}
    assert written["per_client"][0] == {"id": 0, "train_samples": None, "test_samples": None, "initial": None,
                                        "personalized": {"1": None}, "bytes": {"down": 1, "up": 2}}
    assert summary.accuracy.longest_finetune() == "5" and summary.global_accuracy() == 0.5
    assert RunSummary.from_json({"status": "interrupted"}).to_json() == {"status": "interrupted"}


def test_older_lines_read_with_what_they_have_and_bad_ones_are_refused() -> None:
    older = {"round": 1, "sampled": [0, 1], "completed": [1], "bytes_down": 10, "bytes_up": 5, "future_key": 1}
    record = RoundRecord.from_json(older)
    assert (record.completed, record.logical, record.clients, record.bytes_in("up")) == ([1], None, None, 5)
    assert "clients" not in record.to_json() and "future_key" not in record.to_json()
    for bad in ({"sampled": []}, {"round": "1"}, [1], {"round": 1, "robust": [1]}, {"round": 1, "logical": {"up": 1}}):
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
    assert summary.privacy is not None and summary.compute.train_flops == sum(r.train_flops for r in rounds)


def test_a_run_directory_whose_records_do_not_read_back_is_refused(tmp_path: Path) -> None:
    """Every run directory the test runs write (``run_fedpart``, servers started by ``processes``)
    is checked by ``conftest.check_records``; it refuses a line written in another key order."""
    line = FULL_ROUND.to_json()
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    check_records(tmp_path)
    reordered = {"completed": line["completed"], **line}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(reordered) + "\n")
    with pytest.raises(AssertionError):
        check_records(tmp_path)
