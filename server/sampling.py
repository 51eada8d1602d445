"""Seeded client sampling per round."""

from __future__ import annotations

import numpy as np


def sample_clients(num_clients: int, round_number: int, seed: int, fraction: float,
                   probability: float | None = None) -> list[int]:
    """Client ids that take part in ``round_number`` (sorted).

    With ``probability`` each client joins independently (FedBug's setting), drawn again while
    nobody is picked; otherwise ``max(1, int(fraction * num_clients))`` clients without
    replacement (McMahan et al. 2017). The draw depends only on (seed, round).
    """
    rng = np.random.default_rng([seed, round_number])
    if probability is not None:
        while True:
            picked = np.flatnonzero(rng.random(num_clients) < probability)
            if picked.size:
                return picked.tolist()
    count = max(1, int(fraction * num_clients + 1e-9))
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())
