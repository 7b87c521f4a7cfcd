"""Backend selection, in one place.

``backend()`` answers which implementation the ops run:

* ``"npu"``  — torch_npu imports and reports at least one device (tensors on ``npu`` use the
  torch_npu fused kernels; CPU tensors still use the reference);
* ``"mock"`` — the mock NPU from :mod:`ascend_vlm.testing` is installed: the NPU code path runs on
  CPU tensors against a strict stand-in ``torch_npu``;
* ``"cpu"``  — otherwise: the plain-torch reference implementations.

``ASCEND_VLM_BACKEND=cpu|npu|mock`` overrides the detection (``mock`` installs the mock if needed;
``npu`` without a usable torch_npu raises).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import torch

BACKENDS = ("npu", "mock", "cpu")
ENV_VAR = "ASCEND_VLM_BACKEND"
# Attribute the mock sets on its stand-in torch_npu module (ascend_vlm.testing.mock_npu).
MOCK_MARKER = "__ascend_vlm_mock__"


def mock_installed() -> bool:
    """True while ``ascend_vlm.testing.install_mock_npu()`` is in effect."""
    return getattr(sys.modules.get("torch_npu"), MOCK_MARKER, False)


@functools.cache
def _real_npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        return bool(torch.npu.is_available() and torch.npu.device_count() > 0)
    except (ImportError, RuntimeError, AttributeError):
        return False


# backend() runs on every op call. os.environ.get costs four Python frames and a caught KeyError
# when the variable is unset; the dict behind os.environ, which every os.environ write updates
# (CPython's os._Environ), answers the same with one lookup.
_ENVIRON_DATA = os.environ._data
_ENV_KEY = os.environ.encodekey(ENV_VAR)


def backend() -> str:
    """The selected backend: ``"npu"``, ``"mock"`` or ``"cpu"`` (see the module docstring)."""
    override = _ENVIRON_DATA.get(_ENV_KEY)
    if override:
        override = os.environ.decodevalue(override)
        if override not in BACKENDS:
            raise ValueError(f"{ENV_VAR}: expected one of {BACKENDS}, got {override!r}")
        if override == "mock" and not mock_installed():
            from ascend_vlm.testing import install_mock_npu

            install_mock_npu()
        if override == "npu" and (mock_installed() or not _real_npu_available()):
            raise RuntimeError(
                f"{ENV_VAR}=npu: expected a real torch_npu with an NPU device, got "
                + ("the mock NPU installed" if mock_installed() else "none usable")
            )
        return override
    return _detected_backend()


def _detected_backend() -> str:
    """:func:`backend` without the override variable."""
    if getattr(sys.modules.get("torch_npu"), MOCK_MARKER, False):  # mock_installed(), inlined
        return "mock"
    return "npu" if _real_npu_available() else "cpu"


def use_npu_kernels(where: torch.device | torch.Tensor) -> bool:
    """Whether an op on tensors of device ``where`` (a device, or a tensor on it) should call
    the torch_npu kernels.

    The mock takes every device, a real NPU only its own tensors. This runs on every op call:
    without the override variable and with no torch_npu imported (so neither the mock nor an
    NPU tensor can exist) it answers from two dictionary lookups.
    """
    if _ENV_KEY not in _ENVIRON_DATA:
        if "torch_npu" not in sys.modules:
            return False
        selected = _detected_backend()
    else:
        selected = backend()
    if selected == "mock":
        return True
    device = where.device if isinstance(where, torch.Tensor) else where
    return selected == "npu" and device.type == "npu"
