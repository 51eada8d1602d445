"""Adaptive clipping for DP-FedAvg (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021), the geometric update: the rule, the split of the
noise multiplier between the deltas and the count, the refusals, the clip's state across a resume,
and runs in which the clip finds the median delta norm."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import read_metrics, read_summary, run_fedpart, small_config
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.config.experiment import build_run_model
from fedpart.common.privacy.clipping import joint_norm
from fedpart.server.policy.privacy import AdaptiveClip, ClippedDeltas, DifferentialPrivacy, NoisedSum, PrivacyBudget
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.policy.insiders import InsiderMonitor
from fedpart.server.policy import build_policy
from fedpart.server.policy.dp import DPFedAvg
from fedpart.server.engine.run_state import read_run_state, write_run_state
from fedpart.server.engine.sampling import expected_clients
from test_robust import InProcessServer, RawClient

QUIET = {"log": lambda _: None}


def _adaptive(dp: dict | None = None, **overrides) -> dict:
    """small_config with privacy.dp and adaptive clipping on (uniform weighting, as DP-FedAvg needs)."""
    train = {**small_config()["train"], "weighting": "uniform"}
    return small_config(train=train, privacy={"dp": {"enabled": True, "adaptive_clip": True, **(dp or {})}},
                        **overrides)


def _deltas(reference: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
    """Deltas of every tensor of ``reference``, all elements equal, of joint L2 norm ``norm``."""
    elements = sum(t.numel() for t in reference.values())
    return {n: torch.full_like(t, norm / math.sqrt(elements)) for n, t in reference.items()}


# ------------------------------------------------------------------------------------ the update rule


@pytest.mark.parametrize("gamma, eta", [(0.5, 0.2), (0.9, 0.5)])
def test_all_within_the_clip_shrinks_it_and_all_over_grows_it(gamma, eta):
    clip = AdaptiveClip(2.0, gamma, eta, count_stddev=0.0, denominator=5)
    generator = torch.Generator().manual_seed(0)
    assert clip.unclipped_fraction(5, 5, generator) == 1.0
    assert clip.update(clip.unclipped_fraction(5, 5, generator)) == pytest.approx(2.0 * math.exp(-eta * (1 - gamma)))
    assert clip.clip_norm == pytest.approx(2.0 * math.exp(-eta * (1 - gamma)))
    before = clip.clip_norm
    assert clip.unclipped_fraction(0, 5, generator) == 0.0
    assert clip.update(0.0) == pytest.approx(before * math.exp(eta * gamma))
    at_target = clip.clip_norm
    assert clip.update(gamma) == pytest.approx(at_target)  # at the quantile the clip stays


def test_the_count_is_centred_over_the_fixed_denominator_and_noised_from_the_rounds_generator():
    """b = 1/2 + (sum (b_i - 1/2) + N(0, sigma_b^2)) / m: with every expected client answering it is the
    fraction of them within the clip; the noise is one draw of the generator."""
    exact = AdaptiveClip(1.0, 0.5, 0.2, count_stddev=0.0, denominator=4)
    assert exact.unclipped_fraction(3, 4, torch.Generator()) == 0.75
    assert exact.unclipped_fraction(2, 2, torch.Generator()) == 0.75  # 1/2 + (2 - 1) / 4
    assert exact.unclipped_fraction(0, 0, torch.Generator()) == 0.5  # nobody answered: no evidence either way
    noisy = AdaptiveClip(1.0, 0.5, 0.2, count_stddev=3.0, denominator=4)
    draw = float(torch.normal(0.0, 3.0, (1,), generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    assert noisy.unclipped_fraction(3, 4, torch.Generator().manual_seed(7)) == \
        pytest.approx(min(1.0, max(0.0, 0.75 + draw / 4)))
    wild = AdaptiveClip(1.0, 0.5, 0.2, count_stddev=1e6, denominator=4)
    assert {wild.unclipped_fraction(2, 4, torch.Generator().manual_seed(s)) for s in range(8)} == {0.0, 1.0}


def test_the_clip_state_round_trips_and_refuses_a_bad_value():
    clip = AdaptiveClip(0.1, 0.5, 0.2, 1.0, 10)
    clip.update(0.0)
    other = AdaptiveClip(0.1, 0.5, 0.2, 1.0, 10)
    other.load_state(clip.state())
    assert other.clip_norm == clip.clip_norm
    other.load_state({})  # a state without the clip (no round closed): unchanged
    assert other.clip_norm == clip.clip_norm
    with pytest.raises(ValueError, match="one positive finite number"):
        other.load_state({AdaptiveClip.STATE_KEY: torch.tensor(-1.0, dtype=torch.float64)})


# ------------------------------------------------------------------------------------ the noise split


@pytest.mark.parametrize("z, sigma_b", [(1.0, 1.0), (0.8, 2.5), (4.0, 2.01)])
def test_the_deltas_noise_multiplier_leaves_the_total_z(z, sigma_b):
    dp = config_from_dict(_adaptive({"noise_multiplier": z, "count_stddev": sigma_b})).privacy.dp
    z_delta = dp.delta_noise_multiplier(4)
    assert z_delta == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5)
    assert z_delta ** -2 + (2 * sigma_b) ** -2 == pytest.approx(z ** -2)  # Andrew et al., Theorem 1
    assert z_delta > z


def test_without_adaptive_clipping_or_noise_the_multiplier_is_unchanged():
    raw = _adaptive({"noise_multiplier": 1.5})
    raw["privacy"]["dp"]["adaptive_clip"] = False
    assert config_from_dict(raw).privacy.dp.delta_noise_multiplier(4) == 1.5
    assert config_from_dict(_adaptive({"noise_multiplier": 0.0, "count_stddev": 0.0})).privacy.dp \
        .delta_noise_multiplier(4) == 0.0


def test_the_default_count_noise_is_a_twentieth_of_the_expected_clients():
    config = config_from_dict(_adaptive({"noise_multiplier": 0.5}, clients=200,
                                        sampling={"scheme": "poisson", "fraction": 0.1}))
    privacy = DifferentialPrivacy(config, **QUIET)
    assert privacy.adaptive.count_stddev == 20 / 20
    assert privacy.delta_noise_multiplier == pytest.approx((0.5 ** -2 - 2.0 ** -2) ** -0.5)
    std, denominator, _ = privacy.noise(1)
    assert denominator == 20 and std == pytest.approx(privacy.delta_noise_multiplier * config.privacy.dp.clip_norm)


@pytest.mark.parametrize("clients, fraction, scheme", [(10, 0.3, "fixed"), (7, 0.5, "fixed"), (10, 0.35, "poisson"),
                                                       (3, 0.01, "fixed")])
def test_the_config_checks_expected_clients_is_the_servers(clients, fraction, scheme):
    """The config check computes the expected clients itself (common imports no server module)."""
    m = expected_clients(clients, fraction, scheme)
    z = 1.0
    just_enough = _adaptive({"noise_multiplier": z}, clients=clients, sampling={"scheme": scheme, "fraction": fraction})
    if m / 20 * 2 > z:
        config_from_dict(just_enough)
    else:
        with pytest.raises(ConfigError, match="2 sigma_b > z"):
            config_from_dict(just_enough)


def test_the_budget_is_accounted_with_the_total_noise_multiplier():
    """Adaptive clipping changes how z is spent, not the accounting: epsilon is that of z."""
    common = {"noise_multiplier": 1.3, "count_stddev": 5.0}
    with_clip = config_from_dict(_adaptive(common, clients=20, sampling={"scheme": "poisson", "fraction": 0.25}))
    raw = _adaptive(common, clients=20, sampling={"scheme": "poisson", "fraction": 0.25})
    raw["privacy"]["dp"]["adaptive_clip"] = False
    for rounds in (1, 5):
        assert PrivacyBudget(with_clip).epsilon(rounds) == PrivacyBudget(config_from_dict(raw)).epsilon(rounds)


# ------------------------------------------------------------------------------------ the config check


@pytest.mark.parametrize("dp, message", [
    ({"target_quantile": 0.0}, "privacy.dp.target_quantile must be in (0, 1)"),
    ({"target_quantile": 1.0}, "privacy.dp.target_quantile must be in (0, 1)"),
    ({"clip_learning_rate": 0.0}, "privacy.dp.clip_learning_rate must be a finite number > 0"),
    ({"clip_learning_rate": math.inf}, "privacy.dp.clip_learning_rate must be a finite number > 0"),
    ({"count_stddev": -1.0}, "privacy.dp.count_stddev must be a finite number >= 0"),
])
def test_bad_adaptive_settings_name_the_key(dp, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict(_adaptive(dp))
    assert message in str(error.value)


@pytest.mark.parametrize("dp, fragment", [
    ({"noise_multiplier": 1.0},
     "raise privacy.dp.count_stddev above 0.5, or lower privacy.dp.noise_multiplier below 0.4"),
    ({"noise_multiplier": 1.0, "count_stddev": 0.5}, "2 sigma_b > z"),  # 2 sigma_b == z: nothing left
    ({"noise_multiplier": 0.1, "count_stddev": 0.0}, "2 sigma_b > z"),  # an exact count is not private
])
def test_count_noise_that_leaves_no_noise_for_the_deltas_is_refused(dp, fragment):
    """small_config: 4 clients a round, so the default sigma_b is 0.2."""
    with pytest.raises(ConfigError, match="privacy.dp: privacy.dp.adaptive_clip: ") as error:
        config_from_dict(_adaptive(dp))
    assert fragment in str(error.value)


def test_adaptive_clipping_with_secure_aggregation_is_refused():
    raw = _adaptive({"noise_multiplier": 0.5, "count_stddev": 1.0})
    raw["privacy"]["secure_aggregation"] = True
    with pytest.raises(ConfigError, match="under privacy.secure_aggregation the server sees no single delta"):
        config_from_dict(raw)


@pytest.mark.parametrize("up", [{"codec": "qsgd8"}, {"codec": "float16"},
                                {"codec": "topk", "fraction": 0.1, "error_feedback": False}])
def test_lossy_upload_codecs_are_accepted(up):
    """The server clips and counts what it decoded, which is what it sums (docs/privacy.md)."""
    assert config_from_dict(_adaptive({"noise_multiplier": 0.5, "count_stddev": 1.0},
                                      compression={"up": up})).privacy.dp.adaptive_clip


# ------------------------------------------------------------------------------------ the server's step


def _step(dp: dict, **overrides) -> tuple[DPFedAvg, dict[str, torch.Tensor]]:
    """The server's policy under ``dp`` (its outermost layer DP-FedAvg's) and the initial model."""
    config = config_from_dict(_adaptive(dp, **overrides))
    policy = build_policy(config, **QUIET)
    assert isinstance(policy, DPFedAvg)
    return policy, dict(build_run_model(config).state_dict())


def _round(step: DPFedAvg, round_number: int, state: dict[str, torch.Tensor], norms: list[float]) -> dict:
    """One round of ``norms`` folded through screening and the noised sum; returns the new global state."""
    deltas = step.open_round(round_number, state)
    for norm in norms:
        sent = _deltas(state, norm)
        screened = step.screen(0, sent, 10)
        assert isinstance(screened.deltas, ClippedDeltas)
        assert screened.clipped == (joint_norm(sent) > step.privacy.clip_norm)
        assert joint_norm(screened.deltas) <= step.privacy.clip_norm
        deltas.add(screened.deltas, screened.weight)
    return {**state, **step.new_global(state, deltas, None)}


def test_the_server_clips_with_the_rounds_clip_and_steps_it_when_the_round_closes():
    step, state = _step({"clip_norm": 1.0, "noise_multiplier": 0.0, "count_stddev": 0.0, "clip_learning_rate": 0.5},
                        clients=4)
    assert step.privacy.noise(1)[0] == 0.0
    state = _round(step, 1, state, [0.5, 0.7, 0.9, 3.0])  # 3 of 4 within the clip
    assert step.privacy.clip_norm == pytest.approx(math.exp(-0.5 * (0.75 - 0.5)))
    assert step.privacy.round_record(1).to_json() == {"epsilon": None, "clip_norm": 1.0, "unclipped_fraction": 0.75}
    _round(step, 2, state, [5.0, 6.0, 7.0, 8.0])
    assert step.privacy.round_record(2).unclipped_fraction == 0.0
    assert step.privacy.clip_norm == pytest.approx(math.exp(-0.5 * 0.25) * math.exp(0.5 * 0.5))


def test_the_noise_of_the_deltas_is_z_delta_times_the_rounds_clip():
    step, state = _step({"clip_norm": 2.0, "noise_multiplier": 1.0, "count_stddev": 1.0}, clients=4)
    z_delta = (1 - 0.25) ** -0.5
    combiner = step.open_round(1, state).combiner
    assert isinstance(combiner, NoisedSum) and combiner.std == pytest.approx(2.0 * z_delta)
    assert combiner.clip_norm == 2.0


def test_a_round_without_results_releases_a_noised_count():
    step, state = _step({"clip_norm": 1.0, "noise_multiplier": 1.0, "count_stddev": 1.0, "noise_seed": 3}, clients=4)
    _round(step, 1, state, [])
    fraction = step.privacy.round_record(1).unclipped_fraction
    assert fraction != 0.5  # noise alone moved it
    assert step.privacy.clip_norm == pytest.approx(math.exp(-0.2 * (fraction - 0.5)))


def test_a_resumed_step_continues_with_the_same_clip_and_noise():
    """Four rounds in one go against two, the state saved and restored into a new step, and two more:
    the same clips, counts and global tensors (the count noise is drawn from the round's generator
    after the deltas' noise)."""
    dp = {"clip_norm": 0.3, "noise_multiplier": 0.5, "count_stddev": 1.0, "noise_seed": 11}
    norms = {1: [0.1, 0.4, 0.9, 2.0], 2: [0.2, 0.3, 1.1, 0.6], 3: [0.5, 0.5, 0.7, 3.0], 4: [0.05, 0.2, 0.4, 0.8]}
    straight, state = _step(dp, clients=4)
    initial = dict(state)
    for round_number in range(1, 5):
        state = _round(straight, round_number, state, norms[round_number])
    first, resumed_state = _step(dp, clients=4)
    for round_number in (1, 2):
        resumed_state = _round(first, round_number, resumed_state, norms[round_number])
    saved = first.state()
    assert {key for key in saved if not key.startswith(InsiderMonitor.STATE_PREFIX)} == {AdaptiveClip.STATE_KEY}
    resumed, _ = _step(dp, clients=4)
    resumed.load_state(saved)
    assert resumed.privacy.clip_norm == first.privacy.clip_norm != dp["clip_norm"]
    for round_number in (3, 4):
        resumed_state = _round(resumed, round_number, resumed_state, norms[round_number])
        assert resumed.privacy.round_record(round_number) == straight.privacy.round_record(round_number)
    assert resumed.privacy.clip_norm == straight.privacy.clip_norm
    for name in state:
        assert torch.equal(resumed_state[name], state[name]), name
        assert not torch.equal(state[name], initial[name])


# ------------------------------------------------------------------------------------ runs


def test_the_clip_settles_at_the_median_norm_of_the_clients_updates(tmp_path):
    """Four clients whose deltas have norms 1, 2, 3 and 4 (a raw client process, which does not
    clip): from C_0 = 0.5 the clip grows while fewer than half are within it and then stays in
    [2, 3), where exactly half are; every round's clip_norm is in its record, and the run state
    written after the last round carries the next round's clip to a resumed coordinator."""
    norms = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    rounds = 8
    server = InProcessServer(clients=4, rounds=rounds, train=_adaptive()["train"],
                             privacy={"dp": {"enabled": True, "adaptive_clip": True, "clip_norm": 0.5,
                                             "noise_multiplier": 0.0, "count_stddev": 0.0,
                                             "clip_learning_rate": 1.0}})
    client = RawClient(server.address, list(norms))
    try:
        server.start()
        for _ in range(rounds * len(norms)):
            header = client.next_task()
            reference = {n: client.state[n] for n in header.train.upload_deltas}
            assert client.submit(header, _deltas(reference, norms[header.client_id]), 10).accepted
        server.wait()
        write_run_state(tmp_path, server.coordinator.snapshot(rounds, 1.0))
        resumed = Coordinator(server.config, log=lambda _: None)
        resumed.restore(read_run_state(tmp_path, server.config.to_dict()))
        assert resumed.policy.find(DPFedAvg).privacy.clip_norm == server.coordinator.policy.find(DPFedAvg).privacy.clip_norm
    finally:
        client.close()
        server.close()
    clips = [record.privacy.clip_norm for record in server.records]
    fractions = [record.privacy.unclipped_fraction for record in server.records]
    expected, clip = [], 0.5
    for _ in range(rounds):
        expected.append(clip)
        within = sum(norm <= clip for norm in norms.values()) / 4
        clip *= math.exp(-(within - 0.5))
    assert clips == pytest.approx(expected)
    assert 2.0 <= clips[-1] < 3.0 and clips[-1] == pytest.approx(clips[-2])
    assert fractions[0] == 0.0 and fractions[-1] == 0.5
    assert [record.robust.clipped for record in server.records][-1] == 2


def test_a_digits_run_adapts_the_clip_and_reports_it(tmp_path):
    """A whole run (clients that train and, under adaptive clipping, do not clip themselves): the
    clip of every round in metrics.jsonl, moving from C_0 by the geometric rule, and epsilon that
    of the total noise multiplier z."""
    rounds, z = 5, 0.5
    config = _adaptive({"clip_norm": 0.1, "noise_multiplier": z, "count_stddev": 1.0, "noise_seed": 5},
                       rounds=rounds)
    done, out = run_fedpart(config, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(out)
    clips = [record["privacy"]["clip_norm"] for record in records]
    fractions = [record["privacy"]["unclipped_fraction"] for record in records]
    assert clips[0] == 0.1
    for t in range(rounds - 1):
        assert clips[t + 1] == pytest.approx(clips[t] * math.exp(-0.2 * (fractions[t] - 0.5)))
    assert clips[-1] > clips[0]  # the digits mlp's first updates are far above 0.1
    # the clients sent them unclipped (clipped to C_0 by the client, none would be over C_0 here)
    assert records[0]["robust"]["clipped"] == len(records[0]["completed"]) > 0
    budget = PrivacyBudget(config_from_dict(config))
    assert [record["privacy"]["epsilon"] for record in records] == [budget.epsilon(r) for r in range(1, rounds + 1)]
    assert read_summary(out)["privacy"]["epsilon"] == budget.epsilon(rounds)
