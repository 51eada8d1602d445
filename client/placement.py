"""Where a client process computes, and how tensors cross between the host and its device.

A process trains on one device: ``cpu``, ``cuda:N`` or ``auto`` (the first visible GPU, else
the CPU). On a GPU its clients' data, the model, the optimizer state and the received global
tensors live on the device. Tensors from the wire are decoded into pinned host buffers (one per
tensor name, reused from version to version) and copied to the device once, without blocking
the host; the tensors a result sends leave the device together, with one wait for the copies.
On the CPU all of this is the identity: nothing is copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fedpart.common.wire.tensors import DTYPES
from fedpart.proto import fedpart_pb2 as pb

AUTO = "auto"


class DeviceError(ValueError):
    """A device spec that names no usable device here (the message says why)."""


def visible_gpus() -> list[str]:
    """``cuda:0`` .. ``cuda:N-1`` for the GPUs this process sees (``CUDA_VISIBLE_DEVICES``)."""
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def resolve_device(spec: str) -> torch.device:
    """The device of ``--device``: ``cpu``, ``cuda`` / ``cuda:N`` (checked against the GPUs
    visible here) or ``auto`` (the first visible GPU, else the CPU). Raises DeviceError."""
    spec = spec.strip()
    if spec == AUTO:
        gpus = visible_gpus()
        return torch.device(gpus[0] if gpus else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as error:
        raise DeviceError(f"device {spec!r} is not cpu, cuda:N or auto") from error
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device {spec!r}: only cpu and cuda devices are supported")
    gpus = visible_gpus()
    if not gpus:
        raise DeviceError(f"device {spec!r}: CUDA is not available on this machine (torch {torch.__version__})")
    index = 0 if device.index is None else device.index
    if index >= len(gpus):
        raise DeviceError(f"device {spec!r}: this machine has {len(gpus)} visible GPU(s), "
                          f"cuda:0 to cuda:{len(gpus) - 1}")
    return torch.device("cuda", index)


def resolve_devices(spec: str) -> list[str]:
    """The devices of ``fedpart run --devices``, one client process each: a comma-separated list
    (a device may repeat: its processes share it) or ``auto``, every visible GPU (an empty list
    when there is none). Raises DeviceError."""
    if spec.strip() == AUTO:
        return visible_gpus()
    entries = [entry.strip() for entry in spec.split(",")]
    if not all(entries):
        raise DeviceError(f"--devices {spec!r}: an empty entry (give devices separated by commas, or auto)")
    if AUTO in entries:
        raise DeviceError(f"--devices {spec!r}: auto stands alone, it cannot be one entry of a list")
    return [str(resolve_device(entry)) for entry in entries]


def describe(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


class Transfers:
    """Moves tensors between the wire (host memory) and ``device``.

    On a GPU, :meth:`staging` gives the wire decoder pinned buffers to decode into,
    :meth:`to_device` copies them to new device tensors without blocking (and remembers when
    those copies are done, so that a buffer is refilled only then), and :meth:`to_host` copies
    device tensors into pinned host tensors and waits once for all of them. On the CPU
    :meth:`staging` is empty (the decoder allocates as before) and both copies are the identity.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_gpu = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def staging(self, specs: Iterable[pb.TensorSpec]) -> dict[str, torch.Tensor]:
        """Pinned host buffers for the tensors ``specs`` declare (GPU only), to decode into."""
        if not self.on_gpu:
            return {}
        if self._copied is not None:
            self._copied.synchronize()  # the last copies out of these buffers have finished
            self._copied = None
        buffers = {}
        for spec in specs:
            dtype, shape = DTYPES.get(spec.dtype), tuple(spec.shape)
            if dtype is None or any(d < 0 for d in shape):
                continue  # a malformed spec: the decoder rejects it with its own error
            held = self._buffers.get(spec.name)
            if held is None or held.dtype != dtype or tuple(held.shape) != shape:
                held = self._buffers[spec.name] = torch.empty(shape, dtype=dtype, pin_memory=True)
            buffers[spec.name] = held
        return buffers

    def to_device(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` as new tensors on the device (the same tensors on the CPU)."""
        if not self.on_gpu:
            return dict(tensors)
        moved = {name: tensor.to(self.device, non_blocking=True) for name, tensor in tensors.items()}
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return moved

    def to_host(self, *groups: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each group of tensors as host tensors (contiguous, pinned), after one wait for every
        copy; on the CPU the tensors themselves."""
        if not self.on_gpu:
            return [dict(group) for group in groups]
        moved = []
        for group in groups:
            out = {}
            for name, tensor in group.items():
                host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
                out[name] = host.copy_(tensor.detach(), non_blocking=True)
            moved.append(out)
        torch.cuda.current_stream(self.device).synchronize()
        return moved


class PeakMemory:
    """The process's peak GPU memory over one task: reset when the task starts, read when it
    ends (``torch.cuda.max_memory_allocated``: every tensor the process holds, data and cache
    included). Nothing on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def metrics(self) -> dict[str, float]:
        """``{gpu_peak_bytes: ...}`` on a GPU, ``{}`` on the CPU."""
        if self.device.type != "cuda":
            return {}
        return {"gpu_peak_bytes": float(torch.cuda.max_memory_allocated(self.device))}

