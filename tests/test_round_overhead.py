"""``benchmarks/round_overhead.py``'s arithmetic and its turns: which fedpart rounds pair with the
floor round run inside them, the report over sittings, the run-queue wait and preemptions it reads
from ``/proc``, and how it stops a run's process group while the floor takes its turn (the benchmark
itself runs for minutes and is not run here)."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torch.nn.utils import parameters_to_vector

from conftest import REPO, load_script
from fedpart.common.process.records import ByteCounts, RoundRecord

round_overhead = load_script(REPO / "benchmarks" / "round_overhead.py")
Usage = round_overhead.Usage
IDLE = Usage(0.0, 0.0, 0.0, 0.0, 0.0, 0)


def _record(round_number: int, seconds: float) -> RoundRecord:
    return RoundRecord(round=round_number, sampled=list(range(10)), completed=list(range(10)), seconds=seconds,
                       bytes_down=1000, bytes_up=2000,
                       bytes_by_part={"body": ByteCounts(down=900, up=1900), "control": ByteCounts(down=100, up=100)})


def _pause(started: float, seconds: float, floor_rounds: tuple[int, ...], usage: Usage = IDLE,
           idle_while_stopped: float = 0.0):
    return round_overhead.Pause(started, started + seconds, floor_rounds, usage, idle_while_stopped)


def _sitting(records, landed, pauses, floor_seconds, usage=None, final=None, fedpart_final=None):
    floor_rounds = {n: (s, (usage or {}).get(n, IDLE)) for n, s in floor_seconds.items()}
    return round_overhead.Sitting(records, landed, pauses, floor_rounds, final, fedpart_final or {}, 0.0)


def test_a_fedpart_round_pairs_with_the_one_floor_round_its_pause_held() -> None:
    # round n's line is seen at 3.2 n; round n + 1 runs from 0.1 s after it for 3.0 s, the pause
    # after line n (1 s, from 0.5 s after it) included
    seen = {n: 3.2 * n for n in range(1, 7)}
    records = [_record(n, 3.0) for n in range(1, 7)]
    pauses = {n: _pause(seen[n] + 0.5, 1.0, (n,)) for n in range(1, 6)}
    pauses[4] = _pause(seen[4] + 0.5, 1.0, (4, 5))    # two floor rounds in one pause: no pair for round 5
    pauses[5] = _pause(seen[5] + 0.5, 1.0, ())
    landed = dict(seen)
    landed[4] = seen[4] + 0.4                          # seen late: it may have started after its pause began
    floor = {n: 2.0 for n in range(1, 7)}
    pairs = _sitting(records, landed, pauses, floor).pairs()
    assert [(p.round, p.fedpart_seconds, p.floor_seconds) for p in pairs] == [(3, 2.0, 2.0)], \
        "round 2 holds the floor's first round; 4 cannot be shown to hold its pause; 5 and 6 hold no single one"
    assert pairs[0].ratio == 1.0
    short = _sitting([_record(3, 0.9)], {3: seen[2] + 1.0}, {2: _pause(seen[2] + 0.5, 1.0, (2,))}, floor).pairs()
    assert short == [], "a round that does not outlast its pause did not hold it"


def test_the_report_pools_the_pairs_of_every_sitting(capsys) -> None:
    model = round_overhead.build_model(round_overhead.MODEL, round_overhead.NUM_CLASSES,
                                       round_overhead.INPUT_SHAPE, round_overhead.SEED)
    vector = parameters_to_vector(model.parameters()).detach()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    sittings = []
    for fedpart_seconds, floor_seconds in (([2.1, 2.2, 2.0], [2.0, 2.0, 2.0]), ([2.6, 2.2, 2.3], [2.0, 2.2, 2.0])):
        records = [_record(1, 5.0), _record(2, 5.0)] + [_record(n + 3, s + 1.0) for n, s in enumerate(fedpart_seconds)]
        landed = {n: 3.2 * n for n in range(1, 6)}
        # the cores sat idle 0.15 core-seconds from one pause to the next, 0.05 of them while the floor ran
        pauses = {n: _pause(3.2 * n + 0.5, 1.0, (n,), Usage(2.1 * n, 1.9 * n, 0.1 * n, 0.15 * n, 1.98 * n, 551 * n),
                            idle_while_stopped=0.05)
                  for n in range(1, 5)}
        floor = dict(zip(range(1, 6), [9.0, *floor_seconds, 9.0]))
        usage = {n: Usage(2.0, 1.9, 0.0192, 0.02, 1.95, 494) for n in floor}
        sittings.append(_sitting(records, landed, pauses, floor, usage, vector, state))
    round_overhead.report(2, sittings)
    out = capsys.readouterr().out
    assert "sitting 1: 3 of rounds 3..5 paired" in out
    assert "ratio       1.050  1.100  1.000" in out
    assert "ratio       1.300  1.000  1.150" in out
    # the six ratios 1.0, 1.0, 1.05, 1.1, 1.15, 1.3: median 1.075
    assert "ratio fedpart / floor       1.075  (median of 6 pairs, quartiles" in out
    # six pairs in two sittings cannot place the median on either side of 1.03
    assert "  90% interval        1.000-1.175 (bootstrap over the pairs)\n" in out
    assert "  90% interval        1.000-1.225 (bootstrap over the 2 sittings, then their pairs): neither meets nor " \
           "misses the 1.03x target as far as these pairs can tell" in out
    assert "paired round medians        fedpart 2.200 s, floor 2.000 s, ratio 1.100" in out
    assert "max |floor - fedpart| over the final weights: 0" in out
    assert "cpu per round, rounds 2..   fedpart 2.100 s, floor 2.000 s, ratio 1.050" in out
    assert "training threads on a core fedpart 1.900 s, floor 1.900 s; all other threads fedpart 0.200 s, " \
           "floor 0.100 s" in out
    assert "training threads waited   fedpart 5.0 %, floor 1.0 % of their runnable time" in out
    assert "training threads preempted fedpart 290, floor 260 times per second on a core" in out  # 551/1.9, 494/1.9
    assert "cores idle                fedpart 0.100 s, floor 0.020 s a round (core-seconds)" in out, \
        "fedpart's idle cores leave out those of the floor's round in its pause"
    assert "of the other threads      in the training processes fedpart 0.080 s, floor 0.050 s; in the others " \
           "(fedpart: server, launcher; floor: parent) fedpart 0.120 s, floor 0.050 s" in out


def test_the_interval_of_the_median_narrows_with_the_pairs_and_decides_the_verdict() -> None:
    spread = [1.0 + 0.04 * (k * 37 % 97) / 96 for k in range(40)]  # scattered over 1.00-1.04
    low, high = round_overhead.median_interval(spread)
    assert (low, high) == round_overhead.median_interval(spread), "seeded: the same pairs give the same interval"
    assert low <= statistics.median(spread) <= high
    assert high - low < round_overhead.median_interval(spread[:8])[1] - round_overhead.median_interval(spread[:8])[0]
    assert round_overhead.median_interval([1.01] * 7) == (1.01, 1.01)
    assert round_overhead.verdict(0.99, 1.03) == "meets the 1.03x target"
    assert round_overhead.verdict(1.031, 1.06) == "MISSES the 1.03x target"
    assert round_overhead.verdict(1.02, 1.04).startswith("neither meets nor misses")


def test_the_interval_over_sittings_carries_how_far_whole_sittings_differ() -> None:
    scattered = [1.0 + 0.04 * (k * 37 % 97) / 96 for k in range(40)]
    low, high = round_overhead.sittings_interval([scattered[:20], scattered[20:]])
    assert (low, high) == round_overhead.sittings_interval([scattered[:20], scattered[20:]]), "seeded"
    pairs_low, pairs_high = round_overhead.median_interval(scattered)
    assert abs(low - pairs_low) < 0.002 and abs(high - pairs_high) < 0.002, \
        "sittings alike: about the interval over the pooled pairs"
    apart = [[1.0 + 0.002 * k for k in range(20)], [1.08 + 0.002 * k for k in range(20)]]
    low, high = round_overhead.sittings_interval(apart)
    pairs_low, pairs_high = round_overhead.median_interval(apart[0] + apart[1])
    assert low < pairs_low and high > pairs_high, "sittings apart: wider than the pairs alone say"
    assert round_overhead.sittings_interval([[1.01, 1.02, 1.03], []]) == \
        round_overhead.median_interval([1.01, 1.02, 1.03]), "one sitting with pairs: the interval over its pairs"


def test_usage_between_two_samples_subtracts_every_measure() -> None:
    later, earlier = Usage(3.0, 2.0, 1.0, 4.0, 2.5, 700), Usage(1.0, 1.5, 0.25, 1.5, 1.75, 500)
    between = later - earlier
    assert between == Usage(2.0, 0.5, 0.75, 2.5, 0.75, 200)
    assert (between.others, between.beside_training, between.not_training) == (1.5, 0.25, 1.25)
    assert between.trainers_preempted_per_second == 400.0
    assert Usage(1.0, 0.0, 0.0, 0.0, 0.0, 0).trainers_preempted_per_second is None, "a thread that did not run"


def test_the_waited_share_and_the_preemptions_count_a_thread_held_off_its_core() -> None:
    """Two busy processes pinned to one core: each main thread waits for about half its runnable
    time (more where other load shares that core), and each is taken off the core it could still use."""
    core = min(os.sched_getaffinity(0))
    pair = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {core})) for _ in range(2)]
    try:
        pids = [process.pid for process in pair]
        before = Usage.of(pids, pids)
        time.sleep(1.0)  # the span measured while both run, not a synchronization
        between = Usage.of(pids, pids) - before
    finally:
        for process in pair:
            process.kill()
            process.wait(timeout=30)
    assert 0.3 < between.trainers_waited < 0.9
    assert between.trainers_preempted > 0, "two threads taking turns on one core take each other's core"
    assert round_overhead.main_thread_schedstat(pair[0].pid) == (0.0, 0.0), "an ended process reads as zeros"
    assert round_overhead.main_thread_preemptions(pair[0].pid) == 0, "an ended process reads as zero"


class _ScriptedRun:
    """Stands in for ``fedpart run``: its n-th poll appends the round lines ``writes[n]`` names to
    ``metrics``; it has ended (exit 0) after the last. Its ``pid`` leads a real process group
    (a sleeping child), which the pauses stop and continue."""

    def __init__(self, metrics: Path, writes: dict[int, list[int]], group: subprocess.Popen) -> None:
        self.metrics = metrics
        self.writes = writes
        self.pid = group.pid
        self.polls = 0

    def poll(self) -> int | None:
        self.polls += 1
        if self.polls in self.writes:
            with self.metrics.open("a") as out:
                out.writelines(f'{{"round": {n}}}\n' for n in self.writes[self.polls])
        return 0 if self.polls > max(self.writes) else None


def _state(pid: int) -> str:
    return round_overhead.stat_fields(pid)[0]


class _RecordingFloor:
    """Stands in for the floor: each round notes the state of the run's process meanwhile."""

    def __init__(self, watched: int) -> None:
        self.watched = watched
        self.rounds_done = 0
        self.states: list[str] = []

    def round(self) -> tuple[float, Usage]:
        self.rounds_done += 1
        self.states.append(_state(self.watched))
        return 0.5, IDLE


