"""Python face of the C++ op registry (``csrc/runtime/op_registry``).

A descriptor is the dict form of ``op_plugins/<op>/spec.json`` (format and vocabulary:
:mod:`ascend_vlm._op_descriptor`, the one validator of it, which every descriptor passes before
it reaches the C++ registry). Python-only keys such as ``kwarg_only`` are not stored.
"""

from __future__ import annotations

from typing import Any

from ascend_vlm import _C
from ascend_vlm._op_descriptor import check_descriptor


def register_op(descriptor: dict[str, Any]) -> None:
    """Validate ``descriptor`` and add it to the registry.

    A malformed descriptor raises ``ValueError`` naming the op, the field, what was expected and
    what came. Re-registering an identical descriptor is a no-op (imports may run twice); a
    different descriptor under a registered name raises ``ValueError``.
    """
    name = descriptor.get("name", "?") if isinstance(descriptor, dict) else "?"
    _C.register_op(_to_cpp(check_descriptor(descriptor, f"op {name!r}")))


def unregister_op(name: str) -> None:
    """Remove op ``name``; ``KeyError`` if it is not registered."""
    if not _C.unregister_op(_op_name(name)):
        raise KeyError(f"op {name!r} is not registered")


def registered_ops() -> list[str]:
    """Names of the registered ops, sorted."""
    return list(_C.registered_ops())


def op_descriptor(name: str) -> dict[str, Any]:
    """The descriptor registered as ``name`` (normalised: optional keys filled in)."""
    op = _C.find_op(_op_name(name))
    if op is None:
        raise KeyError(f"op {name!r} is not registered")
    return {
        "name": op.name,
        "summary": op.summary,
        "npu_kernel": op.npu_kernel,
        "inputs": [_tensor_dict(tensor, with_optional=True) for tensor in op.inputs],
        "outputs": [_tensor_dict(tensor, with_optional=False) for tensor in op.outputs],
        "attrs": [{"name": a.name, "type": a.type, "default": a.default} for a in op.attrs],
    }


def _op_name(name: object) -> str:
    if not isinstance(name, str):
        raise ValueError(f"name: expected str, got {type(name).__name__} {name!r}")
    return name


def _tensor_to_cpp(entry: dict[str, Any]) -> _C.TensorSpec:
    tensor = _C.TensorSpec()
    tensor.name = entry["name"]
    tensor.dtypes = entry["dtypes"]
    tensor.formats = entry["formats"]
    tensor.rank = entry["rank"]
    dims = entry.get("dynamic_dims", [])
    if dims == "all":
        tensor.all_dims_dynamic = True
    else:
        tensor.dynamic_dims = dims
    tensor.optional = entry.get("optional", False)
    return tensor


def _attr_to_cpp(entry: dict[str, Any]) -> _C.AttrSpec:
    attr = _C.AttrSpec()
    attr.name = entry["name"]
    attr.type = entry["type"]
    attr.default = entry.get("default")
    return attr


def _to_cpp(descriptor: dict[str, Any]) -> _C.OpDescriptor:
    """A checked descriptor as the C++ registry's struct."""
    op = _C.OpDescriptor()
    op.name = descriptor["name"]
    op.summary = descriptor["summary"]
    op.npu_kernel = descriptor["npu_kernel"]
    op.inputs = [_tensor_to_cpp(entry) for entry in descriptor["inputs"]]
    op.outputs = [_tensor_to_cpp(entry) for entry in descriptor["outputs"]]
    op.attrs = [_attr_to_cpp(entry) for entry in descriptor.get("attrs", [])]
    return op


def _tensor_dict(tensor: _C.TensorSpec, *, with_optional: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": tensor.name,
        "dtypes": list(tensor.dtypes),
        "formats": list(tensor.formats),
        "rank": tensor.rank,
        "dynamic_dims": "all" if tensor.all_dims_dynamic else list(tensor.dynamic_dims),
    }
    if with_optional:
        out["optional"] = tensor.optional
    return out
