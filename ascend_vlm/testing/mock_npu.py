"""A strict stand-in for ``torch_npu`` so the NPU code path runs on CPU tensors.

``install_mock_npu()`` puts a module named ``torch_npu`` into ``sys.modules`` (with the stand-in
kernels of :mod:`ascend_vlm.testing.mock_ops`: ``npu_fusion_attention``,
``npu_fused_infer_attention_score`` (page-attention decode), ``npu_rms_norm``,
``npu_rotary_mul``, ``npu_swiglu``, ``npu_weight_quant_batchmatmul``,
``npu_convert_weight_to_int4pack``, ``npu_grouped_matmul``, ``npu_moe_token_permute``,
``npu_moe_token_unpermute``, ``npu_chunk_gated_delta_rule``, ``npu_recurrent_gated_delta_rule``,
``npu_fused_causal_conv1d``, and an ``npu`` submodule) and sets ``torch.npu`` to that
submodule (:mod:`ascend_vlm.testing.npu_namespace`: ``is_available``, ``device_count``,
``current_device``, ``set_device``, ``synchronize``, ``Stream``, ``Event``, ``current_stream``,
``stream``, ``recorded_streams`` (what ``Tensor.record_stream``, patched as torch_npu patches
it, got), ``mstx`` (profiler ranges), ``get_device_name``, which reports an Atlas A2 SoC), and
selects the ``"mock"`` kernel backend (:mod:`ascend_vlm.kernel_backend`).
``uninstall_mock_npu()`` restores exactly what was there before, the backend selection included.

Every op and API keeps the signature of the real torch_npu (``testing/torch_npu_schemas.json``,
held by ``tests/testing/test_torch_npu_schemas.py``). Sources (Ascend/op-plugin docs):
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md``,
``docs/context/torch_npu-npu_rotary_mul.md``, ``（beta）torch_npu-npu_rms_norm.md``,
``（beta）torch_npu-npu_swiglu.md``, ``torch_npu-npu_weight_quant_batchmatmul.md``,
``torch_npu-npu_convert_weight_to_int4pack.md``; summarised with sources in
shared/reference/npu_api.md §1. The MoE, gated delta rule and causal conv1d kernels: their
docstrings in the wheels' ``torch_npu/_op_plugin_docs.py`` (``ascend_vlm/ops/moe_experts.py``
and the gated delta rule ops sum them up).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from ascend_vlm import kernel_backend
from ascend_vlm.kernel_backend import MOCK_MARKER
from ascend_vlm.testing._checks import bad
from ascend_vlm.testing.mock_ops import MOCK_OPS
from ascend_vlm.testing.npu_namespace import build_npu_namespace, make_record_stream

_ABSENT = object()
_LOCK = threading.Lock()
_SAVED: list[dict[str, Any]] = []  # one entry per active install (nesting allowed)


def _build_modules(device_count: int) -> tuple[types.ModuleType, types.ModuleType]:
    mock = types.ModuleType("torch_npu", "ascend_vlm's mock torch_npu (CPU tensors)")
    mock.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    mock.__version__ = "0.0.0+ascend_vlm.mock"
    setattr(mock, MOCK_MARKER, True)
    for name, op in MOCK_OPS.items():
        setattr(mock, name, op)
    npu = build_npu_namespace(device_count)
    mock.npu = npu
    return mock, npu


def install_mock_npu(device_count: int = 1) -> types.ModuleType:
    """Install the mock ``torch_npu`` (and ``torch.npu``); returns the mock module.

    Selects the ``"mock"`` kernel backend. Installs nest: each call must be paired with
    :func:`uninstall_mock_npu`. Raises ``RuntimeError`` if a real torch_npu is already imported
    (the mock never shadows it).
    """
    if device_count < 1:
        raise bad("device_count", "an int >= 1", device_count)
    with _LOCK:
        current = sys.modules.get("torch_npu")
        if current is not None and not getattr(current, MOCK_MARKER, False):
            raise RuntimeError(
                "install_mock_npu: a real torch_npu is imported; refusing to "
                "shadow it (set ASCEND_VLM_TEST_REAL_NPU=1 to test on it)"
            )
        saved = {
            "torch_npu": sys.modules.get("torch_npu", _ABSENT),
            "torch_npu.npu": sys.modules.get("torch_npu.npu", _ABSENT),
            "torch.npu": torch.__dict__.get("npu", _ABSENT),
        }
        mock, npu = _build_modules(device_count)
        sys.modules["torch_npu"] = mock
        sys.modules["torch_npu.npu"] = npu
        torch.npu = npu
        saved["record_stream"] = torch.Tensor.record_stream
        torch.Tensor.record_stream = make_record_stream(npu, torch.Tensor.record_stream)
        saved["backend"] = kernel_backend.set_backend("mock")
        _SAVED.append(saved)
        return mock


def uninstall_mock_npu() -> None:
    """Undo the latest :func:`install_mock_npu`, restoring the previous modules and kernel
    backend selection exactly."""
    with _LOCK:
        if not _SAVED:
            raise RuntimeError("uninstall_mock_npu: the mock NPU is not installed")
        saved = _SAVED.pop()
        for name in ("torch_npu", "torch_npu.npu"):
            if saved[name] is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]
        if saved["torch.npu"] is _ABSENT:
            torch.__dict__.pop("npu", None)
        else:
            torch.npu = saved["torch.npu"]
        torch.Tensor.record_stream = saved["record_stream"]
        kernel_backend.set_backend(saved["backend"])


@contextlib.contextmanager
def mock_npu(device_count: int = 1) -> Iterator[types.ModuleType]:
    """``with mock_npu() as torch_npu:`` — the mock installed for the block."""
    module = install_mock_npu(device_count)
    try:
        yield module
    finally:
        uninstall_mock_npu()


kernel_backend.register_mock_installer(install_mock_npu)

__all__ = ["install_mock_npu", "mock_npu", "uninstall_mock_npu"]
