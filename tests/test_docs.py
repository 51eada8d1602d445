"""The documentation: the MkDocs site builds strictly (every link and anchor resolves), every page
is in its navigation, nothing names a path of one machine, and the README stays a front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
    from fedpart.common.reference import reference

    assert (DOCS / "components.md").read_text() == reference(), \
        "regenerate it: python -m fedpart.common.reference --markdown > docs/components.md"
