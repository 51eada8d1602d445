"""The processes of ``fedpart run``, forked from a fork server that has imported torch
(``fedpart/deploy/forks.py``): each runs its ``fedpart`` command with the environment, output,
name and exit code it is given, and stops on its signals like a process started by exec (the
environment and the plug-ins' import path are those of every ``fedpart run`` test)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from conftest import WAIT, child_env, small_config, write_config
from fedpart.cli.main import main
from fedpart.deploy.forks import ForkServer


@pytest.fixture(scope="module")
def forks() -> ForkServer:
    return ForkServer(main)


def test_a_forked_command_writes_into_its_log_and_exits_with_its_code(forks, tmp_path: Path) -> None:
    log = tmp_path / "client.log"
    log.write_text("an earlier line\n")
    process = forks.start(["client", "--server", "127.0.0.1", "--clients", "0", "--insecure"], child_env(), log)
    assert process.wait(timeout=WAIT) == 2
    text = log.read_text()
    assert text.startswith("an earlier line\n")  # appended: a resumed run's log goes on
    assert "127.0.0.1" in text and "port" in text, text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process names and /proc are Linux's")
def test_a_forked_server_is_named_and_stops_on_sigterm(forks, tmp_path: Path) -> None:
    config = write_config(tmp_path / "run.yaml", small_config(clients=2))
    server = forks.start(["server", str(config), "--address", "127.0.0.1:0", "--insecure", "--out",
                          str(tmp_path / "out")], child_env())
    assert server.poll() is None
    lines = []
    for line in server.stdout:  # its output through the launcher's pipe
        lines.append(line)
        if "listening on" in line:
            break
    assert any("listening on 127.0.0.1:" in line for line in lines), lines
    assert Path(f"/proc/{server.pid}/comm").read_text().strip() == "fedpart-server"
    server.terminate()
    assert server.wait(timeout=WAIT) == 128 + signal.SIGTERM
    assert "terminated" in server.stdout.read()
