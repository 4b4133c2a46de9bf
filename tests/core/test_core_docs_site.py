"""The documentation builds as a site with nothing broken: `mkdocs build --strict` (mkdocs-material, the API pages
from the docstrings through mkdocstrings) fails on a missing page, a page left out of the nav, a broken link or
anchor. The build is offline: no plugin that fetches, no web fonts. The README's own links point at files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from sharpclip.train.features import FEATURES

ROOT = Path(__file__).resolve().parents[2]
OFFLINE_PLUGINS = {"search", "mkdocstrings"}  # social cards, privacy, optimize etc. fetch: none of them here


def _site_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    proc = subprocess.run([*cmd, "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, "mkdocs is a [dev] dependency (pip install -e '.[dev]')\n" + proc.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "losses" / "index.html").read_text(encoding="utf-8")
    assert 'id="sharpclip.losses.margins.hn_clip"' in api  # the reference is generated from the docstrings


def test_the_build_fetches_nothing() -> None:
    cfg = _site_config()
    plugins = {p if isinstance(p, str) else next(iter(p)) for p in cfg.get("plugins", [])}
    assert plugins <= OFFLINE_PLUGINS, f"plugins that may fetch at build time: {plugins - OFFLINE_PLUGINS}"
    assert cfg["theme"]["font"] is False  # material's default downloads Google Fonts
    assert cfg["strict"] is True


def test_the_readme_links_point_at_files() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m]
    assert links, "the README links into the docs"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_method_notes_feature_table_names_every_feature() -> None:
    text = (ROOT / "docs" / "method-notes.md").read_text(encoding="utf-8")
    table = text[text.index("| feature | shape |") :].split("\n\n")[0]
    named = {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    assert named == set(FEATURES), f"docs/method-notes.md §10 differs from train/features.py: {named ^ set(FEATURES)}"
