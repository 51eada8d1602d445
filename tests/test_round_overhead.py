"""``benchmarks/round_overhead.py``'s arithmetic: the slowest process's training per round from a
round record, each fedpart run against the floor runs either side of it, the report over runs
that took turns, the run-queue wait it reads from ``/proc``, and how it samples a run's usage at
its round lines (the benchmark itself runs for minutes and is not run here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from conftest import REPO, load_script
from fedpart.common.records import RoundRecord

round_overhead = load_script(REPO / "benchmarks" / "round_overhead.py")
Usage = round_overhead.Usage


def _record(round_number: int, seconds: float, compute: dict[int, float]) -> RoundRecord:
    return RoundRecord(round=round_number, sampled=sorted(compute), completed=sorted(compute), seconds=seconds,
                       bytes_down=1000, bytes_up=2000,
                       bytes_by_part={"body": {"down": 900, "up": 1900}, "control": {"down": 100, "up": 100}},
                       clients={str(c): {"compute_seconds": s} for c, s in compute.items()})


def test_the_slowest_process_is_the_one_whose_clients_trained_longest_in_all() -> None:
    groups, _ = round_overhead.client_processes(2)
    assert groups == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    # process 0: 5 x 0.5 = 2.5 s; process 1 holds the slowest single client but 0.9 + 4 x 0.3 = 2.1 s
    compute = {c: 0.5 for c in range(5)} | {5: 0.9} | {c: 0.3 for c in range(6, 10)}
    assert round_overhead._slowest_training(_record(1, 2.6, compute), groups) == pytest.approx(2.5)


def test_each_fedpart_run_is_set_against_the_mean_of_the_floors_either_side() -> None:
    def floor(seconds: list[float]):
        return round_overhead.FloorRun(round_overhead.RoundTimes(seconds, seconds, [None] * len(seconds)),
                                       torch.zeros(1), 0.0)

    def fed(seconds: list[float]):
        return round_overhead.FedpartRun([], round_overhead.RoundTimes(seconds, seconds, [None] * len(seconds)),
                                         {}, 0.0)

    floors = [floor([2.0, 2.0, 9.0]), floor([3.0, 3.0, 1.0]), floor([4.0, 4.0, 4.0])]
    fedparts = [fed([2.75, 2.75, 0.1]), fed([3.5, 3.5, 3.5])]
    assert round_overhead._pair_ratios(fedparts, floors) == pytest.approx([2.75 / 2.5, 3.5 / 3.5])


def test_the_report_pools_the_rounds_of_runs_that_took_turns(capsys) -> None:
    model = round_overhead.build_model(round_overhead.MODEL, round_overhead.NUM_CLASSES,
                                       round_overhead.INPUT_SHAPE, round_overhead.SEED)
    vector = parameters_to_vector(model.parameters()).detach()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    compute = {c: 0.2 for c in range(10)}
    floors, fedparts = [], []
    for walls in ([1.0, 1.1], [1.2, 1.3], [1.0, 1.0]):
        times = round_overhead.RoundTimes(walls, [w - 0.05 for w in walls], [None, Usage(2.0, 1.9, 0.0192, 0.02, 1.95, 494)])
        floors.append(round_overhead.FloorRun(times, vector, 0.0))
    for walls in ([1.1, 1.2], [1.15, 1.25]):
        records = [_record(n + 1, w, compute) for n, w in enumerate(walls)]
        times = round_overhead.RoundTimes(walls, [1.0, 1.0], [None, Usage(2.1, 1.9, 0.1, 0.15, 1.98, 551)])
        fedparts.append(round_overhead.FedpartRun(records, times, state, 0.0))
    round_overhead.report(2, floors, fedparts)
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    names = [line[0] for line in lines if line and line[0].startswith(("floor#", "fedpart#"))]
    assert names == ["floor#1", "fedpart#1", "floor#2", "fedpart#2", "floor#3"], "in the order they ran"
    # medians: fedpart over 1.1, 1.2, 1.15, 1.25 -> 1.175; floor over 1.0, 1.1, 1.2, 1.3, 1.0, 1.0 -> 1.05
    assert "ratio fedpart / floor       1.119  (MISSES the 1.03x target)" in out
    assert "run by run                  1.000, 1.067" in out  # 1.15 / ((1.05 + 1.25) / 2), 1.2 / ((1.25 + 1.0) / 2)
    assert "max |floor - fedpart| over the final weights: 0" in out
    assert "cpu per round, rounds 2..   fedpart 2.100 s, floor 2.000 s, ratio 1.050" in out
    assert "training threads on a core fedpart 1.900 s, floor 1.900 s; all other threads fedpart 0.200 s, " \
           "floor 0.100 s" in out
    assert "training threads waited   fedpart 5.0 %, floor 1.0 % of their runnable time" in out
    assert "training threads preempted fedpart 290, floor 260 times per second on a core" in out  # 551/1.9, 494/1.9
    assert "cores idle                fedpart 0.150 s, floor 0.020 s a round (core-seconds)" in out
    assert "of the other threads      in the training processes fedpart 0.080 s, floor 0.050 s; in the others " \
           "(fedpart: server, launcher; floor: parent) fedpart 0.120 s, floor 0.050 s" in out


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
    ``metrics``; it has ended (exit 0) after the last."""

    pid = os.getpid()

    def __init__(self, metrics, writes: dict[int, list[int]]) -> None:
        self.metrics = metrics
        self.writes = writes
        self.polls = 0

    def poll(self) -> int | None:
        self.polls += 1
        if self.polls in self.writes:
            with self.metrics.open("a") as out:
                out.writelines(f'{{"round": {n}}}\n' for n in self.writes[self.polls])
        return 0 if self.polls > max(self.writes) else None


def test_following_a_run_samples_its_usage_once_per_line_count_seen(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    run = _ScriptedRun(metrics, {2: [1], 4: [2], 5: [3, 4]})
    code, usage_at_lines = round_overhead._follow(run, metrics, time.monotonic() + 60)
    assert code == 0 and run.polls == 6
    assert sorted(usage_at_lines) == [1, 2, 4], "each count once; two lines landing together are one sample"
    assert all(isinstance(usage, Usage) for usage in usage_at_lines.values())
