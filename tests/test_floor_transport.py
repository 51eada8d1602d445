"""``benchmarks/floor_transport.py``: its messages over sealed connections, and a short run in
which round_overhead's floor over pipes and the same floor over sealed TLS connections (worker
processes of their own, certificates made in the run) take turns and end with the same weights."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import REPO, WAIT, load_script
from fedpart.common.sealed import SealedSocket

SCRIPT = REPO / "benchmarks" / "floor_transport.py"
floor_transport = load_script(SCRIPT)


def _sealed_pair() -> tuple[SealedSocket, SealedSocket]:
    left, right = socket.socketpair()
    one, other = os.urandom(32), os.urandom(32)
    return SealedSocket(left, one, other), SealedSocket(right, other, one)


def test_messages_cross_a_sealed_connection_whole_and_a_cut_one_is_told_apart_from_an_end() -> None:
    sender, receiver = _sealed_pair()
    delta = np.arange(floor_transport.floor.PARAMETERS, dtype=np.float32)
    results = [(3, 600, delta), (4, 590, -delta)]  # a message of several sealed frames

    def send() -> None:  # beside the reader: a socket pair buffers far less than the message
        floor_transport.send_message(sender, floor_transport.results_message(results))
        floor_transport.send_message(sender, floor_transport.weights_message(7, results[0][2]))
        sender.close()

    receiver.settimeout(WAIT)
    sending = threading.Thread(target=send)
    sending.start()
    received = floor_transport.read_results(floor_transport.receive_message(receiver))
    assert [(client, samples) for client, samples, _ in received] == [(3, 600), (4, 590)]
    assert all(np.array_equal(got, sent) for (_, _, got), (_, _, sent) in zip(received, results))
    round_number, weights = floor_transport.read_weights(floor_transport.receive_message(receiver))
    assert round_number == 7 and np.array_equal(weights, delta)
    assert floor_transport.receive_message(receiver) is None, "closed between messages: the end"
    sending.join(timeout=WAIT)
    receiver.close()

    sender, receiver = _sealed_pair()
    receiver.settimeout(WAIT)
    sender.sendall(floor_transport.LENGTH.pack(1000) + b"only part of it")
    sender.close()
    with pytest.raises(EOFError):
        floor_transport.receive_message(receiver)
    receiver.close()


def test_both_floors_take_turns_and_end_with_the_same_weights() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--processes", "2", "--rounds", "2"],
                         capture_output=True, text=True, timeout=WAIT)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert re.search(r"ratio sealed / pipes    \d\.\d{3}  \(median of 1 pairs; 90% interval", out), out
    for line in ("cpu per round           pipes ", "  training threads      pipes ", "  other threads         pipes "):
        assert line in out, out
    assert "max |pipes - sealed| over the final weights: 0\n" in out, out


def test_bad_options_are_refused_before_anything_starts(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        floor_transport.main(["--rounds", "1"])
    assert refused.value.code == 2
    assert "--rounds at least 2" in capsys.readouterr().err
