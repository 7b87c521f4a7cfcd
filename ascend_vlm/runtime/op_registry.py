"""Python face of the C++ op registry (``csrc/runtime/op_registry``).

A descriptor is the dict form of ``op_plugins/<op>/spec.json``::

    {"name": "rms_norm", "summary": "...", "npu_kernel": "torch_npu.npu_rms_norm",
     "inputs":  [{"name": "x", "dtypes": ["float16"], "formats": ["ND"], "rank": 3,
                  "dynamic_dims": [0, 1], "optional": false}],
     "outputs": [{"name": "y", "dtypes": ["float16"], "formats": ["ND"], "rank": 3,
                  "dynamic_dims": [0, 1]}],
     "attrs":   [{"name": "eps", "type": "float", "default": 1e-6}]}

Other keys (e.g. Python-only hints such as ``kwarg_only``) are ignored. This module checks the
dict's shape (keys present, value types); the C++ registry checks the
rules (known dtypes/formats, axes within the rank, unique names, defaults matching attr types).
Both raise ``ValueError`` naming the op, the field, what was expected and what came.
"""

from __future__ import annotations

from typing import Any

from ascend_vlm import _C

_OP_REQUIRED = ("name", "summary", "npu_kernel", "inputs", "outputs")
_TENSOR_REQUIRED = ("name", "dtypes", "formats", "rank")
_ATTR_REQUIRED = ("name", "type")


def register_op(descriptor: dict[str, Any]) -> None:
    """Validate ``descriptor`` and add it to the registry.

    Re-registering an identical descriptor is a no-op (imports may run twice); a different
    descriptor under a registered name raises ``ValueError``.
    """
    _C.register_op(_parse_op(descriptor))


def unregister_op(name: str) -> None:
    """Remove op ``name``; ``KeyError`` if it is not registered."""
    if not _C.unregister_op(_require(str, "name", name, "op")):
        raise KeyError(f"op {name!r} is not registered")


def registered_ops() -> list[str]:
    """Names of the registered ops, sorted."""
    return list(_C.registered_ops())


def op_descriptor(name: str) -> dict[str, Any]:
    """The descriptor registered as ``name`` (normalised: optional keys filled in)."""
    op = _C.find_op(_require(str, "name", name, "op"))
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


def _require(expected: type | tuple[type, ...], field: str, value: object, op: str) -> Any:
    """Return ``value`` if it has an ``expected`` type (``bool`` only if listed), else raise."""
    types = expected if isinstance(expected, tuple) else (expected,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise ValueError(
            f"op {op!r}: {field}: expected {names}, got {type(value).__name__} {value!r}"
        )
    return value


def _require_keys(entry: object, required: tuple[str, ...], field: str, op: str) -> dict[str, Any]:
    _require(dict, field, entry, op)
    missing = [key for key in required if key not in entry]
    if missing:
        raise ValueError(f"op {op!r}: {field}: missing key(s) {missing}, got keys {sorted(entry)}")
    return entry


def _string_list(field: str, value: object, op: str) -> list[str]:
    _require(list, field, value, op)
    return [_require(str, f"{field}[{i}]", item, op) for i, item in enumerate(value)]


def _parse_tensor(entry: object, field: str, op: str) -> _C.TensorSpec:
    entry = _require_keys(entry, _TENSOR_REQUIRED, field, op)
    tensor = _C.TensorSpec()
    tensor.name = _require(str, f"{field}.name", entry["name"], op)
    tensor.dtypes = _string_list(f"{field}.dtypes", entry["dtypes"], op)
    tensor.formats = _string_list(f"{field}.formats", entry["formats"], op)
    tensor.rank = _require(int, f"{field}.rank", entry["rank"], op)
    dims = entry.get("dynamic_dims", [])
    if dims == "all":
        tensor.all_dims_dynamic = True
    else:
        _require(list, f"{field}.dynamic_dims", dims, op)
        tensor.dynamic_dims = [
            _require(int, f"{field}.dynamic_dims[{i}]", d, op) for i, d in enumerate(dims)
        ]
    tensor.optional = _require(bool, f"{field}.optional", entry.get("optional", False), op)
    return tensor


def _parse_attr(entry: object, field: str, op: str) -> _C.AttrSpec:
    entry = _require_keys(entry, _ATTR_REQUIRED, field, op)
    attr = _C.AttrSpec()
    attr.name = _require(str, f"{field}.name", entry["name"], op)
    attr.type = _require(str, f"{field}.type", entry["type"], op)
    default = entry.get("default")
    if isinstance(default, list):
        for i, item in enumerate(default):
            _require((int, float), f"{field}.default[{i}]", item, op)
    elif default is not None:
        _require((bool, int, float, str), f"{field}.default", default, op)
    attr.default = default
    return attr


def _parse_op(descriptor: object) -> _C.OpDescriptor:
    name = descriptor.get("name", "?") if isinstance(descriptor, dict) else "?"
    label = name if isinstance(name, str) else repr(name)
    entry = _require_keys(descriptor, _OP_REQUIRED, "descriptor", label)
    op = _C.OpDescriptor()
    op.name = _require(str, "name", entry["name"], label)
    op.summary = _require(str, "summary", entry["summary"], label)
    op.npu_kernel = _require(str, "npu_kernel", entry["npu_kernel"], label)
    for group in ("inputs", "outputs"):
        items = _require(list, group, entry[group], label)
        setattr(op, group, [_parse_tensor(t, f"{group}[{i}]", label) for i, t in enumerate(items)])
    attrs = _require(list, "attrs", entry.get("attrs", []), label)
    op.attrs = [_parse_attr(a, f"attrs[{i}]", label) for i, a in enumerate(attrs)]
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
