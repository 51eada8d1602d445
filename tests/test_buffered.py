"""The buffered round engine (FedBuff) and reproducible device heterogeneity, in process: the
device model, the staleness weights, the engine's schedule, its configuration checks, and the
engine itself driven through its task board the way client processes drive it (polls, results
in an order the test chooses), with deltas the test makes."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from conftest import poll_task, small_config
from fedpart.client.mods.heterogeneity import EmulatedDevices
from fedpart.client.mods import Reply
from fedpart.common.config.run_config import BufferedConfig, ConfigError, HeterogeneityConfig, config_from_dict
from fedpart.common.config.heterogeneity import Device, Devices
from fedpart.common.wire.plans import HostedClient, JoinInfo, Phase, ResultInfo, TaskInfo, TaskKind, TrainPlan
from fedpart.common.wire.protocol import PROTOCOL_VERSION, Rejected
from fedpart.server.output.accounting import ByteLedger
from fedpart.server.engine.buffered import BufferedCoordinator, LedgerTotals, Schedule, VersionTraffic, stale_scaled, \
    staleness_weight
from fedpart.server.policy.robust import MeasuredDeltas
from fedpart.server.engine.run_state import is_operational
from fedpart.server.engine.sampling import sample_clients
from fedpart.server.engine.virtual_clock import VirtualClock

BOUND = 60.0  # seconds: every wait here is bounded


# ------------------------------------------------------------------------- devices


def test_an_intermittent_device_waits_for_its_online_window_and_pauses_offline() -> None:
    device = Device(slowdown=1.0, phase=10.0, period=100.0, offline=50.0)  # offline [10, 60) + k * 100
    assert device.online_at(0.0) == 0.0 and device.online_at(10.0) == 60.0 and device.online_at(160.0) == 160.0
    assert device.finish(0.0, 10.0) == 10.0      # exactly fills the window before going offline
    assert device.finish(55.0, 40.0) == 100.0    # waits until 60, then 40 s
    assert device.finish(100.0, 200.0) == 500.0  # 10 + 50 + 50 + 50 + 40 s online, three offline windows between
    assert Device(slowdown=3.0).finish(7.0, 2.0) == 9.0  # always online


def test_devices_are_drawn_from_the_seed_alone() -> None:
    section = HeterogeneityConfig(speed="lognormal", speed_sigma=1.0, offline_share=0.1)
    first, again, other = Devices(section, 100, 0), Devices(section, 100, 0), Devices(section, 100, 1)
    assert [first[c] for c in range(100)] == [again[c] for c in range(100)]
    assert [first[c] for c in range(100)] != [other[c] for c in range(100)]
    assert sum(1 for c in range(100) if first[c].offline) == 10  # exactly the share
    slowdowns = np.array([first[c].slowdown for c in range(100)])
    assert 0.5 < float(np.median(slowdowns)) < 2.0 and slowdowns.max() > 5 * slowdowns.min()
    alike = Devices(HeterogeneityConfig(), 100, 0)
    assert {alike[c] for c in range(100)} == {Device()}
    assert alike.task_seconds(3, 20) == pytest.approx(20 * 0.05)
    assert Devices(HeterogeneityConfig(seed=7), 5, 0)[2] == Devices(HeterogeneityConfig(seed=7), 5, 1)[2]


class _Clock:
    """A clock the test moves; waiting moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waited: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waited.append(seconds)
        self.now += seconds


def test_an_emulated_device_holds_a_training_task_for_its_device_time() -> None:
    section = HeterogeneityConfig(speed="lognormal", step_seconds=0.5)
    devices = Devices(section, 4, 0)
    clock = _Clock()
    mod = EmulatedDevices(devices, clock.wait, lambda line: None, clock)
    plan = TrainPlan(phases=(Phase(2, ("fc1",)),), lr=0.1, batch_size=10)

    def train(task: TaskInfo) -> Reply:
        clock.now += 0.25  # the training itself
        return Reply(samples=35)

    reply = mod(TaskInfo(TaskKind.TRAIN, 1, 1, 2, train=plan), train)
    steps = 2 * math.ceil(35 / 10)
    assert reply.samples == 35 and plan.local_steps(35) == steps
    assert clock.waited == [pytest.approx(devices.task_seconds(2, steps) - 0.25)]
    clock.waited.clear()
    mod(TaskInfo(TaskKind.EVALUATE, 2, 2, 2), train)  # an evaluation is not held
    assert clock.waited == []


# ------------------------------------------------------------------------- staleness and schedule


