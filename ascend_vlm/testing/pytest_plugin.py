"""pytest plugin: the ``mock_npu`` fixture and marker, and the ``single_threaded_torch`` fixture.

A test that takes the ``mock_npu`` fixture (or carries ``@pytest.mark.mock_npu``) runs with the
NPU code path active: under the mock torch_npu by default, or on real hardware when
``ASCEND_VLM_TEST_REAL_NPU=1`` (skipped if torch_npu or a device is missing). The fixture value
is an :class:`NpuTestBackend`; create inputs on its ``device`` so the same test runs on both.
Register it from ``tests/conftest.py`` with ``pytest_plugins = ["ascend_vlm.testing.pytest_plugin"]``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from ascend_vlm.testing.mock_npu import mock_npu as _mock_npu_installed

REAL_NPU_ENV = "ASCEND_VLM_TEST_REAL_NPU"


@dataclass(frozen=True)
class NpuTestBackend:
    """What a ``mock_npu`` test runs against."""

    torch_npu: ModuleType  # the mock or the real module
    device: torch.device  # where test inputs belong: cpu under the mock, npu:0 on hardware
    is_mock: bool


def _real_backend() -> NpuTestBackend:
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as error:
        pytest.skip(f"{REAL_NPU_ENV}=1 but torch_npu does not import: {error}")
    if not (torch.npu.is_available() and torch.npu.device_count() > 0):
        pytest.skip(f"{REAL_NPU_ENV}=1 but no NPU device is available")
    return NpuTestBackend(torch_npu=torch_npu, device=torch.device("npu:0"), is_mock=False)


@pytest.fixture
def mock_npu() -> Iterator[NpuTestBackend]:
    """The NPU code path for one test: mock torch_npu on CPU, or real hardware (see module)."""
    if os.environ.get(REAL_NPU_ENV) == "1":
        yield _real_backend()
        return
    with _mock_npu_installed() as module:
        yield NpuTestBackend(torch_npu=module, device=torch.device("cpu"), is_mock=True)


@pytest.fixture
def single_threaded_torch() -> Iterator[None]:
    """Run one test with a single torch thread (restored afterwards): for tiny tensors, intra-op
    threads only add start-up cost and, on a loaded machine, contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``@pytest.mark.mock_npu`` get the fixture without naming it."""
    for item in items:
        if item.get_closest_marker("mock_npu") and "mock_npu" not in item.fixturenames:
            item.fixturenames.append("mock_npu")
