"""deploy/: the Dockerfiles, the Compose files and the Kubernetes manifests are well-formed, mount
only files that ``fedpart certs`` writes (never the CA key), and run ``fedpart`` command lines that
``fedpart``'s own parser accepts, each pointing at files its container really mounts."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from string import Template
from typing import Any

import pytest
import yaml

from fedpart.common.config.run_config import load_config
from fedpart.common.process.limits import CpuBudget, client_threads
from fedpart.cli.main import build_parser, resolve_config_path
from fedpart.common.wire.client_ids import split_clients
from fedpart.common.wire.security import ClientSecurity
from fedpart.server.transport.health import RUN_SERVICE

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
K8S_BASE = DEPLOY / "k8s" / "base"
K8S_GPU = DEPLOY / "k8s" / "gpu"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]

# The run the deploy files are written for: `fedpart certs --out deploy/secrets --server-names server
# --clients 10 --processes 2` and the bundled quickstart config.
RUN_CONFIG = "quickstart"
RUN_DIR = "/runs/quickstart"
CLIENTS = 10
PROCESSES = 2
SERVER_NAME = "server"
TORCH_PIN = "torch==2.13.0"
# Options whose value is a file the process reads: each must be a file its container mounts.
FILE_OPTIONS = ("--tls-cert", "--tls-key", "--client-ca", "--credentials", "--ca", "--token-file", "--cert", "--key")


def process_files(process: int) -> set[str]:
    """The token, certificate and key ``fedpart certs`` writes for client process ``process``."""
    return {f"process_{process}.{suffix}" for suffix in ("token", "pem", "key")}


def certs_outputs(processes: int) -> set[str]:
    """The files ``fedpart certs --processes K`` writes (the interface fixed in the issue 6 brief)."""
    per_process = set().union(*(process_files(k) for k in range(processes)))
    return {"ca.pem", "ca.key", "server.pem", "server.key", "credentials.yaml"} | per_process


def options(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command line (every deploy command passes values, no switches)."""
    return {flag: value for flag, value in zip(argv, argv[1:], strict=False) if flag.startswith("--")}


def parse_fedpart(argv: list[str]) -> None:
    """Fail the test with the command line when ``fedpart``'s parser refuses it."""
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"fedpart refuses: fedpart {shlex.join(argv)}") from None


def asks_in_plaintext(health_argv: list[str]) -> bool:
    """Whether a ``fedpart health`` command line speaks plaintext, as a --health-port needs."""
    args = build_parser().parse_args(health_argv)
    return ClientSecurity.from_options(args.ca, args.server_name, args.token_file, args.cert, args.key,
                                       args.insecure, credential_required=False).insecure


def check_server_command(argv: list[str]) -> None:
    """The server runs the run config into its run dir with TLS and tokens, or resumes that run dir
    (whose config.yaml it reads: no CONFIG then)."""
    flags = options(argv)
    assert {"--tls-cert", "--tls-key", "--client-ca", "--credentials"} <= set(flags)
    if "--resume" in flags:
        assert argv[1] == "--resume" and flags["--resume"] == RUN_DIR and "--out" not in flags
    else:
        assert argv[:2] == ["server", RUN_CONFIG] and flags["--out"] == RUN_DIR


def check_client_command(argv: list[str]) -> int:
    """A client process K hosts the ids ``fedpart certs`` gave process_K, with process_K's files."""
    flags = options(argv)
    assert argv[0] == "client"
    assert flags["--server-name"] == SERVER_NAME
    process = int(re.fullmatch(r"process_(\d+)\.token", PurePosixPath(flags["--token-file"]).name)[1])
    assert PurePosixPath(flags["--cert"]).name == f"process_{process}.pem"
    assert PurePosixPath(flags["--key"]).name == f"process_{process}.key"
    assert PurePosixPath(flags["--ca"]).name == "ca.pem"
    assert flags["--clients"] == split_clients(CLIENTS, PROCESSES)[process]
    return process


def load_yaml(path: Path) -> list[Any]:
    return list(yaml.safe_load_all(path.read_text()))


# --------------------------------------------------------------------------------------- all YAML


