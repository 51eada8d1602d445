"""A slower or intermittent device, emulated in wall time (``heterogeneity.clock: wall``,
:mod:`fedpart.common.config.heterogeneity`): a training task lasts as long as the client's device would
take, counted from when the process starts it: the process trains, then waits out the rest of its
device's time, its offline windows included (counted from the process's start). Where the
training itself takes longer than the device would, nothing is added. The same run config gives
every process, hand-started or launched by ``fedpart run``, the same devices.

A process trains its clients one after another, so a slow client delays the next one's start in the
same process: to emulate every client as a device of its own, run one client per process. The
virtual clock (``heterogeneity.clock: virtual``) waits for nothing and treats every client as its
own device whatever the packing."""

from __future__ import annotations

import time
from collections.abc import Callable

from fedpart.client.mods import Execute, Reply, WorkerContext
from fedpart.common.config.heterogeneity import Devices
from fedpart.common.wire.plans import TaskInfo


def build(context: WorkerContext) -> EmulatedDevices | None:
    section = context.config.heterogeneity
    if not section.emulated or section.clock != "wall":
        return None
    devices = Devices(section, context.config.clients, context.config.seed)
    return EmulatedDevices(devices, context.wait, context.log)


class EmulatedDevices:
    """Makes each training task last its client's device time."""

    train_options: dict[str, object] = {}

    def __init__(self, devices: Devices, wait: Callable[[float], None], log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.devices = devices
        self.wait = wait
        self.log = log
        self.clock = clock
        self.origin = clock()

    def __call__(self, task: TaskInfo, call_next: Execute) -> Reply:
        if task.train is None:
            return call_next(task)
        started = self.clock() - self.origin
        reply = call_next(task)
        steps = task.train.local_steps(reply.samples)
        finish = self.devices.finish(task.client_id, started, steps)
        left = finish - (self.clock() - self.origin)
        if left > 0:
            self.log(f"client {task.client_id} round {task.round}: its device takes {finish - started:.2f} s for "
                     f"{steps} steps (heterogeneity); waiting {left:.2f} s more")
            self.wait(left)
        return reply
