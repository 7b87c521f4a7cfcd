"""The serving tests' shared server fixture (helpers: served_vlm.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from served_vlm import RunningServer, running_server


@pytest.fixture(scope="module")
def tiny_server(model_and_processor) -> Iterator[RunningServer]:
    """The tiny Qwen2-VL served with default limits (at most 64 new tokens per request)."""
    model, processor = model_and_processor
    with running_server(model, processor, max_batch_size=32) as server:
        yield server
