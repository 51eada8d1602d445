"""benchmarks/reproduce.py: every study runs end to end at its tiny size (digits, a round or two,
one seed) through real ``fedpart run`` processes, and its tables have every row; the paired
verdicts follow their rule on hand-made records. No assertion on accuracy values: at this size
they mean nothing. FedBABU's study runs one cell (``--cells tau=1``): the other two repeat its
five algorithms with another epoch count, and its trend claim across cells is checked on
hand-made records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, child_env, load_script

SCRIPT = REPO / "benchmarks" / "reproduce.py"
STUDY_TIMEOUT = 900.0
CELLS = {"fedbabu": ["tau=1"]}  # the cells a study's test runs (default: all)

reproduce = load_script(SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(reproduce.STUDIES))
def test_study_runs_end_to_end_at_tiny_size(name: str, tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "study.json", tmp_path / "study.md"
    cells = CELLS.get(name, [])
    chosen = ["--cells", ",".join(cells)] if cells else []
    command = [sys.executable, str(SCRIPT), name, "--size", "tiny", "--seeds", "0", *chosen,
               "--out-root", str(tmp_path / "runs"), "--json", str(out_json), "--markdown", str(out_md)]
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=STUDY_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    study = reproduce.select(reproduce.STUDIES[name]("tiny"), cells)
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
    assert all("| 1/1" in line for line in table[2:])
    assert len(dumped["verdicts"]) == len(study.claims) + len(study.trend_claims)
    for verdict in dumped["verdicts"]:  # a run that did not train in a round or two gives no verdict, and says so
        if verdict["verdict"] == "no verdict (a run did not train)":
            assert "left out" in verdict["measured"]
        else:
            assert verdict["verdict"] in ("reproduced", "not reproduced", "inconclusive")
    if study.per_round:  # the per-round global accuracy was recorded for the algorithms with a global model
        assert any(r["curve"] for r in records)

    # --collect tabulates the same run directories again without running anything
    files = sorted((tmp_path / "runs").rglob("*"))
    collected_json = tmp_path / "collected.json"
    collected = subprocess.run([sys.executable, str(SCRIPT), name, "--size", "tiny", "--seeds", "0", *chosen,
                                "--collect", "--out-root", str(tmp_path / "runs"), "--json", str(collected_json)],
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


def test_a_trend_verdict_pairs_each_seeds_gap_at_both_cells() -> None:
    """FedBABU's trend claim (its personalized advantage over FedAvg grows with tau), on hand-made
    records: per seed, the gap at tau=10 minus the gap at tau=1; a cell a run did not train in
    leaves its seed out."""
    study = reproduce.select(reproduce.STUDIES["fedbabu"]("tiny"), ["tau=1", "tau=10"], ["FedAvg", "FedBABU"])
    assert len(study.trend_claims) == 1

    def trend(small_gaps: list[float], large_gaps: list[float]) -> object:
        records = []
        for seed, (small, large) in enumerate(zip(small_gaps, large_gaps)):
            for cell, gap in (("tau=1", small), ("tau=10", large)):
                records += [_record("FedAvg", seed, 0.5, cell), _record("FedBABU", seed, 0.5 + gap, cell)]
        for record in records:
            record.values = {"ft5": record.values["m"]}
        return records, reproduce.verdicts(study, records)[-1]

    _, grows = trend([0.01, 0.02], [0.05, 0.04])
    assert (grows.text, grows.cell) == (study.trend_claims[0][0], "tau=1 → tau=10")
    assert grows.verdict == "reproduced" and grows.measured == "gap at tau=10 - gap at tau=1 = +3.00 points " \
        "(seeds: +4.00, +2.00)"
    assert trend([0.05, 0.01], [0.08, 0.00])[1].verdict == "inconclusive"       # the mean grows, one seed shrinks
    assert trend([0.05], [0.05])[1].verdict == "not reproduced"
    records, _ = trend([0.01, 0.02], [0.05, 0.04])
    records[-1].mark = "collapsed: model accuracy 10.0 % (chance 10 %)"       # seed 1's FedBABU at tau=10
    found = reproduce.verdicts(study, records)[-1]
    assert found.measured == "gap at tau=10 - gap at tau=1 = +4.00 points (seeds: +4.00); left out: " \
        "FedBABU seed 1 collapsed"


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


def _sweep_study() -> object:
    """The FedBABU study's tau=4 cell with FedAvg, FedBABU and LG-FedAvg, swept over two rates."""
    study = reproduce.select(reproduce.STUDIES["fedbabu"]("full"), ["tau=4"], ["FedAvg", "FedBABU", "LG-FedAvg"])
    return reproduce.sweep_learning_rates(study, [0.01, 0.1])


