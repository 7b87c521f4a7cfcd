"""The C++ op registry behind ascend_vlm.runtime.register_op."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ascend_vlm import runtime

OP_PLUGINS = Path(__file__).resolve().parents[2] / "op_plugins"


def descriptor(name: str = "rt_test_op") -> dict[str, Any]:
    return {
        "name": name,
        "summary": "test op",
        "npu_kernel": "torch_npu.npu_test",
        "inputs": [
            {
                "name": "x",
                "dtypes": ["float16", "float32"],
                "formats": ["ND"],
                "rank": 3,
                "dynamic_dims": [0, 1],
                "optional": False,
            },
            {
                "name": "bias",
                "dtypes": ["float32"],
                "formats": ["ND"],
                "rank": -1,
                "dynamic_dims": "all",
                "optional": True,
            },
        ],
        "outputs": [
            {"name": "y", "dtypes": ["float32"], "formats": ["BNSD"], "rank": 4, "dynamic_dims": []}
        ],
        "attrs": [
            {"name": "eps", "type": "float", "default": 1e-6},
            {"name": "steps", "type": "int_list", "default": [1, 2]},
            {"name": "mode", "type": "str", "default": None},
        ],
    }


@pytest.fixture
def registered():
    """Register the test descriptor and remove it afterwards."""
    op = descriptor()
    runtime.register_op(op)
    yield op
    runtime.unregister_op(op["name"])


def test_round_trip_and_listing(registered):
    assert "rt_test_op" in runtime.registered_ops()
    assert runtime.registered_ops() == sorted(runtime.registered_ops())
    stored = runtime.op_descriptor("rt_test_op")
    assert stored["inputs"] == registered["inputs"]
    assert stored["outputs"] == [{**registered["outputs"][0]}]
    assert stored["attrs"] == registered["attrs"]


def test_identical_re_registration_is_a_no_op_and_conflict_is_an_error(registered):
    runtime.register_op(copy.deepcopy(registered))
    changed = copy.deepcopy(registered)
    changed["summary"] = "different"
    with pytest.raises(ValueError, match="op 'rt_test_op': name: already registered"):
        runtime.register_op(changed)


def test_unregister_and_lookup_of_missing_op():
    with pytest.raises(KeyError, match="not registered"):
        runtime.op_descriptor("rt_missing_op")
    with pytest.raises(KeyError, match="not registered"):
        runtime.unregister_op("rt_missing_op")


def test_project_specs_pass_the_registry_rules():
    """Every op_plugins/*/spec.json validates (registered under a test name, then removed)."""
    specs = sorted(OP_PLUGINS.glob("*/spec.json"))
    assert specs
    for spec_path in specs:
        spec = json.loads(spec_path.read_text())
        spec["name"] = f"rt_check_{spec['name']}"
        runtime.register_op(spec)
        assert runtime.op_descriptor(spec["name"])["inputs"][0]["name"] == spec["inputs"][0]["name"]
        runtime.unregister_op(spec["name"])


def _set(path: str, value: Any):
    def mutate(op: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = op
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[int(last) if last.isdigit() else last] = value

    return mutate


_DELETE = object()

INVALID_CASES = [
    (
        _set("inputs.0.dtypes", ["float8"]),
        r"inputs\[0\]\.dtypes: expected names from .*got 'float8'",
    ),
    (_set("inputs.0.dtypes", []), r"inputs\[0\]\.dtypes: expected at least one of"),
    (_set("outputs.0.formats", ["NC1HWC0"]), r"outputs\[0\]\.formats: expected names from"),
    (
        _set("inputs.0.dynamic_dims", [0, 3]),
        r"inputs\[0\]\.dynamic_dims: expected axes in \[0, 3\), got \[0, 3\]",
    ),
    (
        _set("inputs.1.dynamic_dims", [-1]),
        r"inputs\[1\]\.dynamic_dims: expected axes in \[0, rank\), got \[-1\]",
    ),
    (_set("inputs.0.rank", -2), r"inputs\[0\]\.rank: expected an int >= 0 or -1"),
    (
        _set("outputs.0.name", "x"),
        r"outputs\[0\]\.name: expected names unique among tensors and attrs, got x",
    ),
    (
        _set("attrs.1.name", "eps"),
        r"attrs\[1\]\.name: expected names unique among tensors and attrs, got eps",
    ),
    (_set("attrs.0.type", "double"), r"attrs\[0\]\.type: expected one of"),
    (_set("attrs.0.default", "small"), r"attrs\[0\]\.default: expected a value of type 'float'"),
    (_set("attrs.1.default", [1.5]), r"attrs\[1\]\.default: expected a value of type 'int_list'"),
    (_set("attrs.2.default", 3), r"attrs\[2\]\.default: expected a value of type 'str', got 3"),
    (_set("summary", _DELETE), r"summary: expected a value, got none \(missing\)"),
    (_set("inputs.0.rank", _DELETE), r"inputs\[0\]\.rank: expected a value, got none \(missing\)"),
    (_set("inputs.0.rank", True), r"inputs\[0\]\.rank: expected int, got bool"),
    (_set("inputs", {}), r"inputs: expected list, got dict"),
]


@pytest.mark.parametrize(("mutate", "message"), INVALID_CASES)
def test_invalid_descriptors_name_op_field_expected_and_got(mutate, message):
    op = descriptor("rt_bad_op")
    mutate(op)
    with pytest.raises(ValueError, match=r"op 'rt_bad_op': " + message):
        runtime.register_op(op)
    assert "rt_bad_op" not in runtime.registered_ops()