def deploy_yaml_files() -> list[Path]:
    secrets = DEPLOY / "secrets"
    return sorted(p for p in DEPLOY.rglob("*.y*ml") if secrets not in p.parents)


def test_every_deploy_yaml_parses_into_mappings():
    files = deploy_yaml_files()
    assert {COMPOSE, COMPOSE_GPU, K8S_BASE / "kustomization.yaml", K8S_GPU / "kustomization.yaml"} <= set(files)
    for path in files:
        documents = load_yaml(path)
        assert documents, path
        assert all(isinstance(document, dict) for document in documents), path


def test_deploy_files_are_written_for_the_run_config():
    assert load_config(resolve_config_path(RUN_CONFIG)).clients == CLIENTS


# ------------------------------------------------------------------------------------ Dockerfiles


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            instructions.append((keyword.upper(), " ".join(arguments.split())))
    return instructions


@dataclass
class Stage:
    """A build stage: the image or stage it starts ``FROM``, and its instructions."""

    base: str
    instructions: list[tuple[str, str]]

    def arguments(self, keyword: str) -> list[str]:
        return [arguments for k, arguments in self.instructions if k == keyword]


def dockerfile_stages(path: Path) -> tuple[dict[str, str], dict[str, Stage]]:
    """The build arguments declared before the first FROM (name -> default) and the stages by name."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, arguments in dockerfile_instructions(path):
        if keyword == "FROM":
            base, name = re.fullmatch(r"(\S+) AS (\S+)", arguments, re.IGNORECASE).groups()
            current = stages[name] = Stage(base, [])
        elif current is None:
            assert keyword == "ARG", f"{path.name}: only ARG before the first FROM"
            name, _, default = arguments.partition("=")
            global_args[name] = default
        else:
            current.instructions.append((keyword, arguments))
    return global_args, stages


def inherited(stages: dict[str, Stage], name: str, keyword: str) -> str | None:
    """The last ``keyword`` in effect in stage ``name``, following its bases through the stages."""
    while name in stages:
        found = stages[name].arguments(keyword)
        if found:
            return found[-1]
        name = stages[name].base
    return None


def pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib: Python 3.11 or later")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def pip_install_targets(run: str) -> list[str]:
    """What one ``RUN`` line's ``pip install`` commands install (their non-option words)."""
    targets = []
    for command in re.split(r"&&|;", run):
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            values = {i + 1 for i, word in enumerate(words) if word in ("--index-url", "--extra-index-url")}
            targets += [w for i, w in enumerate(words[2:], 2) if not w.startswith("-") and i not in values]
    return targets


