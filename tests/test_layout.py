"""The import graph between the project's folders (docs/architecture.md, Layout): every import,
at module level or inside a function, goes down the layers (proto < common < server, client <
api < deploy, report < cli < the package root), two folders of one layer never import each other
(server and client, deploy and report), no two modules import each other through any chain
(no cycle), and nothing goes up at run time either (``common`` names no server module to import
by name, and validating a config with the server's parts loads none). Inside ``common`` the rooms
are layers too (process, privacy, components < wire < ml < data, models < config); every module
of ``server`` but its entry point lives in a room; the lab (``lab/``, the instruments of the tests
and measurements) stays outside the package, and the product never imports it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# each folder's layer: a module imports its own folder and lower layers (api, the public plugin
# surface, re-exports what plugins need; deploy starts processes and writes credentials, report
# reads run directories; the command line in cli drives them all)
FOLDERS = {"proto": 0, "common": 1, "server": 2, "client": 2, "api": 3, "deploy": 4, "report": 4, "cli": 5,
           "fedpart": 6}
PACKAGE = "fedpart"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == PACKAGE:  # the package's root (python -m fedpart)
        parts.pop(0)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _run_time_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``: imports there name types for
    annotations and never run, so they are no arrow of the import graph."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                pending.extend(child.orelse)
            else:
                pending.append(child)


def _imports(path: Path) -> set[str]:
    """The fedpart modules ``path`` imports, resolved to modules of the repository where they are
    names inside a module (``from fedpart.common.config.run_config import RunConfig`` ->
    fedpart.common.config.run_config)."""
    found = set()
    for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE + "."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else PACKAGE


def test_imports_go_down_the_layers():
    wrong = []
    for module, imported in _graph().items():
        for target in imported:
            source_folder, target_folder = _folder(module), _folder(target)
            if source_folder != target_folder and FOLDERS[target_folder] >= FOLDERS[source_folder]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that go up or across the layers:\n" + "\n".join(sorted(wrong))


# the rooms of common and their layers: a module imports its own room and lower layers (the
# registries of components, the process's basics and the privacy primitives stand on nothing;
# the wire carries what the learning declares; data and models use both; a run's config reads and
# checks them all); the modules at common's root (a deprecated alias) stand on any room
COMMON_ROOMS = {"process": 0, "privacy": 0, "components": 0, "wire": 1, "ml": 2, "data": 3, "models": 3, "config": 4}
# the rooms of server; their imports cross in both directions (the engine runs the policy, whose
# layers dispatch the engine's tasks), so they are no layers, but no module stands outside them
SERVER_ROOMS = ("transport", "engine", "policy", "output")
SERVER_ENTRY = f"{PACKAGE}.server.main"


def _room(module: str) -> str:
    """The room of a module of common or server (``fedpart.common.wire.tensors`` -> wire, and the
    room's package itself, fedpart.common.wire -> wire); "" for a module at the folder's root."""
    parts = module.split(".")
    if len(parts) == 3 and parts[2] in (*COMMON_ROOMS, *SERVER_ROOMS):
        return parts[2]
    return parts[2] if len(parts) > 3 else ""


def test_imports_go_down_the_rooms_of_common():
    top = max(COMMON_ROOMS.values()) + 1
    wrong = []
    for module, imported in _graph().items():
        if _folder(module) != "common":
            continue
        for target in imported:
            if _folder(target) != "common" or _room(target) == _room(module):
                continue
            if COMMON_ROOMS.get(_room(target), top) >= COMMON_ROOMS.get(_room(module), top):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that go up or across the rooms of common:\n" + "\n".join(sorted(wrong))


def test_every_module_lives_in_a_room():
    graph = _graph()
    common = {_room(m) for m in graph if _folder(m) == "common"} - {""}
    assert common == set(COMMON_ROOMS)
    loose = [m for m in graph if _folder(m) == "server" and m not in {f"{PACKAGE}.server", SERVER_ENTRY}
             and _room(m) not in SERVER_ROOMS]
    assert not loose, "server modules outside the rooms:\n" + "\n".join(sorted(loose))
    assert not [m for m, imported in graph.items() if SERVER_ENTRY in imported and _folder(m) == "server"]


def test_the_product_never_imports_the_lab():
    """The lab's tools (fault relay, load generator, reference writer) import the product; no
    module of the package imports them, and the package does not ship them."""
    found = []
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "lab"]
    assert not found, "the product imports the lab:\n" + "\n".join(found)
    packaging = (REPO / "pyproject.toml").read_text()
    assert '"lab' not in packaging and "lab" not in FOLDERS
    assert (REPO / "lab" / "relay.py").is_file()


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


CLIENT_SIDE = """
import json, sys
import fedpart.client.runtime
from fedpart.common.config.run_config import RunConfig, config_from_dict
from fedpart.common.config.experiment import build_run_model
raw = json.loads(RunConfig().to_json())
raw["privacy"]["secure_aggregation"] = True
build_run_model(config_from_dict(raw, server_parts=False))
print(sorted(m for m in sys.modules if m.startswith("fedpart.server") or m.split(".")[0] == "numba"))
"""


def test_a_client_process_imports_nothing_of_the_server():
    """What the registry resolves lazily (the server's optimizers and robust aggregators, whose
    modules bring the server's compiled fold) stays out of a client reading the server's config."""
    out = subprocess.run([sys.executable, "-c", CLIENT_SIDE], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_common_names_no_server_module_to_import_at_run_time():
    """No string in common/ is a server module's dotted name (a registry's home, an importlib
    target): what common imports by name stays in common."""
    named = []
    for path in (REPO / "common").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.split(":")[0].startswith(f"{PACKAGE}.server") and " " not in node.value:
                named.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value}")
    assert not named, "common/ names server modules:\n" + "\n".join(named)


COMMON_AT_RUN_TIME = """
import importlib, json, pkgutil, sys
import fedpart.common
for module in pkgutil.walk_packages(fedpart.common.__path__, "fedpart.common."):
    importlib.import_module(module.name)
from fedpart.common.config.run_config import ConfigError, RunConfig, config_from_dict
from fedpart.common.config.experiment import check_experiment
raw = json.loads(RunConfig().to_json())
raw.update(server_optimizer={"name": "fedadam", "lr": 0.1}, robust={**raw["robust"], "aggregator": "trimmed_mean"})
check_experiment(config_from_dict(raw), server_data=True)
raw.update(server_optimizer={"name": "fedexp"}, robust={**raw["robust"], "aggregator": "mean"},
           train={**raw["train"], "weighting": "uniform"}, privacy={**raw["privacy"], "secure_aggregation": True})
try:
    config_from_dict(raw)
except ConfigError as error:
    print("refused:", error)
raw["algorithm"] = {"name": "fedavg", "objective": {"feddyn": {"alpha": 0.1}}}
raw["server_optimizer"] = {"name": "plain"}
raw["privacy"] = {**raw["privacy"], "secure_aggregation": False, "dp": {**raw["privacy"]["dp"], "enabled": True}}
try:
    config_from_dict(raw)
except ConfigError as error:
    print("refused:", error)
print(sorted(m for m in sys.modules if m.startswith("fedpart.server")))
"""


def test_common_and_a_config_with_server_parts_load_no_server_module():
    """Every module of common imported, a config that names server parts (a server optimizer with
    options, a robust aggregator) validated and checked whole, and the refusals that ask those
    parts' capabilities (FedExP's result norms, FedDyn's result counts) made: no module of the
    server is loaded."""
    out = subprocess.run([sys.executable, "-c", COMMON_AT_RUN_TIME], capture_output=True, text=True, timeout=300,
                         check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("refused: privacy.secure_aggregation: server_optimizer fedexp needs each result's")
    assert lines[1].startswith("refused: privacy.dp: algorithm.objective.feddyn brings a server step")
    assert lines[-1] == "[]"


def _reachable(graph: dict[str, set[str]], module: str) -> set[str]:
    """The modules ``module`` imports, directly or through others."""
    found, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()] - found:
            found.add(target)
            todo.append(target)
    return found


def test_the_records_and_their_readers_need_no_server():
    """The run's records (common/process/records.py) import the standard library only, and the report
    (report/) reads run directories through those types with no module of the server, directly
    or through others: a report runs on any machine. One module of the server writes a run
    directory's records (run_directory.py)."""
    graph = _graph()
    assert graph[f"{PACKAGE}.common.process.records"] == set()
    server = {m: sorted(r for r in _reachable(graph, m) if _folder(r) == "server")
              for m in graph if _folder(m) == "report"}
    assert not {m: found for m, found in server.items() if found}
    writers = [p.relative_to(REPO).as_posix() for p in sorted((REPO / "server").rglob("*.py"))
               if "def append_round" in p.read_text() or "def write_summary" in p.read_text()]
    assert writers == ["server/output/run_directory.py"]
