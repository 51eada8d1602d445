"""User-level differential privacy on the client (DP-FedAvg: McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018): a training reply's deltas are
clipped together to ``privacy.dp.clip_norm`` before any codec rounds them. The server clips what it
decoded again and adds the noise (``fedpart.server.policy.privacy``); under adaptive clipping
(``privacy.dp.adaptive_clip``) the clip moves from round to round, and only the server clips."""

from __future__ import annotations

from fedpart.client.mods import Execute, Reply, WorkerContext
from fedpart.common.wire.plans import TaskInfo
from fedpart.common.privacy.clipping import clip_deltas


def build(context: WorkerContext) -> ClipDeltas | None:
    dp = context.config.privacy.dp
    return ClipDeltas(dp.clip_norm) if dp.enabled and not dp.adaptive_clip else None


class ClipDeltas:
    """Clips a training reply's deltas to ``clip_norm`` in L2 over all of them."""

    train_options: dict[str, object] = {}

    def __init__(self, clip_norm: float) -> None:
        self.clip_norm = clip_norm

    def __call__(self, task: TaskInfo, call_next: Execute) -> Reply:
        reply = call_next(task)
        if task.train is None:
            return reply
        deltas = {name: reply.uploads[name] for name in task.train.upload_deltas if name in reply.uploads}
        clipped = clip_deltas(deltas, self.clip_norm)[0]
        reply.uploads = {name: clipped.get(name, tensor) for name, tensor in reply.uploads.items()}
        return reply
