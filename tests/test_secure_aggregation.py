"""Secure aggregation in the round (docs/privacy.md): the server receives keys, sealed shares and
masked updates, never one client's update, and moves the model by their weighted mean within the
quantization bound; clients that drop out after sharing or after masking do not stop the round;
too few survivors fail the round clearly and keep the model; the config check refuses what a sum
cannot serve. The in-process cases drive the coordinator with clients written against
``fedpart.common.privacy.secagg`` (not our client runtime); the end-to-end case runs real processes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from conftest import (
    WAIT,
    fedpart_command,
    poll_task,
    read_metrics,
    read_summary,
    run_fedpart,
    small_config,
    start_server,
    write_config,
)
from fedpart.common.process.checkpoint import load_tensors
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.wire.plans import HostedClient, JoinInfo, ResultInfo, SecAggAnswer, SecAggStage, TaskKind
from fedpart.common.wire.protocol import PROTOCOL_VERSION, Rejected
from fedpart.common.privacy.secagg import ClientParty, quantize, round_tag
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.engine.task_board import Task

BOUND = 60.0
CLIENTS = 6


class SimulatedClient:
    """One client in a process of its own, answering the round's steps with a fixed update; a
    ``lie`` of ``"garbage-shares"`` seals random bytes to its neighbours, ``"alter-share"`` adds 1
    to one share it reveals (of the lowest other survivor's seed)."""

    def __init__(self, coordinator: Coordinator, client: int, update: dict[str, torch.Tensor], samples: int,
                 lie: str | None = None) -> None:
        self.coordinator = coordinator
        self.client = client
        self.update = update
        self.samples = samples
        self.lie = lie
        self.session = coordinator.join(JoinInfo(protocol=PROTOCOL_VERSION, process_name=f"p{client}",
                                                 clients=(HostedClient(client),)))
        self.party: ClientParty | None = None
        self.quantized: np.ndarray | None = None

    def answer_next(self) -> tuple[Task, ResultInfo, dict[str, torch.Tensor]]:
        task = poll_task(self.coordinator, self.session, wait=BOUND)
        assert task is not None
        step = task.secagg
        tensors: dict[str, torch.Tensor] = {}
        secagg = None
        if task.kind == TaskKind.TRAIN:
            assert step.stage == SecAggStage.ADVERTISE
            self.party = ClientParty(self.client, round_tag(self.coordinator.run_id, task.round))
            cipher, mask = self.party.public_keys()
            secagg = SecAggAnswer(cipher_key=cipher, mask_key=mask, seed_commitment=self.party.seed_commitment())
        elif step.stage == SecAggStage.SHARE:
            dealt = self.party.share(step.peers, step.threshold)
            sealed = dealt.sealed
            if self.lie == "garbage-shares":
                sealed = {v: bytes(len(box)) for v, box in sealed.items()}
            secagg = SecAggAnswer(sealed=sealed, commitments=dealt.commitments)
        elif step.stage == SecAggStage.CHECK:
            secagg = SecAggAnswer(disputed=tuple(self.party.check(step.sealed, step.commitments)))
        elif step.stage == SecAggStage.MASK:
            flat = np.concatenate([t.reshape(-1).numpy() for t in self.update.values()])
            self.quantized = quantize(flat, step.bound, step.step, step.weight)
            masked = torch.from_numpy(self.party.masked(self.quantized, step.mask_with).view(np.int32))
            start = 0
            for name, tensor in self.update.items():
                tensors[name] = masked[start:start + tensor.numel()].reshape(tensor.shape).clone()
                start += tensor.numel()
        else:
            revealed = self.party.reveal(step.survivors, step.dropped)
            others = [u for u in step.survivors if u != self.client]
            if self.lie == "alter-share":
                revealed[others[0]] = revealed[others[0]][:-1] + bytes([revealed[others[0]][-1] ^ 1])
            secagg = SecAggAnswer(revealed=revealed)
        result = ResultInfo(self.session, task.task_id, self.client, task.round, num_samples=self.samples,
                            metrics={"loss": 1.0}, secagg=secagg)
        return task, result, tensors

    def step(self, received: list[dict[str, torch.Tensor]]) -> Task:
        task, result, tensors = self.answer_next()
        received.append(tensors)
        self.coordinator.accept(task, result, tensors)
        return task

    def leave(self) -> None:
        self.coordinator.registry.leave(self.session, "killed")


def _coordinator(train: dict | None = None, **privacy) -> Coordinator:
    config = small_config(clients=CLIENTS, rounds=1, model={"name": "mlp", "hidden": 8},
                          privacy={"secure_aggregation": True, **privacy})
    config["train"].update(train or {})
    return Coordinator(config_from_dict(config), log=lambda message: None)


def _clients(coordinator: Coordinator) -> list[SimulatedClient]:
    generator = torch.Generator().manual_seed(3)
    uploads = coordinator.round_plan(1, 0).upload_deltas
    clients = []
    for c in range(CLIENTS):
        update = {n: (torch.rand(coordinator.global_state[n].shape, generator=generator) - 0.5) for n in uploads}
        clients.append(SimulatedClient(coordinator, c, update, samples=10 + 7 * c))
    return clients


def _run(coordinator: Coordinator, clients: list[SimulatedClient], drop_before_mask: set[int] = frozenset(),
         drop_after_mask: set[int] = frozenset(), left_out: set[int] = frozenset()
         ) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """One round: every client trains, shares and checks; ``drop_before_mask`` leave before
    masking, ``drop_after_mask`` before unmasking; ``left_out`` are not asked to mask (the server
    dropped them at CHECK). Returns the round's record and every tensor received."""
    records: list[dict] = []
    worker = threading.Thread(target=lambda: records.append(coordinator.run_round(1).to_json()), daemon=True)
    worker.start()
    received: list[dict[str, torch.Tensor]] = []
    gone: set[int] = set()
    for stage in ("train", "share", "check", "mask", "unmask"):
        for client in clients:
            if client.client in gone or (stage in ("mask", "unmask") and client.client in left_out):
                continue
            if (stage, client.client in drop_before_mask, client.client in drop_after_mask) in (
                    ("mask", True, False), ("unmask", False, True)):
                client.leave()
                gone.add(client.client)
                continue
            client.step(received)
    worker.join(BOUND)
    assert records, "the round did not end"
    return records[0], received


def _weighted_mean(clients: list[SimulatedClient], bound: float) -> dict[str, torch.Tensor]:
    total = sum(c.samples for c in clients)
    names = clients[0].update
    return {n: sum(c.update[n].double().clamp(-bound, bound) * c.samples for c in clients) / total for n in names}


def _moved(coordinator: Coordinator, before: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    return {n: coordinator.global_state[n].double() - before[n].double() for n in names}


def _max_error(moved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((moved[n] - expected[n]).abs().max()) for n in expected)


def test_the_server_sees_only_masked_updates_and_moves_the_model_by_their_weighted_mean(one_torch_thread) -> None:
    coordinator = _coordinator()
    clients = _clients(coordinator)
    before = {n: t.clone() for n, t in coordinator.global_state.items()}
    record, received = _run(coordinator, clients)
    assert record["completed"] == list(range(CLIENTS)) and coordinator.failures == []
    masked = [tensors for tensors in received if tensors]
    assert len(masked) == CLIENTS  # only the MASK step carries tensors: training results carry keys alone
    for tensors, client in zip(masked, clients):
        flat = np.concatenate([t.reshape(-1).numpy().view(np.uint32) for t in tensors.values()])
        assert all(t.dtype == torch.int32 for t in tensors.values())
        assert not np.array_equal(flat, client.quantized)
        near = np.abs(flat.astype(np.int64) - client.quantized.astype(np.int64)) < 2 ** 20
        assert near.mean() < 0.01  # a masked element is uniform on the ring, not near the one it hides
    step = 1.0 / ((2 ** 31 - 1) // sum(c.samples for c in clients))
    error = _max_error(_moved(coordinator, before, clients[0].update), _weighted_mean(clients, 1.0))
    assert error <= step / 2 + 1e-6  # the quantization bound, plus float32 rounding of the new model


def test_clients_that_drop_after_sharing_or_after_masking_do_not_stop_the_round(one_torch_thread) -> None:
    """Client 1 leaves before masking (its update is out, its pairwise masks are removed from the
    others'); client 4 leaves after masking (its update is in, its self mask is removed from the
    shares the others reveal)."""
    coordinator = _coordinator()
    clients = _clients(coordinator)
    before = {n: t.clone() for n, t in coordinator.global_state.items()}
    record, _ = _run(coordinator, clients, drop_before_mask={1}, drop_after_mask={4})
    assert record["completed"] == [0, 2, 3, 4, 5]
    assert not [line for line in coordinator.failures if "secure aggregation" in line]
    kept = [c for c in clients if c.client != 1]
    error = _max_error(_moved(coordinator, before, clients[0].update), _weighted_mean(kept, 1.0))
    assert error <= 1e-5


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_with_dp_the_server_noises_the_unmasked_sum_over_the_fixed_denominator(one_torch_thread, noise) -> None:
    """DP-FedAvg over secure aggregation: every result weighs 1, the noise goes on the unmasked sum,
    which is divided by the expected number of clients (all 6 here)."""
    dp = {"enabled": True, "noise_multiplier": noise, "clip_norm": 1.0, "noise_seed": 5}
    coordinator = _coordinator(train={"weighting": "uniform"}, dp=dp)
    clients = _clients(coordinator)
    before = {n: t.clone() for n, t in coordinator.global_state.items()}
    _run(coordinator, clients)
    names = clients[0].update
    expected = {n: sum(c.update[n].double().clamp(-1, 1) for c in clients) / CLIENTS for n in names}
    error = _max_error(_moved(coordinator, before, names), expected)
    if noise:
        assert error > 0.1  # noise of standard deviation 1/6 on every coordinate
    else:
        assert error <= 1e-6


@pytest.mark.parametrize("lie", ["garbage-shares", "alter-share"])
def test_one_lying_client_is_named_alone_and_the_round_is_exact(one_torch_thread, lie) -> None:
    """Client 2 seals random bytes to its neighbours (each of them disputes it at CHECK, it is
    dropped before masking and the mean is the others'), or alters a share it reveals (it is
    ignored and the mean is everyone's). Either way only client 2 is named, as a failure."""
    coordinator = _coordinator()
    clients = _clients(coordinator)
    clients[2].lie = lie
    before = {n: t.clone() for n, t in coordinator.global_state.items()}
    record, _ = _run(coordinator, clients, left_out={2} if lie == "garbage-shares" else set())
    counted = [c for c in clients if lie == "alter-share" or c.client != 2]
    assert record["completed"] == [c.client for c in counted]
    assert len(coordinator.failures) == 1
    assert re.findall(r"\bclients? \[?(\d+(?:, \d+)*)", coordinator.failures[0]) in (["2"], ["2", "2"])
    error = _max_error(_moved(coordinator, before, clients[0].update), _weighted_mean(counted, 1.0))
    assert error <= 1e-5


def test_too_few_survivors_fail_the_round_clearly_and_keep_the_model(one_torch_thread) -> None:
    coordinator = _coordinator(secure_aggregation_threshold=5)
    clients = _clients(coordinator)
    before = {n: t.clone() for n, t in coordinator.global_state.items()}
    record, _ = _run(coordinator, clients, drop_after_mask={0, 1})
    assert record["completed"] == []
    assert any("secure aggregation failed" in line and "unmasking failed" in line for line in coordinator.failures)
    assert all(torch.equal(coordinator.global_state[n], before[n]) for n in before)


def test_a_malformed_answer_is_refused_and_changes_nothing(one_torch_thread) -> None:
    coordinator = _coordinator()
    clients = _clients(coordinator)
    worker = threading.Thread(target=lambda: coordinator.run_round(1), daemon=True)
    worker.start()
    task, result, _ = clients[0].answer_next()
    short = ResultInfo(result.session, result.task_id, 0, 1, num_samples=10,
                       secagg=SecAggAnswer(cipher_key=b"x" * 31, mask_key=b"y" * 32))
    with pytest.raises(Rejected, match="32 bytes"):
        coordinator.accept(task, short, {})
    coordinator.accept(task, result, {})  # the well-formed answer is still taken
    for client in clients:
        client.leave()
    worker.join(BOUND)


@pytest.mark.parametrize("override, reason", [
    ({"robust": {"aggregator": "median"}}, "robust.aggregator"),
    ({"robust": {"norm_bound": 1.0}}, "robust.norm_bound"),
    ({"compression": {"up": {"codec": "topk", "options": {"fraction": 0.1}}}}, "compression.up"),
    ({"algorithm": {"name": "fedftha"}}, "per-client dictionary"),
    ({"server_optimizer": {"name": "fedexp"}}, "fedexp"),
    ({"clients": 1}, "fewer than 2 clients"),
])
def test_the_config_check_refuses_what_a_sum_cannot_serve(override, reason) -> None:
    config = small_config(privacy={"secure_aggregation": True})
    config.update(override)
    with pytest.raises(ConfigError, match=reason):
        config_from_dict(config)


def test_bad_secure_aggregation_keys_are_refused() -> None:
    for privacy, reason in [({"secure_aggregation_threshold": 1}, "threshold"),
                            ({"secure_aggregation_bound": 0}, "bound"),
                            ({"secure_aggregation_neighbours": 1}, "neighbours")]:
        with pytest.raises(ConfigError, match=reason):
            config_from_dict(small_config(privacy={"secure_aggregation": True, **privacy}))


def _final_model(tmp_path, name: str, **privacy) -> tuple[dict[str, torch.Tensor], dict]:
    config = small_config(rounds=1, clients=4, evaluate={"finetune_epochs": [1], "batch_size": 50}, privacy=privacy)
    run, out = run_fedpart(config, tmp_path, name=name)
    assert run.returncode == 0, run.stdout + run.stderr
    return load_tensors(out / "checkpoints" / "round_0001.safetensors"), read_summary(out)


def test_a_real_run_under_secure_aggregation_matches_the_plain_run_within_the_bound(tmp_path) -> None:
    plain, plain_summary = _final_model(tmp_path, "plain")
    secure, summary = _final_model(tmp_path, "secure", secure_aggregation=True)
    body = [n for n in plain if n.startswith("body.")]
    assert body and max(float((plain[n] - secure[n]).abs().max()) for n in body) <= 1e-5
    assert summary["bytes"]["by_part"]["secagg"]["up"] > 0
    logical, plain_logical = summary["bytes"]["logical"]["by_part"], plain_summary["bytes"]["logical"]["by_part"]
    assert logical["secagg"]["up"] > 0 and logical["secagg"]["down"] > 0
    # the steps carry no model: the model's logical bytes are the plain run's, and the masked
    # update is as large as the plain one
    assert logical["body"] == plain_logical["body"] and logical["head"] == plain_logical["head"]


# A real client process that SIGKILLs itself once the server has taken its first masked update:
# its clients have masked, and drop out before the unmasking step.
KILLED_AFTER_MASKING = """
import os
import signal
import sys

from fedpart.client.runtime import ClientProcess

server, clients, state_dir = sys.argv[1:]


class KilledAfterMasking(ClientProcess):
    def _setup(self, reply):
        super()._setup(reply)
        execute = self._execute_with_mods

        def killed_once_masked(task):
            answer = execute(task)
            if task.kind.name == "SECAGG" and task.secagg.stage.name == "MASK":
                answer.on_taken.append(lambda: os.kill(os.getpid(), signal.SIGKILL))
            return answer

        self._execute_with_mods = killed_once_masked


sys.exit(KilledAfterMasking(server, [int(c) for c in clients.split(",")], state_dir=state_dir, threads=1).run())
"""


def test_a_client_process_killed_after_masking_does_not_stop_the_round(tmp_path, processes) -> None:
    """Clients 0-3 in a fedpart client process; client 4 in a process that is SIGKILLed once its
    masked update was taken. The round unmasks with the shares of the others as soon as the
    server sees the process gone (its heartbeats stop), well before server.round_timeout."""
    config = small_config(clients=5, rounds=1, processes=1, evaluate={"finetune_epochs": [1], "batch_size": 50},
                          privacy={"secure_aggregation": True},
                          server={"round_timeout": 600, "join_timeout": WAIT, "heartbeat_timeout": 4})
    out = tmp_path / "run"
    server, reader, address = start_server(processes, write_config(tmp_path / "run.yaml", config), out)
    honest = processes.start(fedpart_command("client", "--insecure", "--server", address, "--clients", "0-3", "--threads", "1",
                                             "--state-dir", str(tmp_path / "state")),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = processes.start([sys.executable, "-c", KILLED_AFTER_MASKING, address, "4", str(tmp_path / "killed")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reader.wait_for(r"round\s+1/1", timeout=WAIT)  # printed once the round's record is written
    assert killed.wait(timeout=WAIT) == -signal.SIGKILL
    record = read_metrics(out)[0]
    assert record["completed"] == [0, 1, 2, 3, 4], "".join(reader.lines)  # client 4's masked update is in
    assert record["seconds"] < 120  # server.round_timeout is 600 s
    assert "secure aggregation failed" not in "".join(reader.lines)
    assert honest.poll() is None  # the run goes on to the final evaluation (client 4 is gone: not awaited here)
