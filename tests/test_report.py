"""``fedpart report`` and ``fedpart compare``: the link model on a hand-computed case, and reports
built from real small runs (real server and client processes), checked figure by figure, number by
number against the runs' summary.json and metrics.jsonl, and opened in a real headless browser."""

from __future__ import annotations

import csv
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import WAIT, child_env, fedpart_command, read_metrics, read_summary, run_fedpart, \
    small_config, start_server, write_config
from fedpart.cli import main as cli
from fedpart.cli.compare import parse_seeds, plan_runs, split_overrides
from fedpart.common.process.records import RoundRecord
from fedpart.report.link import (ClientRound, Link, cumulative_seconds, default_target, parse_duration,
                                        parse_rate, round_time, round_times, time_to_accuracy)
from fedpart.report.runs import read_runs

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ALL_FIGURES = {"accuracy_rounds", "accuracy_bytes", "bytes_per_round", "bytes_units", "compute_rounds",
               "personalization", "link_time"}


# ------------------------------------------------------------------------------- the link model


def test_link_model_on_a_hand_computed_round() -> None:
    # downlink 8 Mbit/s = 1,000,000 B/s, uplink 4 Mbit/s = 500,000 B/s, RTT 50 ms, 2 round trips
    clients = {1: ClientRound(down=1_000_000, up=500_000, compute_seconds=2.0),
               2: ClientRound(down=2_000_000, up=250_000, compute_seconds=0.5)}
    latency = 2 * 0.050

    # Server link not a bottleneck: each client on its own.
    # client 1: 1,000,000/1e6 + 2.0 + 500,000/5e5 + 0.1 = 1.0 + 2.0 + 1.0 + 0.1 = 4.1 s
    # client 2: 2,000,000/1e6 + 0.5 + 250,000/5e5 + 0.1 = 2.0 + 0.5 + 0.5 + 0.1 = 3.1 s
    time = round_time(Link(downlink=8e6, uplink=4e6, rtt=0.050), clients)
    assert time.slowest == 1
    assert time.seconds == pytest.approx(4.1)
    assert (time.download, time.compute, time.upload, time.latency) == pytest.approx((1.0, 2.0, 1.0, latency))

    # Shared server link of 6 Mbit/s = 750,000 B/s each direction.
    # Downloads from t=0: two transfers at min(1e6, 750,000/2) = 375,000 B/s each; client 1's
    #   1,000,000 B end at 8/3 s, when client 2 has 1,000,000 B left, alone at min(1e6, 750,000):
    #   + 4/3 s -> 4.0 s (3,000,000 B / 750,000 B/s = 4.0 s in all).
    # Training: client 1 until 8/3 + 2.0 = 14/3 s, client 2 until 4.0 + 0.5 = 4.5 s.
    # Uploads: client 2 alone from 4.5 s at min(5e5, 750,000) = 500,000 B/s; at 14/3 s (1/6 s later)
    #   it has 250,000 - 83,333.3 = 166,666.7 B left and client 1 joins: 375,000 B/s each, client 2
    #   ends after 166,666.7 / 375,000 = 4/9 s (46/9 s), client 1 has then sent 166,666.7 B and sends
    #   its other 333,333.3 B alone at 500,000 B/s in 2/3 s: 14/3 + 4/9 + 2/3 = 52/9 s.
    # Round: 52/9 + 0.1 s, client 1 the slowest; its upload took 52/9 - 14/3 = 10/9 s.
    shared = round_time(Link(downlink=8e6, uplink=4e6, rtt=0.050, server=6e6), clients)
    assert shared.slowest == 1
    assert shared.seconds == pytest.approx(52 / 9 + latency)
    assert (shared.download, shared.compute, shared.upload) == pytest.approx((8 / 3, 2.0, 10 / 9))


