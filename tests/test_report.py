"""``fedpart report`` and ``fedpart compare``: the link model on a hand-computed case, and reports
built from real small runs (real server and client processes), checked figure by figure, number by
number against the runs' summary.json and metrics.jsonl, and opened in a real headless browser."""

from __future__ import annotations

import csv
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import WAIT, child_env, fedpart_command, read_metrics, read_summary, run_fedpart, \
    small_config, write_config
from fedpart.deploy import cli
from fedpart.deploy.compare import split_overrides
from fedpart.deploy.report.link import (ClientRound, Link, cumulative_seconds, default_target, parse_duration,
                                        parse_rate, round_time, round_times, time_to_accuracy)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ALL_FIGURES = {"accuracy_rounds", "accuracy_bytes", "bytes_per_round", "compute_rounds", "personalization",
               "link_time"}


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
    records = [
        # client 4 was sampled but did not complete (no compute seconds): left out
        {"round": 1, "bytes_down": 2_000_100, "bytes_up": 1_000_000, "global": {"acc": 0.5},
         "clients": {"3": {"down": 2_000_000, "up": 1_000_000, "compute_seconds": 1.0},
                     "4": {"down": 100, "up": 0, "compute_seconds": None}}},
        # 2.0 + 1.0 + 1.0 = 4.0 s; 0.8 reached here
        {"round": 2, "bytes_down": 1_000_000, "bytes_up": 1_000_000, "global": {"acc": 0.8},
         "clients": {"3": {"down": 1_000_000, "up": 1_000_000, "compute_seconds": 2.0}}},
        {"round": 3, "bytes_down": 0, "bytes_up": 0, "clients": {}},  # nobody completed: adds nothing
    ]
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


def _table(report: Path) -> dict[str, dict[str, str]]:
    with (report / "table.csv").open() as f:
        return {row["run"]: row for row in csv.DictReader(f)}


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
    assert {p.stem for p in report.glob("*.png")} == ALL_FIGURES
    for png in report.glob("*.png"):
        _check_png(png)
    table = _table(report)
    assert set(table) == {"fedavg", "fedper"}
    per_round = {}
    for name in ("fedavg", "fedper"):
        row, summary, metrics = table[name], read_summary(runs[name]), read_metrics(runs[name])
        accuracy = summary["accuracy"]
        assert row["algorithm"] == name and row["status"] == "complete" and int(row["rounds"]) == 2
        assert _number(row["initial_acc"]) == accuracy["initial"]["mean"]
        assert _number(row["personalized_acc"]) == accuracy["personalized"]["2"]["mean"]
        assert int(row["finetune_epochs"]) == 2
        assert _number(row["global_acc"]) == accuracy.get("global", {}).get("acc")
        assert _number(row["bytes_down_per_round"]) == summary["bytes"]["per_round_mean"]["down"]
        assert _number(row["bytes_up_per_round"]) == summary["bytes"]["per_round_mean"]["up"]
        assert _number(row["bytes_down_per_round"]) == statistics.fmean(r["bytes_down"] for r in metrics)
        assert _number(row["client_compute_seconds_per_round"]) == pytest.approx(
            summary["compute"]["client_seconds"] / len(metrics))
        assert _number(row["train_flops_per_round"]) == statistics.fmean(r["train_flops"] for r in metrics)
        assert _number(row["wall_seconds"]) == summary["seconds"]
        # the link time from the bytes and compute seconds in metrics.jsonl, by the model's formula
        # (server link not shared: the slowest client's download + compute + upload, + 2 RTT)
        per_round[name] = [max(8 * c["down"] / 1e7 + c["compute_seconds"] + 8 * c["up"] / 1e7
                               for c in r["clients"].values()) + 2 * 0.05 for r in metrics]
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
    assert f"| fedavg | fedavg | complete | 2 | {100 * fedavg['initial']['mean']:.2f} |" in markdown
    page = (report / "index.html").read_text()
    assert "no accuracy per round: fedper keeps parts of the model on the clients" in page
    assert page.count("data:image/png;base64,") == len(ALL_FIGURES)
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
    assert row["status"] == "incomplete" and int(row["rounds"]) == 1
    assert _number(row["bytes_down_per_round"]) == first["bytes_down"]
    # a target of 1% is reached in round 1: the time to target is round 1's modelled time
    assert first["global"]["acc"] >= 0.01
    slowest = max(8 * c["down"] / 1e6 + c["compute_seconds"] + 8 * c["up"] / 1e6 for c in first["clients"].values())
    assert _number(row["link_time_to_target"]) == pytest.approx(slowest + 2 * 0.02)
    assert row["initial_acc"] == row["personalized_acc"] == row["wall_seconds"] == ""
    # what the rounds support is drawn; personalization needs the final evaluation
    assert {p.stem for p in report.glob("*.png")} == ALL_FIGURES - {"personalization"}
    page = (report / "index.html").read_text()
    assert "incomplete: no summary.json, the run stopped after round 1 of 2" in page
    assert "figure &#x27;Personalization&#x27; not drawn" in page


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
    assert len(images) == len(ALL_FIGURES)
    assert all(width > 0 for _, width in images), images
    _check_png(screenshot)


def test_compare_runs_each_algorithm_on_the_same_clients_and_reports(tmp_path: Path) -> None:
    config = write_config(tmp_path / "compare.yaml", _config())
    out = tmp_path / "compare"
    # an option of one algorithm only, scoped: fedavg has no mu
    result = _fedpart("compare", str(config), "--algorithms", "fedavg,fedprox", "--set", "algorithm.mu=0.05",
                      "--out", str(out))
    assert result.returncode == 2 and "fedavg: unknown option" in result.stderr
    assert "--set ALGORITHM:algorithm.OPTION=VALUE" in result.stderr
    assert not out.exists()

    result = _fedpart("compare", str(config), "--algorithms", "fedavg,fedprox", "--set", "fedprox:algorithm.mu=0.05",
                      "--set", "train.lr=0.04", "--out", str(out), "--link", "10Mbit/50ms", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    fedavg, fedprox = read_metrics(out / "fedavg"), read_metrics(out / "fedprox")
    assert [r["sampled"] for r in fedavg] == [r["sampled"] for r in fedprox]
    for name, mu in (("fedavg", None), ("fedprox", 0.05)):
        resolved = yaml.safe_load((out / name / "config.yaml").read_text())
        assert resolved["algorithm"]["name"] == name and resolved["train"]["lr"] == 0.04
        assert resolved["algorithm"]["options"].get("mu") == mu
        assert read_summary(out / name)["algorithm"] == name
    table = _table(out / "report")
    assert set(table) == {"fedavg", "fedprox"}
    assert _number(table["fedprox"]["initial_acc"]) == read_summary(out / "fedprox")["accuracy"]["initial"]["mean"]
    assert (out / "report" / "link_time.png").is_file()

    before = (out / "fedavg" / "summary.json").read_bytes()
    result = _fedpart("compare", str(config), "--algorithms", "fedavg", "--out", str(out))
    assert result.returncode == 2 and "never writes into an earlier run" in result.stderr
    assert (out / "fedavg" / "summary.json").read_bytes() == before
