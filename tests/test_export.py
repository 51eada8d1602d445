"""``fedpart export`` and ``fedpart.api.load_model``: personalized models taken away from a run
and rebuilt, in a fresh process without the run directory, with the accuracy the run reported."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from conftest import REPO, WAIT, child_env, fedpart_command, read_summary, run_fedpart
from fedpart.api import build_algorithm, build_model, load_model, read_export_metadata
from fedpart.api.exported import EXPORT_FORMAT, write_exported_model
from fedpart.client.store import ClientStore
from fedpart.cli.export import MANIFEST, ExportError, add_export_parser, run_export

ROUNDS = 2


def export(run_dir: Path, out: Path, *state_dirs: Path) -> int:
    """``run_export`` on arguments parsed by the ``export`` parser, as ``fedpart export`` parses them."""
    parser = argparse.ArgumentParser(prog="fedpart")
    add_export_parser(parser.add_subparsers(dest="command"))
    argv = ["export", str(run_dir), "--out", str(out)]
    for state_dir in state_dirs:
        argv += ["--state-dir", str(state_dir)]
    return run_export(parser.parse_args(argv))


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled quickstart (FedBABU on digits, 10 clients in 2 processes), cut to 2 rounds."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["rounds"] = ROUNDS
    completed, out = run_fedpart(config, tmp_path_factory.mktemp("quickstart"))
    assert completed.returncode == 0, completed.stderr
    return out


@pytest.fixture(scope="module")
def exported(quickstart_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "models"
    assert export(quickstart_run, out) == 0
    return out


def test_export_writes_one_model_per_client_with_metadata_and_a_manifest(quickstart_run: Path, exported: Path) -> None:
    summary = read_summary(quickstart_run)
    config = yaml.safe_load((quickstart_run / "config.yaml").read_text())
    run_id = json.loads((quickstart_run / "server_state" / "state.json").read_text())["run_id"]
    manifest = json.loads((exported / MANIFEST).read_text())
    assert manifest["run_id"] == run_id
    assert manifest["run"]["status"] == summary["status"]
    assert manifest["run"]["accuracy"] == summary["accuracy"]
    assert manifest["clients_without_model"] == []
    assert [entry["client_id"] for entry in manifest["clients"]] == list(range(config["clients"]))
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        [MANIFEST] + [f"client_{c}.safetensors" for c in range(config["clients"])])
    for entry, reported in zip(manifest["clients"], summary["per_client"]):
        client = entry["client_id"]
        hosting = quickstart_run / entry["process"]
        assert ClientStore(hosting, run_id).personalized_models()[client].is_file()
        metadata = read_export_metadata(exported / entry["file"])
        assert metadata == entry["metadata"]
        assert (metadata["format"], metadata["run_id"], metadata["client_id"]) == (EXPORT_FORMAT, run_id, client)
        assert metadata["algorithm"] == {"name": config["algorithm"]["name"], "options": {}}
        assert metadata["model"] == {"name": config["model"]["name"], "options": {}}
        assert (metadata["num_classes"], metadata["input_shape"]) == (10, [1, 8, 8])  # digits, left null in config.yaml
        assert metadata["finetune_epochs"] == max(config["evaluate"]["finetune_epochs"])
        assert metadata["accuracy"]["initial"] == reported["initial"]
        assert metadata["accuracy"]["personalized"] == reported["personalized"]
        assert metadata["test_samples"] == reported["test_samples"]
    processes = {entry["process"] for entry in manifest["clients"]}
    assert processes == {"state/process_0", "state/process_1"}


FRESH_PROCESS_ACCURACY = """
import json, sys
import torch
from fedpart.api import load_dataset, load_model, make_partition, read_export_metadata

results = {}
for path in sys.argv[1:]:
    model = load_model(path)
    assert isinstance(model, torch.nn.Module) and not model.training
    meta = read_export_metadata(path)
    data = meta["data"]
    dataset = load_dataset(data["dataset"], None, **data["options"])
    split = make_partition(dataset.y_train, dataset.y_test, data["clients"], data["partition"]["scheme"],
                           data["partition_seed"], num_classes=dataset.num_classes,
                           **data["partition"]["options"])[meta["client_id"]]
    x, y = dataset.features(dataset.x_test[split.test]), dataset.targets(dataset.y_test[split.test])
    with torch.no_grad():
        correct = int((model(x).argmax(dim=1) == y).sum())
    results[meta["client_id"]] = [correct, len(y)]