def test_link_model_over_round_records_and_time_to_accuracy() -> None:
    link = Link(downlink=8e6, uplink=8e6, rtt=0.0)  # 1,000,000 B/s both ways, no latency
    records = [RoundRecord.from_json(r) for r in [
        # client 4 was sampled but did not complete (no compute seconds): left out
        {"round": 1, "bytes_down": 2_000_100, "bytes_up": 1_000_000, "global": {"acc": 0.5},
         "clients": {"3": {"down": 2_000_000, "up": 1_000_000, "compute_seconds": 1.0},
                     "4": {"down": 100, "up": 0, "compute_seconds": None}}},
        # 2.0 + 1.0 + 1.0 = 4.0 s; 0.8 reached here
        {"round": 2, "bytes_down": 1_000_000, "bytes_up": 1_000_000, "global": {"acc": 0.8},
         "clients": {"3": {"down": 1_000_000, "up": 1_000_000, "compute_seconds": 2.0}}},
        {"round": 3, "bytes_down": 0, "bytes_up": 0, "clients": {}},  # nobody completed: adds nothing
    ]]
    times = round_times(link, records)
    assert [t.seconds if t else None for t in times] == pytest.approx([4.0, 4.0, None])
    cumulative = cumulative_seconds(times)
    assert cumulative == pytest.approx([4.0, 8.0, 8.0])
    assert time_to_accuracy(records, cumulative, 0.5) == pytest.approx(4.0)
    assert time_to_accuracy(records, cumulative, 0.7) == pytest.approx(8.0)
    assert time_to_accuracy(records, cumulative, 0.9) is None
    # the default target: the highest accuracy every run reaches
    assert default_target([[0.5, 0.8], [0.6, 0.7], []]) == 0.7
    assert default_target([[], []]) is None


def test_link_options() -> None:
    assert parse_rate("10Mbit") == 1e7 and parse_rate("2.5 kbit") == 2500 and parse_rate("1e3bit") == 1000
    assert parse_duration("50ms") == pytest.approx(0.05) and parse_duration("0s") == 0.0
    link = Link.from_options(link="10Mbit/50ms")
    assert (link.downlink, link.uplink, link.rtt, link.server) == (1e7, 1e7, pytest.approx(0.05), None)
    link = Link.from_options(link="10Mbit/50ms", uplink="1Mbit", server="1Gbit")
    assert (link.downlink, link.uplink, link.server) == (1e7, 1e6, 1e9)
    assert Link.from_options(uplink="1Mbit", downlink="20Mbit", rtt="10ms").rtt == pytest.approx(0.01)
    assert Link.from_options() is None
    for bad in ({"link": "10Mbit"}, {"link": "10MB/50ms"}, {"link": "0Mbit/5ms"}, {"uplink": "1Mbit"},
                {"rtt": "5ms"}, {"link": "10Mbit/50"}):
        with pytest.raises(ValueError, match="--"):
            Link.from_options(**bad)


def test_compare_overrides_are_shared_or_scoped_to_one_algorithm() -> None:
    common, scoped = split_overrides(["rounds=2", "fedprox:algorithm.mu=0.1", "data.dataset=pkg.mod:fn"],
                                     ["fedavg", "fedprox"])
    assert common == ["rounds=2", "data.dataset=pkg.mod:fn"]
    assert scoped == {"fedavg": [], "fedprox": ["algorithm.mu=0.1"]}
    with pytest.raises(ValueError, match="not one of --algorithms"):
        split_overrides(["fedbabu:algorithm.mu=0.1"], ["fedavg"])
    with pytest.raises(ValueError, match="algorithm.name"):
        split_overrides(["algorithm.name=fedbabu"], ["fedavg"])


# ------------------------------------------------------------------------- reports of real runs


