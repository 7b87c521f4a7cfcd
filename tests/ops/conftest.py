"""Ops tests use tiny tensors: run torch single-threaded so intra-op thread start-up (and, on a
loaded 2-core machine, thread contention) does not dominate; restored after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def single_threaded_torch() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
