"""Robust aggregation (the ``robust:`` section) against poisoned results.

Unit cases check the screening by hand (norm clip and reject, sample-count caps); protocol cases
drive hostile clients written against the proto (raw stubs) into an in-process server; the
end-to-end case runs a real ``fedpart server`` and a ``fedpart client`` for nine honest clients
while a hostile client in the test process hosts the tenth and poisons every round.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from conftest import (
    WAIT,
    Processes,
    fedpart_command,
    read_metrics,
    read_summary,
    small_config,
    start_server,
    write_config,
)
from fedpart.client.local_data import load_client_data
from fedpart.common.config import ConfigError, config_from_dict
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.protocol import PROTOCOL_VERSION
from fedpart.common.wire import decode_chunks, encode_chunks, make_spec
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.aggregation import CoordinateMedian, CoordinateTrimmedMean, WeightedMean
from fedpart.server.coordinator import Coordinator
from fedpart.server.main import start_grpc
from fedpart.server.robust import AggregationStep, ResultRefused, delta_norm, partition_train_sizes

BOUND = 60.0  # seconds: every wait in these tests is bounded
HUGE_SAMPLES = 2**62


def _step(clients: int = 10, train: dict | None = None, **robust) -> AggregationStep:
    overrides = {"train": train} if train else {}
    return AggregationStep(config_from_dict(small_config(clients=clients, robust=robust, **overrides)),
                           log=lambda line: None)


# ------------------------------------------------------------------------------------ unit cases


def test_delta_norm_is_over_all_tensors_of_a_result():
    assert delta_norm({"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0], [12.0]])}) == 13.0
    assert delta_norm({"a": torch.full((4,), 2.0**100)}) == 2.0**101  # squares overflow float32, not float64


def test_clip_scales_a_delta_down_to_the_bound():
    step = _step(norm_bound=1.0, norm_action="clip", partition_sizes=False)
    deltas = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # norm 5
    screened = step.screen(0, deltas, 100)
    assert screened.clipped and not screened.samples_capped
    assert screened.deltas["a"].tolist() == pytest.approx([0.6, 0.0])
    assert screened.deltas["b"].tolist() == pytest.approx([0.8])
    assert screened.deltas["a"].dtype == torch.float32
    assert delta_norm(screened.deltas) == pytest.approx(1.0, rel=1e-6)
    assert screened.notes == ("delta norm 5 exceeds robust.norm_bound 1; scaled down to it",)
    assert deltas["a"].tolist() == [3.0, 0.0], "the received tensors are not modified"


def test_a_delta_within_the_bound_is_passed_through_untouched():
    step = _step(norm_bound=5.0, norm_action="clip")
    deltas = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    screened = step.screen(0, deltas, 10)
    assert not screened.clipped and screened.notes == ()
    assert all(screened.deltas[n] is deltas[n] for n in deltas)


def test_reject_refuses_a_delta_over_the_bound_naming_norm_and_bound():
    step = _step(norm_bound=1.0, norm_action="reject")
    with pytest.raises(ResultRefused, match=r"delta norm 5 exceeds robust.norm_bound 1"):
        step.screen(0, {"a": torch.tensor([3.0, 4.0])}, 10)


def test_sample_counts_are_capped_at_the_partition_size_and_the_configured_cap():
    sizes = partition_train_sizes(config_from_dict(small_config(clients=10)))
    assert sizes == [144] * 8 + [143] * 2        # digits' 1,437 training samples over 10 clients (iid)
    step = _step()
    screened = step.screen(9, {"a": torch.ones(2)}, HUGE_SAMPLES)
    assert (screened.samples, screened.weight, screened.samples_capped) == (143, 143.0, True)
    assert screened.notes == (f"reported {HUGE_SAMPLES} training samples, more than the 143 it can have; "
                              "counted 143",)
    honest = step.screen(9, {"a": torch.ones(2)}, 143)
    assert (honest.samples, honest.samples_capped, honest.notes) == (143, False, ())
    assert _step(max_samples=100).screen(0, {}, 144).samples == 100                       # the lower cap wins
    assert _step(max_samples=1000).screen(0, {}, 5000).samples == 144
    assert _step(max_samples=100, partition_sizes=False).screen(0, {}, 5000).samples == 100
    assert _step(partition_sizes=False).screen(0, {}, HUGE_SAMPLES).samples == HUGE_SAMPLES  # no cap configured
    uniform = _step(train={"weighting": "uniform"}).screen(0, {"a": torch.ones(2)}, HUGE_SAMPLES)
    assert (uniform.samples, uniform.weight) == (144, 1.0)


def test_a_client_without_training_data_cannot_claim_samples():
    step = _step()
    step.partition_sizes[3] = 0
    with pytest.raises(ResultRefused, match="reported 7 training samples; client 3 has none"):
        step.screen(3, {"a": torch.ones(2)}, 7)


def test_the_servers_partition_sizes_match_what_the_clients_train_on():
    raw = small_config(clients=6, data={"dataset": "digits", "partition": {"scheme": "dirichlet", "alpha": 0.3}})
    config = config_from_dict(raw)
    sizes = partition_train_sizes(config)
    clients = load_client_data(config, list(range(6)), None, torch.device("cpu"))
    assert sizes == [clients[c].train_size for c in range(6)]
    assert len(set(sizes)) > 1


def test_without_the_dataset_the_server_says_so_and_falls_back_to_the_configured_cap(tmp_path):
    raw = small_config(data={"dataset": "mnist", "root": str(tmp_path), "partition": {"scheme": "iid"}},
                       robust={"max_samples": 600})
    lines: list[str] = []
    step = AggregationStep(config_from_dict(raw), log=lines.append)
    assert step.partition_sizes is None
    assert len(lines) == 1 and "cannot compute the partition" in lines[0] and "robust.max_samples (600)" in lines[0]
    assert step.screen(0, {}, HUGE_SAMPLES).samples == 600


@pytest.mark.parametrize("name, kind", [("mean", WeightedMean), ("median", CoordinateMedian),
                                        ("trimmed_mean", CoordinateTrimmedMean)])
def test_the_aggregator_is_chosen_from_config(name, kind):
    aggregator = _step(aggregator=name, trim_fraction=0.2).new_aggregator()
    assert type(aggregator.combiner) is kind


@pytest.mark.parametrize("robust, message", [
    ({"aggregator": "krum"}, "robust.aggregator must be"),
    ({"trim_fraction": 0.5}, "robust.trim_fraction must be in [0, 0.5)"),
    ({"norm_bound": -1}, "robust.norm_bound must be a finite number >= 0"),
    ({"norm_bound": float("inf")}, "robust.norm_bound must be a finite number >= 0"),
    ({"norm_action": "drop"}, "robust.norm_action must be 'clip' or 'reject'"),
    ({"max_samples": -5}, "robust.max_samples must be >= 0"),
    ({"max_samples": 1.5}, "robust.max_samples: expected an integer"),
    ({"bound": 3}, "unknown setting 'robust.bound'"),
])
def test_bad_robust_settings_name_the_key(robust, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict(small_config(robust=robust))
    assert message in str(error.value)


# ----------------------------------------------------------------- a client written against the proto


class RawClient:
    """A client process that speaks the protocol with raw stubs and hosts ``clients``."""

    def __init__(self, address: str, clients: list[int], name: str = "hostile") -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        reply = self.stub.Join(pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=name,
                                              clients=[pb.HostedClient(id=c) for c in clients]), timeout=BOUND)
        self.session = reply.session
        self.held: dict[str, int] = {}
        self.state: dict[str, torch.Tensor] = {}  # the global tensors as last received

    def next_task(self) -> pb.TaskHeader:
        """Long-poll until a task (or DONE) arrives; keeps the received tensors."""
        while True:
            request = pb.TaskRequest(session=self.session, held_versions=self.held, wait_seconds=BOUND / 4)
            header, tensors = decode_chunks(self.stub.GetTask(request, timeout=BOUND))
            if header.kind != pb.IDLE:
                self.state.update(tensors)
                self.held.update({spec.name: spec.version for spec in header.tensors})
                return header

    def submit(self, header: pb.TaskHeader, uploads: dict[str, torch.Tensor], samples: int,
               metrics: dict[str, float] | None = None) -> pb.SubmitReply:
        result = pb.ResultHeader(session=self.session, task_id=header.task_id, client_id=header.client_id,
                                 round=header.round, num_samples=samples, metrics=metrics or {"loss": 1.0},
                                 tensors=[make_spec(n, t) for n, t in uploads.items()])
        chunks: Iterator = encode_chunks(pb.ResultChunk, result, list(uploads.values()))
        return self.stub.SubmitResult(chunks, timeout=BOUND)

    def close(self) -> None:
        self.channel.close()


class InProcessServer:
    """A coordinator with its gRPC server on 127.0.0.1, driving rounds on a thread."""

    def __init__(self, **overrides) -> None:
        overrides.setdefault("server", {"round_timeout": 30, "heartbeat_timeout": 30})
        self.config = config_from_dict(small_config(**overrides))
        self.logs: list[str] = []
        self.coordinator = Coordinator(self.config, log=self.logs.append)
        self.initial = {k: v.clone() for k, v in self.coordinator.global_state.items()}
        self.server = start_grpc(self.coordinator, "127.0.0.1:0")
        self.address = self.server.address
        self.records: list[dict] = []
        self._thread = threading.Thread(target=self._drive, daemon=True)

    def _drive(self) -> None:
        self.coordinator.registry.wait_for_clients()
        for round_number in range(1, self.config.rounds + 1):
            self.records.append(self.coordinator.run_round(round_number))

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> None:
        self._thread.join(timeout=BOUND)
        assert not self._thread.is_alive(), "rounds did not finish in time"

    def moved(self, names) -> float:
        """L2 distance of the global tensors ``names`` from where they started."""
        return delta_norm({n: self.coordinator.global_state[n] - self.initial[n] for n in names})

    def close(self) -> None:
        self.coordinator.finish()
        self.server.stop(grace=None)


@pytest.fixture
def serve():
    made: list[tuple[InProcessServer, RawClient]] = []

    def make(clients: int, **overrides) -> tuple[InProcessServer, RawClient]:
        """A server for ``clients`` clients, all hosted by one raw client process."""
        server = InProcessServer(clients=clients, **overrides)
        made.append((server, RawClient(server.address, list(range(clients)))))
        return made[-1]

    yield make
    for server, client in made:
        client.close()
        server.close()


def _filled(header: pb.TaskHeader, state: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(state[n], value) for n in header.train.upload_deltas}


# ----------------------------------------------------------------------------------- protocol cases


def test_a_1e30_delta_is_clipped_to_the_norm_bound(serve):
    server, client = serve(1, rounds=1, robust={"norm_bound": 2.0, "norm_action": "clip"})
    server.start()
    header = client.next_task()
    assert client.submit(header, _filled(header, client.state, 1e30), 10).accepted
    server.wait()
    assert server.moved(header.train.upload_deltas) == pytest.approx(2.0, rel=1e-5)
    assert server.records[0]["robust"] == {"clipped": 1, "rejected": 0, "samples_capped": 0, "non_finite": []}
    assert any(line.startswith("warning: round 1 client 0: delta norm") and "exceeds robust.norm_bound 2;" in line
               for line in server.logs)
    assert server.coordinator.failures == []


def test_a_delta_over_the_bound_is_rejected_and_changes_nothing(serve):
    server, client = serve(1, rounds=1, robust={"norm_bound": 2.0, "norm_action": "reject"})
    server.start()
    header = client.next_task()
    uploads = _filled(header, client.state, 3.0)
    with pytest.raises(grpc.RpcError) as error:
        client.submit(header, uploads, 10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"delta norm {delta_norm(uploads):.6g} exceeds robust.norm_bound 2" in error.value.details()
    server.wait()
    record = server.records[0]
    assert record["completed"] == [] and record["robust"]["rejected"] == 1
    assert all(torch.equal(server.initial[k], v) for k, v in server.coordinator.global_state.items())
    assert any("exceeds robust.norm_bound" in failure for failure in server.coordinator.failures)


@pytest.mark.parametrize("partition_sizes", [False, True], ids=["uncapped", "capped"])
def test_a_huge_sample_count_cannot_zero_the_body(serve, partition_sizes):
    """Client 1 sends minus the global model and claims 2^62 samples; client 0 sends nothing new."""
    server, client = serve(2, rounds=1, robust={"partition_sizes": partition_sizes})
    server.start()
    sizes = partition_train_sizes(server.config)
    for _ in range(2):
        header = client.next_task()
        if header.client_id == 1:
            client.submit(header, {n: -client.state[n] for n in header.train.upload_deltas}, HUGE_SAMPLES)
        else:
            client.submit(header, _filled(header, client.state, 0.0), sizes[0])
    server.wait()
    record = server.records[0]
    weight = server.initial["body.fc1.1.weight"]
    got = server.coordinator.global_state["body.fc1.1.weight"]
    if partition_sizes:
        assert torch.allclose(got, weight * (sizes[0] / (sizes[0] + sizes[1])), rtol=1e-6, atol=0)
        assert record["robust"]["samples_capped"] == 1 and record["train_samples"] == sum(sizes)
        assert any(f"reported {HUGE_SAMPLES} training samples" in line for line in server.logs)
    else:
        assert float(got.abs().max()) < 1e-12 * float(weight.abs().max()), "the attack works without the cap"
        assert record["robust"]["samples_capped"] == 0


@pytest.mark.parametrize("aggregator", ["mean", "median"])
def test_a_non_finite_aggregate_is_never_installed(serve, aggregator):
    """float32's largest value with server_optimizer.lr 2 overflows the new global; the old tensor stays."""
    server, client = serve(1, rounds=2, train={"lr": 0.05}, server_optimizer={"lr": 2.0},
                           robust={"aggregator": aggregator})
    server.start()
    header = client.next_task()
    client.submit(header, _filled(header, client.state, torch.finfo(torch.float32).max), 10)
    header = client.next_task()
    assert header.round == 2
    assert client.submit(header, _filled(header, client.state, 0.25), 10).accepted
    server.wait()
    names = sorted(header.train.upload_deltas)
    assert server.records[0]["robust"]["non_finite"] == names
    assert server.records[1]["robust"]["non_finite"] == []
    state = server.coordinator.global_state
    assert all(torch.equal(state[n], server.initial[n] + 0.5) for n in names), "round 2 applied to the kept tensors"
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    assert sum("is not finite; its previous value is kept" in f for f in server.coordinator.failures) == len(names)
    assert any(line.startswith("error: round 1: the aggregated") for line in server.logs)


