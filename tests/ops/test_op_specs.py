"""op_plugins/<op>/spec.json is the single source of schema, registry descriptor and docs."""

from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ascend_vlm import ops
from ascend_vlm.ops import _op_spec as _spec

OP_NAMES = sorted(ops.OPS)


def test_every_public_op_has_a_spec_and_the_registered_schema_comes_from_it() -> None:
    assert [spec.name for spec in _spec.available_specs()] == OP_NAMES
    for name in OP_NAMES:
        spec = _spec.load_spec(name)
        registered = getattr(torch.ops.ascend_vlm, name).default._schema
        reparsed = torch._C.parse_schema(f"ascend_vlm::{name}{spec.schema()}")
        assert str(registered) == str(reparsed)


@pytest.mark.parametrize("name", OP_NAMES)
def test_python_wrapper_takes_exactly_the_spec_arguments(name: str) -> None:
    """Names, order, positional/keyword-only and defaults of ``ascend_vlm.ops.<name>`` are the
    spec's, so the README table (generated from the spec) documents what the wrapper accepts."""

    def plain(signature: inspect.Signature) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in signature.parameters.values()]

    wrapper = inspect.signature(getattr(ops, name))
    assert plain(wrapper) == plain(_spec.load_spec(name).signature())


def test_schema_marks_optional_and_keyword_only_arguments() -> None:
    schema = _spec.load_spec("rms_norm").schema()
    assert schema == "(Tensor x, Tensor weight, float eps=1e-06, *, float offset=0.0) -> Tensor"
    attention = _spec.load_spec("fused_attention").schema()
    assert "Tensor? attention_mask=None, *, str layout='BNSD', int? num_heads=None" in attention


def test_descriptor_holds_only_registry_keys() -> None:
    descriptor = _spec.load_spec("fused_attention").descriptor()
    assert set(descriptor) == {"name", "summary", "npu_kernel", "inputs", "outputs", "attrs"}
    assert all("kwarg_only" not in entry for entry in descriptor["attrs"])
    assert descriptor["npu_kernel"] == "torch_npu.npu_fusion_attention"


def test_markdown_table_lists_every_op() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ascend_vlm.ops", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| `ascend_vlm.ops.")]
    assert [re.search(r"ops\.(\w+)", row).group(1) for row in rows] == OP_NAMES


def _write_spec(root: Path, name: str, **changes) -> Path:
    raw = copy.deepcopy(_spec.load_spec("swiglu").raw)
    raw.update(name=name, **changes)
    path = root / name / "spec.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(raw))
    return path


def _load_error(monkeypatch, root: Path, name: str) -> str:
    """The ValueError message of loading spec ``name`` from ``root`` alone."""
    monkeypatch.setattr(_spec, "spec_roots", lambda: [root])
    _spec.load_spec.cache_clear()
    try:
        with pytest.raises(ValueError) as raised:
            _spec.load_spec(name)
    finally:
        _spec.load_spec.cache_clear()
    return str(raised.value)


def _input(**changes) -> dict:
    entry = {"name": "x", "dtypes": ["float32"], "formats": ["ND"], "rank": 2, "optional": False}
    return {**entry, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"inputs": [_input(dtypes=["float8"])]},
            "inputs[0].dtypes: expected names from ['float16', 'bfloat16', 'float32', 'float64', "
            "'int8', 'uint8', 'int32', 'int64', 'bool'], got 'float8'",
        ),
        (
            {"inputs": [_input(formats=["NCDHW"])]},
            "inputs[0].formats: expected names from ['ND', 'BNSD', 'BSH', 'BSND', 'SBH', 'TND', "
            "'NCHW', 'NHWC'], got 'NCDHW'",
        ),
        (
            {"attrs": [{"name": "dim", "type": "double", "default": 0}]},
            "attrs[0].type: expected one of ['int', 'float', 'bool', 'str', 'int_list', "
            "'float_list'], got 'double'",
        ),
        (
            {"inputs": [_input(dynamic_dims=[2])]},
            "inputs[0].dynamic_dims: expected axes in [0, 2), got [2]",
        ),
        (
            {"attrs": [{"name": "x", "type": "int", "default": 0}]},
            "attrs[0].name: expected names unique among tensors and attrs, got x",
        ),
        (
            {"attrs": [{"name": "dim", "type": "int", "default": 0.5}]},
            "attrs[0].default: expected a value of type 'int', got 0.5",
        ),
    ],
    ids=["dtype", "format", "attr-type", "dynamic-dim", "duplicate", "default"],
)
def test_malformed_specs_are_rejected_naming_file_and_field(
    tmp_path, monkeypatch, changes, message
):
    path = _write_spec(tmp_path, "broken_op", **changes)
    assert _load_error(monkeypatch, tmp_path, "broken_op") == f"{path}: {message}"


def test_a_spec_named_after_another_folder_is_rejected(tmp_path, monkeypatch) -> None:
    path = _write_spec(tmp_path, "renamed_op")
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "name": "swiglu"}))
    assert _load_error(monkeypatch, tmp_path, "renamed_op") == (
        f"{path}: name: expected the folder name 'renamed_op', got 'swiglu'"
    )


def test_installed_copy_is_found_when_the_source_tree_is_absent(tmp_path, monkeypatch) -> None:
    installed = tmp_path / "_op_plugins"
    (installed / "swiglu").mkdir(parents=True)
    source = _spec.spec_roots()[0] / "swiglu" / "spec.json"
    (installed / "swiglu" / "spec.json").write_text(source.read_text())
    monkeypatch.setattr(_spec, "spec_roots", lambda: [tmp_path / "op_plugins", installed])
    _spec.load_spec.cache_clear()
    try:
        assert _spec.load_spec("swiglu").raw == json.loads(source.read_text())
        with pytest.raises(
            FileNotFoundError, match=re.escape("op spec 'rms_norm': no rms_norm/spec.json")
        ):
            _spec.load_spec("rms_norm")
    finally:
        _spec.load_spec.cache_clear()


def test_ops_are_registered_in_the_cpp_registry_when_the_extension_is_built() -> None:
    runtime = pytest.importorskip("ascend_vlm.runtime", reason="ascend_vlm._C is not built")
    assert set(OP_NAMES) <= set(runtime.registered_ops())
    for name in OP_NAMES:
        registered = runtime.op_descriptor(name)
        expected = _spec.load_spec(name).descriptor()
        assert registered["npu_kernel"] == expected["npu_kernel"]
        assert [a["name"] for a in registered["attrs"]] == [a["name"] for a in expected["attrs"]]
        assert [(i["name"], i["dtypes"], i["rank"]) for i in registered["inputs"]] == [
            (i["name"], i["dtypes"], i["rank"]) for i in expected["inputs"]
        ]
