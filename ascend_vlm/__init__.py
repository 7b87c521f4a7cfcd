"""ascend_vlm: fused Ascend NPU kernels and runtime plumbing for Hugging Face VLMs.

Public API: :func:`patch`, :func:`unpatch`, :class:`PatchReport`, the submodules :mod:`ops`,
:mod:`runtime`, :mod:`distributed`, :mod:`kernel_backend` (which implementation the ops run),
:mod:`pruning` (visual-token pruning and KV-cache compression at prefill),
:mod:`quantization` and :func:`quantize` (weight-only W8/W4 linear layers), :mod:`batching`
(:class:`BatchGenerator`: continuous batching under budgets), :func:`verify` and
:class:`VerifyReport` (where a model drifts from its stock reference, module by module),
:mod:`integrations` (transformers Trainer / TRL callback, ``apply_to_instance``, FSDP2),
:mod:`observability` and
:func:`trace` (stage timelines, attention maps, anomalous-token reports), :mod:`adapters`
and :class:`AdapterSet` (many LoRA adapters over one base, new visual tokens), :mod:`reuse`
(:class:`ChatSession`: multi-turn chat keeping its KV cache; :class:`VisionCache`: vision
features kept across calls and requests), :mod:`vision_input` (:class:`QwenVLPixels`:
image preprocessing equal to Hugging Face's, faster) and :mod:`testing` (the
mock NPU and its pytest plugin), and the errors :class:`AclError`, :class:`PatchError`.

Importing the package registers the custom ops ``torch.ops.ascend_vlm.*`` (schemas, kernels,
fake kernels, autograd), as torch extension libraries do, so a ``torch.export``-ed program or a
compiled artifact that calls them loads after ``import ascend_vlm``. It also registers the
attention implementation ``"ascend_flash"`` with transformers (its attention and mask functions),
so ``from_pretrained(..., attn_implementation="ascend_flash")`` routes attention to :mod:`ops`:
the registration runs when transformers' modeling code is first imported (or now, if it already
is), so ``import ascend_vlm`` does not import transformers. That imports torch and
:mod:`ops` (with :mod:`kernel_backend`); everything heavier (transformers through ``patch``,
:mod:`distributed`, :mod:`pruning`, :mod:`quantization`, :mod:`batching`,
:mod:`observability`, :mod:`adapters`, :mod:`reuse`, :mod:`vision_input`, :mod:`testing`)
loads on first access.
"""

from __future__ import annotations

import importlib
import types
import warnings
from typing import TYPE_CHECKING, Any

from ascend_vlm import kernel_backend, ops
from ascend_vlm._compat.post_import import call_when_imported
from ascend_vlm._errors import AclError, PatchError
from ascend_vlm._version import __version__ as __version__

__all__ = [
    "AclError",
    "AdapterSet",
    "BatchGenerator",
    "ChatSession",
    "PatchError",
    "PatchReport",
    "QwenVLPixels",
    "VerifyReport",
    "VisionCache",
    "adapters",
    "batching",
    "distributed",
    "integrations",
    "kernel_backend",
    "observability",
    "ops",
    "patch",
    "pruning",
    "quantization",
    "quantize",
    "reuse",
    "runtime",
    "testing",
    "trace",
    "unpatch",
    "verify",
    "vision_input",
]

_LAZY_SUBMODULES = {
    "runtime",
    "distributed",
    "pruning",
    "quantization",
    "reuse",
    "testing",
    "batching",
    "observability",
    "adapters",
    "vision_input",
    "integrations",
}
_LAZY_ATTRIBUTES = {
    "AdapterSet": "ascend_vlm.adapters",
    "BatchGenerator": "ascend_vlm.batching",
    "patch": "ascend_vlm.patching",
    "unpatch": "ascend_vlm.patching",
    "PatchReport": "ascend_vlm.patching",
    "quantize": "ascend_vlm.quantization",
    "ChatSession": "ascend_vlm.reuse",
    "VisionCache": "ascend_vlm.reuse",
    "trace": "ascend_vlm.observability",
    "QwenVLPixels": "ascend_vlm.vision_input",
    "verify": "ascend_vlm.verification",
    "VerifyReport": "ascend_vlm.verification",
}

if TYPE_CHECKING:
    from ascend_vlm import (
        adapters,
        batching,
        distributed,
        integrations,
        observability,
        pruning,
        quantization,
        reuse,
        runtime,
        testing,
        vision_input,
    )
    from ascend_vlm.adapters import AdapterSet
    from ascend_vlm.batching import BatchGenerator
    from ascend_vlm.observability import trace
    from ascend_vlm.patching import PatchReport, patch, unpatch
    from ascend_vlm.quantization import quantize
    from ascend_vlm.reuse import ChatSession, VisionCache
    from ascend_vlm.verification import VerifyReport, verify
    from ascend_vlm.vision_input import QwenVLPixels


def _register_ascend_flash(modeling_utils: types.ModuleType) -> None:
    """Register ``"ascend_flash"`` with transformers (`register_attention`) once its
    `modeling_utils` is imported; a failure warns instead of breaking that import."""
    from ascend_vlm.patching.attention import register_attention

    try:
        register_attention()
    except Exception as error:  # transformers' API moved: say so, keep transformers usable
        warnings.warn(
            f"ascend_vlm could not register attn_implementation='ascend_flash' with "
            f"{modeling_utils.__name__}: {error!r}",
            stacklevel=2,
        )


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"ascend_vlm.{name}")
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    raise AttributeError(f"module 'ascend_vlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Last, so that a registration running now (transformers already imported) sees the whole package.
call_when_imported("transformers.modeling_utils", _register_ascend_flash)
