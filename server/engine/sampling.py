"""Seeded client sampling per round."""

from __future__ import annotations

import math

import numpy as np


def sample_clients(num_clients: int, round_number: int, seed: int, fraction: float,
                   probability: float | None = None, over_selection: float = 0.0,
                   scheme: str = "fixed") -> list[int]:
    """Client ids that take part in ``round_number`` (sorted).

    ``scheme`` ``poisson``: each client joins independently with probability ``fraction`` and the
    round may be empty (Poisson sampling, as DP-FedAvg's accounting assumes: McMahan et al.,
    ICLR 2018). ``fixed``: with ``probability`` each client joins independently (FedBug's
    setting), drawn again while nobody is picked; otherwise :func:`round_target` clients without
    replacement (McMahan et al. 2017), and ``over_selection`` of them more (at most every client).
    The draw depends only on (seed, round).
    """
    rng = np.random.default_rng([seed, round_number])
    if scheme == "poisson":
        return np.flatnonzero(rng.random(num_clients) < fraction).tolist()
    if probability is not None:
        while True:
            picked = np.flatnonzero(rng.random(num_clients) < probability)
            if picked.size:
                return picked.tolist()
    target = round_target(num_clients, fraction)
    count = min(num_clients, math.ceil(target * (1 + over_selection) - 1e-9))
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())


def round_target(num_clients: int, fraction: float) -> int:
    """The clients a fixed-size round needs: ``max(1, int(fraction * num_clients))``."""
    return max(1, int(fraction * num_clients + 1e-9))


def expected_clients(num_clients: int, fraction: float, scheme: str) -> float:
    """The number of clients a round samples in expectation: ``fraction * num_clients`` under
    Poisson sampling, :func:`round_target` for a fixed-size sample (DP-FedAvg's fixed denominator)."""
    return fraction * num_clients if scheme == "poisson" else float(round_target(num_clients, fraction))
