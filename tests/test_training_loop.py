"""``benchmarks/training_loop.py``: fedpart's training loop and the floor's end at the same weights,
and fedpart's adds no operator beyond the loss sum's (no copy, conversion or multiply a step)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, WAIT, load_script

SCRIPT = REPO / "benchmarks" / "training_loop.py"
training_loop = load_script(SCRIPT)

# what fedpart's loop may run beside the floor's: one in-place add and one detach a step for the
# loss sum, the sum's creation and single read at the end, and the anchors' move to the device (a
# no-op there, no copy)
LOSS_SUM = {"aten::add_", "aten::detach", "detach", "aten::zeros", "aten::zero_", "aten::empty", "aten::item",
            "aten::_local_scalar_dense", "aten::to"}
# the regions torch's optimizer names in the profile (labels, not operators): fedpart's CPU
# optimizer (client/speed.py, PlainSGD) runs the same operators without them
TORCH_OPTIMIZER_LABELS = {"Optimizer.step#SGD.step", "Optimizer.zero_grad#SGD.zero_grad"}


def test_both_loops_end_at_the_same_weights_and_differ_only_in_the_loss_sum() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--pairs", "2"], capture_output=True, text=True, timeout=WAIT)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "same work           identical final weights\n" in out, out
    assert re.search(r"ratio fedpart / floor \d\.\d{4} \(median of 2 pairs\), 90% interval", out), out
    differing = {match.group(1): int(match.group(2)) for match in re.finditer(r"^  (\S+) +fedpart .*\(([+-]\d+)\)$",
                                                                             out, re.MULTILINE)}
    labels = {name: differing.pop(name) for name in TORCH_OPTIMIZER_LABELS & set(differing)}
    assert all(count == -60 for count in labels.values()), out  # the floor's 60 steps, none in fedpart
    assert differing and set(differing) <= LOSS_SUM, out
    assert differing["aten::add_"] == 60, out  # one a step: the epoch's 60 steps


def test_bad_options_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        training_loop.main(["--pairs", "0"])
    assert refused.value.code == 2
    assert "--pairs must be at least 1" in capsys.readouterr().err
