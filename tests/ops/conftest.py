"""Ops tests use tiny tensors: every test runs single-threaded (ascend_vlm.testing.pytest_plugin)."""

import pytest


@pytest.fixture(autouse=True)
def _tiny_tensors_run_single_threaded(single_threaded_torch: None) -> None:
    """Applies ``single_threaded_torch`` to every test in tests/ops."""
