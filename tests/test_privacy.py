"""User-level differential privacy, DP-FedAvg (McMahan et al., ICLR 2018): the clip on both sides,
the noised sum with its fixed denominator, the budget from Google's dp-accounting for the
sampling actually used, the refusals of the config check, and whole runs."""

from __future__ import annotations

import math
import sys

import dp_accounting
import pytest
import torch

from conftest import read_metrics, read_summary, run_fedpart, small_config
from fedpart.common.process.checkpoint import load_tensors
from fedpart.common.config.run_config import ConfigError, check_dp_accounting, config_from_dict
from fedpart.common.privacy.clipping import clip_deltas, joint_norm
from fedpart.common.process.records import RoundPrivacy
from fedpart.server.policy.privacy import DifferentialPrivacy, NoisedSum, PrivacyBudget
from fedpart.server.policy import build_policy
from fedpart.server.policy.screening import RobustScreening
from fedpart.server.engine.sampling import expected_clients, sample_clients
from test_robust import InProcessServer, RawClient, _filled


def _dp_config(dp: dict | None = None, **overrides) -> dict:
    """small_config with privacy.dp on (uniform weighting, as DP-FedAvg needs)."""
    train = {**small_config()["train"], "weighting": "uniform"}
    return small_config(train=train, privacy={"dp": {"enabled": True, **(dp or {})}}, **overrides)


