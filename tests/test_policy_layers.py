"""The server's policy as layers around a pure core (``fedpart.server.policy``): the config picks
the layers, each wraps the one inside it, and a new mechanism is one module named in ``LAYERS``;
the round engine runs it without a line of its own."""

from __future__ import annotations

import pytest
import torch

from conftest import small_config
from fedpart.common.config.run_config import config_from_dict
from fedpart.server import policy as policy_package
from fedpart.server.policy import build_policy
from fedpart.server.policy.combine import Combine
from fedpart.server.policy.dp import DPFedAvg
from fedpart.server.policy.screening import RobustScreening
from fedpart.server.policy.secure_aggregation import SecureAggregation
from fedpart.server.policy.robust import delta_norm
from fixtures.policy_layer import Halving
from test_privacy import _dp_config
from test_robust import serve  # noqa: F401 (a fixture)


def layers(policy) -> list[type]:
    """The policy's layers, outermost first, down to the core."""
    kinds = []
    while policy is not None:
        kinds.append(type(policy))
        policy = policy.inner
    return kinds


def test_the_config_picks_the_layers_around_the_core():
    plain = config_from_dict(small_config())
    assert layers(build_policy(plain, print)) == [RobustScreening, Combine]
    private = config_from_dict(_dp_config())
    assert layers(build_policy(private, print)) == [DPFedAvg, RobustScreening, Combine]
    secure = config_from_dict(small_config(clients=4, privacy={"secure_aggregation": True}))
    assert layers(build_policy(secure, print, run_id=lambda: "run", blame=lambda *_: None,
                               round_uploads=lambda _: ())) == [SecureAggregation, RobustScreening, Combine]


def test_a_layer_from_outside_fedpart_runs_in_a_real_round(serve, monkeypatch):
    """One module and its name in LAYERS: the round engine folds what the layer made of a result."""
    monkeypatch.setattr(policy_package, "LAYERS", (*policy_package.LAYERS, "fixtures.policy_layer"))
    server, client = serve(1, rounds=1, robust={"adaptive_bound": 0})
    server.start()
    header = client.next_task()
    deltas = {name: torch.full_like(client.state[name], 0.01) for name in header.train.upload_deltas}
    assert client.submit(header, deltas, 10).accepted
    server.wait()
    halving = server.coordinator.policy.find(Halving)
    assert halving is not None and halving.halved == 1
    assert server.moved(header.train.upload_deltas) == pytest.approx(delta_norm(deltas) / 2, rel=1e-4)
