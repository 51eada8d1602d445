"""Device heterogeneity that can be reproduced: every client's speed and availability, drawn from
the named, seeded distributions of the ``heterogeneity`` section, the same on the server and on
every client process (they draw from the run's config alone).

- **Speed**: a task of ``s`` local steps takes ``s * step_seconds * slowdown`` seconds of device
  time; ``speed: lognormal`` draws each slowdown as exp(speed_sigma * z), z standard normal (median
  1, heavy-tailed: at sigma 1 one device in ten is 3.6 times slower than the median or more),
  ``none`` gives every device slowdown 1.
- **Availability**: ``offline_share`` of the clients (exactly that share, rounded, drawn by the
  seed) are offline for ``offline_fraction`` of every ``offline_period`` seconds, each from a seeded
  phase in [0, period); the others are always online. A device that is offline does not train: a
  task that reaches it waits until it is online, and its training pauses while it is offline.

Time is counted from the start of the run (the virtual clock's zero); a client process that
emulates its device in wall time counts from its own start (:mod:`fedpart.client.mods.heterogeneity`).
Standard library and numpy only: a config check never loads torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedpart.common.config.run_config import HeterogeneityConfig

_SALT = 0x5EED_DE71  # keeps this draw apart from every other draw seeded by the same run seed


@dataclass(frozen=True)
class Device:
    """One client's device: its slowdown, and its offline windows (``offline`` seconds from
    ``phase`` on, every ``period`` seconds; ``offline`` 0: always online)."""

    slowdown: float = 1.0
    phase: float = 0.0
    period: float = 1.0
    offline: float = 0.0

    def online_at(self, t: float) -> float:
        """The first moment at or after ``t`` when the device is online."""
        if not self.offline:
            return t
        into = (t - self.phase) % self.period
        return t + (self.offline - into) if into < self.offline else t

    def finish(self, start: float, seconds: float) -> float:
        """When work of ``seconds`` of device time given to the device at ``start`` is done: it
        begins once the device is online and pauses in every offline window."""
        t = self.online_at(start)
        if not self.offline:
            return t + seconds
        online = self.period - self.offline
        while True:
            into = (t - self.phase - self.offline) % self.period  # time since this online window opened
            if into >= online:  # t is where a window opens, rounded into the window before
                into -= self.period
            next_off = t + online - into
            if t + seconds <= next_off:
                return t + seconds
            seconds -= next_off - t
            t = next_off + self.offline


class Devices:
    """The devices of a run's clients, drawn once from the ``heterogeneity`` section and ``seed``
    (the section's own seed, or else the run's)."""

    def __init__(self, section: HeterogeneityConfig, clients: int, seed: int) -> None:
        self.step_seconds = section.step_seconds
        rng = np.random.default_rng([section.seed if section.seed is not None else seed, _SALT])
        normal = rng.standard_normal(clients)
        slowdowns = np.exp(section.speed_sigma * normal) if section.speed == "lognormal" else np.ones(clients)
        intermittent = set(rng.permutation(clients)[:round(section.offline_share * clients)].tolist())
        phases = rng.uniform(0.0, section.offline_period, clients)
        offline = section.offline_fraction * section.offline_period
        self._devices = [Device(float(slowdowns[c]), float(phases[c]), section.offline_period, offline)
                         if c in intermittent else Device(float(slowdowns[c])) for c in range(clients)]

    def __getitem__(self, client: int) -> Device:
        return self._devices[client]

    def task_seconds(self, client: int, steps: int) -> float:
        """Device time of ``steps`` local steps on ``client``'s device (offline time aside)."""
        return steps * self.step_seconds * self._devices[client].slowdown

    def finish(self, client: int, start: float, steps: int) -> float:
        """When a task of ``steps`` local steps that reaches ``client`` at ``start`` is done."""
        return self._devices[client].finish(start, self.task_seconds(client, steps))

    def describe(self) -> str:
        """The drawn devices in one line: slowdown quantiles and the intermittent clients."""
        slowdowns = sorted(d.slowdown for d in self._devices)
        quantile = {q: slowdowns[min(len(slowdowns) - 1, math.floor(q * len(slowdowns)))] for q in (0.1, 0.5, 0.9)}
        offline = [c for c, d in enumerate(self._devices) if d.offline]
        return (f"slowdown p10 {quantile[0.1]:.2f}, median {quantile[0.5]:.2f}, p90 {quantile[0.9]:.2f}, "
                f"max {slowdowns[-1]:.2f}; {len(offline)} intermittent client(s)")
