"""Op specs: ``op_plugins/<op>/spec.json`` is the single source of each op's interface.

From one spec we derive (a) the ``torch.library`` schema string, (b) the descriptor handed to the
C++ op registry (``ascend_vlm.runtime.register_op``) and (c) the README ops table
(``python -m ascend_vlm.ops --markdown``). Specs are found in the source tree (``op_plugins/``
beside the package) or in the installed copy (``ascend_vlm/_op_plugins/``, made by setup.py).
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ascend_vlm

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
FORMATS = frozenset({"ND", "BNSD", "BSH", "BSND", "SBH", "TND", "NCHW", "NHWC"})
# spec attr type -> torch schema type
ATTR_TYPES = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "int_list": "int[]",
    "float_list": "float[]",
}
# Keys of the descriptor the C++ registry understands; "kwarg_only" only shapes the Python schema.
_TENSOR_KEYS = ("name", "dtypes", "formats", "rank", "dynamic_dims", "optional")
_OUTPUT_KEYS = ("name", "dtypes", "formats", "rank", "dynamic_dims")
_ATTR_KEYS = ("name", "type", "default")


def spec_roots() -> list[Path]:
    """Folders that may hold ``<op>/spec.json``: the source tree first, then the installed copy."""
    package_dir = Path(ascend_vlm.__file__).resolve().parent
    return [package_dir.parent / "op_plugins", package_dir / "_op_plugins"]


@dataclass(frozen=True)
class OpSpec:
    """A parsed, checked ``spec.json``."""

    name: str
    raw: dict[str, Any]

    @property
    def qualname(self) -> str:
        return f"ascend_vlm::{self.name}"

    def input_dtypes(self, input_name: str) -> frozenset[torch.dtype]:
        """The torch dtypes the spec allows for input ``input_name``."""
        for entry in self.raw["inputs"]:
            if entry["name"] == input_name:
                return frozenset(DTYPES[d] for d in entry["dtypes"])
        raise KeyError(f"{self.name}: spec has no input {input_name!r}")

    def arguments(self) -> list[tuple[str, bool]]:
        """Schema arguments in order as ``(name, kwarg_only)``: tensor inputs, then attrs."""
        entries = self.raw["inputs"] + self.raw["attrs"]
        return [(e["name"], bool(e.get("kwarg_only", False))) for e in entries]

    def signature(self) -> inspect.Signature:
        """The Python signature the schema implies, which the public wrapper
        ``ascend_vlm.ops.<name>`` must have: the same names in the same order, ``*`` before the
        first kwarg-only one, the spec's defaults (None for an optional tensor)."""
        parameters = []
        for entry in self.raw["inputs"] + self.raw["attrs"]:
            if "type" in entry:
                default = entry["default"]
            else:
                default = None if entry["optional"] else inspect.Parameter.empty
            kind = (
                inspect.Parameter.KEYWORD_ONLY
                if entry.get("kwarg_only", False)
                else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
            parameters.append(inspect.Parameter(entry["name"], kind, default=default))
        return inspect.Signature(parameters)

    def schema(self) -> str:
        """The ``torch.library`` schema, e.g. ``(Tensor x, Tensor weight, float eps=1e-06) -> Tensor``."""
        parts: list[str] = []
        keyword_marker_placed = False
        for entry in self.raw["inputs"] + self.raw["attrs"]:
            if entry.get("kwarg_only", False) and not keyword_marker_placed:
                parts.append("*")
                keyword_marker_placed = True
            parts.append(_schema_argument(entry))
        outputs = ", ".join("Tensor" for _ in self.raw["outputs"])
        returns = outputs if len(self.raw["outputs"]) == 1 else f"({outputs})"
        return f"({', '.join(parts)}) -> {returns}"

    def descriptor(self) -> dict[str, Any]:
        """The descriptor for the C++ op registry (the spec without Python-only keys)."""
        raw = self.raw
        return {
            "name": raw["name"],
            "summary": raw["summary"],
            "npu_kernel": raw["npu_kernel"],
            "inputs": [{k: e[k] for k in _TENSOR_KEYS} for e in raw["inputs"]],
            "outputs": [{k: e[k] for k in _OUTPUT_KEYS} for e in raw["outputs"]],
            "attrs": [{k: e[k] for k in _ATTR_KEYS} for e in raw["attrs"]],
        }


def _schema_argument(entry: dict[str, Any]) -> str:
    if "type" not in entry:  # a tensor input
        if entry["optional"]:
            return f"Tensor? {entry['name']}=None"
        return f"Tensor {entry['name']}"
    schema_type = ATTR_TYPES[entry["type"]]
    default = entry["default"]
    if default is None:
        return f"{schema_type}? {entry['name']}=None"
    if isinstance(default, str):
        return f"{schema_type} {entry['name']}='{default}'"
    if isinstance(default, bool):
        return f"{schema_type} {entry['name']}={default}"
    if isinstance(default, list):
        return f"{schema_type} {entry['name']}=[{', '.join(map(str, default))}]"
    return f"{schema_type} {entry['name']}={default!r}"


def _check_spec(raw: dict[str, Any], origin: Path) -> None:
    """Reject malformed specs early, naming the file, the field, what was expected and got."""

    def fail(field: str, expected: str, got: object) -> ValueError:
        return ValueError(f"{origin}: {field}: expected {expected}, got {got!r}")

    for key in ("name", "summary", "npu_kernel", "inputs", "outputs", "attrs"):
        if key not in raw:
            raise fail(key, "a value", "missing")
    if raw["name"] != origin.parent.name:
        raise fail("name", f"the folder name {origin.parent.name!r}", raw["name"])
    for section in ("inputs", "outputs"):
        for entry in raw[section]:
            field = f"{section}.{entry.get('name')}"
            for dtype in entry["dtypes"]:
                if dtype not in DTYPES:
                    raise fail(f"{field}.dtypes", f"one of {sorted(DTYPES)}", dtype)
            for fmt in entry["formats"]:
                if fmt not in FORMATS:
                    raise fail(f"{field}.formats", f"one of {sorted(FORMATS)}", fmt)
            rank = entry["rank"]
            if not isinstance(rank, int) or rank < -1:
                raise fail(f"{field}.rank", "an int >= -1 (-1 = any)", rank)
            if rank != -1 and any(d >= rank for d in entry["dynamic_dims"]):
                raise fail(f"{field}.dynamic_dims", f"dims < rank {rank}", entry["dynamic_dims"])
    for entry in raw["attrs"]:
        if entry["type"] not in ATTR_TYPES:
            raise fail(f"attrs.{entry['name']}.type", f"one of {sorted(ATTR_TYPES)}", entry["type"])
    names = [e["name"] for e in raw["inputs"] + raw["attrs"]]
    if len(set(names)) != len(names):
        raise fail("inputs/attrs", "unique argument names", names)


@functools.cache
def load_spec(op_name: str) -> OpSpec:
    """Load and check ``<root>/<op_name>/spec.json`` from the first root that has it."""
    for root in spec_roots():
        path = root / op_name / "spec.json"
        if path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))
            _check_spec(raw, path)
            return OpSpec(name=op_name, raw=raw)
    searched = ", ".join(str(r) for r in spec_roots())
    raise FileNotFoundError(f"op spec {op_name!r}: no {op_name}/spec.json under {searched}")


def available_specs() -> list[OpSpec]:
    """Every op spec found, sorted by name (source tree wins over the installed copy)."""
    names = sorted({path.parent.name for root in spec_roots() for path in root.glob("*/spec.json")})
    return [load_spec(name) for name in names]


def markdown_table(specs: list[OpSpec]) -> str:
    """The README ops table generated from the specs: each op's Python call signature (which
    its wrapper has, see `OpSpec.signature`), summary, tensor inputs and NPU kernel."""
    lines = [
        "| op (Python signature) | what it computes | inputs (dtypes; formats) | NPU kernel |",
        "|---|---|---|---|",
    ]
    for spec in specs:
        raw = spec.raw
        inputs = "<br>".join(
            f"`{e['name']}`{'?' if e['optional'] else ''}: {', '.join(e['dtypes'])}; "
            f"{', '.join(e['formats'])}"
            for e in raw["inputs"]
        )
        lines.append(
            f"| `ascend_vlm.ops.{spec.name}{spec.signature()}` | {raw['summary']} | {inputs} | "
            f"`{raw['npu_kernel']}` |"
        )
    return "\n".join(lines)
