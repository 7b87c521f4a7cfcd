"""The README and docs/ are current and true: generated tables match the code, every Python
example runs, every command and link they name exists, and the site builds strictly."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def _blocks(page: Path, language: str) -> list[str]:
    """The page's fenced blocks of `language`, after its snippet lines are replaced by the
    files they name (as pymdownx.snippets does)."""
    text = page.read_text(encoding="utf-8")
    text = SNIPPET.sub(lambda m: (DOCS / m.group(1)).read_text(encoding="utf-8"), text)
    return [body for lang, body in FENCE.findall(text) if lang == language]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


PYTHON_PAGES = [page for page in PAGES if _blocks(page, "python")]


def test_generated_tables_are_current():
    script = ROOT / "scripts" / "update_docs.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_python_examples_run(page, tmp_path):
    # A page's blocks build on each other, as a reader runs them: one process per page, in a
    # scratch folder for the files the examples write.
    code = "\n\n".join(_blocks(page, "python"))
    (tmp_path / "example.py").write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _commands(page: Path) -> list[str]:
    lines = [
        line.split("#")[0].strip() for body in _blocks(page, "bash") for line in body.splitlines()
    ]
    return [line for line in lines if line]


def test_bash_examples_name_real_commands_scripts_and_targets():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    subcommands = subprocess.run(
        [sys.executable, "-m", "ascend_vlm", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    checked = 0
    for page in PAGES:
        for command in _commands(page):
            words = command.split()
            for index, word in enumerate(words):
                if word.endswith(".py") and word.startswith("scripts/"):
                    assert (ROOT / word).is_file(), f"{_name(page)}: {command}"
                    checked += 1
                if word == "ascend_vlm" and index and words[index - 1] == "-m":
                    sub = words[index + 1] if index + 1 < len(words) else ""
                    assert sub.startswith("-") or sub in subcommands, f"{_name(page)}: {command}"
                    checked += 1
            if words[0] == "make":
                for target in words[1:]:
                    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), command
                    checked += 1
    assert checked > 10


def test_the_readme_is_a_landing_page():
    # The manual lives in docs/; the README keeps to what it is, install, the two commands, a
    # quick start, the supported-models table and links (issue 41).
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md: expected at most 200 lines, got {len(lines)}"


def test_relative_links_point_at_files():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for page in PAGES:
        for target in link.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{_name(page)} links to {target}"


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs is not None, "mkdocs: expected beside this Python (requirements-dev.txt)"
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
