"""The documentation: the MkDocs site builds strictly (every link and anchor resolves), every page
is in its navigation, nothing names a path of one machine, and the README stays a front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 250


def _nav_pages(entries: list) -> set[str]:
    pages: set[str] = set()
    for entry in entries:
        for value in entry.values():
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "results" / "index.html").is_file()


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert _nav_pages(config["nav"]) == {p.name for p in DOCS.glob("*.md")}


def test_no_machine_paths_and_a_short_readme():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for path in [REPO / "README.md", *DOCS.glob("*.md")]:
        assert not re.search(r"(?<![\w.])/(tmp|work|home)/", path.read_text()), path


def test_readme_links_reach_existing_pages():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert targets
    for target in targets:
        assert (REPO / target).is_file(), target


def test_every_bundled_config_is_listed():
    reference = (DOCS / "configuration.md").read_text()
    for config in (REPO / "configs").glob("*.yaml"):
        assert f"| `{config.stem}` |" in reference, config.stem


def test_the_components_page_matches_the_registries():
    from lab.reference import reference

    assert (DOCS / "components.md").read_text() == reference(), \
        "regenerate it: python -m lab.reference --markdown > docs/components.md"


def test_the_components_page_lists_every_option_and_capability_of_every_component():
    """Every kind declares its options (algorithms, objective terms and step rules included, e.g.
    FedBug's gu_ratio) and the page shows each in its component's section, with its capabilities."""
    from fedpart.common.components.registry import KINDS

    page = (DOCS / "components.md").read_text()
    listed = 0
    for kind, registry in KINDS.items():
        chapter = page.split(f"\n## {kind.capitalize()}s\n", 1)[1].split("\n## ", 1)[0]
        for name, component in registry.builtin().items():
            section = chapter.split(f"\n### `{name}`\n", 1)[1].split("\n### ", 1)[0]
            for option in component.options:
                assert f"| `{option.name}` | {option.kind.__name__} |" in section, (kind, name, option.name)
                listed += 1
            for capability in component.capabilities:
                assert f"`{capability}`" in section, (kind, name, capability)
    assert "| `gu_ratio` | float | `0.2` |" in page.split("\n### `fedbug`\n", 1)[1].split("\n### ", 1)[0]
    assert listed >= 40


ROBUST_PLUGIN = '''
from fedpart.api import ROBUST_AGGREGATORS
from fedpart.server.policy.aggregation import WeightedMean

mean_again = ROBUST_AGGREGATORS.component("docs_mean_again", "The weighted mean, from outside.", WeightedMean)
'''


def _path_config(kind: str, path: str) -> dict:
    """A small run config that names ``path`` at the setting of ``kind``."""
    from conftest import small_config

    return {"codec": small_config(compression={"up": {"codec": path}}),
            "server optimizer": small_config(server_optimizer={"name": path}),
            "robust aggregator": small_config(robust={"aggregator": path}),
            "model": small_config(model={"name": path}),
            "dataset": small_config(data={"dataset": path, "input_shape": [8], "num_classes": 0,
                                          "partition": {"scheme": "iid"}}),
            "partition scheme": small_config(data={"dataset": "digits", "partition": {"scheme": path}}),
            "algorithm": small_config(algorithm={"name": path}),
            "objective term": small_config(algorithm={"name": "fedavg", "objective": {path: {}}})}[kind]


def test_what_the_components_page_says_each_kind_takes_is_what_a_run_config_takes(tmp_path, monkeypatch):
    """docs/components.md says, kind by kind, whether a path selects a Component, a plain function
    or nothing; a run config naming a path at each kind's setting is accepted or refused
    accordingly (step rules have no setting: an algorithm brings its own)."""
    from conftest import FIXTURES
    from fedpart.common.config.run_config import ConfigError, config_from_dict
    from fedpart.common.components.registry import BY_COMPONENT, BY_FUNCTION, BY_NAME, KINDS

    (tmp_path / "docs_robust_plugin.py").write_text(ROBUST_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(FIXTURES))
    page = (DOCS / "components.md").read_text()
    assert "A `package.module:name` path to a\n`fedpart.api.Component` selects a component" not in page
    plugins = {"codec": "plugin_codec:fixed_point", "server optimizer": "plugin_optimizer:signed",
               "robust aggregator": "docs_robust_plugin:mean_again", "model": "custom_components:regression_model",
               "dataset": "custom_components:regression_dataset", "algorithm": "plugin_algorithm:head_warmup"}
    expected = {BY_COMPONENT: {"codec", "server optimizer", "robust aggregator", "algorithm"},
                BY_FUNCTION: {"model", "dataset"}, BY_NAME: {"objective term", "step rule", "partition scheme"}}
    for paths, kinds in expected.items():
        assert {kind for kind, registry in KINDS.items() if registry.paths == paths} == kinds
    for kind, registry in KINDS.items():
        section = page.split(f"\n## {kind.capitalize()}s\n", 1)[1].split("\n### ", 1)[0]
        assert registry.accepts() in section, kind
        if kind == "step rule":
            continue
        if registry.paths == BY_NAME:
            with pytest.raises(ConfigError, match="unknown"):
                config_from_dict(_path_config(kind, "custom_components:regression_model"))
            assert "Built-in names only" in section
        else:
            config_from_dict(_path_config(kind, plugins[kind]))
            wanted = "`fedpart.api.Component`" if registry.paths == BY_COMPONENT else "plain function"
            assert wanted in section and "Built-in names only" not in section
