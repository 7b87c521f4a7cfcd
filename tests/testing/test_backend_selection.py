"""ascend_vlm.kernel_backend: detection, explicit selection and the ASCEND_VLM_BACKEND override."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ascend_vlm import kernel_backend, ops
from ascend_vlm.kernel_backend import (
    active_backend,
    mock_installed,
    set_backend,
    use_npu_kernels,
    using_backend,
)
from ascend_vlm.testing import mock_npu, uninstall_mock_npu

# These check detection on a machine without Ascend hardware (CI and development boxes).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu is installed"
)


@pytest.fixture(autouse=True)
def fresh_detection() -> Iterator[None]:
    """Each test starts undetected, and leaves the selection as it found it."""
    previous = set_backend(None)
    yield
    set_backend(previous)


def test_cpu_when_no_npu_and_no_mock(monkeypatch) -> None:
    monkeypatch.delenv("ASCEND_VLM_BACKEND", raising=False)
    assert active_backend() == "cpu"
    assert not use_npu_kernels(torch.device("cpu"))
    assert not use_npu_kernels(torch.zeros(1))  # a tensor stands for its device


def test_mock_install_selects_mock_and_uninstall_restores_the_selection(monkeypatch) -> None:
    monkeypatch.delenv("ASCEND_VLM_BACKEND", raising=False)
    assert active_backend() == "cpu"
    with mock_npu():
        assert active_backend() == "mock"
        assert use_npu_kernels(torch.device("cpu"))
        assert use_npu_kernels(torch.zeros(1))
        with mock_npu():  # installs nest
            assert active_backend() == "mock"
        assert active_backend() == "mock"
        with using_backend("cpu"):
            assert active_backend() == "cpu"
            assert not use_npu_kernels(torch.zeros(1))
        assert active_backend() == "mock"
    assert active_backend() == "cpu"


def test_cpu_override_wins_over_the_installed_mock_at_redetection(monkeypatch) -> None:
    with mock_npu():
        monkeypatch.setenv("ASCEND_VLM_BACKEND", "cpu")
        assert active_backend() == "mock"  # read only at the defined points
        set_backend(None)
        assert active_backend() == "cpu"
        assert not use_npu_kernels(torch.zeros(1))


def test_env_change_after_detection_needs_set_backend_none(monkeypatch) -> None:
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "cpu")
    assert active_backend() == "cpu"
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "gpu")
    assert active_backend() == "cpu"
    set_backend(None)
    with pytest.raises(ValueError, match="got 'gpu'"):
        active_backend()


def test_mock_override_installs_the_mock(monkeypatch) -> None:
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "mock")
    assert not mock_installed()
    try:
        assert active_backend() == "mock"
        assert mock_installed()
        x = torch.randn(2, 8)
        torch.testing.assert_close(ops.swiglu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    finally:
        uninstall_mock_npu()
    assert not mock_installed()


def test_bad_overrides_raise(monkeypatch) -> None:
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "gpu")
    with pytest.raises(
        ValueError,
        match=re.escape("ASCEND_VLM_BACKEND: expected one of ('npu', 'mock', 'cpu'), got 'gpu'"),
    ):
        active_backend()
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "npu")
    with mock_npu():
        set_backend(None)
        with pytest.raises(
            RuntimeError,
            match=re.escape(
                "ASCEND_VLM_BACKEND=npu: expected a real torch_npu with an NPU device, "
                "got the mock NPU installed"
            ),
        ):
            use_npu_kernels(torch.zeros(1))


def test_set_backend_rejects_unknown_and_unusable_names() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "set_backend: name: expected one of ('npu', 'mock', 'cpu') or None, got 'gpu'"
        ),
    ):
        set_backend("gpu")
    with pytest.raises(
        RuntimeError,
        match=re.escape("set_backend('npu'): expected a real torch_npu with an NPU device, got "),
    ):
        set_backend("npu")
    with pytest.raises(RuntimeError, match=re.escape("set_backend('mock'): expected the mock NPU")):
        set_backend("mock")
    assert set_backend("cpu") is None  # the fixture left it undetected; failures changed nothing


def _module_level_imports(path: Path) -> set[str]:
    """Modules imported by top-level statements of ``path`` (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_kernel_backend_does_not_import_testing_at_import() -> None:
    imported = _module_level_imports(Path(kernel_backend.__file__))
    assert not any(name.startswith("ascend_vlm.testing") for name in imported)
    code = (
        "import sys, ascend_vlm.kernel_backend as kb\n"
        "print(kb.active_backend(), sorted(m for m in sys.modules if 'ascend_vlm.testing' in m))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={k: v for k, v in os.environ.items() if k != kernel_backend.ENV_VAR},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[0] == "cpu []"


def test_mock_override_without_the_testing_package_says_what_is_missing() -> None:
    # kernel_backend never imports ascend_vlm.testing; the variable alone cannot install the mock.
    code = (
        "import ascend_vlm.kernel_backend as kb\n"
        "try:\n"
        "    kb.active_backend()\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, kernel_backend.ENV_VAR: "mock"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == (
        "ASCEND_VLM_BACKEND=mock: expected the mock NPU of ascend_vlm.testing to be importable "
        "here, got no installer registered; import ascend_vlm.testing (its pytest plugins do) "
        "before the first op call"
    )