def _config(**overrides) -> dict:
    """Two rounds, global accuracy after every round, a fine-tune sweep."""
    return small_config(rounds=2, evaluate={"finetune_epochs": [0, 1, 2], "batch_size": 50, "global_every": 1},
                        **overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real runs: FedAvg (global accuracy every round), FedPer (no global model: personal heads),
    and an interrupted run (FedAvg's directory as a server killed in round 2 leaves it: no
    summary.json, the round in flight cut short in metrics.jsonl)."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for algorithm in ("fedavg", "fedper"):
        result, path = run_fedpart(_config(algorithm={"name": algorithm}), root, name=algorithm)
        assert result.returncode == 0, result.stdout + result.stderr
        out[algorithm] = path
    interrupted = root / "interrupted"
    shutil.copytree(out["fedavg"], interrupted)
    (interrupted / "summary.json").unlink()
    first, second = (interrupted / "metrics.jsonl").read_text().splitlines()
    (interrupted / "metrics.jsonl").write_text(first + "\n" + second[: len(second) // 2])
    out["interrupted"] = interrupted
    return out


def _fedpart(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(fedpart_command(*args), capture_output=True, text=True, env=child_env(), cwd=cwd,
                          timeout=WAIT)


def _table(report: Path, kind: str = "run") -> dict[str, dict[str, str]]:
    """table.csv's rows of one kind (``run`` or ``group``), by label."""
    with (report / "table.csv").open() as f:
        return {row["run"]: row for row in csv.DictReader(f) if row["row"] == kind}


def _round_table(report: Path) -> list[dict[str, str]]:
    with (report / "rounds.csv").open() as f:
        return list(csv.DictReader(f))


def _figures(*run_dirs: Path) -> set[str]:
    """The figures a report of these complete runs with a link draws: the bytes per unit only
    where metrics.jsonl records them."""
    with_units = any("bytes_by_unit" in record for run in run_dirs for record in read_metrics(run))
    return ALL_FIGURES if with_units else ALL_FIGURES - {"bytes_units"}


def _client_bytes(entry: dict, direction: str) -> int:
    """What the link model takes for a client: its logical bytes where recorded, else physical."""
    return entry.get(f"logical_{direction}", entry[direction])


def _per_round_bytes(summary: dict, direction: str) -> float:
    """The table's bytes per round: logical where summary.json has them, else physical."""
    counted = summary["bytes"].get("logical", summary["bytes"])
    return counted["per_round_mean"][direction]


def _number(text: str) -> float | None:
    return None if text == "" else float(text)


def _check_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 400 and image.height >= 200, path
        colors = image.convert("RGB").getcolors(maxcolors=256)  # None: more than 256 colours
        assert colors is None or len(colors) > 2, f"{path} is blank"


def test_round_records_carry_per_client_bytes_and_compute(runs: dict[str, Path]) -> None:
    for record in read_metrics(runs["fedavg"]):
        entries = record["clients"]
        assert sorted(int(c) for c in entries) == record["sampled"]
        assert all(entries[str(c)]["compute_seconds"] > 0 for c in record["completed"])
        assert all(e["down"] > 0 and e["up"] > 0 for e in entries.values())
        # the rest of the round's bytes belong to no client: process-level control
        assert sum(e["down"] for e in entries.values()) <= record["bytes_down"]
        assert sum(e["up"] for e in entries.values()) <= record["bytes_up"]
        assert record["client_compute_seconds"] == pytest.approx(sum(e["compute_seconds"] for e in entries.values()))


def test_report_of_real_runs_matches_their_numbers(runs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _fedpart("report", str(runs["fedavg"]), str(runs["fedper"]), "--out", str(report),
                      "--link", "10Mbit/50ms")
    assert result.returncode == 0, result.stdout + result.stderr
    figures = _figures(runs["fedavg"], runs["fedper"])
    assert {p.stem for p in report.glob("*.png")} == figures
    for png in report.glob("*.png"):
        _check_png(png)
    table = _table(report)
    assert set(table) == {"fedavg", "fedper"}
    per_round = {}
    for name in ("fedavg", "fedper"):
        row, summary, metrics = table[name], read_summary(runs[name]), read_metrics(runs[name])
        accuracy = summary["accuracy"]
        assert row["algorithm"] == name and row["status"] == "completed" and int(row["rounds"]) == 2
        assert row["exit_code"] == "0" and row["exit_code_source"] == "recorded" and row["failures"] == "0"
        assert row["short_rounds"] == "0" and row["failure_list"] == ""
        assert [int(row[f"seed_{s}"]) for s in ("partition", "init", "sampling", "training")] == [0, 0, 0, 0]
        assert _number(row["initial_acc"]) == accuracy["initial"]["mean"]
        assert _number(row["personalized_acc"]) == accuracy["personalized"]["2"]["mean"]
        assert int(row["finetune_epochs"]) == 2
        assert _number(row["global_acc"]) == accuracy.get("global", {}).get("acc")
        assert _number(row["bytes_down_per_round"]) == _per_round_bytes(summary, "down")
        assert _number(row["bytes_up_per_round"]) == _per_round_bytes(summary, "up")
        assert _number(row["physical_bytes_down_per_round"]) == summary["bytes"]["per_round_mean"]["down"]
        assert _number(row["physical_bytes_up_per_round"]) == summary["bytes"]["per_round_mean"]["up"]
        assert _number(row["physical_bytes_down_per_round"]) == statistics.fmean(r["bytes_down"] for r in metrics)
        assert row["bytes_counted"] == ("logical" if "logical" in summary["bytes"] else "physical")
        assert _number(row["client_compute_seconds_per_round"]) == pytest.approx(
            summary["compute"]["client_seconds"] / len(metrics))
        assert _number(row["train_flops_per_round"]) == statistics.fmean(r["train_flops"] for r in metrics)
        assert _number(row["wall_seconds"]) == summary["seconds"]
        # the link time from the bytes and compute seconds in metrics.jsonl, by the model's formula
        # (server link not shared: the slowest client's download + compute + upload, + 2 RTT)
        per_round[name] = [max(8 * _client_bytes(c, "down") / 1e7 + c["compute_seconds"]
                               + 8 * _client_bytes(c, "up") / 1e7 for c in r["clients"].values()) + 2 * 0.05
                           for r in metrics]
        assert _number(row["link_seconds_total"]) == pytest.approx(sum(per_round[name]))
        assert _number(row["link_seconds_per_round"]) == pytest.approx(statistics.fmean(per_round[name]))
    assert table["fedper"]["global_acc"] == "" and table["fedper"]["link_time_to_target"] == ""
    # the default target is the best accuracy of the only run with accuracy per round: reached in
    # the first round that has it
    accuracies = [r["global"]["acc"] for r in read_metrics(runs["fedavg"])]
    reached = accuracies.index(max(accuracies))
    assert _number(table["fedavg"]["link_time_to_target"]) == pytest.approx(sum(per_round["fedavg"][: reached + 1]))
    markdown = (report / "table.md").read_text()
    fedavg = read_summary(runs["fedavg"])["accuracy"]
    assert f"| fedavg | completed | 0 | 0 | 0 | 2 | {100 * fedavg['initial']['mean']:.2f} |" in markdown
    # one run per group: the group rows repeat the runs' numbers, with n 1 and no deviation
    groups = _table(report, "group")
    assert set(groups) == {"fedavg", "fedper"}
    assert groups["fedavg"]["n"] == "1" and groups["fedavg"]["initial_acc"] == table["fedavg"]["initial_acc"]
    assert groups["fedavg"]["initial_acc_std"] == "" and groups["fedavg"]["initial_acc_n"] == "1"
    # rounds.csv: every round of both runs, as metrics.jsonl has it
    rounds = _round_table(report)
    assert [(r["run"], int(r["round"])) for r in rounds] == [(n, i) for n in ("fedavg", "fedper") for i in (1, 2)]
    for row, record in zip(rounds, read_metrics(runs["fedavg"]) + read_metrics(runs["fedper"])):
        assert int(row["sampled"]) == len(record["sampled"]) and int(row["completed"]) == len(record["completed"])
        assert float(row["train_loss"]) == record["train_loss"]
        assert int(row["physical_down"]) == record["bytes_down"] and int(row["physical_up"]) == record["bytes_up"]
        assert _number(row["global_acc"]) == record.get("global", {}).get("acc")
        assert float(row["train_flops"]) == record["train_flops"]
        for part, counts in record["bytes_by_part"].items():
            assert int(row[f"physical_{part}_down"]) == counts["down"] and int(row[f"physical_{part}_up"]) == counts["up"]
        if "logical" in record:
            assert int(row["logical_down"]) == record["logical"]["down"] and row["bytes_counted"] == "logical"
            for part, counts in record["logical"]["by_part"].items():
                assert int(row[f"logical_{part}_up"]) == counts["up"]
        for unit, counts in record.get("bytes_by_unit", {}).items():
            assert int(row[f"unit_{unit}_down"]) == counts["down"]
    page = (report / "index.html").read_text()
    assert "no accuracy per round: fedper keeps parts of the model on the clients" in page
    assert "Failures" not in page  # nothing failed
    assert page.count("data:image/png;base64,") == len(figures)
    assert "http://" not in page and "https://" not in page  # nothing to fetch


def test_report_refuses_a_used_folder_unless_overwrite(runs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report"
    report.mkdir()
    keep = report / "notes.txt"
    keep.write_text("mine")
    result = _fedpart("report", str(runs["fedavg"]), "--out", str(report))
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert sorted(p.name for p in report.iterdir()) == ["notes.txt"]
    result = _fedpart("report", str(runs["fedavg"]), "--out", str(report), "--overwrite")
    assert result.returncode == 0, result.stderr
    assert (report / "index.html").is_file() and keep.read_text() == "mine"
    assert not (report / "link_time.png").exists()  # no --link, no link figure
    for bad, message in ((["--target", "0.5"], "give --link too"), (["--link", "10Mbit"], "RATE/RTT"),
                         (["--link", "1Mbit/5ms", "--target", "150%"], "an accuracy in (0, 1]")):
        result = _fedpart("report", str(runs["fedavg"]), "--out", str(tmp_path / "other"), *bad)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "other").exists()
    result = _fedpart("report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "other"))
    assert result.returncode == 2 and "no such directory" in result.stderr


def test_report_of_an_interrupted_run(runs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _fedpart("report", str(runs["interrupted"]), "--out", str(report), "--link", "1Mbit/20ms",
                      "--target", "1%")
    assert result.returncode == 0, result.stdout + result.stderr
    row = _table(report)["fedavg"]
    first = read_metrics(runs["fedavg"])[0]
    assert row["status"] == "interrupted" and int(row["rounds"]) == 1
    assert row["exit_code"] == "" and row["exit_code_source"] == "unknown"
    assert _number(row["physical_bytes_down_per_round"]) == first["bytes_down"]
    assert _number(row["bytes_down_per_round"]) == first.get("logical", {}).get("down", first["bytes_down"])
    # a target of 1% is reached in round 1: the time to target is round 1's modelled time
    assert first["global"]["acc"] >= 0.01
    slowest = max(8 * _client_bytes(c, "down") / 1e6 + c["compute_seconds"] + 8 * _client_bytes(c, "up") / 1e6
                  for c in first["clients"].values())
    assert _number(row["link_time_to_target"]) == pytest.approx(slowest + 2 * 0.02)
    assert row["initial_acc"] == row["personalized_acc"] == row["wall_seconds"] == ""
    # what the rounds support is drawn; personalization needs the final evaluation
    assert {p.stem for p in report.glob("*.png")} == _figures(runs["fedavg"]) - {"personalization"}  # fedavg's first round
    page = (report / "index.html").read_text()
    assert "interrupted: no summary.json (the server was stopped before it could write one); the run stopped " \
           "after round 1 of 2" in page
    assert '<h2 class="failed">Failures: 1 of 1 run</h2>' in page
    assert "fedavg: interrupted after round 1 of 2" in page
    assert "figure &#x27;Personalization&#x27; not drawn" in page


def test_a_run_without_logical_bytes_is_reported_with_physical_ones_and_says_so(runs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """FedAvg's run directory as fedpart wrote it before it counted logical bytes (no ``logical``,
    ``bytes_by_unit`` or per-client ``logical_down`` / ``logical_up``): the table, the figures and
    the link model fall back to physical bytes, and the page says so."""
    older = tmp_path / "older"
    shutil.copytree(runs["fedavg"], older)
    records = read_metrics(older)
    for record in records:
        record.pop("logical", None)
        record.pop("bytes_by_unit", None)
        for entry in record["clients"].values():
            entry.pop("logical_down", None)
            entry.pop("logical_up", None)
    (older / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = read_summary(older)
    summary["bytes"].pop("logical", None)
    (older / "summary.json").write_text(json.dumps(summary))
    report = tmp_path / "report"
    result = _fedpart("report", str(older), "--out", str(report), "--link", "10Mbit/50ms")
    assert result.returncode == 0, result.stdout + result.stderr
    row = _table(report)["fedavg"]
    assert row["bytes_counted"] == "physical"
    assert _number(row["bytes_down_per_round"]) == _number(row["physical_bytes_down_per_round"]) == \
        summary["bytes"]["per_round_mean"]["down"]
    slowest = [max(8 * c["down"] / 1e7 + c["compute_seconds"] + 8 * c["up"] / 1e7 for c in r["clients"].values())
               + 2 * 0.05 for r in records]
    assert _number(row["link_seconds_total"]) == pytest.approx(sum(slowest))
    assert {r["bytes_counted"] for r in _round_table(report)} == {"physical"}
    assert not (report / "bytes_units.png").exists()
    page = (report / "index.html").read_text()
    assert "fedavg: metrics.jsonl has no logical bytes" in page
    assert "physical bytes for fedavg, whose metrics.jsonl has no logical bytes" in page
    caption = page.split('<figure id="accuracy_bytes">')[1].split("</figure>")[0]
    assert "physical bytes (what crossed each process&#x27;s connection" in caption


def test_runs_that_differ_only_in_their_seeds_form_one_group(runs: dict[str, Path], tmp_path: Path) -> None:
    """A copy of FedAvg's run directory marked as another initialisation seed joins its group; a
    run with the same seeds as another (the interrupted copy) is no seed of the same experiment, so
    then every run is its own group, named by directory."""
    other_seed = tmp_path / "other-seed"
    shutil.copytree(runs["fedavg"], other_seed)
    config = yaml.safe_load((other_seed / "config.yaml").read_text())
    config["seeds"] = {**config.get("seeds", {}), "init": 1}
    (other_seed / "config.yaml").write_text(yaml.safe_dump(config))
    summary = read_summary(other_seed)
    summary["seeds"] = {**summary["seeds"], "init": 1}
    (other_seed / "summary.json").write_text(json.dumps(summary))
    grouped = read_runs([runs["fedavg"], other_seed, runs["fedper"]])
    assert [(r.group, r.label) for r in grouped] == [("fedavg", "fedavg seed 0"), ("fedavg", "fedavg seed 1"),
                                                     ("fedper", "fedper")]
    apart = read_runs([runs["fedavg"], other_seed, runs["interrupted"]])
    assert [(r.group, r.label) for r in apart] == [(f"fedavg ({name})", f"fedavg ({name})")
                                                   for name in ("fedavg", "other-seed", "interrupted")]


def test_report_without_matplotlib_names_the_extra(runs: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code = cli.main(["report", str(runs["fedavg"]), "--out", str(tmp_path / "report")])
    assert code == 2
    assert "pip install 'fedpart[report]'" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_report_page_in_a_headless_browser(runs: dict[str, Path], tmp_path: Path) -> None:
    """The page opens in Debian's Chromium (installed by .ci/run) without console or page errors,
    every figure loads, and its screenshot is a picture, not a blank page."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is not installed (.ci/run installs the Debian package chromium where apt works)")
    playwright = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")
    report = tmp_path / "report"
    result = _fedpart("report", str(runs["fedavg"]), str(runs["fedper"]), str(runs["interrupted"]),
                      "--out", str(report), "--link", "10Mbit/50ms", "--server-link", "20Mbit")
    assert result.returncode == 0, result.stdout + result.stderr
    screenshot = tmp_path / "page.png"
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as profile, playwright.sync_playwright() as driver:
        browser = driver.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900})
        try:
            page = browser.new_page()
            page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}")
                    if message.type in ("error", "warning") else None)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("requestfailed", lambda request: problems.append(f"request failed: {request.url}"))
            page.goto((report / "index.html").as_uri(), wait_until="load")
            images = page.evaluate("[...document.images].map(i => [i.alt, i.complete && i.naturalWidth])")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert len(images) == len(_figures(runs["fedavg"], runs["fedper"]))
    assert all(width > 0 for _, width in images), images
    _check_png(screenshot)


SHORT_ROUND_RGB = (255, 0, 0)  # the red x of a round that folded fewer clients than sampled


def _red_pixels(path: Path) -> int:
    from PIL import Image

    with Image.open(path) as image:
        return sum(count for count, rgb in image.convert("RGB").getcolors(maxcolors=1 << 24) if rgb == SHORT_ROUND_RGB)


def test_a_run_that_lost_a_client_process_is_reported_as_failed(tmp_path: Path, processes) -> None:
    """A real run whose second client process is stopped (SIGTERM) after round 1 and started again
    later: the rounds in between fold 2 of 4 sampled clients, the server exits 3 and summary.json
    lists the failure. The report says so on the page, in table.csv and rounds.csv, and marks the
    short rounds on the per-round figures."""
    config = small_config(rounds=4, evaluate={"finetune_epochs": [1], "batch_size": 50, "global_every": 1},
                          server={"round_timeout": 120, "join_timeout": 120, "heartbeat_timeout": 30})
    config_path = write_config(tmp_path / "config.yaml", config)
    out = tmp_path / "run"
    server, reader, address = start_server(processes, config_path, out)

    def client(index: int, ids: str) -> subprocess.Popen:
        with (tmp_path / f"client_{index}.log").open("a") as log:
            return processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", ids, "--threads", "1",
                                                   "--state-dir", str(tmp_path / f"state_{index}")),
                                   stdout=log, stderr=subprocess.STDOUT)

    first, second = client(0, "0-1"), client(1, "2-3")
    reader.wait_for(r"round\s+1/4", timeout=WAIT)
    second.terminate()
    reader.wait_for(r"left: terminated", timeout=WAIT)
    restarted = client(1, "2-3")
    output = reader.rest(timeout=WAIT)
    assert server.wait(timeout=WAIT) == 3, output
    assert first.wait(timeout=WAIT) == 0 and restarted.wait(timeout=WAIT) == 0
    summary, metrics = read_summary(out), read_metrics(out)
    assert summary["status"] == "completed" and summary["failures"], summary["failures"]
    short = [(r["round"], len(r["completed"]), len(r["sampled"])) for r in metrics
             if len(r["completed"]) < len(r["sampled"])]
    assert short and short[0][0] == 2, short  # the process left before round 2 could fold its clients

    report = tmp_path / "report"
    result = _fedpart("report", str(out), "--out", str(report), "--link", "10Mbit/50ms")
    assert result.returncode == 0, result.stdout + result.stderr
    row = _table(report)["fedavg"]
    assert row["status"] == "completed with failures"
    assert row["exit_code"] == "3" and row["exit_code_source"] == "recorded"
    assert int(row["failures"]) == len(summary["failures"])  # the server lists missing evaluations itself
    assert all(failure in row["failure_list"] for failure in summary["failures"])
    assert int(row["short_rounds"]) == len(short)
    assert row["short_round_list"] == "; ".join(f"{n}: {done}/{sampled}" for n, done, sampled in short)
    assert _table(report, "group")["fedavg"]["status"] == "1 completed with failures"
    rounds = _round_table(report)
    assert [(int(r["round"]), int(r["completed"]), int(r["sampled"])) for r in rounds] == \
        [(m["round"], len(m["completed"]), len(m["sampled"])) for m in metrics]

    page = (report / "index.html").read_text()
    assert '<h2 class="failed">Failures: 1 of 1 run</h2>' in page
    assert "fedavg: the server exited 3 (recorded)" in page
    assert "completed with failures, exit 3</span>" in page
    for failure in summary["failures"]:  # the server's own lines name the rounds that lacked results
        assert f"fedavg: {failure}" in page
    assert any(f"round {short[0][0]}: " in failure for failure in summary["failures"])
    assert f"{len(short)} round{'s' if len(short) > 1 else ''} folded fewer clients than sampled" in page
    per_round = {"accuracy_rounds", "accuracy_bytes", "bytes_per_round", "compute_rounds", "link_time"} | (
        {"bytes_units"} & {p.stem for p in report.glob("*.png")})
    for name in per_round:  # every per-round figure marks them, and says so
        caption = page.split(f'<figure id="{name}">')[1].split("</figure>")[0]
        assert "A red x marks a round that folded fewer clients than it sampled" in caption, name
        assert _red_pixels(report / f"{name}.png") > 0, name
    assert f"| fedavg | completed with failures | 3 | {row['failures']} | {len(short)} | 4 |" in \
        (report / "table.md").read_text()


def test_a_report_of_runs_that_folded_every_client_marks_no_round(runs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _fedpart("report", str(runs["fedavg"]), "--out", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    for png in report.glob("*.png"):
        assert _red_pixels(png) == 0, png
    assert "red x" not in (report / "index.html").read_text()


def test_compare_plans_one_run_per_algorithm_and_seed(tmp_path: Path) -> None:
    config = write_config(tmp_path / "compare.yaml", _config())
    out = tmp_path / "compare"
    plain = plan_runs(config, ["fedavg", "fedbabu"], [], out)
    assert [(r.out, r.seed, r.label) for r in plain] == [(out / "fedavg", None, "fedavg"),
                                                       (out / "fedbabu", None, "fedbabu")]
    assert [r.config.resolved_seeds() for r in plain] == [dict.fromkeys(("partition", "init", "sampling", "training"), 0)] * 2
    seeded = plan_runs(config, ["fedavg", "fedbabu"], ["seed=7"], out, seeds=[0, 3])
    assert [(r.out, r.label) for r in seeded] == [(out / a / f"seed{s}", f"{a} seed {s}")
                                                  for a in ("fedavg", "fedbabu") for s in (0, 3)]
    # one partition (the config's seed), everything else from --seeds
    assert [r.config.resolved_seeds() for r in seeded] == [{"partition": 7, "init": s, "sampling": s, "training": s}
                                                           for _ in range(2) for s in (0, 3)]
    varied = plan_runs(config, ["fedavg"], [], out, seeds=[2], vary_partition=True)
    assert varied[0].config.resolved_seeds() == dict.fromkeys(("partition", "init", "sampling", "training"), 2)
    assert not out.exists()  # planning writes nothing
    for args, message in (((["seeds.init=1"], out, [0]), "--seeds sets the seeds"),
                          ((["fedavg:seeds.training=1"], out, [0]), "--seeds sets the seeds"),
                          ((["seed=1"], out, [0], True), "--seeds sets the seeds"),
                          (([], out, None, True), "give --seeds too")):
        with pytest.raises(ValueError, match=message):
            plan_runs(config, ["fedavg"], *args)
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "1,1", "a", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_compare_runs_each_algorithm_per_seed_and_reports_mean_and_std(tmp_path: Path) -> None:
    """fedavg and fedprox, seeds 0 and 1, over one partition, with evaluate.global_every 0 (the
    quickstart's): the same sampled clients for both algorithms in a seed, another initial model
    per seed, one group per algorithm with mean ± std, and the accuracy-vs-bytes figure drawn from
    the final global models."""
    config = write_config(tmp_path / "compare.yaml", _config(sampling={"fraction": 0.5}))
    out = tmp_path / "compare"
    # an option of one algorithm only, scoped: fedavg has no mu
    result = _fedpart("compare", str(config), "--algorithms", "fedavg,fedprox", "--set", "algorithm.mu=0.05",
                      "--out", str(out))
    assert result.returncode == 2 and "fedavg: algorithm.mu: not an option of algorithm 'fedavg'" in result.stderr
    assert "--set ALGORITHM:algorithm.OPTION=VALUE" in result.stderr
    assert not out.exists()

    result = _fedpart("compare", str(config), "--algorithms", "fedavg,fedprox", "--set", "fedprox:algorithm.mu=0.05",
                      "--set", "train.lr=0.04", "--set", "evaluate.global_every=0", "--seeds", "0,1",
                      "--out", str(out), "--link", "10Mbit/50ms", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    dirs = {(a, s): out / a / f"seed{s}" for a in ("fedavg", "fedprox") for s in (0, 1)}
    for (name, seed), run_dir in dirs.items():
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert resolved["algorithm"]["name"] == name and resolved["train"]["lr"] == 0.04
        assert resolved["algorithm"]["options"].get("mu") == (0.05 if name == "fedprox" else None)
        assert read_summary(run_dir)["seeds"] == {"partition": 0, "init": seed, "sampling": seed, "training": seed}
    for seed in (0, 1):
        assert [r["sampled"] for r in read_metrics(dirs["fedavg", seed])] == \
            [r["sampled"] for r in read_metrics(dirs["fedprox", seed])]
    # one partition: every client holds as many samples in both seeds; another initial model per seed
    samples = {s: [c["train_samples"] for c in read_summary(dirs["fedavg", s])["per_client"]] for s in (0, 1)}
    assert samples[0] == samples[1]
    initial = "checkpoints/round_0000.safetensors"
    assert (dirs["fedavg", 0] / initial).read_bytes() != (dirs["fedavg", 1] / initial).read_bytes()

    report = out / "report"
    runs_table, groups = _table(report), _table(report, "group")
    assert set(runs_table) == {f"{a} seed {s}" for a in ("fedavg", "fedprox") for s in (0, 1)}
    assert set(groups) == {"fedavg", "fedprox"}
    for name in ("fedavg", "fedprox"):
        group = groups[name]
        assert group["n"] == "2" and group["status"] == "2 completed"
        assert group["seed_partition"] == "0" and group["seed_init"] == ""  # shared, and varied
        for key, values in (("initial_acc", [read_summary(dirs[name, s])["accuracy"]["initial"]["mean"] for s in (0, 1)]),
                            ("global_acc", [read_summary(dirs[name, s])["accuracy"]["global"]["acc"] for s in (0, 1)])):
            assert _number(group[key]) == pytest.approx(statistics.fmean(values))
            assert _number(group[f"{key}_std"]) == pytest.approx(statistics.stdev(values))
            assert group[f"{key}_n"] == "2"
            assert [_number(runs_table[f"{name} seed {s}"][key]) for s in (0, 1)] == values
    markdown = (report / "table.md").read_text()
    fedavg = groups["fedavg"]
    assert (f"{100 * _number(fedavg['initial_acc']):.2f} ± {100 * _number(fedavg['initial_acc_std']):.2f} (2)"
            in markdown)
    assert "Runs of the groups above, one row each:" in markdown
    assert len(_round_table(report)) == 4 * 2
    # no accuracy per round (global_every 0): the accuracy-vs-bytes figure has the final global models
    assert (report / "accuracy_bytes.png").is_file() and (report / "link_time.png").is_file()
    page = (report / "index.html").read_text()
    assert "A run without accuracy per round (evaluate.global_every 0) is one filled point" in page
    assert "No run has accuracy per round, so there are no curves." in page
    assert re.search(r"<h3>Training loss per round</h3>.*?<figcaption>Per round: the sample-weighted training loss "
                     r"of the round&#x27;s clients\.", page, re.S)
    assert "(left)" not in page.split('id="accuracy_rounds"')[1].split("</figure>")[0]

    before = (dirs["fedavg", 0] / "summary.json").read_bytes()
    result = _fedpart("compare", str(config), "--algorithms", "fedavg", "--seeds", "0", "--out", str(out))
    assert result.returncode == 2 and "never writes into an earlier run" in result.stderr
    assert (dirs["fedavg", 0] / "summary.json").read_bytes() == before
