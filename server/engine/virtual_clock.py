"""The virtual clock (``heterogeneity.clock: virtual``): the time a run would take on the devices of
the ``heterogeneity`` section (:mod:`fedpart.common.config.heterogeneity`), simulated on the server while
the client processes train without waiting.

A task that reaches its client at virtual time ``start`` is done at ``Devices.finish(client,
start, steps)``, its ``steps`` being the local steps its plan takes on the client's training
samples (the server computes the seeded partition for them). Communication takes no virtual
time. A synchronous round starts when the previous one closed and closes when the last of its
folded clients is done: it waits for its slowest device, as FedAvg does. The buffered engine
(:mod:`fedpart.server.engine.buffered`) orders results by their virtual finish instead of their arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fedpart.common.config.run_config import RunConfig
from fedpart.common.config.heterogeneity import Devices
from fedpart.common.wire.plans import TrainPlan
from fedpart.server.policy.robust import partition_sizes


class VirtualClockError(ValueError):
    """The virtual clock cannot be run (the message says why and what to change)."""


class VirtualClock:
    """Virtual time of a run; ``now`` is when the last round (or server version) closed.
    ``plan_of(round, client)`` is the training plan of a client's task of that round."""

    def __init__(self, config: RunConfig, plan_of: Callable[[int, int], TrainPlan]) -> None:
        try:
            self.sizes = partition_sizes(config).train
        except (OSError, ValueError, ImportError) as error:
            raise VirtualClockError(f"heterogeneity.clock: virtual needs each client's training samples, from the "
                                    f"partition the server computes, and it cannot ({error}): give the server "
                                    "data.root, or set heterogeneity.clock: wall") from error
        self.devices = Devices(config.heterogeneity, config.clients, config.seed)
        self.plan_of = plan_of
        self.now = 0.0

    def steps(self, client: int, round_number: int) -> int:
        """Local steps of ``client``'s task of round ``round_number``."""
        return self.plan_of(round_number, client).local_steps(self.sizes[client])

    def finish(self, client: int, round_number: int, start: float) -> float:
        """When ``client``'s task of round ``round_number``, started at ``start``, is done."""
        return self.devices.finish(client, start, self.steps(client, round_number))

    def busy(self, client: int, round_number: int) -> float:
        """Device seconds of ``client``'s task of round ``round_number`` (its offline time aside)."""
        return self.devices.task_seconds(client, self.steps(client, round_number))

    def sync_round(self, round_number: int, clients: Iterable[int]) -> tuple[float, float]:
        """Close a synchronous round whose ``clients`` were folded: the clock moves to the last
        one's finish. Returns the new time and the device seconds of the round's tasks."""
        clients = list(clients)
        start = self.now
        self.now = max((self.finish(c, round_number, start) for c in clients), default=start)
        return self.now, sum(self.busy(c, round_number) for c in clients)
