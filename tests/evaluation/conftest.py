"""Shared fixtures: the tiny default model's checkpoint (random weights)."""

from __future__ import annotations

import pytest

from ascend_vlm.default_model import default_model_path


@pytest.fixture(scope="session")
def tiny_model_path():
    return default_model_path()
