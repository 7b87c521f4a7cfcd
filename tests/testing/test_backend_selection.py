"""ascend_vlm.device.backend(): detection and the ASCEND_VLM_BACKEND override."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from ascend_vlm import ops
from ascend_vlm.device import backend, mock_installed, use_npu_kernels
from ascend_vlm.testing import mock_npu, uninstall_mock_npu

# These check detection on a machine without Ascend hardware (CI and development boxes).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu is installed"
)


def test_cpu_when_no_npu_and_no_mock(monkeypatch) -> None:
    monkeypatch.delenv("ASCEND_VLM_BACKEND", raising=False)
    assert backend() == "cpu"
    assert not use_npu_kernels(torch.device("cpu"))
    assert not use_npu_kernels(torch.zeros(1))  # a tensor stands for its device


def test_mock_when_installed_and_cpu_override_wins(monkeypatch) -> None:
    monkeypatch.delenv("ASCEND_VLM_BACKEND", raising=False)
    with mock_npu():
        assert backend() == "mock"
        assert use_npu_kernels(torch.device("cpu"))
        assert use_npu_kernels(torch.zeros(1))
        monkeypatch.setenv("ASCEND_VLM_BACKEND", "cpu")
        assert backend() == "cpu"
        assert not use_npu_kernels(torch.zeros(1))


def test_mock_override_installs_the_mock(monkeypatch) -> None:
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "mock")
    assert not mock_installed()
    try:
        assert backend() == "mock"
        assert mock_installed()
        x = torch.randn(2, 8)
        torch.testing.assert_close(ops.swiglu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    finally:
        uninstall_mock_npu()


def test_bad_overrides_raise(monkeypatch) -> None:
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "gpu")
    with pytest.raises(
        ValueError,
        match=re.escape("ASCEND_VLM_BACKEND: expected one of ('npu', 'mock', 'cpu'), got 'gpu'"),
    ):
        backend()
    monkeypatch.setenv("ASCEND_VLM_BACKEND", "npu")
    with mock_npu(), pytest.raises(RuntimeError, match="got the mock NPU installed"):
        backend()
