"""Per-client state on the device: personal parts, error-feedback residuals and personalized
models, under the state dir.

Layout: ``<state_dir>/<run_id>/client_<id>/personal.safetensors`` (tensors of the parts the
algorithm keeps on the client, as the client's last training left them),
``personal_start_<round>.safetensors`` (the personal parts that training round started from),
``residual.safetensors`` and ``residual_start_<round>.safetensors`` (the same for the upload
codec's error-feedback residuals: what earlier uploads did not carry) and
``personalized.safetensors`` (the whole model after the final evaluation's longest fine-tune;
``fedpart export`` takes these away, :meth:`ClientStore.personalized_models` finds them);
``<state_dir>/latest_run`` names the run last served. The state survives a client process
restart within a run; nothing here is ever sent unless the algorithm uploads it.

A resumed server redoes the round it lost, which the client may already have trained: that round
starts again from its start files, so the redone round gives the same result.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from fedpart.common.process.checkpoint import load_tensors, save_tensors
from fedpart.common.ml.split_model import tensor_part


PERSONAL = "personal"
RESIDUAL = "residual"
PERSONALIZED_FILE = "personalized.safetensors"
CLIENT_DIR_PREFIX = "client_"


class ClientStore:
    """Personal tensors and residuals of the hosted clients, cached in memory and mirrored to disk."""

    def __init__(self, state_dir: str | Path, run_id: str) -> None:
        self.root = Path(state_dir) / run_id
        self._latest_state: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (client, kind) -> tensors

    @staticmethod
    def latest_run(state_dir: str | Path) -> str:
        """The run this state dir served last ('' if none)."""
        marker = Path(state_dir) / "latest_run"
        return marker.read_text().strip() if marker.is_file() else ""

    def mark_latest(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root.parent / "latest_run").write_text(self.root.name)

    def _dir(self, client: int) -> Path:
        return self.root / f"{CLIENT_DIR_PREFIX}{client}"

    def _start_path(self, client: int, kind: str, round_number: int) -> Path:
        return self._dir(client) / f"{kind}_start_{round_number:04d}.safetensors"

    def _latest(self, client: int, kind: str) -> dict[str, torch.Tensor]:
        """The client's ``kind`` tensors after its last training (empty if it has none yet)."""
        if (client, kind) not in self._latest_state:
            path = self._dir(client) / f"{kind}.safetensors"
            self._latest_state[(client, kind)] = load_tensors(path) if path.is_file() else {}
        return self._latest_state[(client, kind)]

    def _at_start(self, client: int, kind: str, round_number: int) -> dict[str, torch.Tensor]:
        """The ``kind`` tensors round ``round_number`` starts from: the start of that round when
        it is being trained again, else the latest."""
        start = self._start_path(client, kind, round_number)
        return load_tensors(start) if start.is_file() else self._latest(client, kind)

    def _save(self, client: int, kind: str, round_number: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the ``kind`` tensors round ``round_number`` left, and what it started from."""
        start = self._start_path(client, kind, round_number)
        if not start.is_file():
            save_tensors(start, self._latest(client, kind))
            for older in self._dir(client).glob(f"{kind}_start_*.safetensors"):
                if older != start:
                    older.unlink()
        cpu = {k: v.detach().to("cpu").clone() for k, v in tensors.items()}
        self._latest_state[(client, kind)] = cpu
        save_tensors(self._dir(client) / f"{kind}.safetensors", cpu)

    def personal(self, client: int, round_number: int) -> dict[str, torch.Tensor]:
        """The personal tensors round ``round_number`` starts from."""
        return self._at_start(client, PERSONAL, round_number)

    def personal_parts(self, client: int) -> list[str]:
        """Parts (``body``/``head``) the client holds a personal copy of."""
        return sorted({tensor_part(name) for name in self._latest(client, PERSONAL)})

    def save_personal(self, client: int, round_number: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the personal tensors round ``round_number`` trained, and what it started from."""
        self._save(client, PERSONAL, round_number, tensors)

    def residuals(self, client: int, round_number: int) -> dict[str, torch.Tensor]:
        """The error-feedback residuals (by tensor name) round ``round_number``'s upload adds to
        its deltas."""
        return self._at_start(client, RESIDUAL, round_number)

    def save_residuals(self, client: int, round_number: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the residuals round ``round_number``'s upload left, and what it started from."""
        self._save(client, RESIDUAL, round_number, tensors)

    def personalized_path(self, client: int) -> Path:
        """Where the client's personalized model lies (whether or not it was written yet)."""
        return self._dir(client) / PERSONALIZED_FILE

    def save_personalized(self, client: int, state: Mapping[str, torch.Tensor]) -> Path:
        """Keep the client's whole personalized model (its state dict); returns the file."""
        path = self.personalized_path(client)
        save_tensors(path, state)
        return path

    def personalized_models(self) -> dict[int, Path]:
        """The personalized model file of every client of this run that has one, by client id."""
        found = {}
        for path in self.root.glob(f"{CLIENT_DIR_PREFIX}*/{PERSONALIZED_FILE}"):
            suffix = path.parent.name[len(CLIENT_DIR_PREFIX):]
            if suffix.isdigit():
                found[int(suffix)] = path
        return dict(sorted(found.items()))
