"""The Makefile's set-up steps: quiet when they succeed, loud when they fail, idle when current.

Run on a copy of the Makefile in a scratch folder whose ``python`` is a stub script, so no venv
is created and nothing is compiled."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/bin/sh
echo "stub python $*"
echo "setuptools banner line"
case "$*" in *build_ext*) [ -f fail ] && exit 1; touch ascend_vlm/_C.stub.so;; esac
exit 0
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for name in ("requirements-dev.txt", "setup.py", "pyproject.toml", "CMakeLists.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "op.cpp").write_text("")
    (tmp_path / "ascend_vlm").mkdir()
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB)
    python.chmod(0o755)
    return tmp_path


def make(project: Path, *targets: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-s", "VENV=venv", "PYTHON=true", *targets],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "MAKEFLAGS": ""},
        check=False,
    )


def test_ext_prints_one_line_per_step_then_nothing_until_a_source_changes(project):
    first = make(project, "ext")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.splitlines() == [
        "creating venv with requirements-dev.txt (log: build/deps.log)",
        "installing ascend_vlm in venv (editable; log: build/install.log)",
        "building the C++ extension (log: build/ext.log)",
    ]
    assert "setuptools banner" in (project / "build" / "ext.log").read_text()
    again = make(project, "ext")
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    source = project / "csrc" / "op.cpp"
    later = source.stat().st_mtime + 5
    os.utime(source, (later, later))
    rebuilt = make(project, "ext")
    assert rebuilt.stdout.splitlines() == ["building the C++ extension (log: build/ext.log)"]


def test_a_failed_build_prints_its_log(project):
    (project / "fail").write_text("")
    failed = make(project, "ext")
    assert failed.returncode != 0
    assert "stub python setup.py --quiet build_ext --inplace" in failed.stdout
    assert "make: building the C++ extension failed (log above)" in failed.stdout
