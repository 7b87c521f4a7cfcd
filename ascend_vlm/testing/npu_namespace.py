"""The mock ``torch_npu.npu`` (= ``torch.npu``) namespace: devices, streams and events
(:mod:`ascend_vlm.testing._streams`), ``get_device_name`` (an Atlas A2 SoC,
:data:`MOCK_SOC_NAME`), ``mstx`` profiler ranges, and ``recorded_streams`` with the
``Tensor.record_stream`` that fills it. Signatures are torch_npu's (``torch_npu/npu/*.py``,
recorded in ``testing/torch_npu_schemas.json``).
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

import torch

from ascend_vlm.testing._checks import bad
from ascend_vlm.testing._streams import make_stream_api

# What the mock's torch.npu.get_device_name() reports: an Atlas A2 SoC (the simulated runtime's
# default, ASCEND_VLM_SIM_SOC); tests replace the function to model other SoCs.
MOCK_SOC_NAME = "Ascend910B1"
MSTX_MAX_MESSAGE_BYTES = 255
MSTX_DEFAULT_DOMAIN = "default"


def get_device_name(device_name: Any = None) -> str:
    """Stand-in for ``torch_npu.npu.get_device_name``: the SoC name, :data:`MOCK_SOC_NAME` for
    every device (torch_npu returns ``aclrtGetSocName``'s string, e.g. ``Ascend910B1``)."""
    return MOCK_SOC_NAME


def _check_mstx_domain(domain: str) -> None:
    if domain != MSTX_DEFAULT_DOMAIN:
        raise NotImplementedError(f"mock mstx: domain={domain!r} is not implemented")


def make_mstx(npu: types.ModuleType) -> types.ModuleType:
    """Stand-in for ``torch_npu.npu.mstx``'s range API: ``range_start(message, stream=None,
    domain='default') -> int`` (a non-zero range id; ``stream`` None marks the host only, else
    a ``torch.npu`` stream) and ``range_end(range_id, domain='default')``. Strict where the
    docs are: ``message`` a string of at most 255 bytes, ``range_id`` one that ``range_start``
    returned and not yet ended; domains other than the default raise NotImplementedError.
    ``ranges`` lists ``(message, stream, ended)`` per started range, for tests."""
    mstx = types.ModuleType("torch_npu.npu.mstx", "mock mstx ranges")
    mstx.ranges = []

    def range_start(message: str, stream: Any = None, domain: str = MSTX_DEFAULT_DOMAIN) -> int:
        if not isinstance(message, str) or len(message.encode()) > MSTX_MAX_MESSAGE_BYTES:
            raise bad("message", f"a string of at most {MSTX_MAX_MESSAGE_BYTES} bytes", message)
        if stream is not None and not isinstance(stream, npu.Stream):
            raise bad("stream", "None or a torch.npu.Stream", stream)
        _check_mstx_domain(domain)
        mstx.ranges.append([message, stream, False])
        return len(mstx.ranges)

    def range_end(range_id: int, domain: str = MSTX_DEFAULT_DOMAIN) -> None:
        if not isinstance(range_id, int) or not 1 <= range_id <= len(mstx.ranges):
            raise bad("range_id", "an id range_start returned", range_id)
        if mstx.ranges[range_id - 1][2]:
            raise bad("range_id", "a range not yet ended", range_id)
        _check_mstx_domain(domain)
        mstx.ranges[range_id - 1][2] = True

    mstx.range_start = range_start
    mstx.range_end = range_end
    return mstx


def build_npu_namespace(device_count: int) -> types.ModuleType:
    """A fresh mock ``torch_npu.npu`` module with ``device_count`` devices."""
    npu = types.ModuleType("torch_npu.npu", "mock torch.npu namespace")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", loader=None)
    for name, value in make_stream_api(device_count).items():
        setattr(npu, name, value)
    npu.get_device_name = get_device_name
    npu.recorded_streams = []
    npu.mstx = make_mstx(npu)
    return npu


def make_record_stream(npu: types.ModuleType, original: Any) -> Any:
    """``Tensor.record_stream`` taking the mock's streams, as torch_npu's patch makes it take
    NPU streams: the mock's (CPU) "NPU tensors" record ``(tensor, stream)`` in
    ``torch.npu.recorded_streams`` (there is no caching allocator to tell); other streams go
    to torch's own method."""

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        if not isinstance(stream, npu.Stream):
            return original(tensor, stream)
        npu.recorded_streams.append((tensor, stream))
        return None

    return record_stream