def test_median_and_clip_compose_with_collected_heads(serve):
    """FedFTHA uploads its head whole into the head dictionary; the body delta is clipped and the
    heads are combined by the median."""
    server, client = serve(1, rounds=1, algorithm={"name": "fedftha", "tau_sync": 1, "tau_head": 1},
                           robust={"aggregator": "median", "norm_bound": 1.0})
    server.start()
    header = client.next_task()
    assert set(header.train.upload_values) == {"head.weight", "head.bias"}
    uploads = _filled(header, client.state, 5.0)
    head = {n: torch.full_like(server.initial[n], 0.5) for n in header.train.upload_values}
    assert client.submit(header, {**uploads, **head}, 10).accepted
    server.wait()
    assert server.moved(header.train.upload_deltas) == pytest.approx(1.0, rel=1e-5)
    assert all(torch.equal(server.coordinator.global_state[n], head[n]) for n in head)
    assert server.records[0]["robust"]["clipped"] == 1


# ----------------------------------------------------------------------------------- end to end

ATTACKER = 9
ATTACK_SCALE = 1e6
# Per-coordinate size of the attacker's base delta: over the mlp's 3,466 parameters a norm of
# about 0.6, where the honest clients' deltas have norms of 0.7 to 4 in this run.
PLAUSIBLE_STEP = 0.01


