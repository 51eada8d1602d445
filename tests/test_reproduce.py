"""benchmarks/reproduce.py: every study runs end to end at its tiny size (digits, a round or two,
one seed) through real ``fedpart run`` processes, and its tables have every row; the paired
verdicts follow their rule on hand-made records. No assertion on accuracy values: at this size
they mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env, load_script

SCRIPT = REPO / "benchmarks" / "reproduce.py"
STUDY_TIMEOUT = 900.0

reproduce = load_script(SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(reproduce.STUDIES))
def test_study_runs_end_to_end_at_tiny_size(name: str, tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "study.json", tmp_path / "study.md"
    command = [sys.executable, str(SCRIPT), name, "--size", "tiny", "--seeds", "0",
               "--out-root", str(tmp_path / "runs"), "--json", str(out_json), "--markdown", str(out_md)]
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=STUDY_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    study = reproduce.STUDIES[name]("tiny")
    dumped = json.loads(out_json.read_text())["studies"][name]
    records = dumped["records"]
    expected = [(cell.key, v.label) for cell in study.cells for v in cell.variants]
    assert [(r["cell"], r["variant"]) for r in records] == expected
    for record in records:
        assert record["error"] is None
        assert Path(record["out"], "summary.json").is_file()  # a real run directory
        assert {"initial", "up_mb", "gflops"} <= set(record["values"]) and record["wall_seconds"] > 0
    section = out_md.read_text()
    table = section.split("\n\n")[3].splitlines()  # title, command, setting, then the results table
    assert [tuple(line.split(" | ")[:2]) for line in table[2:]] == [(f"| {c}", v) for c, v in expected]
    assert all("| 1/1 |" in line for line in table[2:])
    assert len(dumped["verdicts"]) == len(study.claims) + len(study.trend_claims)
    assert all(v["verdict"] in ("reproduced", "not reproduced", "inconclusive") for v in dumped["verdicts"])
    if study.per_round:  # the per-round global accuracy was recorded for the algorithms with a global model
        assert any(r["curve"] for r in records)

    # --collect tabulates the same run directories again without running anything
    files = sorted((tmp_path / "runs").rglob("*"))
    collected_json = tmp_path / "collected.json"
    collected = subprocess.run([sys.executable, str(SCRIPT), name, "--size", "tiny", "--seeds", "0", "--collect",
                                "--out-root", str(tmp_path / "runs"), "--json", str(collected_json)],
                               cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    again = json.loads(collected_json.read_text())["studies"][name]
    assert [r["values"] for r in again["records"]] == [r["values"] for r in records]
    assert [v["verdict"] for v in again["verdicts"]] == [v["verdict"] for v in dumped["verdicts"]]
    assert sorted((tmp_path / "runs").rglob("*")) == files  # nothing new was run or written


def test_start_from_uses_the_final_checkpoint_of_the_same_cell_and_seed() -> None:
    study = reproduce.STUDIES["fedbabu"]("tiny")
    for cell in study.cells:
        labels = [v.label for v in cell.variants]
        for variant in cell.variants:
            if variant.start_from is not None:  # the run it starts from goes first
                assert labels.index(variant.start_from) < labels.index(variant.label)


def _record(variant: str, seed: int, value: float, cell: str = "c") -> object:
    return reproduce.Record("s", cell, variant, seed, "", [], 1.0, values={"m": value})


def test_verdicts_pair_seeds_and_follow_the_rule() -> None:
    claim = reproduce.Claim("a above b", "c", "m", "a", "b")
    study = reproduce.Study("s", "paper", "", {}, (), (), (claim,))

    def verdict(a: list[float], b: list[float]) -> str:
        records = [_record("a", s, v) for s, v in enumerate(a)] + [_record("b", s, v) for s, v in enumerate(b)]
        return reproduce.verdicts(study, records)[0].verdict

    assert verdict([0.9, 0.8, 0.7], [0.8, 0.7, 0.6]) == "reproduced"           # every seed agrees
    assert verdict([0.9, 0.6, 0.9], [0.8, 0.7, 0.6]) == "inconclusive"         # mean agrees, one seed does not
    assert verdict([0.7, 0.7, 0.7], [0.8, 0.7, 0.6]) == "not reproduced"       # mean difference 0
    assert verdict([0.5], [0.6]) == "not reproduced"
    assert verdict([], [0.6]) == "no data"
    # lower is better: fewer bytes beat more
    cost = reproduce.Study("s", "paper", "", {}, (), (), (reproduce.Claim("a cheaper", "c", "m", "a", "b", lower=True),))
    records = [_record("a", 0, 1.0), _record("b", 0, 2.0)]
    assert reproduce.verdicts(cost, records)[0].verdict == "reproduced"
    # a failed run drops out of the pairing instead of counting as zero
    failed = _record("a", 1, 5.0)
    failed.error = "exit code 1"
    records = [_record("a", 0, 0.9), failed, _record("b", 0, 0.8), _record("b", 1, 0.8)]
    found = reproduce.verdicts(study, records)[0]
    assert found.verdict == "reproduced" and found.measured.endswith("(seeds: +0.10)")


def test_run_settings_precedence(tmp_path: Path) -> None:
    study = reproduce.STUDIES["fedbabu"]("full")
    cell = study.cells[2]
    lg = next(v for v in cell.variants if v.label == "LG-FedAvg")
    settings = reproduce.run_settings(study, cell, lg, 7, tmp_path, {"train.lr": 0.5, "model.name": "cnn2"})
    assert settings["seed"] == 7 and settings["train.epochs"] == 10 and settings["model.name"] == "cnn2"
    assert settings["train.lr"] == 0.5                     # --set wins over the variant's lr 1e-3
    assert settings["rounds"] == max(1, 60 // 10 // 4)      # the variant's rounds win over the cell's
    assert settings["data.root"] == str(tmp_path.resolve())
    assert settings["data.options"] == {"normalize": True, "train_samples": 3000, "test_samples": 2500}