def _library_epsilon(relation, event, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon as dp-accounting computes it, independently of fedpart's code."""
    if accountant == "pld":
        library = dp_accounting.pld.PLDAccountant()
    else:
        library = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    library.compose(event, rounds)
    return library.get_epsilon(delta)


def _poisson(q: float, z: float):
    return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, \
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


def _fixed(clients: int, sample: int, z: float):
    """Replace-one adjacency: swapping one client's clipped update moves the sum by up to 2C."""
    return dp_accounting.NeighboringRelation.REPLACE_ONE, \
        dp_accounting.SampledWithoutReplacementDpEvent(clients, sample, dp_accounting.GaussianDpEvent(z / 2))


# ------------------------------------------------------------------------------------ clipping


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("clip_norm", [1e-3, 0.5, 7.0])
def test_clipping_bounds_the_joint_norm_and_keeps_the_direction(dtype, clip_norm):
    generator = torch.Generator().manual_seed(3)
    deltas = {"body.0.weight": torch.randn(64, 32, generator=generator).to(dtype) * 5,
              "head.bias": torch.randn(10, generator=generator).to(dtype) * 5}
    clipped, norm = clip_deltas(deltas, clip_norm)
    assert norm == pytest.approx(joint_norm(deltas))
    assert norm > clip_norm
    assert joint_norm(clipped) <= clip_norm
    assert joint_norm(clipped) == pytest.approx(clip_norm, rel=2 * torch.finfo(dtype).eps + 1e-6)
    for name, tensor in deltas.items():
        assert clipped[name].dtype == dtype
        cosine = torch.nn.functional.cosine_similarity(clipped[name].double().flatten(), tensor.double().flatten(), dim=0)
        assert float(cosine) > 0.99


def test_an_update_within_the_clip_is_not_touched():
    deltas = {"a": torch.tensor([0.3, 0.4]), "b": torch.tensor([0.0])}
    clipped, norm = clip_deltas(deltas, 1.0)
    assert norm == pytest.approx(0.5)
    assert all(clipped[n] is deltas[n] for n in deltas)


def test_a_non_finite_update_cannot_be_clipped():
    with pytest.raises(ValueError, match="cannot be clipped"):
        clip_deltas({"a": torch.tensor([1.0, float("inf")])}, 1.0)


def test_the_server_clips_a_result_that_ignored_the_clip():
    step = build_policy(config_from_dict(_dp_config({"clip_norm": 2.0, "noise_multiplier": 0.0})), log=lambda _: None)
    assert step.find(RobustScreening).adaptive_bound is None  # the clip is the bound under DP
    hostile = {"body.0.weight": torch.full((32, 64), 1e6)}
    screened = step.screen(0, hostile, 10)
    assert screened.clipped and screened.weight == 1.0
    assert joint_norm(screened.deltas) <= 2.0
    assert any("exceeds privacy.dp.clip_norm 2; clipped to it on the server" in note for note in screened.notes)
    honest, _ = clip_deltas({"body.0.weight": torch.randn(32, 64)}, 2.0)
    assert not step.screen(0, honest, 10).clipped


@pytest.fixture
def hostile_run():
    """An in-process server with privacy.dp (clip 0.5, no noise) for one client, hosted by a raw
    client process written against the proto, which need not clip."""
    server = InProcessServer(clients=1, rounds=1, train=_dp_config()["train"],
                             privacy={"dp": {"enabled": True, "clip_norm": 0.5, "noise_multiplier": 0.0}})
    client = RawClient(server.address, [0])
    yield server, client
    client.close()
    server.close()


def test_a_hostile_client_moves_the_model_by_at_most_the_clip(hostile_run):
    """A client that sends a 1e30 delta through the protocol: the server clips it to C and the
    noise-free mean over the fixed denominator (one client of one) moves the model by C."""
    server, client = hostile_run
    server.start()
    header = client.next_task()
    assert client.submit(header, _filled(header, client.state, 1e30), 10).accepted
    server.wait()
    assert server.moved(header.train.upload_deltas) == pytest.approx(0.5, rel=1e-5)
    assert server.moved(header.train.upload_deltas) <= 0.5 * (1 + 1e-6)
    assert server.records[0].robust.clipped == 1
    assert server.records[0].privacy == RoundPrivacy(epsilon=None)  # no noise: no guarantee


# ------------------------------------------------------------------------------------ the noised sum


def test_the_noised_sum_divides_by_the_fixed_denominator():
    reference = {"w": torch.zeros(3), "v": torch.zeros(2)}
    noised = NoisedSum(reference, std=0.0, denominator=4.0, generator=torch.Generator().manual_seed(0))
    noised.add({"w": torch.tensor([1.0, 2.0, 3.0])}, 1.0)
    noised.add({"w": torch.tensor([1.0, 0.0, 1.0]), "v": torch.tensor([4.0, 4.0])}, 1.0)
    result = noised.result()
    assert torch.equal(result["w"], torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64))
    assert torch.equal(result["v"], torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert noised.counts() == {"w": 2, "v": 1}
    with pytest.raises(ValueError, match="weighs every result 1"):
        noised.add({"w": torch.ones(3)}, 2.0)


def test_an_empty_round_releases_noise_of_the_configured_scale():
    std, denominator = 1.5, 3.0
    noised = NoisedSum({"w": torch.zeros(200_000)}, std, denominator, torch.Generator().manual_seed(1))
    result = noised.result()["w"]
    assert float(result.mean()) == pytest.approx(0.0, abs=5 * std / denominator / math.sqrt(200_000))
    assert float(result.std()) == pytest.approx(std / denominator, rel=0.01)


def test_the_noise_of_a_round_depends_on_the_seed_and_the_round_only():
    privacy = DifferentialPrivacy(config_from_dict(_dp_config({"noise_seed": 7})), log=lambda _: None)
    again = DifferentialPrivacy(config_from_dict(_dp_config({"noise_seed": 7})), log=lambda _: None)

    def draw(source: DifferentialPrivacy, round_number: int) -> torch.Tensor:
        return torch.randn(5, generator=source.round_generator(round_number))

    assert torch.equal(draw(privacy, 3), draw(again, 3))
    assert not torch.equal(draw(privacy, 3), draw(privacy, 4))
    secret = DifferentialPrivacy(config_from_dict(_dp_config()), log=lambda _: None)
    assert not torch.equal(draw(secret, 3), draw(privacy, 3))


def test_poisson_sampling_is_independent_and_may_be_empty():
    sizes = [len(sample_clients(10, r, seed=2, fraction=0.1, scheme="poisson")) for r in range(1, 2001)]
    assert sizes.count(0) > 0
    assert sum(sizes) / len(sizes) == pytest.approx(1.0, abs=0.1)  # q N = 1; std of the mean ~0.02
    assert expected_clients(10, 0.1, "poisson") == pytest.approx(1.0)
    assert expected_clients(10, 0.25, "fixed") == 2.0


# ------------------------------------------------------------------------------------ the budget


@pytest.mark.parametrize("scheme, accountant", [("poisson", "rdp"), ("poisson", "pld"), ("fixed", "rdp")])
def test_the_budget_is_dp_accountings_for_the_sampling_used(scheme, accountant):
    config = config_from_dict(_dp_config({"noise_multiplier": 1.3, "accountant": accountant}, clients=20,
                                         sampling={"scheme": scheme, "fraction": 0.25}))
    budget = PrivacyBudget(config)
    delta = 1 / 20 ** 1.1
    relation, event = _poisson(0.25, 1.3) if scheme == "poisson" else _fixed(20, 5, 1.3)
    for rounds in (1, 4):
        assert budget.epsilon(rounds) == _library_epsilon(relation, event, rounds, delta, accountant)
    assert budget.epsilon(0) == 0.0


def test_target_epsilon_allows_the_rounds_within_it():
    config = config_from_dict(_dp_config({"noise_multiplier": 1.0, "target_epsilon": 2.0}, rounds=50, clients=20,
                                         sampling={"scheme": "poisson", "fraction": 0.25}))
    privacy = DifferentialPrivacy(config, log=lambda _: None)
    relation, event = _poisson(0.25, 1.0)
    delta = 1 / 20 ** 1.1
    allowed = privacy.rounds
    assert 0 < allowed < 50
    assert _library_epsilon(relation, event, allowed, delta) <= 2.0 < _library_epsilon(relation, event, allowed + 1, delta)
    assert f"stopped after round {allowed} of 50" in privacy.stop_note()
    with pytest.raises(ConfigError, match="below the epsilon of a single round"):
        DifferentialPrivacy(config_from_dict(_dp_config({"noise_multiplier": 0.5, "target_epsilon": 0.01})),
                            log=lambda _: None)


# ------------------------------------------------------------------------------------ the config check


@pytest.mark.parametrize("overrides, reason", [
    ({"train": {"weighting": "samples"}}, "set train.weighting: uniform"),
    ({"robust": {"aggregator": "median"}}, "set robust.aggregator: mean"),
    ({"robust": {"aggregator": "trimmed_mean"}}, "set robust.aggregator: mean"),
    ({"robust": {"norm_bound": 3.0}}, "set robust.norm_bound: 0"),
    ({"sampling": {"probability": 0.5}}, "set sampling.scheme: poisson"),
    ({"sampling": {"fraction": 0.5, "over_selection": 0.5}}, "set sampling.over_selection: 0"),
    ({"privacy": {"dp": {"enabled": True, "accountant": "pld"}}}, "set privacy.dp.accountant: rdp"),
    ({"compression": {"up": {"codec": "topk", "fraction": 0.1}}}, "set compression.up.error_feedback: false"),
    ({"server_optimizer": {"name": "fedexp"}}, "fedexp sets its step from each result's delta norm"),
    ({"algorithm": {"name": "fedavg", "objective": {"feddyn": {"alpha": 0.01}}}}, "remove the feddyn term"),
    ({"algorithm": {"name": "fedftha"}}, "uploads its head values whole"),
])
def test_the_config_check_refuses_what_cannot_be_private(overrides, reason):
    raw = _dp_config()
    for key, value in overrides.items():
        raw[key] = {**raw.get(key, {}), **value}
    with pytest.raises(ConfigError, match="privacy.dp: ") as error:
        config_from_dict(raw)
    assert reason in str(error.value)


@pytest.mark.parametrize("overrides", [
    {"server_optimizer": {"name": "fedadam"}},
    {"server_optimizer": {"name": "fedavgm"}},
    {"compression": {"up": {"codec": "qsgd8"}}},
    {"compression": {"up": {"codec": "topk", "fraction": 0.1, "error_feedback": False}}},
    {"algorithm": {"name": "fedbabu"}},
    {"algorithm": {"name": "layer_expansion_vanilla", "unfreeze_rounds": [0, 1, 2]}},
    {"sampling": {"scheme": "poisson", "fraction": 0.5}, "privacy": {"dp": {"enabled": True, "accountant": "pld"}}},
])
def test_the_config_check_accepts_what_can_be_private(overrides):
    raw = _dp_config()
    for key, value in overrides.items():
        raw[key] = {**raw.get(key, {}), **value}
    assert config_from_dict(raw).privacy.dp.enabled


@pytest.mark.parametrize("dp, message", [
    ({"clip_norm": 0.0}, "privacy.dp.clip_norm must be a finite number > 0"),
    ({"noise_multiplier": -1.0}, "privacy.dp.noise_multiplier must be a finite number >= 0"),
    ({"delta": 1.0}, "privacy.dp.delta must be in (0, 1)"),
    ({"target_epsilon": 0.0}, "privacy.dp.target_epsilon must be a finite number > 0"),
    ({"accountant": "moments"}, "privacy.dp.accountant must be one of rdp, pld"),
])
def test_bad_dp_settings_name_the_key(dp, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict(_dp_config(dp))
    assert message in str(error.value)


def test_without_dp_accounting_the_server_refuses_with_the_pip_command(monkeypatch):
    config = config_from_dict(_dp_config())
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)
    with pytest.raises(ConfigError, match='pip install "dp-accounting>=0.4"'):
        check_dp_accounting(config)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # an import of it now fails
    with pytest.raises(ConfigError, match='pip install "dp-accounting>=0.4"'):
        PrivacyBudget(config)
    check_dp_accounting(config_from_dict(small_config()))  # without privacy.dp nothing is needed


# ------------------------------------------------------------------------------------ whole runs


def test_a_poisson_run_reports_dp_accountings_epsilon_and_empty_rounds_release_noise(tmp_path):
    rounds, clients, q, z = 3, 4, 0.5, 1.0
    config = _dp_config({"clip_norm": 1.0, "noise_multiplier": z}, rounds=rounds, clients=clients,
                        sampling={"scheme": "poisson", "fraction": q})
    empty = [r for r in range(1, rounds + 1) if not sample_clients(clients, r, 0, q, scheme="poisson")]
    assert empty, "the seed should give an empty round"
    done, out = run_fedpart(config, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(out)
    relation, event = _poisson(q, z)
    delta = 1 / clients ** 1.1
    for record in records:
        assert record["privacy"]["epsilon"] == _library_epsilon(relation, event, record["round"], delta)
    privacy = read_summary(out)["privacy"]
    assert privacy == {"epsilon": _library_epsilon(relation, event, rounds, delta), "delta": delta,
                       "sampling": "poisson", "accountant": "rdp", "noise_multiplier": z, "clip_norm": 1.0,
                       "target_epsilon": None, "rounds": rounds}
    before, after = (load_tensors(out / "checkpoints" / f"round_{r:04d}.safetensors") for r in (empty[0] - 1, empty[0]))
    assert records[empty[0] - 1]["completed"] == []
    assert all(not torch.equal(before[name], after[name]) for name in before)  # noise alone moved the model


def test_noise_is_really_added_and_fixed_sampling_is_accounted_as_such(tmp_path):
    """The same seed at noise 0 and at a large noise multiplier: the noised run's global model is
    measurably worse, and its epsilon is dp-accounting's for m of N without replacement."""
    rounds, clients, fraction, z = 4, 4, 0.5, 4.0
    accuracy = {}
    train = {**_dp_config()["train"], "epochs": 3, "lr": 0.1}
    for noise in (0.0, z):
        config = _dp_config({"clip_norm": 10.0, "noise_multiplier": noise}, rounds=rounds, clients=clients,
                            sampling={"fraction": fraction})
        config["train"] = train
        done, out = run_fedpart(config, tmp_path, name=f"noise_{noise:g}")
        assert done.returncode == 0, done.stderr[-3000:]
        summary = read_summary(out)
        accuracy[noise] = summary["accuracy"]["global"]["acc"]
    relation, event = _fixed(clients, 2, z)
    assert summary["privacy"]["epsilon"] == _library_epsilon(relation, event, rounds, 1 / clients ** 1.1)
    assert summary["privacy"]["sampling"] == "fixed"
    assert accuracy[0.0] > 0.6, accuracy
    assert accuracy[z] < accuracy[0.0] - 0.3, accuracy


def test_target_epsilon_stops_the_run_before_the_round_that_would_pass_it(tmp_path):
    """The server runs the rounds up to Coordinator.last_round and the summary says why it stopped."""
    rounds, clients, q, z = 6, 4, 0.5, 2.0
    relation, event = _poisson(q, z)
    delta = 1 / clients ** 1.1
    target = float(_library_epsilon(relation, event, 2, delta) + _library_epsilon(relation, event, 3, delta)) / 2
    config = _dp_config({"noise_multiplier": z, "target_epsilon": target}, rounds=rounds, clients=clients,
                        sampling={"scheme": "poisson", "fraction": q})
    done, out = run_fedpart(config, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [record["round"] for record in read_metrics(out)] == [1, 2]
    summary = read_summary(out)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["privacy"]["epsilon"] == _library_epsilon(relation, event, 2, delta) <= target
    assert "stopped after round 2 of 6: round 3 would take epsilon to" in summary["note"]
    assert summary["accuracy"]["initial"]["clients"] == clients  # the final evaluation ran
    assert (out / "checkpoints" / "round_0002.safetensors").is_file()
