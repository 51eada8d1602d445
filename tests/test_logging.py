"""fedpart's log lines are stdlib logging records (common/process/console.py): levels given as
arguments and shown in the line's text, the display as the default handler, handlers of an
embedding program, and ``--quiet`` / ``--verbose`` for a command and the processes it starts."""

from __future__ import annotations

import io
import logging
import re
import subprocess

import pytest

from conftest import WAIT, child_env, fedpart_command, run_fedpart, small_config, write_config
from fedpart.common.process.console import (DISPLAY_HANDLER, LOG_LEVEL_ENV, LOGGER, Display, Log, set_log_level,
                                            with_level)


@pytest.fixture
def restore_level(monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_ENV, "normal")  # set_log_level sets it: undone after the test
    level = logging.getLogger(LOGGER).level
    yield
    logging.getLogger(LOGGER).setLevel(level)


def test_a_line_says_its_level() -> None:
    assert with_level("the aggregated 'w' is not finite", logging.ERROR) == "error: the aggregated 'w' is not finite"
    assert with_level("round 2 client 1 dropped", logging.WARNING) == "warning: round 2 client 1 dropped"
    assert with_level("round 1/3 clients 10/10") == "round 1/3 clients 10/10"
    assert with_level("error: in the text is not a level") == "error: in the text is not a level"


def test_a_component_s_log_writes_a_plain_callable_the_line_the_display_prints() -> None:
    lines: list[str] = []
    log = Log.of(lines.append)
    log("round 1/3")
    log.warning("slow")
    log.error("gave up")
    log("dropped", logging.WARNING)
    assert Log.of(log) is log
    assert lines == ["round 1/3", "warning: slow", "error: gave up", "warning: dropped"]


def test_the_display_prints_stamped_lines_at_the_level_set(restore_level) -> None:
    stream = io.StringIO()
    display = Display(stream=stream, logger="fedpart.server")
    set_log_level("normal")
    display.log("round 1/3")
    display.log("slow", source="[client a] ", level=logging.WARNING)
    set_log_level("quiet")
    display.log("round 2/3")
    Log(display).error("gave up")
    lines = stream.getvalue().splitlines()
    assert [line[20:] for line in lines] == ["round 1/3", "[client a] warning: slow", "error: gave up"]
    assert all(line[4] == "-" and line[19] == " " for line in lines)  # "2026-11-25 18:00:00 " stamps


def test_an_embedding_program_takes_the_records_with_their_levels(restore_level) -> None:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    stream = io.StringIO()
    collect = Collect()
    logger = logging.getLogger(LOGGER)
    logger.addHandler(collect)
    logger.removeHandler(DISPLAY_HANDLER)
    try:
        set_log_level("normal")
        Log(Display(stream=stream, logger="fedpart.client"), source="[client b] ").warning("data missing")
    finally:
        logger.removeHandler(collect)
        logger.addHandler(DISPLAY_HANDLER)
    assert stream.getvalue() == ""  # the display's handler was taken out: the program has the lines
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("fedpart.client", logging.WARNING, "[client b] warning: data missing")]


def test_quiet_run_prints_no_round_lines_but_the_results(tmp_path) -> None:
    run, out = run_fedpart(small_config(rounds=2, evaluate={"finetune_epochs": [1], "batch_size": 50}),
                           tmp_path, name="quiet")
    assert run.returncode == 0, run.stderr
    quiet = _run_quiet(tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    rounds = re.compile(r"round\s+1/2\s+clients")
    assert rounds.search(run.stdout) and not rounds.search(quiet.stdout)
    assert "joined:" in run.stdout and "joined:" not in quiet.stdout
    assert "listening on" in quiet.stdout  # the address line is for launchers: always there
    assert "personalized, 1 epochs" in quiet.stdout  # the final table is a result, not a log line


def _run_quiet(tmp_path) -> subprocess.CompletedProcess:
    config = write_config(tmp_path / "q.yaml", small_config(rounds=2, evaluate={"finetune_epochs": [1],
                                                                                 "batch_size": 50}))
    return subprocess.run(fedpart_command("--quiet", "run", str(config), "--out", str(tmp_path / "q")),
                          capture_output=True, text=True, env=child_env(), timeout=WAIT, cwd=tmp_path)