print(json.dumps(results))
"""


def test_exported_model_reproduces_the_reported_personalized_accuracy_in_a_fresh_process(
        quickstart_run: Path, exported: Path, tmp_path: Path) -> None:
    summary = read_summary(quickstart_run)
    epochs = str(read_export_metadata(exported / "client_0.safetensors")["finetune_epochs"])
    reported = {entry["id"]: entry for entry in summary["per_client"]}
    # the saved model is the fine-tuned one, not the global model: some client's accuracy tells them apart
    assert any(entry["personalized"][epochs] != entry["initial"] for entry in reported.values())
    taken_away = tmp_path / "taken_away"
    shutil.copytree(exported, taken_away)
    hidden_run = quickstart_run.with_name(quickstart_run.name + "_hidden")
    quickstart_run.rename(hidden_run)
    try:
        files = sorted(str(p) for p in taken_away.glob("client_*.safetensors"))
        completed = subprocess.run([sys.executable, "-c", FRESH_PROCESS_ACCURACY, *files], capture_output=True,
                                   text=True, timeout=WAIT, cwd=tmp_path, env=child_env())
    finally:
        hidden_run.rename(quickstart_run)
    assert completed.returncode == 0, completed.stderr
    measured = {int(client): counts for client, counts in json.loads(completed.stdout).items()}
    assert set(measured) == set(reported)
    for client, (correct, samples) in measured.items():
        assert samples == reported[client]["test_samples"]
        assert correct == round(reported[client]["personalized"][epochs] * samples), client


def test_export_refuses_an_out_dir_that_is_not_empty(quickstart_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        export(quickstart_run, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_without_client_state_says_where_it_looked(quickstart_run: Path, tmp_path: Path) -> None:
    server_only = tmp_path / "server_run"
    server_only.mkdir()
    for name in ("config.yaml", "summary.json"):
        shutil.copy(quickstart_run / name, server_only / name)
    shutil.copytree(quickstart_run / "server_state", server_only / "server_state")
    with pytest.raises(ExportError, match="--state-dir"):
        export(server_only, tmp_path / "out")
    unrelated = tmp_path / "unrelated_state"
    unrelated.mkdir()
    with pytest.raises(ExportError, match=str(unrelated)):
        export(server_only, tmp_path / "out", unrelated)
    assert not (tmp_path / "out").exists()


def test_export_from_a_client_process_state_dir_outside_the_run_dir(quickstart_run: Path, tmp_path: Path) -> None:
    """A client machine's ``--state-dir``: only its clients are exported, named by that dir."""
    machine_state = tmp_path / "machine" / "fedpart-state"
    shutil.copytree(quickstart_run / "state" / "process_1", machine_state)
    hosted = sorted(ClientStore(machine_state, ClientStore.latest_run(machine_state)).personalized_models())
    out = tmp_path / "out"
    assert export(quickstart_run, out, machine_state) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert [entry["client_id"] for entry in manifest["clients"]] == hosted
    assert {entry["process"] for entry in manifest["clients"]} == {str(machine_state.resolve())}
    assert manifest["clients_without_model"] == [c for c in range(manifest["run"]["clients"]) if c not in hosted]


def test_fedpart_export_command(quickstart_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    completed = subprocess.run(fedpart_command("export", str(quickstart_run), "--out", str(out)), capture_output=True,
                               text=True, timeout=WAIT, env=child_env())
    assert completed.returncode == 0, completed.stderr
    assert "exported 10 personalized model(s)" in completed.stdout
    assert (out / MANIFEST).is_file()
    refused = subprocess.run(fedpart_command("export", str(quickstart_run), "--out", str(out)), capture_output=True,
                             text=True, timeout=WAIT, env=child_env())
    assert refused.returncode == 2
    assert "fedpart export: error:" in refused.stderr and "not an empty directory" in refused.stderr


def _metadata(algorithm: str, model: str, options: dict) -> dict:
    return {"format": EXPORT_FORMAT, "run_id": "r", "client_id": 3, "model": {"name": model, "options": options},
            "algorithm": {"name": algorithm, "options": {}}, "num_classes": 4, "input_shape": [1, 8, 8],
            "finetune_epochs": 1}


def test_load_model_adds_the_algorithms_extra_parts(tmp_path: Path) -> None:
    """FedRoD's personal head is a part of the saved model; the loader builds it before loading."""
    model = build_algorithm("fedrod").add_parts(build_model("mlp", 4, (1, 8, 8), seed=7, hidden=16))
    assert list(model.parts)
    path = tmp_path / "fedrod.safetensors"
    write_exported_model(path, model.state_dict(), _metadata("fedrod", "mlp", {"hidden": 16}))
    loaded = load_model(path)
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    assert not loaded.training
    assert torch.equal(loaded(x), model.eval()(x))


def test_load_model_refuses_a_file_fedpart_did_not_export(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="no fedpart metadata"):
        load_model(path)
    with pytest.raises(ValueError, match="lacks"):
        write_exported_model(tmp_path / "x.safetensors", {"w": torch.zeros(2)}, {"format": EXPORT_FORMAT})


def test_a_client_found_in_two_state_dirs_comes_from_the_newer_file(quickstart_run: Path, tmp_path: Path) -> None:
    """A client whose process moved left a model in each state dir; its last evaluation wrote the newer."""
    earlier, later = tmp_path / "earlier", tmp_path / "later"
    for state_dir in (earlier, later):
        shutil.copytree(quickstart_run / "state" / "process_0", state_dir)
    run_id = ClientStore.latest_run(earlier)
    for state_dir, mtime in ((earlier, 1_000_000_000), (later, 1_000_000_100)):
        for path in ClientStore(state_dir, run_id).personalized_models().values():
            os.utime(path, (mtime, mtime))
    out = tmp_path / "out"
    assert export(quickstart_run, out, earlier, later) == 0
    entries = json.loads((out / MANIFEST).read_text())["clients"]
    assert entries and {entry["process"] for entry in entries} == {str(later.resolve())}


def test_the_store_lists_only_client_dirs_with_a_personalized_model(tmp_path: Path) -> None:
    store = ClientStore(tmp_path, "run-1")
    store.save_personalized(4, {"w": torch.ones(1)})
    store.save_personal(2, 1, {"head.weight": torch.ones(1)})
    (store.root / "client_x").mkdir()
    (store.root / "client_x" / "personalized.safetensors").write_bytes(b"")
    assert store.personalized_models() == {4: store.personalized_path(4)}