def test_sweep_runs_every_cell_at_each_rate_and_checks_every_claim_per_rate(tmp_path: Path) -> None:
    unswept = reproduce.select(reproduce.STUDIES["fedbabu"]("full"), ["tau=4"], ["FedAvg", "FedBABU", "LG-FedAvg"])
    study = _sweep_study()
    assert [c.key for c in study.cells] == ["tau=4 lr=0.01", "tau=4 lr=0.1"]
    assert all(c.origin == "tau=4" for c in study.cells) and [c.lr for c in study.cells] == [0.01, 0.1]
    for cell in study.cells:
        by_label = {v.label: v for v in cell.variants}
        assert reproduce.run_settings(study, cell, by_label["FedAvg"], 0, tmp_path, {})["train.lr"] == cell.lr
        # a variant with a rate of its own keeps it (LG-FedAvg fine-tunes FedAvg's model at 1e-3)
        assert reproduce.run_settings(study, cell, by_label["LG-FedAvg"], 0, tmp_path, {})["train.lr"] == 0.001
    directories = {reproduce.run_directory(tmp_path, study, 0, c, c.variants[0]) for c in study.cells}
    assert len(directories) == 2 and all(" " not in str(d) for d in directories)
    assert sorted((c.text, c.cell) for c in study.claims) == sorted(
        (c.text, f"{c.cell} lr={lr:g}") for c in unswept.claims for lr in (0.01, 0.1))
    # FedPer and FedRep were not selected: no claim against them is left
    assert all({c.better, c.worse} <= {"FedAvg", "FedBABU", "LG-FedAvg"} for c in study.claims)
    with pytest.raises(ValueError, match="tau=5"):
        reproduce.select(reproduce.STUDIES["fedbabu"]("full"), ["tau=5"])


def _run(variant: str, seed: int, cell: str, model: float | None, initial: float = 0.5,
         nonfinite: float = 0.0) -> object:
    values = {"global": model, "initial": initial, "nonfinite_loss_rounds": nonfinite}
    return reproduce.Record("fedbabu", cell, variant, seed, "", [], 1.0, values=values)


def test_mark_runs_names_diverged_collapsed_and_under_trained_runs() -> None:
    study = _sweep_study()
    low, high = "tau=4 lr=0.01", "tau=4 lr=0.1"
    records = [
        _run("FedAvg", 0, low, 0.90), _run("FedAvg", 0, high, 0.70),          # 20 points below its best rate
        _run("FedAvg", 1, low, 0.90), _run("FedAvg", 1, high, 0.80),          # 10 points below: trained
        _run("FedBABU", 0, low, 0.12), _run("FedBABU", 0, high, 0.85),        # within 5 points of chance
        _run("FedBABU", 1, low, 0.85), _run("FedBABU", 1, high, 0.84, nonfinite=1.0),
        _run("LG-FedAvg", 0, low, None, initial=0.11),                       # no global model: personal accuracy
        _run("LG-FedAvg", 0, high, None, initial=float("nan")),
    ]
    failed = _run("LG-FedAvg", 1, low, 0.10)
    failed.error = "exit code 1"
    reproduce.mark_runs(study, records + [failed])
    marks = [(r.variant, r.seed, r.cell, (r.mark or "trained").split(":")[0]) for r in records]
    assert marks == [
        ("FedAvg", 0, low, "trained"), ("FedAvg", 0, high, "under-trained"),
        ("FedAvg", 1, low, "trained"), ("FedAvg", 1, high, "trained"),
        ("FedBABU", 0, low, "collapsed"), ("FedBABU", 0, high, "trained"),
        ("FedBABU", 1, low, "trained"), ("FedBABU", 1, high, "diverged"),
        ("LG-FedAvg", 0, low, "collapsed"), ("LG-FedAvg", 0, high, "diverged"),
    ]
    assert failed.mark is None  # a failed run is already out of every verdict
    assert "70.0 % against 90.0 % at lr 0.01" in records[1].mark