def _poisoning_config(robust: dict) -> dict:
    return small_config(
        clients=10, rounds=8, processes=1,
        train={"epochs": 2, "batch_size": 20, "lr": 0.2, "momentum": 0.5},
        evaluate={"finetune_epochs": [1], "batch_size": 50},
        robust=robust,
    )


def _attack(address: str, config: dict, errors: list[BaseException]) -> None:
    """Host client 9 and send 1e6 x a plausible delta (seeded noise of an honest update's size)
    every round; answer the final evaluation with counts that match the partition."""
    try:
        dataset = load_dataset("digits", None)
        split = make_partition(dataset.y_train, dataset.y_test, config["clients"], "iid", config["seed"],
                               num_classes=dataset.num_classes)[ATTACKER]
        client = RawClient(address, [ATTACKER], name="attacker")
        generator = torch.Generator().manual_seed(1)
        try:
            while True:
                header = client.next_task()
                if header.kind == pb.DONE:
                    return
                if header.kind == pb.TRAIN:
                    uploads = {n: torch.randn(client.state[n].shape, generator=generator)
                               * (PLAUSIBLE_STEP * ATTACK_SCALE) for n in header.train.upload_deltas}
                    try:
                        client.submit(header, uploads, len(split.train))
                    except grpc.RpcError as error:  # refused: try again next round
                        if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                            raise
                else:
                    metrics = {"train_samples": len(split.train), "test_samples": len(split.test),
                               "initial_acc": 0.1, "initial_loss": 2.3, "finetune_1_acc": 0.1, "finetune_1_loss": 2.3}
                    client.submit(header, {}, 0, metrics)
        finally:
            client.close()
    except BaseException as error:  # noqa: BLE001 - reported by the test thread
        errors.append(error)