def test_taking_turns_stops_the_run_while_the_floor_catches_up_to_its_lines(tmp_path) -> None:
    group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=os.setpgrp)
    try:
        metrics = tmp_path / "metrics.jsonl"
        run = _ScriptedRun(metrics, {2: [1], 4: [2], 5: [3, 4], 7: [5]}, group)
        floor = _RecordingFloor(group.pid)
        code, landed, pauses, floor_rounds = round_overhead.take_turns(run, metrics, floor, 5, time.monotonic() + 60)
        assert code == 0 and run.polls == 8
        assert sorted(landed) == [1, 2, 3, 4, 5]
        assert {n: p.floor_rounds for n, p in pauses.items()} == {1: (1,), 2: (2,), 4: (3, 4)}, \
            "after each count seen, below the last round: the floor runs up to it"
        assert sorted(floor_rounds) == [1, 2, 3, 4], "the last round is the caller's, after the run ended"
        assert floor.states == ["T"] * 4, "the run's process group is stopped while the floor runs"
        assert _state(group.pid) in "SR", "and continued after"
        assert all(p.ended - p.started >= 0 and isinstance(p.usage, Usage) for p in pauses.values())
    finally:
        os.killpg(group.pid, signal.SIGCONT)
        group.kill()
        group.wait(timeout=30)
