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

from ascend_vlm._op_descriptor import ATTR_TYPES, DTYPES, check_descriptor

# The spec's dtype names are torch's.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
# Keys of the descriptor the C++ registry stores; "kwarg_only" only shapes the Python schema.
_TENSOR_KEYS = ("name", "dtypes", "formats", "rank", "dynamic_dims", "optional")
_OUTPUT_KEYS = ("name", "dtypes", "formats", "rank", "dynamic_dims")
_ATTR_KEYS = ("name", "type", "default")


def spec_roots() -> list[Path]:
    """Folders that may hold ``<op>/spec.json``: the source tree first, then the installed copy."""
    package_dir = Path(__file__).resolve().parent.parent  # ascend_vlm/
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
                return frozenset(TORCH_DTYPES[d] for d in entry["dtypes"])
        raise KeyError(f"{self.name}: spec has no input {input_name!r}")

    def signature(self) -> inspect.Signature:
        """The Python signature the schema implies, which the public wrapper
        ``ascend_vlm.ops.<name>`` must have: the same names in the same order, ``*`` before the
        first kwarg-only one, the spec's defaults (None for an optional tensor)."""
        parameters = []
        for entry in self.raw["inputs"] + self.raw["attrs"]:
            if "type" in entry:
                default = entry.get("default")
            else:
                default = None if entry.get("optional", False) else inspect.Parameter.empty
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
            "inputs": [{k: e[k] for k in _TENSOR_KEYS if k in e} for e in raw["inputs"]],
            "outputs": [{k: e[k] for k in _OUTPUT_KEYS if k in e} for e in raw["outputs"]],
            "attrs": [{k: e[k] for k in _ATTR_KEYS if k in e} for e in raw["attrs"]],
        }


def _schema_argument(entry: dict[str, Any]) -> str:
    if "type" not in entry:  # a tensor input
        if entry.get("optional", False):
            return f"Tensor? {entry['name']}=None"
        return f"Tensor {entry['name']}"
    schema_type = ATTR_TYPES[entry["type"]]
    default = entry.get("default")
    if default is None:
        return f"{schema_type}? {entry['name']}=None"
    if isinstance(default, str):
        return f"{schema_type} {entry['name']}='{default}'"
    if isinstance(default, bool):
        return f"{schema_type} {entry['name']}={default}"
    if isinstance(default, list):
        return f"{schema_type} {entry['name']}=[{', '.join(map(str, default))}]"
    return f"{schema_type} {entry['name']}={default!r}"


@functools.cache
def load_spec(op_name: str) -> OpSpec:
    """Load and check ``<root>/<op_name>/spec.json`` from the first root that has it."""
    for root in spec_roots():
        path = root / op_name / "spec.json"
        if path.is_file():
            raw = check_descriptor(json.loads(path.read_text(encoding="utf-8")), str(path))
            if raw["name"] != op_name:
                raise ValueError(
                    f"{path}: name: expected the folder name {op_name!r}, got {raw['name']!r}"
                )
            return OpSpec(name=op_name, raw={"attrs": [], **raw})
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
            f"`{e['name']}`{'?' if e.get('optional', False) else ''}: {', '.join(e['dtypes'])}; "
            f"{', '.join(e['formats'])}"
            for e in raw["inputs"]
        )
        lines.append(
            f"| `ascend_vlm.ops.{spec.name}{spec.signature()}` | {raw['summary']} | {inputs} | "
            f"`{raw['npu_kernel']}` |"
        )
    return "\n".join(lines)