def _run(tmp_path: Path, processes, name: str, robust: dict, attacked: bool) -> tuple[dict, list[dict], str]:
    """A real server and one client process (clients 0-8, or 0-9 when not attacked)."""
    config = _poisoning_config(robust)
    out = tmp_path / name
    server, reader, address = start_server(processes, write_config(tmp_path / f"{name}.yaml", config), out)
    honest = "0-8" if attacked else "0-9"
    processes.start(fedpart_command("client", "--server", address, "--clients", honest, "--threads", "1",
                                    "--state-dir", str(tmp_path / f"{name}-state")),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    errors: list[BaseException] = []
    attacker = threading.Thread(target=_attack, args=(address, config, errors), daemon=True)
    if attacked:
        attacker.start()
    log = reader.rest(timeout=WAIT)
    server.wait(timeout=WAIT)
    if attacked:
        attacker.join(timeout=BOUND)
        assert not attacker.is_alive() and errors == [], errors
    assert (out / "summary.json").is_file(), log
    return read_summary(out), read_metrics(out), log


@pytest.fixture(scope="module")
def clean_accuracy(tmp_path_factory) -> float:
    processes = Processes()
    try:
        summary, _, log = _run(tmp_path_factory.mktemp("clean"), processes, "clean", {}, attacked=False)
    finally:
        processes.stop_all()
    assert summary["failures"] == [], log
    return summary["accuracy"]["global"]["acc"]


@pytest.mark.slow
@pytest.mark.parametrize("defence", ["none", "clip", "median"])
def test_one_attacker_in_ten(tmp_path, processes, clean_accuracy, defence):
    """Without a defence one attacker in ten wrecks global accuracy; a norm clip or the median
    keeps it within a few points of the clean run."""
    robust = {"none": {}, "clip": {"norm_bound": 5.0}, "median": {"aggregator": "median"}}[defence]
    summary, metrics, log = _run(tmp_path, processes, defence, robust, attacked=True)
    accuracy = summary["accuracy"]["global"]["acc"]
    print(f"global accuracy: clean {clean_accuracy:.3f}, attacked with defence {defence!r} {accuracy:.3f}")
    assert clean_accuracy > 0.8
    if defence == "none":
        assert accuracy < clean_accuracy - 0.3
        return
    assert accuracy > clean_accuracy - 0.05
    assert summary["failures"] == [], summary["failures"]
    clipped = [record["robust"]["clipped"] for record in metrics]
    if defence == "clip":
        assert all(count >= 1 for count in clipped), clipped
        assert f"warning: round 1 client {ATTACKER}: delta norm" in log
    else:
        assert clipped == [0] * len(metrics)
