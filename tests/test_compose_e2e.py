""".ci/compose_e2e.py's pieces that need no Docker: the Compose file as the test runs it, what
makes a summary complete, the host network comparison, the wheel index's layout and the server's
round lines. The script itself runs in CI after the suite (.ci/run), as root with Docker."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from conftest import REPO, load_script

e2e = load_script(REPO / ".ci" / "compose_e2e.py")
COMPOSE = REPO / "deploy" / "docker-compose.yml"


def test_ci_compose_publishes_on_loopback_only_and_changes_nothing_else():
    compose = yaml.safe_load(COMPOSE.read_text())
    copy = e2e.ci_compose(compose, COMPOSE.parent)
    assert copy["secrets"] == compose["secrets"] and copy["volumes"] == compose["volumes"]
    assert set(copy["services"]) == set(compose["services"])
    published = 0
    for name, service in copy["services"].items():
        original = compose["services"][name]
        assert service["build"] == original["build"] | {"context": str(REPO)}
        if "ports" in original:
            container_ports = [str(port).rsplit(":", 1)[1] for port in original["ports"]]
            assert service["ports"] == [f"127.0.0.1::{port}" for port in container_ports]
            published += 1
        rest = {key: value for key, value in service.items() if key not in ("build", "ports")}
        assert rest == {key: value for key, value in original.items() if key not in ("build", "ports")}
    assert published == 2  # the server and its resume service
    assert "name" not in copy
    assert yaml.safe_load(yaml.safe_dump(copy)) == copy


def complete_summary() -> dict:
    return {"status": "completed", "exit_code": 0, "rounds": 20, "rounds_completed": 20,
            "accuracy": {"initial": {"mean": 0.88}, "personalized": {"1": {"mean": 0.95}}, "global": {"acc": 0.89}}}


def test_summary_problems_name_what_a_complete_run_lacks():
    assert e2e.summary_problems(complete_summary(), 20) == []
    interrupted = complete_summary() | {"status": "interrupted", "exit_code": 7, "rounds_completed": 3}
    problems = e2e.summary_problems(interrupted, 20)
    assert problems == ["status 'interrupted', exit code 7", "3 of 20 rounds"]
    no_global = complete_summary()
    no_global["accuracy"] = {"initial": {"mean": 0.88}, "personalized": {}}
    assert e2e.summary_problems(no_global, 20) == ["no personalized, global accuracy"]
    assert e2e.summary_problems(complete_summary(), 25) == ["20 of 25 rounds"]


def test_host_differences_name_each_setting_that_changed():
    before = {"links": ["eth0", "lo"], "net/ipv4/ip_forward": "0", "iptables-save": "*filter\nCOMMIT"}
    assert e2e.host_differences(before, dict(before)) == []
    after = before | {"links": ["br-0123abcd", "eth0", "lo"], "net/ipv4/ip_forward": "1"}
    assert e2e.host_differences(before, after) == [
        "links: ['eth0', 'lo'] -> ['br-0123abcd', 'eth0', 'lo']", "net/ipv4/ip_forward: '0' -> '1'"]
    assert e2e.DOCKER_LINKS.match("br-0123abcd") and e2e.DOCKER_LINKS.match("docker0")
    assert e2e.DOCKER_LINKS.match("veth1a2b3c") and not e2e.DOCKER_LINKS.match("eth0")


def test_wheel_index_has_a_page_per_project_under_its_normalized_name(tmp_path: Path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    names = ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "typing_extensions-4.16.0-py3-none-any.whl",
             "MarkupSafe-3.0.4-cp311-cp311-manylinux_2_17_x86_64.whl", "zope.interface-7.0-py3-none-any.whl"]
    for name in names:
        (wheels / name).write_bytes(name.encode())
    (wheels / "notes.txt").write_text("not a wheel")
    index = tmp_path / "index"
    (index / "stale").mkdir(parents=True)
    e2e.write_wheel_index(wheels, index)
    pages = {page.name: sorted(p.name for p in page.iterdir()) for page in index.iterdir()}
    assert pages == {"torch": [names[0]], "typing-extensions": [names[1]], "markupsafe": [names[2]],
                     "zope-interface": [names[3]]}
    assert (index / "torch" / names[0]).read_bytes() == names[0].encode()


def test_round_lines_of_the_server():
    line = "2026-12-07 01:56:32 round    2/20  clients 10/10  loss 0.4131  lr 0.05  down 0.443 MB  up 2.133 MB  0.25 s"
    assert e2e.round_reached(line) == (2, 20)
    assert e2e.round_reached("2026-12-07 01:56:20 waiting for 10 clients to be hosted ...") is None


def test_kill_round_leaves_the_quickstart_most_of_its_rounds():
    rounds = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["rounds"]
    assert 1 <= e2e.KILL_ROUND <= rounds // 4


def test_ci_makes_the_secrets_the_docs_tell_operators_to_make():
    (line,) = [line for line in (REPO / "docs" / "deploy.md").read_text().splitlines()
               if line.startswith("fedpart certs ")]
    argv = shlex.split(line)
    assert argv[2:4] == ["--out", "deploy/secrets"] and argv[4:] == e2e.CERTS_ARGS
