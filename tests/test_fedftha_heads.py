"""benchmarks/fedftha_heads.py (FedFTHA's global head against FedAvg): a tiny real run pair made
by its ``run`` command, tabulated, read again, and analysed head by head."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import REPO, load_script, read_summary

heads = load_script(REPO / "benchmarks" / "fedftha_heads.py")


def test_a_fedftha_only_change_pairs_with_the_fedavg_run_of_the_same_shared_settings() -> None:
    for setting in heads.SETTINGS.values():
        home = heads.fedavg_setting(setting)
        assert home.shared == setting.shared
        assert not home.fedftha_only  # FedAvg's run sits under a setting that changes nothing of FedFTHA's
    changed_only_for_fedftha = [s for s in heads.SETTINGS.values() if s.fedftha_only]
    assert changed_only_for_fedftha
    assert all(heads.fedavg_setting(s) is not s for s in changed_only_for_fedftha)


def test_analyse_needs_a_pair() -> None:
    with pytest.raises(SystemExit):
        heads.parse_args(["analyse", "only_one_run"])
    with pytest.raises(SystemExit):
        heads.parse_args(["analyse", "--pair", "no_comma"])
    pairs = heads.parse_args(["analyse", "a", "b", "--pair", "c,d"]).pairs
    assert [(str(f), str(g)) for f, g in pairs] == [("a", "b"), ("c", "d")]


@pytest.mark.slow
def test_run_then_analyse_a_tiny_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_root = tmp_path / "runs"
    run_args = ["run", "--size", "tiny", "--settings", "base", "--seeds", "0", "--rounds", "2",
                "--out-root", str(out_root)]
    assert heads.main(run_args) == 0
    made = capsys.readouterr().out
    table = [line for line in made.splitlines() if line.startswith("| the study")]
    assert len(table) == 1
    fedftha_global, fedavg_global, difference = (float(cell) for cell in table[0].strip("| ").split(" | ")[2:])
    assert 0 <= fedftha_global <= 100 and 0 <= fedavg_global <= 100
    assert difference == pytest.approx(fedftha_global - fedavg_global, abs=0.011)

    # a second invocation reads the finished runs instead of making them again
    assert heads.main(run_args) == 0
    again = capsys.readouterr().out
    assert again.count("finished before") == 2 and table[0] in again

    pair = out_root / "fedftha_base" / "seed0" / "shards2"
    fedftha, fedavg = pair / "FedFTHA", pair / "FedAvg"
    analysis = heads.analyse_pair(fedftha, fedavg)
    assert set(analysis.rows) == set(heads.ROWS)
    assert all(0.0 <= value <= 1.0 for value in analysis.rows.values() if not math.isnan(value))
    reported = read_summary(fedftha)["accuracy"].get("global", {}).get("acc")
    if reported is not None:
        assert analysis.rows["weighted"] == pytest.approx(reported, abs=1e-6)
    assert analysis.rows["fedavg_global"] == pytest.approx(read_summary(fedavg)["accuracy"]["global"]["acc"], abs=1e-6)
    assert sum(analysis.holders) >= analysis.clients  # every client holds at least one class

    assert heads.main(["analyse", str(fedftha), str(fedavg), "--weakest", "2"]) == 0
    printed = capsys.readouterr().out
    for text in heads.ROWS.values():
        row = next(line for line in printed.splitlines() if line.startswith(f"| {text} |"))
        value = row.rsplit("|", 2)[1].strip()
        assert value == "-" or 0.0 <= float(value) <= 100.0
    weakest = next(line for line in printed.splitlines() if line.startswith(f"- {analysis.label}: "))
    assert weakest.count("clients hold it") == 2