# What each Dockerfile builds: its build arguments' defaults (the public base image and torch index
# a user's machine reaches) and the extras of fedpart each final stage installs.
DOCKERFILE_DEFAULTS = {
    "Dockerfile": {"BASE_IMAGE": "python:3.12-slim", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"},
    "Dockerfile.cuda": {"BASE_IMAGE": "nvidia/cuda:12.8.1-runtime-ubuntu24.04", "TORCH_INDEX_URL": "https://pypi.org/simple"},
}
IMAGE_EXTRAS = {"Dockerfile": {"client": set(), "server": {"server", "metrics"}}, "Dockerfile.cuda": {"client": set()}}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_build_arguments_default_to_the_public_base_image_and_torch_index(path: Path):
    """BASE_IMAGE and TORCH_INDEX_URL let a machine without the public registry and index build the
    images (CI: a debootstrapped base and a local index); their defaults are what a user gets."""
    global_args, stages = dockerfile_stages(path)
    defaults = DOCKERFILE_DEFAULTS[path.name]
    assert global_args == {"BASE_IMAGE": defaults["BASE_IMAGE"]}
    (first, *_) = stages.values()
    assert first.base == "${BASE_IMAGE}" and stages["torch"] is first
    assert first.arguments("ARG") == [f"TORCH_INDEX_URL={defaults['TORCH_INDEX_URL']}"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_torch_from_its_index_then_fedpart_from_a_wheel_with_only_the_extras_it_needs(path: Path):
    """torch, pinned, from TORCH_INDEX_URL in the stage every image starts from; the sources are
    copied into the wheel stage only, and each image installs the wheel with its own extras."""
    _, stages = dockerfile_stages(path)
    runs = [run for stage in stages.values() for run in stage.arguments("RUN")]
    assert not any("torchvision" in run for run in runs)
    torch_installs = [run for run in stages["torch"].arguments("RUN") if TORCH_PIN in pip_install_targets(run)]
    assert len(torch_installs) == 1 and pip_install_targets(torch_installs[0]) == [TORCH_PIN]
    assert '--index-url "$TORCH_INDEX_URL"' in torch_installs[0]
    copies = {name: [c for c in stage.arguments("COPY") if c.split()[0] == "."] for name, stage in stages.items()}
    assert {name for name, found in copies.items() if found} == {"wheel"}
    assert stages["wheel"].base == "torch"
    optional = pyproject()["project"]["optional-dependencies"]
    finals = {name: stage for name, stage in stages.items() if name not in ("torch", "wheel")}
    assert set(finals) == set(IMAGE_EXTRAS[path.name])
    for name, stage in finals.items():
        assert stage.base == "torch" and stage.arguments("COPY") == ["--from=wheel /tmp/wheels /tmp/wheels"]
        (run,) = stage.arguments("RUN")
        (install,) = pip_install_targets(run)
        assert "/tmp/wheels/fedpart-*.whl" in run, "the wheel of the wheel stage"
        extras = re.search(r"\[([\w,-]+)\]$", install)
        assert set(extras[1].split(",") if extras else ()) == IMAGE_EXTRAS[path.name][name]
        assert IMAGE_EXTRAS[path.name][name] <= set(optional)
        assert not any(TORCH_PIN in run for run in stage.arguments("RUN")), "torch is the shared layer below"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_images_run_fedpart_as_a_non_root_user(path: Path):
    _, stages = dockerfile_stages(path)
    for name in IMAGE_EXTRAS[path.name]:
        assert inherited(stages, name, "USER").split(":")[0] not in ("root", "0"), name
        assert json.loads(inherited(stages, name, "ENTRYPOINT")) == ["fedpart"]
        parse_fedpart(json.loads(inherited(stages, name, "CMD")))
    assert stages["torch"].arguments("USER") == [], "the virtual environment stays root's"


def test_server_image_declares_its_ports_and_its_healthcheck_asks_the_health_service(k8s_command_lines):
    """The server image EXPOSEs the ports deploy/'s server commands use (gRPC, --health-port,
    --metrics-port) and its HEALTHCHECK is ``fedpart health`` on the --health-port, which Compose
    inherits; the client images have neither."""
    _, stages = dockerfile_stages(DEPLOY / "Dockerfile")
    server_commands = [s["command"] for s in compose_services(COMPOSE).values() if s["command"][0] == "server"]
    server_commands += [argv for component, argv, _ in k8s_command_lines if component == "server"]
    (health_port,) = {options(argv)["--health-port"] for argv in server_commands}
    ports = {options(argv)["--address"].rsplit(":", 1)[1] for argv in server_commands} | {health_port}
    ports |= {options(argv)["--metrics-port"] for argv in server_commands if "--metrics-port" in options(argv)}
    assert set(" ".join(stages["server"].arguments("EXPOSE")).split()) == ports
    (healthcheck,) = stages["server"].arguments("HEALTHCHECK")
    settings, _, command = healthcheck.partition(" CMD ")
    test = json.loads(command)
    assert test[0] == "fedpart"
    parse_fedpart(test[1:])
    assert test[1] == "health" and options(test[1:])["--server"] == f"127.0.0.1:{health_port}"
    assert asks_in_plaintext(test[1:]), "the health port answers in plaintext"
    assert "--start-period=" in settings
    for name, stage in stages.items():
        if name != "server":
            assert not stage.arguments("HEALTHCHECK") and not stage.arguments("EXPOSE"), name
    assert all("healthcheck" not in service for service in compose_services(COMPOSE).values())


def test_compose_and_kubernetes_run_the_images_the_docs_build():
    """Servers run the server image, clients the client image (or the CUDA one), and
    docs/deploy.md builds each from the Dockerfile and target that Compose names."""
    images: dict[str, tuple[str, str | None]] = {}
    for variant in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        for service in compose_services(*variant).values():
            build = service["build"]
            images.setdefault(service["image"], (build["dockerfile"], build.get("target")))
            assert images[service["image"]] == (build["dockerfile"], build.get("target"))
            expected = "server" if service["command"][0] == "server" else "client"
            assert build.get("target", "client") == expected
    assert images == {"fedpart:server": ("deploy/Dockerfile", "server"),
                      "fedpart:client": ("deploy/Dockerfile", "client"), "fedpart:cuda": ("deploy/Dockerfile.cuda", None)}
    objects = k8s_objects(K8S_BASE)
    assert container_of(objects, "Deployment")["image"] == "fedpart:server"
    assert container_of(objects, "Job")["image"] == "fedpart:client"
    (patch,) = load_yaml(K8S_GPU / "clients-gpu.yaml")
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == "fedpart:cuda"
    built = set()
    for line in (REPO / "docs" / "deploy.md").read_text().splitlines():
        if line.startswith("docker build "):
            argv = shlex.split(line.split("#")[0])
            flags = options(argv)
            built.add((flags["--tag"], (flags["--file"], flags.get("--target"))))
            assert argv[-1] == "."
    assert built == set(images.items())


def test_compose_file_is_valid_for_compose_1_and_2():
    """No top-level ``name:`` (Compose 1, Debian's docker-compose 1.29, refuses it: the project name
    is given with -p) and only the top-level keys both know."""
    for path in (COMPOSE, COMPOSE_GPU):
        top = set(yaml.safe_load(path.read_text()))
        assert {key for key in top if not key.startswith("x-")} <= {"services", "secrets", "volumes", "networks"}
    for line in (REPO / "docs" / "deploy.md").read_text().splitlines():
        if line.startswith("docker compose "):
            assert shlex.split(line)[2:4] == ["-p", "fedpart"], line


def test_dockerignore_keeps_runs_venvs_and_secrets_out_of_the_build_context(tmp_path: Path):
    """Docker's own matching of .dockerignore (docker-py's, the one Compose 1 uses), over the
    repository's tracked files and what an operator's checkout may hold besides: only the packages,
    pyproject.toml and README.md enter the build context."""
    from docker.utils.build import exclude_paths

    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True,
                             timeout=60).stdout.split()
    local = [".venv/bin/python", ".venv-cpu/lib/x.py", "venv/pyvenv.cfg", "server/.venv/x", "runs/quickstart/summary.json",
             "client/runs/a/config.yaml", "fedpart-state/client_0/head.safetensors", "out/summary.json",
             "deploy/secrets/ca.key", "deploy/secrets/process_0.token", "secrets/server.key",
             "my-secrets/server.key", "credentials.yaml", "process_3.token", "build/lib/x.py",
             "fedpart.egg-info/PKG-INFO", "common/__pycache__/x.pyc", "notes/todo.md", "CHANGES.md",
             "server/runs/x/summary.json", "deploy/k8s/local/secret.yaml"]
    for name in tracked + local:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    context = {path for path in exclude_paths(str(tmp_path), patterns) if (tmp_path / path).is_file()}
    assert not context & set(local), sorted(context & set(local))
    setuptools = pyproject()["tool"]["setuptools"]
    packages = set(setuptools["package-dir"].values())
    assert "fedpart.deploy" not in setuptools["package-data"], "the deploy package is its .py files"
    needed = {"pyproject.toml", "README.md"} | {f for f in tracked if f.split("/")[0] in packages
                                                and not (f.startswith("deploy/") and not f.endswith(".py"))}
    assert context - {".dockerignore"} == needed


# --------------------------------------------------------------------------------- Docker Compose


def compose_services(*paths: Path) -> dict[str, dict[str, Any]]:
    """Services of Compose files merged as ``docker compose -f A -f B`` does for the keys used here."""
    services: dict[str, dict[str, Any]] = {}
    for path in paths:
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            services[name] = {**services.get(name, {}), **service}
    return services


def mount_targets(service: dict[str, Any]) -> list[str]:
    return [volume.split(":")[1] for volume in service.get("volumes", [])]


def test_compose_mounts_only_files_that_fedpart_certs_writes():
    compose = yaml.safe_load(COMPOSE.read_text())
    secrets = compose["secrets"]
    for name, secret in secrets.items():
        assert PurePosixPath(secret["file"]) == PurePosixPath("secrets") / name
    assert set(secrets) <= certs_outputs(PROCESSES) - {"ca.key"}
    for name, service in compose["services"].items():
        assert set(service.get("secrets", [])) <= set(secrets), name


def test_compose_command_lines_read_their_mounted_secrets_and_cover_every_client_once():
    for variant in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        services = compose_services(*variant)
        assert services["server-resume"]["networks"]["default"]["aliases"] == [SERVER_NAME]
        port = options(services[SERVER_NAME]["command"])["--address"].rsplit(":", 1)[1]
        hosted = []
        for name, service in services.items():
            argv = service["command"]
            flags = options(argv)
            for flag in FILE_OPTIONS:
                if flag in flags:
                    path = PurePosixPath(flags[flag])
                    assert path.parent == PurePosixPath("/run/secrets"), (name, flag)
                    assert path.name in service["secrets"], (name, flag)
            if argv[0] == "server":
                check_server_command(argv)
                assert service["ports"] == [f"{port}:{port}"]
                assert any(PurePosixPath(t) in PurePosixPath(flags.get("--out", flags.get("--resume"))).parents for t in mount_targets(service))
                assert ("--resume" in flags) == (name == "server-resume")
            else:
                process = check_client_command(argv)
                assert flags["--server"] == f"{SERVER_NAME}:{port}"
                assert set(service["secrets"]) == {"ca.pem"} | process_files(process)
                assert flags["--state-dir"] in mount_targets(service)
                hosted.append(process)
        assert sorted(hosted) == list(range(PROCESSES))


def test_compose_command_lines_parse():
    for variant in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        for service in compose_services(*variant).values():
            parse_fedpart(service["command"])


def test_compose_gpu_variant_gives_each_client_its_own_gpu():
    base = compose_services(COMPOSE)
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]
    assert set(gpu) == {name for name, service in base.items() if service["command"][0] == "client"}
    gpus = []
    for name, service in gpu.items():
        assert service["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        assert (REPO / service["build"]["dockerfile"]).is_file()
        device_index = service["command"].index("--device") + 1
        assert service["command"][device_index] == "cuda:0"
        expected = list(base[name]["command"])
        expected[device_index] = "cuda:0"
        assert service["command"] == expected, "the GPU command differs from the CPU one only in --device"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        (gpu_id,) = device["device_ids"]
        gpus.append(gpu_id)
    assert len(set(gpus)) == len(gpus)


# ------------------------------------------------------------------------------------- Kubernetes


def k8s_objects(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The objects of a kustomization's resource files, keyed by (kind, name)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = {}
    for resource in kustomization["resources"]:
        for document in load_yaml(directory / resource):
            objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> file names, from the ``kubectl create secret generic`` lines of docs/deploy.md."""
    secrets = {}
    for line in (REPO / "docs" / "deploy.md").read_text().splitlines():
        if line.startswith("kubectl create secret generic "):
            argv = shlex.split(line)
            secrets[argv[4]] = {a.removeprefix("--from-file=") for a in argv[5:] if a.startswith("--from-file=")}
    return secrets


def pod_spec(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    (spec,) = [o["spec"]["template"]["spec"] for (k, _), o in objects.items() if k == kind]
    return spec


def secret_mounts(spec: dict[str, Any]) -> dict[PurePosixPath, str]:
    """Mount path -> Secret name for the one container of a pod spec."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    (container,) = spec["containers"]
    mounts = [m for m in container["volumeMounts"] if m["name"] in secrets]
    return {PurePosixPath(m["mountPath"]): secrets[m["name"]] for m in mounts}


def fedpart_lines(spec: dict[str, Any], variables: dict[str, str]) -> list[list[str]]:
    """The ``exec fedpart ...`` lines of a container's ``sh -c`` script, shell variables filled in."""
    (container,) = spec["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    lines = [line.strip() for line in script.splitlines() if line.strip().startswith("exec fedpart ")]
    return [shlex.split(Template(line).substitute(variables))[2:] for line in lines]


def client_variables(spec: dict[str, Any], index: int) -> dict[str, str]:
    """The pod's environment for completion index ``index``, with CLIENTS as its script computes it."""
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]} | {"JOB_COMPLETION_INDEX": str(index)}
    (script,) = container["args"]
    assignment = re.search(r"^CLIENTS=\$\((.*)\)$", script, re.MULTILINE)[1]
    program = shlex.split(assignment)
    assert program[:2] == ["python", "-c"]
    result = subprocess.run([sys.executable, "-c", program[2]], env=dict(os.environ) | env, capture_output=True,
                            text=True, timeout=120, check=True)
    return env | {"CLIENTS": result.stdout.strip()}


@pytest.fixture(scope="module")
def k8s_command_lines() -> list[tuple[str, list[str], dict[str, Any]]]:
    """(component, argv, pod spec) for the server's lines and every client index's line."""
    objects = k8s_objects(K8S_BASE)
    server, client = pod_spec(objects, "Deployment"), pod_spec(objects, "Job")
    lines = [("server", argv, server) for argv in fedpart_lines(server, {})]
    completions = objects[("Job", "fedpart-clients")]["spec"]["completions"]
    for index in range(completions):
        lines += [("client", argv, client) for argv in fedpart_lines(client, client_variables(client, index))]
    return lines


def test_k8s_objects_and_their_references():
    objects = k8s_objects(K8S_BASE)
    assert {kind for kind, _ in objects} == {"PersistentVolumeClaim", "Deployment", "Service", "Job"}
    (deployment,) = [o for (k, _), o in objects.items() if k == "Deployment"]
    (service,) = [o for (k, _), o in objects.items() if k == "Service"]
    (job,) = [o for (k, _), o in objects.items() if k == "Job"]
    assert deployment["apiVersion"] == "apps/v1" and job["apiVersion"] == "batch/v1"
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    server_spec = deployment["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in server_spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims and all(("PersistentVolumeClaim", c) in objects for c in claims)
    assert job["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(env["FEDPART_PROCESSES"]) == PROCESSES
    assert int(env["FEDPART_CLIENTS"]) == CLIENTS
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")


def test_k8s_secrets_are_created_from_fedpart_certs_outputs():
    secrets = documented_secrets()
    assert set(secrets) == {"fedpart-server", "fedpart-clients"}
    for files in secrets.values():
        assert files <= certs_outputs(PROCESSES) - {"ca.key"}
    objects = k8s_objects(K8S_BASE)
    for kind in ("Deployment", "Job"):
        assert set(secret_mounts(pod_spec(objects, kind)).values()) <= set(secrets)


def test_k8s_command_lines_read_mounted_files_and_cover_every_client_once(k8s_command_lines):
    objects = k8s_objects(K8S_BASE)
    secrets = documented_secrets()
    (service,) = [o for (k, _), o in objects.items() if k == "Service"]
    (port,) = [p["port"] for p in service["spec"]["ports"]]
    server_lines, hosted = [], []
    for component, argv, spec in k8s_command_lines:
        flags = options(argv)
        mounts = secret_mounts(spec)
        for flag in FILE_OPTIONS:
            if flag in flags:
                path = PurePosixPath(flags[flag])
                assert path.parent in mounts and path.name in secrets[mounts[path.parent]], (component, flag)
        assert argv[0] == component
        if component == "server":
            check_server_command(argv)
            assert flags["--address"] == f"0.0.0.0:{port}"
            (container,) = spec["containers"]
            volume_paths = [PurePosixPath(m["mountPath"]) for m in container["volumeMounts"]]
            assert any(p in PurePosixPath(flags.get("--out", flags.get("--resume"))).parents for p in volume_paths if p not in mounts)
            server_lines.append(argv)
        else:
            assert flags["--server"] == f"{service['metadata']['name']}:{port}"
            hosted.append(check_client_command(argv))
    assert sorted("--resume" in argv for argv in server_lines) == [False, True]
    assert sorted(hosted) == list(range(PROCESSES))


def test_k8s_command_lines_parse(k8s_command_lines):
    for _, argv, _ in k8s_command_lines:
        parse_fedpart(argv)


def test_k8s_gpu_overlay_patches_the_client_container_with_one_gpu():
    kustomization = yaml.safe_load((K8S_GPU / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../base"]
    (patch_ref,) = kustomization["patches"]
    (patch,) = load_yaml(K8S_GPU / patch_ref["path"])
    base_job = k8s_objects(K8S_BASE)[(patch["kind"], patch["metadata"]["name"])]
    (base_container,) = base_job["spec"]["template"]["spec"]["containers"]
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    assert container["name"] == base_container["name"], "a patch with another name would add a container"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"FEDPART_DEVICE": "cuda:0"}
    assert "FEDPART_DEVICE" in {e["name"] for e in base_container["env"]}
    assert container["image"] != base_container["image"]


# The Kubernetes versions the manifests are checked against: every release kubernetes-validate has
# schemas for from 1.27 on (gRPC probes are GA since 1.27).
OLDEST_K8S = (1, 27)


def strategic_merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch for what deploy/k8s/gpu patches: maps merged key by key, lists of
    named maps (containers, env) merged by name, other values replaced (as kustomize does)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{key: strategic_merge(base.get(key), value) for key, value in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i
                                                                    for i in base + patch):
        patched = {item["name"]: item for item in patch}
        merged = [strategic_merge(item, patched.pop(item["name"])) if item["name"] in patched else item
                  for item in base]
        return merged + list(patched.values())
    return patch


def test_k8s_manifests_are_valid_against_the_kubernetes_schemas():
    """Every object of the base, and the client Job as the GPU overlay patches it, against the
    OpenAPI schemas of each Kubernetes release from OLDEST_K8S on (kubernetes-validate, strict:
    an unknown or misspelt field fails too)."""
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    versions = sorted({v for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= OLDEST_K8S},
                      key=lambda v: tuple(map(int, v.split("."))))
    assert len(versions) >= 2
    objects = k8s_objects(K8S_BASE)
    (patch,) = load_yaml(K8S_GPU / "clients-gpu.yaml")
    key = (patch["kind"], patch["metadata"]["name"])
    gpu_job = strategic_merge(objects[key], patch)
    assert gpu_job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"
    for version in versions:
        for (kind, name), document in [*objects.items(), (("Job, GPU overlay", key[1]), gpu_job)]:
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                raise AssertionError(f"{kind} {name} is not valid for Kubernetes {version}: {error.message}") from None
    broken = strategic_merge(objects[key], {"spec": {"template": {"spec": {"containers": [
        {"name": "client", "resources": {"limit": {"cpu": "2"}}}]}}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, versions[-1], strict=True)


def test_k8s_server_resumes_an_interrupted_run_and_never_reruns_a_completed_one(tmp_path: Path):
    """The server pod's script, its commands echoed instead of run, on the run directory a server
    leaves: a new run without one, --resume after a crash or an interrupt (whose summary.json is
    marked interrupted), nothing once the run completed."""
    from conftest import small_config
    from fedpart.common.config.run_config import config_from_dict
    from fedpart.server.engine.coordinator import Coordinator
    from fedpart.server.engine.run_state import mark_finished, write_run_state

    (script,) = pod_spec(k8s_objects(K8S_BASE), "Deployment")["containers"][0]["args"]
    run_dir = tmp_path / "quickstart"
    runnable = script.replace(RUN_DIR, str(run_dir)).replace("exec ", "echo ")

    def branch() -> str:
        return subprocess.run(["sh", "-c", runnable], capture_output=True, text=True, timeout=60,
                              check=True).stdout

    assert "fedpart server quickstart" in branch()
    write_run_state(run_dir, Coordinator(config_from_dict(small_config()), log=lambda _: None).snapshot(1, 1.0))
    (run_dir / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    assert f"fedpart server --resume {run_dir}" in branch()
    mark_finished(run_dir)
    assert "is finished" in branch() and "sleep infinity" in branch()


# ------------------------------------------------------------------------- probes, metrics and CPUs


def container_of(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    (container,) = pod_spec(objects, kind)["containers"]
    return container


def cpus(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity (``2``, ``"1.5"``, ``"500m"``) in cores."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_k8s_server_probes_use_the_health_service_and_prometheus_scrapes_its_metrics(k8s_command_lines,
                                                                                     tmp_path: Path):
    """Readiness: the kubelet's own gRPC probe (plaintext) on --health-port, asking for the run's
    service. Liveness and startup: ``fedpart health`` on that port, passing without a server once
    the run is finished (the pod then stays up for kubectl cp). The metrics port is declared and
    annotated for Prometheus."""
    objects = k8s_objects(K8S_BASE)
    container = container_of(objects, "Deployment")
    server_lines = [argv for component, argv, _ in k8s_command_lines if component == "server"]
    (health_port,) = {int(options(argv)["--health-port"]) for argv in server_lines}
    (metrics_port,) = {int(options(argv)["--metrics-port"]) for argv in server_lines}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == health_port and ports["metrics"] == metrics_port
    annotations = objects[("Deployment", "fedpart-server")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                           "prometheus.io/path": "/metrics"}
    assert container["readinessProbe"]["grpc"] == {"port": health_port, "service": RUN_SERVICE}

    for probe in ("startupProbe", "livenessProbe"):
        shell, flag, script = container[probe]["exec"]["command"]
        assert (shell, flag) == ("/bin/sh", "-c")
        argv = shlex.split(script.rsplit("exec fedpart ", 1)[1])
        parse_fedpart(argv)
        assert argv[0] == "health" and options(argv)["--server"] == f"127.0.0.1:{health_port}"
        assert asks_in_plaintext(argv), f"{probe}: the health port answers in plaintext"
        run_dir = tmp_path / probe
        runnable = script.replace(RUN_DIR, str(run_dir)).replace("exec fedpart health", "exit 7 #")
        state = run_dir / "server_state" / "state.json"
        outcomes = []
        for text in (None, '{"finished": false}', '{"round": 20, "finished": true}'):
            if text is not None:
                state.parent.mkdir(parents=True, exist_ok=True)
                state.write_text(text)
            outcomes.append(subprocess.run(["sh", "-c", runnable], timeout=60).returncode)
        assert outcomes == [7, 7, 0], probe  # asks the server, unless the run is finished
    assert container["livenessProbe"]["timeoutSeconds"] >= 5 and container["livenessProbe"]["failureThreshold"] >= 3


def test_k8s_clients_have_cpu_limits_and_take_their_threads_from_them(k8s_command_lines):
    """Each client pod requests and is limited to whole CPUs; its command line names no --threads,
    so the process runs as many torch threads as its cgroup quota (the limit) has cores."""
    resources = container_of(k8s_objects(K8S_BASE), "Job")["resources"]
    limit = cpus(resources["limits"]["cpu"])
    assert cpus(resources["requests"]["cpu"]) == limit and limit == int(limit) >= 1
    assert {"memory"} <= set(resources["requests"]) and {"memory"} <= set(resources["limits"])
    for component, argv, _ in k8s_command_lines:
        if component == "client":
            flags = options(argv)
            assert "--threads" not in flags and "--processes-per-host" not in flags
    assert client_threads(1, CpuBudget(affinity=64, quota=limit)) == int(limit)


def test_compose_clients_are_cpu_limited():
    """The client containers share one Docker host: each is limited by ``cpus`` (its cgroup quota)
    so that together they fit a 2-core host, and names no --threads."""
    for variant in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        services = compose_services(*variant)
        clients = [s for s in services.values() if s["command"][0] == "client"]
        assert sum(float(s["cpus"]) for s in clients) <= 2 and all(s["mem_limit"] for s in clients)
        assert all("--threads" not in s["command"] for s in clients)
