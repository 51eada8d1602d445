"""Compression of what a client uploads (``compression.up``, ``fedpart.common.wire.codecs``): a
training reply's deltas go through the codec, and its whole values too where the codec keeps
every element; a codec with error feedback (top-k) adds the residual the client's last upload left
before encoding and keeps the new one once the server has taken the result (Stich et al.,
"Sparsified SGD with Memory", NeurIPS 2018). The rounding is seeded by the run, client and round,
so a task sent again gives the same bytes."""

from __future__ import annotations

import torch

from fedpart.client.mods import Execute, Reply, WorkerContext
from fedpart.client.store import ClientStore
from fedpart.common.wire.codecs import Codec, build_codec, encode, encode_with_feedback, seeded_generator
from fedpart.common.wire.plans import TaskInfo


def build(context: WorkerContext) -> Compress | None:
    section = context.config.compression.up
    codec = build_codec(section.codec, section.options)
    return Compress(codec, context.config.training_seed, context.store) if codec is not None else None


class Compress:
    """Encodes a training reply's uploads with the upload codec."""

    train_options: dict[str, object] = {}

    def __init__(self, codec: Codec, seed: int, store: ClientStore) -> None:
        self.codec = codec
        self.seed = seed
        self.store = store

    def __call__(self, task: TaskInfo, call_next: Execute) -> Reply:
        reply = call_next(task)
        if task.train is None:
            return reply  # an evaluation's report, or a protocol step's answer: as they are
        codec, client, round_number = self.codec, task.client_id, task.round
        generator = seeded_generator(self.seed, client, round_number)
        feedback = codec.error_feedback
        previous = self.store.residuals(client, round_number) if feedback else {}
        residuals: dict[str, torch.Tensor] = {}
        deltas = task.train.upload_deltas
        for name, tensor in reply.uploads.items():
            if name in deltas and feedback and tensor.is_floating_point():
                reply.encoded[name], residuals[name] = encode_with_feedback(codec, tensor, previous.get(name),
                                                                            generator)
            elif name in deltas or not codec.sparse:
                reply.encoded[name] = encode(codec, tensor, generator)
        if feedback:
            reply.on_taken.append(lambda: self.store.save_residuals(client, round_number, residuals))
        return reply