def test_a_verdict_never_rests_on_a_run_that_did_not_train() -> None:
    study = reproduce.Study("s", "paper", "", {}, (reproduce.Cell("c", {}, ()),), (),
                            (reproduce.Claim("a above b", "c", "m", "a", "b"),))
    records = [_record("a", 0, 0.9), _record("a", 1, 0.9), _record("b", 0, 0.8), _record("b", 1, 0.95)]
    assert reproduce.verdicts(study, records)[0].verdict == "inconclusive"
    records[3].mark = "under-trained: model accuracy 50.0 % against 90.0 % at lr 0.03"
    found = reproduce.verdicts(study, records)[0]
    assert found.verdict == "reproduced"  # seed 1's baseline did not train: only seed 0 is paired
    assert found.measured.endswith("(seeds: +0.10); left out: b seed 1 under-trained")
    records[2].mark = "collapsed: model accuracy 10.0 % (chance 10 %)"
    assert reproduce.verdicts(study, records)[0].verdict == "no verdict (a run did not train)"


def test_best_rate_verdict_pairs_each_variant_at_its_own_best_rate() -> None:
    study = _sweep_study()
    low, high = "tau=4 lr=0.01", "tau=4 lr=0.1"
    records = []
    for seed in (0, 1):
        records += [_run("FedAvg", seed, low, 0.90, initial=0.88), _run("FedAvg", seed, high, 0.80, initial=0.60),
                    _run("FedBABU", seed, low, 0.85, initial=0.80), _run("FedBABU", seed, high, 0.88, initial=0.84)]
    reproduce.mark_runs(study, records)
    found = reproduce.verdicts(study, records)
    initial = [v for v in found if v.text.startswith("initial accuracy")]
    # FedAvg's initial accuracy is above FedBABU's at 0.01, below it at 0.1
    assert [(v.cell, v.verdict) for v in initial] == [
        (low, "reproduced"), (high, "not reproduced"),
        ("tau=4, best lr (FedAvg 0.01, FedBABU 0.1)", "reproduced")]
    assert initial[2].measured.startswith("FedAvg - FedBABU = +4.00 points")


@pytest.mark.slow
def test_learning_rate_sweep_end_to_end_marks_runs_by_the_rule(tmp_path: Path) -> None:
    out_json = tmp_path / "sweep.json"
    command = [sys.executable, str(SCRIPT), "fedftha", "--size", "tiny", "--seeds", "0", "--variants",
               "FedFTHA,FedAvg", "--lrs", "0.001,0.1", "--out-root", str(tmp_path / "runs"), "--json", str(out_json)]
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=STUDY_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dumped = json.loads(out_json.read_text())["studies"]["fedftha"]
    records = dumped["records"]
    assert [(r["cell"], r["variant"]) for r in records] == [
        ("shards2 lr=0.001", "FedFTHA"), ("shards2 lr=0.001", "FedAvg"),
        ("shards2 lr=0.1", "FedFTHA"), ("shards2 lr=0.1", "FedAvg")]
    for record in records:  # each run trained at its cell's rate
        rate = float(record["cell"].split("lr=")[1])
        config = yaml.safe_load((Path(record["out"]) / "config.yaml").read_text())
        assert config["train"]["lr"] == rate
    by_run = {(r["cell"], r["variant"]): r for r in records}
    for (cell, variant), record in by_run.items():  # the marks follow the documented rule
        accuracy = record["values"]["global"]
        best = max(by_run[(c, variant)]["values"]["global"] for c in ("shards2 lr=0.001", "shards2 lr=0.1"))
        expected = ("collapsed" if accuracy < 0.1 + reproduce.CHANCE_MARGIN
                    else "under-trained" if best - accuracy > reproduce.UNDERTRAINED_GAP else None)
        assert (record["mark"] or "").split(":")[0] == (expected or "")
    verdicts = dumped["verdicts"]
    assert [v["cell"] for v in verdicts][:2] == ["shards2 lr=0.001", "shards2 lr=0.1"]
    assert verdicts[2]["cell"].startswith("shards2, best lr (FedFTHA ")
    for verdict in verdicts[:2]:
        marked = [r for r in records if r["cell"] == verdict["cell"] and r["mark"]]
        assert ("left out" in verdict["measured"]) == bool(marked)
        if marked:  # one seed: nothing is left to pair
            assert verdict["verdict"] == "no verdict (a run did not train)"
        else:
            assert verdict["verdict"] in ("reproduced", "not reproduced", "inconclusive")