def test_staleness_weights() -> None:
    assert staleness_weight(BufferedConfig())(7) == 1.0
    polynomial = staleness_weight(BufferedConfig(staleness="polynomial", staleness_exponent=0.5))
    assert polynomial(0) == 1.0 and polynomial(3) == pytest.approx(0.5)
    hinge = staleness_weight(BufferedConfig(staleness="hinge", hinge_slope=10.0, hinge_cutoff=4))
    assert hinge(4) == 1.0 and hinge(5) == pytest.approx(1 / 11)


def test_a_stale_delta_is_scaled_and_keeps_what_screening_measured() -> None:
    deltas = MeasuredDeltas({"w": torch.ones(3), "steps": torch.tensor([4])}, norm=2.0)
    out = stale_scaled(deltas, 0.5)
    assert isinstance(out, MeasuredDeltas) and out.norm == 2.0
    assert torch.equal(out["w"], torch.full((3,), 0.5)) and torch.equal(out["steps"], torch.tensor([4]))
    assert torch.equal(deltas["w"], torch.ones(3))  # the screened deltas are not changed


def _virtual_config(**overrides):
    config = small_config(clients=5, rounds=4, sampling={"fraction": 0.4},
                          data={"dataset": "digits", "partition": {"scheme": "shards", "shards_per_client": 2}},
                          server={"engine": "buffered", "round_timeout": 120, "heartbeat_timeout": 30},
                          buffered={"concurrency": 4, "buffer_size": 2, "staleness": "polynomial"},
                          heterogeneity={"speed": "lognormal", "offline_share": 0.34, "offline_period": 3.0,
                                         "clock": "virtual"})
    config.update(overrides)
    return config_from_dict(config)


def test_the_schedule_keeps_concurrency_and_folds_the_first_to_finish(one_torch_thread) -> None:
    config = _virtual_config()
    coordinator = BufferedCoordinator(config, log=lambda line: None)
    clock = VirtualClock(config, coordinator.round_plan)
    schedule = Schedule(5, 4, 2, config.sampling_seed, clock)
    started = schedule.start(1, last=4)
    assert len(started) == 4 and all(f.round == 1 and f.start == 0.0 for f in started)
    members = schedule.members()
    finishing = sorted(started, key=lambda f: (f.finish, f.client))
    assert members == {f.client for f in finishing[:2]}
    done, (now, busy) = schedule.close(members)
    assert now == max(f.finish for f in done) and busy > 0
    again = schedule.start(2, last=4)
    assert len(again) == 2 and all(f.start == now and f.client not in schedule.flights or f in again
                                   for f in again)
    assert len(schedule.flights) == 4
    schedule.close(schedule.members())
    assert schedule.start(4, last=4) == []  # version 4 can fold 2: the 2 in flight are enough
    # with every client idle and concurrency = the round's sample, a version draws the synchronous sample
    alike = Schedule(6, 3, 3, 5)
    assert sorted(f.client for f in alike.start(9, last=20)) == sample_clients(6, 9, 5, 0.5)


# ------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("settings, message", [
    ({"server": {"engine": "async"}}, "server.engine must be one of"),
    ({"server": {"engine": "buffered"}, "buffered": {"concurrency": 2, "buffer_size": 3}}, "could never fill"),
    ({"server": {"engine": "buffered"}, "buffered": {"concurrency": 20}}, "buffered.concurrency must be in"),
    ({"server": {"engine": "buffered"}, "buffered": {"staleness": "linear"}}, "buffered.staleness must be one of"),
    ({"server": {"engine": "buffered"}, "sampling": {"scheme": "poisson", "fraction": 0.5}}, "sampling.scheme"),
    ({"server": {"engine": "buffered", "round_deadline_factor": 2}}, "round_deadline_factor"),
    ({"server": {"engine": "buffered"}, "buffered": {"buffer_size": 2, "concurrency": 3},
      "privacy": {"secure_aggregation": True, "secure_aggregation_threshold": 3}}, "fewer than its threshold"),
    ({"server": {"engine": "buffered"}, "buffered": {"staleness": "polynomial"},
      "privacy": {"secure_aggregation": True}}, "never sees one"),
    ({"server": {"engine": "buffered"}, "buffered": {"concurrency": 3, "buffer_size": 2}, "train": {"weighting": "uniform"},
      "privacy": {"dp": {"enabled": True}}}, "set sampling.fraction to 2/4"),
    ({"heterogeneity": {"speed": "pareto"}}, "heterogeneity.speed must be one of"),
    ({"heterogeneity": {"offline_fraction": 1.0}}, "heterogeneity.offline_fraction"),
    ({"heterogeneity": {"clock": "fast"}}, "heterogeneity.clock must be one of"),
])
def test_what_the_buffered_engine_and_the_devices_refuse(settings, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(small_config(**settings))


def test_a_sync_run_may_carry_a_buffered_section_and_a_resume_keeps_its_engine() -> None:
    config = config_from_dict(small_config(buffered={"concurrency": 2}))  # read only by the buffered engine
    assert config.server.engine == "sync"
    assert config_from_dict(small_config(server={"engine": "buffered"})).buffered.resolved(4, 1.0) == (4, 4)
    assert not is_operational("server.engine") and is_operational("server.round_timeout")


# ------------------------------------------------------------------------- the engine in process


def _join(coordinator: BufferedCoordinator) -> str:
    hosted = tuple(HostedClient(c) for c in range(coordinator.config.clients))
    return coordinator.join(JoinInfo(protocol=PROTOCOL_VERSION, process_name="p", clients=hosted))


def _delta(coordinator: BufferedCoordinator, task, scale: float = 0.01) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * task.client_id + task.round)
    return {n: scale * torch.randn(coordinator.global_state[n].shape, generator=generator)
            for n in task.train.upload_deltas}


