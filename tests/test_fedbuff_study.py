"""benchmarks/fedbuff_study.py: its FedBABU cell runs end to end at its tiny size (digits, three
rounds) through real ``fedpart run`` processes, each run's recorded virtual clock is the dry run
of the engines' schedule, and the verdicts follow their rule on hand-made records. No assertion
on accuracy values: at this size they mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env, load_script

SCRIPT = REPO / "benchmarks" / "fedbuff_study.py"
STUDY_TIMEOUT = 900.0

study = load_script(SCRIPT)


@pytest.mark.slow
def test_the_study_runs_end_to_end_at_tiny_size(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "study.json", tmp_path / "study.md"
    command = [sys.executable, str(SCRIPT), "--size", "tiny", "--algorithms", "fedbabu", "--settings", "heavy-tailed",
               "--out-root", str(tmp_path / "runs"), "--json", str(out_json), "--markdown", str(out_md)]
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=STUDY_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = json.loads(out_json.read_text())
    assert [r["engine"] for r in records] == ["sync", "buffered", "buffered, T/2"]
    assert all(r["error"] is None for r in records)
    sync, buffered, half = (r["values"] for r in records)
    assert records[2]["rounds"] < records[1]["rounds"] <= study.VERSIONS_PER_ROUND * records[0]["rounds"]
    assert buffered["virtual_seconds"] <= sync["virtual_seconds"] and half["virtual_seconds"] <= sync["virtual_seconds"] / 2
    assert sync["mean_staleness"] == 0 and sum(buffered["staleness"].values()) == buffered["folded"]
    assert 0 < sync["utilization"] < buffered["utilization"] < 1
    assert sync["bytes_per_update"] == pytest.approx(buffered["bytes_per_update"], rel=1e-3)
    text = out_md.read_text()
    assert "| fedbabu | heavy-tailed | buffered, T/2 |" in text and "- fedbabu, heavy-tailed: personalized" in text


def _record(algorithm: str, engine: str, **values) -> object:
    return study.Record(algorithm, "heavy-tailed", engine, 10, "out", values=values)


def test_verdicts_read_time_to_target_and_the_half_time_run() -> None:
    records = [_record("fedavg", "sync", **{"global": 0.8, "time_to_target": 100.0}),
               _record("fedavg", "buffered", time_to_target=40.0),
               _record("fedbabu", "sync", personalized=0.9, virtual_seconds=100.0),
               _record("fedbabu", "buffered"),
               _record("fedbabu", "buffered, T/2", personalized=0.91, virtual_seconds=49.0),
               _record("fedrep", "sync", personalized=0.9, virtual_seconds=100.0),
               _record("fedrep", "buffered"),
               _record("fedrep", "buffered, T/2", personalized=0.89, virtual_seconds=49.0)]
    lines = study.verdicts(records)
    assert lines[0].endswith("2.50x sooner")
    assert lines[1].endswith("reached at least 2.04x sooner")
    assert lines[2].endswith("not reached in half the time")
    records[1].values["time_to_target"] = None
    assert "did not reach 80.00 %" in study.verdicts(records)[0]
    records[1].error = "exit code 1"
    assert study.verdicts(records)[0] == "fedavg, heavy-tailed: no verdict (a run failed)"
