"""The mock torch_npu has the real signatures, and every call the project makes to torch_npu binds
on every supported torch-npu release (``ascend_vlm/testing/torch_npu_schemas.json``, read from the
wheels by ``scripts/update_torch_npu_schemas.py``)."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ascend_vlm.testing.mock_ops import MOCK_OPS
from ascend_vlm.testing.npu_namespace import build_npu_namespace
from ascend_vlm.testing.torch_npu_schemas import (
    REQUIRED,
    SCHEMAS_PATH,
    Parameter,
    callable_parameters,
    check_call,
    find_call_sites,
    load_schemas,
    newest_release,
    parse_op_schema,
    parse_python_signature,
)

ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILES = sorted(p for top in ("ascend_vlm", "scripts") for p in (ROOT / top).rglob("*.py"))
SCHEMAS = load_schemas()
NEWEST = SCHEMAS[newest_release()]
RELEASES = json.loads(SCHEMAS_PATH.read_text())["releases"]
PYTHON_APIS = sorted(RELEASES[newest_release()]["python"])
# Ops a release does not have: the op modules look them up on torch_npu and run their reference
# when they are missing (tests/ops/test_gated_delta_rule.py holds that).
ABSENT = {release: set(data["absent"]) for release, data in RELEASES.items()}


def _mock_api_parameters(api: str) -> tuple[Parameter, ...]:
    """The mock's parameters for a schema-file Python API key (``npu.Stream.wait_event``): a
    class gives its constructor's, a method drops ``self``."""
    owner: Any = None
    target: Any = build_npu_namespace(device_count=1)
    for name in api.split(".")[1:]:
        owner, target = target, getattr(target, name)
    parameters = callable_parameters(target)
    return parameters[1:] if inspect.isclass(owner) else parameters


def test_the_schema_parser_reads_names_order_keyword_only_markers_and_defaults() -> None:
    name, parameters = parse_op_schema(
        "op(Tensor input, Tensor(a!) out, int[2] k=[1, 1], *, float s=1., str m='half', "
        'int? n=None, bool b=True, str e="") -> (Tensor, Tensor)'
    )
    assert name == "op"
    assert parameters == (
        Parameter("input", "positional"),
        Parameter("out", "positional"),
        Parameter("k", "positional", [1, 1]),
        Parameter("s", "keyword", 1.0),
        Parameter("m", "keyword", "half"),
        Parameter("n", "keyword", None),
        Parameter("b", "keyword", True),
        Parameter("e", "keyword", ""),
    )
    assert parse_python_signature("f(a, b=None, *, c: str='x', **kwargs) -> int") == (
        "f",
        (
            Parameter("a", "positional", REQUIRED),
            Parameter("b", "positional", None),
            Parameter("c", "keyword", "x"),
            Parameter("kwargs", "var_keyword"),
        ),
    )


def test_the_mock_provides_exactly_the_recorded_ops() -> None:
    ops = {api for api in NEWEST if not api.startswith("npu.")}
    assert set(MOCK_OPS) == ops
    for release, absent in ABSENT.items():
        assert absent == set(MOCK_OPS) - set(SCHEMAS[release]), release


@pytest.mark.parametrize("op", sorted(MOCK_OPS))
def test_each_mock_op_has_the_newest_releases_signature(op: str) -> None:
    assert callable_parameters(MOCK_OPS[op]) == NEWEST[op]


@pytest.mark.parametrize("api", PYTHON_APIS)
def test_each_mock_npu_api_has_the_newest_releases_signature(api: str) -> None:
    assert _mock_api_parameters(api) == NEWEST[api]


def test_a_wrong_mock_signature_is_caught() -> None:
    def npu_swiglu(self, dim=-1):  # the declared name, not the registered one
        raise AssertionError("never called")

    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):  # without rotate
        raise AssertionError("never called")

    assert callable_parameters(npu_swiglu) != NEWEST["npu_swiglu"]
    assert callable_parameters(npu_rotary_mul) != NEWEST["npu_rotary_mul"]


def _call_problems(paths: list[Path]) -> list[str]:
    """Every call site in ``paths`` that does not bind on some release, as readable lines."""
    problems = []
    for site in find_call_sites(paths):
        where = f"{site.path.relative_to(site.path.parents[1])}:{site.line} {site.api}"
        if site.unpacked:
            problems.append(f"{where}: passes *args/**kwargs, which cannot be checked")
            continue
        for release, apis in SCHEMAS.items():
            if site.api in ABSENT[release]:
                continue
            if site.api not in apis:
                problems.append(f"{where}: not in the schema file for {release}")
                continue
            for problem in check_call(apis[site.api], site.positional, site.keywords):
                problems.append(f"{where} on torch-npu {release}: {problem}")
    return problems


def test_every_project_call_to_torch_npu_binds_on_every_supported_release() -> None:
    sites = find_call_sites(PROJECT_FILES)
    # The mock stands in for exactly the ops the project calls, so the scan finds each.
    assert {site.api for site in sites} >= set(MOCK_OPS)
    assert _call_problems(PROJECT_FILES) == []


def test_wrong_calls_are_caught(tmp_path: Path) -> None:
    source = tmp_path / "pkg" / "calls.py"
    source.parent.mkdir()
    source.write_text(
        textwrap.dedent(
            """
            import torch, torch_npu
            torch_npu.npu_swiglu(self=x)
            torch_npu.npu_rms_norm(x, gamma, eps=1e-6)
            torch_npu.npu_rotary_mul(x, r1, r2, "half", rotate)
            torch_npu.npu_fusion_attention(q, k, v, 4, input_layout="BNSD", head_num=4)
            torch.npu.Stream(**options)
            self._mstx.range_start(msg="stage")
            torch_npu.npu_not_recorded(x)
            """
        )
    )
    problems = "\n".join(_call_problems([source]))
    assert "calls.py:3 npu_swiglu on torch-npu 2.14.0: no parameter named 'self'" in problems
    assert "required parameters not given: ['input']" in problems
    assert "calls.py:4 npu_rms_norm on torch-npu 2.14.0: no parameter named 'eps'" in problems
    assert "npu_rotary_mul on torch-npu 2.6.0.post5: 5 positional arguments, at most 4" in problems
    assert "npu_rotary_mul on torch-npu 2.14.0" not in problems
    assert "'head_num' given both by position and by keyword" in problems
    assert "calls.py:7 npu.Stream: passes *args/**kwargs" in problems
    assert "npu.mstx.range_start on torch-npu 2.14.0: no parameter named 'msg'" in problems
    assert "npu_not_recorded: not in the schema file for 2.14.0" in problems


def test_the_call_checker_accepts_what_python_binds() -> None:
    parameters = parse_op_schema("f(Tensor a, int b=0, *, int c=1) -> Tensor")[1]
    assert check_call(parameters, 1, ["c"]) == []
    assert check_call(parameters, 0, ["a", "b"]) == []
    assert check_call(parameters, 3, []) == ["3 positional arguments, at most 2 taken"]
    assert check_call(parameters, 0, ["b"]) == ["required parameters not given: ['a']"]