def _answer(coordinator: BufferedCoordinator, session: str, task, scale: float = 0.01) -> None:
    result = ResultInfo(session, task.task_id, task.client_id, task.round, num_samples=10, metrics={"loss": 1.0})
    coordinator.accept(task, result, _delta(coordinator, task, scale))


def _take(coordinator: BufferedCoordinator, session: str, count: int, held: tuple = ()) -> list:
    """``count`` tasks, each poll listing the tasks the process holds."""
    tasks = []
    for _ in range(count):
        tasks.append(poll_task(coordinator, session, (*held, *(t.task_id for t in tasks)), wait=BOUND))
    return tasks


def _versions(coordinator: BufferedCoordinator, versions: int) -> tuple[threading.Thread, list[dict]]:
    records: list[dict] = []

    def run() -> None:
        for number in range(1, versions + 1):
            records.append(coordinator.run_round(number).to_json())

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, records


def _drive(config, order) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Run every version of ``config``, the test's one process answering the tasks it holds in
    ``order`` (a sort key of the tasks) each time it has taken all it was given."""
    coordinator = BufferedCoordinator(config, log=lambda line: None)
    session = _join(coordinator)
    worker, records = _versions(coordinator, config.rounds)
    while worker.is_alive():
        held = []
        while (task := poll_task(coordinator, session, tuple(t.task_id for t in held), wait=0.2)) is not None:
            held.append(task)
        for task in sorted(held, key=order):
            _answer(coordinator, session, task)
    worker.join(BOUND)
    assert not worker.is_alive() and coordinator.failures == []
    return coordinator.global_state, records


def test_the_virtual_clock_folds_the_same_results_whatever_order_they_arrive_in(one_torch_thread) -> None:
    """Results arrive in opposite orders: a version folds the tasks that finish first in virtual
    time either way, holding the ones that arrived early, so the model is the same, bit for bit."""
    config = _virtual_config()
    first, first_records = _drive(config, lambda task: task.task_id)
    second, second_records = _drive(config, lambda task: -task.task_id)
    assert all(torch.equal(first[n], second[n]) for n in first)

    def schedule(records: list[dict]) -> list[list]:  # what arrived early (held) depends on the order, nothing else
        return [[r["sampled"], r["completed"], r["virtual_seconds"], r["virtual_busy"],
                 {k: v for k, v in r["buffered"].items() if k != "held"}] for r in records]

    assert schedule(first_records) == schedule(second_records)
    assert any(r["buffered"]["held"] for r in first_records + second_records)
    assert any(s != "0" for r in first_records for s in r["buffered"]["staleness"])  # some results were stale
    times = [r["virtual_seconds"] for r in first_records]
    assert times == sorted(times) and len(set(times)) > 1


def test_on_the_wall_clock_a_version_takes_the_first_results_and_holds_the_rest(one_torch_thread) -> None:
    config = _virtual_config(heterogeneity={})
    coordinator = BufferedCoordinator(config, log=lambda line: None)
    session = _join(coordinator)
    worker, records = _versions(coordinator, 2)
    tasks = _take(coordinator, session, 4)
    assert {t.round for t in tasks} == {1}
    for task in tasks[:3]:  # the third arrives once version 1 has its two: held for version 2
        _answer(coordinator, session, task)
    fresh = _take(coordinator, session, 2, (tasks[3].task_id,))  # version 2 refills concurrency
    assert {t.round for t in fresh} == {2}
    # each task carries the model it was dispatched with: version 0 for the last of round 1
    specs, tensors = coordinator.task_tensors(tasks[3], {})
    assert {spec.version for spec in specs} == {0}
    assert all(torch.equal(t, coordinator.model.state_dict()[s.name]) for s, t in zip(specs, tensors))
    specs, _ = coordinator.task_tensors(fresh[0], {})
    assert {spec.version for spec in specs} == {1}
    assert coordinator.task_tensors(fresh[0], {s.name: 1 for s in specs}) == ([], [])
    _answer(coordinator, session, tasks[3])
    worker.join(BOUND)
    assert [r["completed"] for r in records] == [sorted(t.client_id for t in tasks[:2]),
                                                 sorted(t.client_id for t in tasks[2:])]
    assert records[1]["buffered"]["staleness"] == {"1": 2}
    assert records[1]["buffered"]["in_flight"] == 2  # the fresh ones, never answered


def test_the_default_bound_refuses_an_oversized_delta_and_frees_its_client(one_torch_thread) -> None:
    """A result whose delta is a million times an honest one: refused on arrival when its version
    takes it (the client hears so), counted in the version's record; a client whose refused task
    is over is idle again."""
    config = _virtual_config(heterogeneity={})
    coordinator = BufferedCoordinator(config, log=lambda line: None)
    session = _join(coordinator)
    worker, records = _versions(coordinator, 1)
    tasks = _take(coordinator, session, 4)
    with pytest.raises(Rejected, match="exceeds"):
        _answer(coordinator, session, tasks[0], scale=1e5)
    coordinator.board.fail_task(tasks[0], "result rejected")  # what the service does with a refused result
    for task in tasks[1:3]:
        _answer(coordinator, session, task)
    worker.join(BOUND)
    assert records[0]["robust"]["rejected"] == 1
    assert tasks[0].client_id not in coordinator.schedule.flights


def test_a_refused_member_is_replaced_by_a_result_that_arrived_already(one_torch_thread) -> None:
    """With the virtual clock a version takes the flights that finish first; when one of them is
    refused, the next to finish takes its place, and where that one's result arrived already (held),
    the version folds it at once instead of waiting out server.round_timeout."""
    config = _virtual_config()
    coordinator = BufferedCoordinator(config, log=lambda line: None)
    session = _join(coordinator)
    worker, records = _versions(coordinator, 1)
    tasks = _take(coordinator, session, 4)
    members = coordinator.schedule.members()
    first, second = [t for t in tasks if t.client_id in members]
    for task in tasks:
        if task.client_id not in members:  # arrive before their turn: held
            _answer(coordinator, session, task)
    started = time.monotonic()
    with pytest.raises(Rejected, match="exceeds"):
        _answer(coordinator, session, first, scale=1e5)
    coordinator.board.fail_task(first, "result rejected")  # what the service does with a refused result
    _answer(coordinator, session, second)
    worker.join(BOUND)
    assert not worker.is_alive()
    assert time.monotonic() - started < config.server.round_timeout / 4
    assert records[0]["robust"]["rejected"] == 1
    assert len(records[0]["completed"]) == 2 and first.client_id not in records[0]["completed"]


def test_a_version_record_counts_the_bytes_moved_while_it_was_open() -> None:
    ledger = ByteLedger(["fc1"])
    ledger.add(1, 0, "down", {"body": 100})
    since = LedgerTotals.of(ledger)
    ledger.add(1, 0, "up", {"body": 40})
    ledger.add(2, 3, "down", {"body": 7, "control": 1})
    ledger.add_logical(1, 0, "up", {"body": 40}, {"fc1": 40})
    traffic = VersionTraffic(ledger, since, {0: 1})
    assert traffic.totals(9) == {"down": 8, "up": 40}
    assert traffic.by_part(9)["body"] == {"down": 7, "up": 40}
    assert traffic.totals(9, 0) == {"down": 100, "up": 40}  # client 0's task of round 1, whole
    assert traffic.totals(9, 3) == {"down": 0, "up": 0}      # not folded in this version
    assert traffic.logical(9)["up"] == 40 and traffic.by_unit(9)["fc1"] == {"down": 0, "up": 40}


def test_a_result_trained_before_a_learning_rate_decay_is_screened_at_the_current_rate(one_torch_thread) -> None:
    """lr x0.1 from version 3 on (train.lr_milestones): a round-1 task folded in version 4 moved
    ~30 times as far as version 3's results, ~3 times on their rate's scale: the adaptive bound
    (10 x the median) takes it at the current rate, scaled back after screening."""
    config = _virtual_config(heterogeneity={}, buffered={"concurrency": 4, "buffer_size": 1}, rounds=8,
                             train={"epochs": 1, "batch_size": 20, "lr": 0.05, "lr_milestones": [0.25]})
    coordinator = BufferedCoordinator(config, log=lambda line: None)
    session = _join(coordinator)
    worker, records = _versions(coordinator, 4)
    first = _take(coordinator, session, 4)
    held = [t.task_id for t in first[1:]]
    _answer(coordinator, session, first[0], scale=0.03)
    for version in (2, 3):
        (task,) = _take(coordinator, session, 1, tuple(held))
        assert task.round == version
        _answer(coordinator, session, task, scale=0.03 if version == 2 else 0.001)
    (fourth,) = _take(coordinator, session, 1, tuple(held))
    _answer(coordinator, session, first[1], scale=0.03)  # stale by 3, trained at the earlier rate
    worker.join(BOUND)
    assert coordinator.failures == [] and records[3]["robust"]["rejected"] == 0
    assert records[3]["completed"] == [first[1].client_id] and records[3]["buffered"]["staleness"] == {"3": 1}
    assert fourth.round == 4


def test_a_kept_update_is_advertised_again_under_the_version_that_folds_it() -> None:
    """Under the buffered engine a process keeps each client's update until that client's version
    asks for keys bound to it; another client's advertise does not drop it."""
    from fedpart.client.mods.secure_aggregation import SecureStepError, SecureUpdates

    updates = SecureUpdates("run", buffered=True)
    first = updates.advertise(0, 3, {"w": torch.ones(2)})
    updates.advertise(1, 5, {"w": torch.zeros(2)})  # a later round of another client keeps client 0's
    assert updates.readvertise(0, 3) == first       # trained in the version that folds it: the same keys
    again = updates.readvertise(0, 6)
    assert again != first and updates.readvertise(0, 6) == again  # keys of round 6, given once
    with pytest.raises(SecureStepError, match="no kept update"):
        updates.readvertise(2, 6)
    synchronous = SecureUpdates("run")
    synchronous.advertise(0, 3, {"w": torch.ones(2)})
    synchronous.advertise(1, 4, {"w": torch.ones(2)})  # a synchronous round ends before the next: dropped
    with pytest.raises(SecureStepError):
        synchronous.readvertise(0, 4)


