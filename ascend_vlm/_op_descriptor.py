"""The op descriptor format (``op_plugins/<op>/spec.json``): its vocabulary and its one validator.

Both readers of descriptors check them here: the ops when they load their specs
(:mod:`ascend_vlm.ops`, which must work without the C++ extension, so the vocabulary cannot live
in C++) and :func:`ascend_vlm.runtime.register_op`, which hands the C++ op registry only
descriptors that passed. A descriptor::

    {"name": "rms_norm", "summary": "...", "npu_kernel": "torch_npu.npu_rms_norm",
     "inputs":  [{"name": "x", "dtypes": ["float16"], "formats": ["ND"], "rank": 3,
                  "dynamic_dims": [0, 1], "optional": false}],
     "outputs": [{"name": "y", "dtypes": ["float16"], "formats": ["ND"], "rank": 3,
                  "dynamic_dims": [0, 1]}],
     "attrs":   [{"name": "eps", "type": "float", "default": 1e-6, "kwarg_only": true}]}

``attrs``, ``dynamic_dims`` (a list of axes, or ``"all"``), ``optional``, ``default`` and
``kwarg_only`` (a Python-only hint: the argument is keyword-only in the op's schema) may be left
out. Every other key is required.
"""

from __future__ import annotations

from typing import Any

# Tensor element types, spelled as torch spells them (``torch.<name>`` is the dtype).
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
FORMATS = ("ND", "BNSD", "BSH", "BSND", "SBH", "TND", "NCHW", "NHWC")
# Attr type -> its type in a torch.library schema.
ATTR_TYPES = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "int_list": "int[]",
    "float_list": "float[]",
}
# Attr type -> the JSON value types its default may have (an int is a valid float).
_DEFAULT_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "str": (str,),
    "int_list": (int,),
    "float_list": (float, int),
}
_LIST_ATTR_TYPES = ("int_list", "float_list")


class _Rejection(ValueError):
    pass


def check_descriptor(descriptor: object, origin: str) -> dict[str, Any]:
    """Return ``descriptor`` if it is a valid op descriptor, else raise ``ValueError``
    ``"<origin>: <field>: expected <what>, got <value>"`` (``origin`` names the spec file or the
    op, ``field`` e.g. ``inputs[0].dtypes``)."""
    try:
        _check(descriptor)
    except _Rejection as rejection:
        field, expected, got = rejection.args
        raise ValueError(f"{origin}: {field}: expected {expected}, got {got}") from None
    return descriptor  # type: ignore[return-value]


def _reject(field: str, expected: str, got: object) -> _Rejection:
    return _Rejection(field, expected, got)


def _value(field: str, entry: dict[str, Any], key: str, types: tuple[type, ...]) -> Any:
    """``entry[key]``, required to have one of ``types`` (a bool counts only if listed)."""
    if key not in entry:
        raise _reject(f"{field}.{key}" if field else key, "a value", "none (missing)")
    return _typed(f"{field}.{key}" if field else key, entry[key], types)


def _typed(field: str, value: object, types: tuple[type, ...]) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise _reject(field, names, f"{type(value).__name__} {value!r}")
    return value


def _names(field: str, values: object, known: tuple[str, ...]) -> None:
    _typed(field, values, (list,))
    if not values:
        raise _reject(field, f"at least one of {list(known)}", "[]")
    for value in values:
        if value not in known:
            raise _reject(field, f"names from {list(known)}", repr(value))


def _check_tensor(field: str, entry: object) -> None:
    entry = _typed(field, entry, (dict,))
    if not _value(field, entry, "name", (str,)):
        raise _reject(f"{field}.name", "a non-empty name", "''")
    _names(f"{field}.dtypes", entry.get("dtypes"), DTYPES)
    _names(f"{field}.formats", entry.get("formats"), FORMATS)
    rank = _value(field, entry, "rank", (int,))
    if rank < -1:
        raise _reject(f"{field}.rank", "an int >= 0 or -1 (any rank)", rank)
    dims = entry.get("dynamic_dims", [])
    if dims != "all":
        # With rank -1 the upper bound is only known per call, so only the sign is checked.
        bound = "rank" if rank == -1 else rank
        for axis in _typed(f"{field}.dynamic_dims", dims, (list,)):
            if _typed(f"{field}.dynamic_dims", axis, (int,)) < 0 or (rank != -1 and axis >= rank):
                raise _reject(f"{field}.dynamic_dims", f"axes in [0, {bound})", dims)
    _typed(f"{field}.optional", entry.get("optional", False), (bool,))
    _typed(f"{field}.kwarg_only", entry.get("kwarg_only", False), (bool,))


def _check_attr(field: str, entry: object) -> None:
    entry = _typed(field, entry, (dict,))
    if not _value(field, entry, "name", (str,)):
        raise _reject(f"{field}.name", "a non-empty name", "''")
    kind = _value(field, entry, "type", (str,))
    if kind not in ATTR_TYPES:
        raise _reject(f"{field}.type", f"one of {list(ATTR_TYPES)}", repr(kind))
    default = entry.get("default")
    if default is not None and not _default_fits(kind, default):
        raise _reject(f"{field}.default", f"a value of type {kind!r}", repr(default))
    _typed(f"{field}.kwarg_only", entry.get("kwarg_only", False), (bool,))


def _default_fits(kind: str, default: object) -> bool:
    if (kind in _LIST_ATTR_TYPES) != isinstance(default, list):
        return False
    allowed = _DEFAULT_TYPES[kind]
    return all(
        isinstance(item, allowed) and (kind == "bool" or not isinstance(item, bool))
        for item in (default if isinstance(default, list) else [default])
    )


def _check(descriptor: object) -> None:
    descriptor = _typed("descriptor", descriptor, (dict,))
    if not _value("", descriptor, "name", (str,)):
        raise _reject("name", "a non-empty op name", "''")
    for key in ("summary", "npu_kernel"):
        _value("", descriptor, key, (str,))
    arguments: list[dict[str, Any]] = []
    seen: set[str] = set()
    for group in ("inputs", "outputs", "attrs"):
        entries = (
            descriptor.get("attrs", [])
            if group == "attrs"
            else _value("", descriptor, group, (list,))
        )
        for i, entry in enumerate(_typed(group, entries, (list,))):
            field = f"{group}[{i}]"
            (_check_attr if group == "attrs" else _check_tensor)(field, entry)
            if entry["name"] in seen:
                raise _reject(
                    f"{field}.name", "names unique among tensors and attrs", entry["name"]
                )
            seen.add(entry["name"])
            if group != "outputs":
                arguments.append(entry)
    keyword_only = [entry.get("kwarg_only", False) for entry in arguments]
    if keyword_only != sorted(keyword_only):
        # The schema places one "*" before the first kwarg_only argument.
        first = keyword_only.index(True)
        late = next(e["name"] for e in arguments[first:] if not e.get("kwarg_only", False))
        raise _reject("kwarg_only", "keyword-only arguments after all the others", late)
