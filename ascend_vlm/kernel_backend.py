"""Which implementation the ops run: the active kernel backend, owned here.

The active backend is one of:

* ``"npu"``  — torch_npu imports and reports at least one device (tensors on ``npu`` use the
  torch_npu fused kernels; CPU tensors still use the reference);
* ``"mock"`` — the mock NPU from :mod:`ascend_vlm.testing` is installed: the NPU code path runs on
  CPU tensors against a strict stand-in ``torch_npu``;
* ``"cpu"``  — the plain-torch reference implementations.

It is held in one module variable, so :func:`use_npu_kernels` (called on every op call) reads
it without touching the environment. It changes only at defined points:

* :func:`set_backend` with a name selects that backend (``install_mock_npu()`` selects
  ``"mock"`` and ``uninstall_mock_npu()`` restores the previous selection);
* at the first use, and at the first use after ``set_backend(None)``, the backend is detected:
  the environment variable ``ASCEND_VLM_BACKEND=cpu|npu|mock`` if set, else ``"mock"`` if the mock
  is installed, ``"npu"`` if a real torch_npu sees a device, ``"cpu"`` otherwise. ``mock`` from
  the variable installs the mock at that point through the installer
  :mod:`ascend_vlm.testing` registers when imported (its pytest plugins import it; without it,
  ``RuntimeError`` says so); ``npu`` without a usable torch_npu raises ``RuntimeError`` (at each
  use, until the variable or the selection changes).

The variable is read only at those points: after changing it in a running process, call
``set_backend(None)`` for the change to take effect.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator

import torch

BACKENDS = ("npu", "mock", "cpu")
ENV_VAR = "ASCEND_VLM_BACKEND"
# Attribute the mock sets on its stand-in torch_npu module (ascend_vlm.testing.mock_npu).
MOCK_MARKER = "__ascend_vlm_mock__"

# The selected backend; None until the next use detects it (see the module docstring).
_selected: str | None = None
# How ``ASCEND_VLM_BACKEND=mock`` installs the mock: set by ascend_vlm.testing when imported, so
# that this module, which the ops import, never imports the testing package.
_mock_installer: Callable[[], object] | None = None


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


def _require_selectable(name: str, source: str) -> None:
    """Raise unless backend ``name`` can run now; ``source`` names who asked for it."""
    if name == "npu" and (mock_installed() or not _real_npu_available()):
        raise RuntimeError(
            f"{source}: expected a real torch_npu with an NPU device, got "
            + ("the mock NPU installed" if mock_installed() else "none usable")
        )
    if name == "mock" and not mock_installed():
        raise RuntimeError(
            f"{source}: expected the mock NPU installed "
            "(ascend_vlm.testing.install_mock_npu()), got none"
        )


def set_backend(name: str | None) -> str | None:
    """Select backend ``name`` (one of :data:`BACKENDS`), or with None forget the selection so
    that the next use detects it again, re-reading ``ASCEND_VLM_BACKEND``.

    Returns the previous selection (None if none was made yet), which restores it when passed
    back. Raises ``ValueError`` for an unknown name, ``RuntimeError`` for ``"npu"`` without a
    usable real torch_npu and for ``"mock"`` while the mock is not installed.
    """
    global _selected
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"set_backend: name: expected one of {BACKENDS} or None, got {name!r}")
        _require_selectable(name, f"set_backend({name!r})")
    previous, _selected = _selected, name
    return previous


@contextlib.contextmanager
def using_backend(name: str) -> Iterator[None]:
    """``with using_backend("cpu"):`` — :func:`set_backend` for the block, then the previous
    selection back (also when the block raises)."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _detect() -> str:
    """Select the backend from the environment variable or what is installed (module docstring)."""
    requested = os.environ.get(ENV_VAR)
    if requested:
        if requested not in BACKENDS:
            raise ValueError(f"{ENV_VAR}: expected one of {BACKENDS}, got {requested!r}")
        if requested == "mock" and not mock_installed():
            _install_mock()
        _require_selectable(requested, f"{ENV_VAR}={requested}")
        detected = requested
    elif mock_installed():
        detected = "mock"
    else:
        detected = "npu" if _real_npu_available() else "cpu"
    global _selected
    _selected = detected
    return detected


def register_mock_installer(installer: Callable[[], object]) -> None:
    """Make ``installer`` (``ascend_vlm.testing.install_mock_npu``) what ``ASCEND_VLM_BACKEND=mock``
    calls at detection. Called once by :mod:`ascend_vlm.testing.mock_npu` on import."""
    global _mock_installer
    _mock_installer = installer


def _install_mock() -> None:
    """Install the mock for ``ASCEND_VLM_BACKEND=mock`` through the registered installer."""
    if _mock_installer is None:
        raise RuntimeError(
            f"{ENV_VAR}=mock: expected the mock NPU of ascend_vlm.testing to be importable here, "
            f"got no installer registered; import ascend_vlm.testing (its pytest plugins do) "
            f"before the first op call"
        )
    _mock_installer()


def active_backend() -> str:
    """The active backend: ``"npu"``, ``"mock"`` or ``"cpu"`` (detected at the first use)."""
    selected = _selected
    return selected if selected is not None else _detect()


def use_npu_kernels(where: torch.device | torch.Tensor) -> bool:
    """Whether an op on tensors of device ``where`` (a device, or a tensor on it) should call
    the torch_npu kernels.

    The mock takes every device, a real NPU only its own tensors. Runs on every op call, so it
    reads the selection from the module variable and detects only when none is made.
    """
    selected = _selected
    if selected is None:
        selected = _detect()
    if selected == "cpu":
        return False
    if selected == "mock":
        return True
    device = where.device if isinstance(where, torch.Tensor) else where
    return device.type == "npu"


__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "active_backend",
    "mock_installed",
    "set_backend",
    "use_npu_kernels",
    "using_backend",
]