def test_compare_runs_each_algorithm_once_per_engine(tmp_path) -> None:
    from conftest import write_config
    from fedpart.cli.compare import parse_engines, plan_runs

    config = write_config(tmp_path / "config.yaml", small_config())
    planned = plan_runs(config, ["fedavg", "fedbabu"], ["buffered.concurrency=2"], tmp_path / "out", [0],
                        engines=parse_engines("sync,buffered"))
    assert [(p.label, p.out.relative_to(tmp_path / "out").as_posix()) for p in planned] == [
        ("fedavg sync seed 0", "fedavg/sync/seed0"), ("fedavg buffered seed 0", "fedavg/buffered/seed0"),
        ("fedbabu sync seed 0", "fedbabu/sync/seed0"), ("fedbabu buffered seed 0", "fedbabu/buffered/seed0")]
    assert [p.config.server.engine for p in planned] == ["sync", "buffered"] * 2
    for bad, message in (("sync,async", "round engines out of"), ("sync,sync", "none twice")):
        with pytest.raises(ConfigError, match=message):
            parse_engines(bad)
    with pytest.raises(ConfigError, match="--engines sets the round engine"):
        plan_runs(config, ["fedavg"], ["server.engine=sync"], tmp_path / "other", engines=["sync"])


def test_the_virtual_clock_says_what_to_fix_when_the_server_cannot_compute_the_partition(tmp_path) -> None:
    from fedpart.server.engine.coordinator import Coordinator
    from fedpart.server.engine.virtual_clock import VirtualClockError

    config = config_from_dict(small_config(data={"dataset": "mnist", "root": str(tmp_path)},
                                           heterogeneity={"clock": "virtual"}))
    with pytest.raises(VirtualClockError, match="give the server data.root, or set heterogeneity.clock: wall"):
        Coordinator(config, log=lambda line: None)
