"""The real torch_npu signatures the mock and the project's call sites are held to.

``torch_npu_schemas.json`` (beside this module, written by ``scripts/update_torch_npu_schemas.py``
from the torch-npu wheels) records per supported release the schema each op registers
(``ops.<op>.registered``, what ``torch_npu.<op>`` binds to) and the Python signature of each
``torch_npu.npu`` API (``python.<api>``). This module reads it into :class:`Parameter` tuples,
reads the same from a Python callable, and finds every ``torch_npu.<op>(...)`` /
``torch.npu.<api>(...)`` call in a source tree and checks it against a signature.
"""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

SCHEMAS_PATH = Path(__file__).with_name("torch_npu_schemas.json")
REQUIRED = inspect.Parameter.empty  # the default of a parameter that has none


@dataclass(frozen=True)
class Parameter:
    """One parameter as a caller sees it: ``kind`` is ``"positional"`` (positional or
    keyword), ``"keyword"`` (keyword-only), ``"var_keyword"`` (``**name``) or
    ``"var_positional"`` (``*name``); ``default`` is :data:`REQUIRED` when there is none."""

    name: str
    kind: str
    default: Any = REQUIRED


@dataclass(frozen=True)
class CallSite:
    """A call of a torch_npu API: ``api`` is its key in the schema file (``npu_swiglu``,
    ``npu.mstx.range_start``); ``unpacked`` when it passes ``*args`` or ``**kwargs``."""

    path: Path
    line: int
    api: str
    positional: int
    keywords: tuple[str, ...]
    unpacked: bool


def _split_top_level(text: str) -> list[str]:
    """``text`` split at commas outside brackets (``Tensor(a!)``, ``int[2]``)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index].strip())
            start = index + 1
    parts.append(text[start:].strip())
    return [part for part in parts if part]


def _schema_default(text: str) -> Any:
    """A schema default as a Python value (``1.`` -> 1.0, ``'half'``, ``None``, ``True``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a symbolic default (e.g. contiguous_format) compares as its text


def parse_op_schema(schema: str) -> tuple[str, tuple[Parameter, ...]]:
    """``(name, parameters)`` of a dispatcher schema ``name(Type arg=default, *, ...) -> ...``."""
    name, _, rest = schema.partition("(")
    arguments = rest.rpartition(") ->")[0] if ") ->" in rest else rest.rpartition(")")[0]
    parameters, kind = [], "positional"
    for argument in _split_top_level(arguments):
        if argument == "*":
            kind = "keyword"
            continue
        declaration, has_default, default = argument.partition("=")
        argument_name = declaration.split()[-1]
        value = _schema_default(default.strip()) if has_default else REQUIRED
        parameters.append(Parameter(argument_name, kind, value))
    return name.strip(), tuple(parameters)


def parse_python_signature(signature: str) -> tuple[str, tuple[Parameter, ...]]:
    """``(name, parameters)`` of a Python signature text ``name(a, b=1, *, c=None) -> T``."""
    function = ast.parse(f"def {signature}: pass").body[0]
    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [REQUIRED] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(node) for node in args.defaults
    ]
    parameters = [
        Parameter(arg.arg, "positional", default)
        for arg, default in zip(positional, defaults, strict=True)
    ]
    if args.vararg:
        parameters.append(Parameter(args.vararg.arg, "var_positional"))
    for arg, node in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        default = REQUIRED if node is None else ast.literal_eval(node)
        parameters.append(Parameter(arg.arg, "keyword", default))
    if args.kwarg:
        parameters.append(Parameter(args.kwarg.arg, "var_keyword"))
    return function.name, tuple(parameters)


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def callable_parameters(function: Callable[..., Any]) -> tuple[Parameter, ...]:
    """The parameters of a Python callable (a class: its constructor's, without self)."""
    return tuple(
        Parameter(p.name, _KINDS[p.kind], p.default)
        for p in inspect.signature(function).parameters.values()
    )


@cache
def load_schemas() -> dict[str, dict[str, tuple[Parameter, ...]]]:
    """``{release: {api: parameters}}`` from the schema file; ops are keyed by op name
    (``npu_swiglu``), Python APIs by their path under ``torch_npu`` (``npu.mstx.range_start``)."""
    releases = json.loads(SCHEMAS_PATH.read_text(encoding="utf-8"))["releases"]
    return {
        release: {
            **{op: parse_op_schema(entry["registered"])[1] for op, entry in data["ops"].items()},
            **{api: parse_python_signature(text)[1] for api, text in data["python"].items()},
        }
        for release, data in releases.items()
    }


def newest_release() -> str:
    """The newest release in the schema file (the one the mock mirrors)."""
    return max(load_schemas(), key=lambda release: tuple(map(int, release.split(".")[:3])))


def check_call(
    parameters: tuple[Parameter, ...], positional: int, keywords: Iterable[str]
) -> list[str]:
    """What is wrong with passing ``positional`` arguments and ``keywords`` to a callable with
    ``parameters`` (an empty list when the call binds), as Python and the dispatcher bind."""
    slots = [p for p in parameters if p.kind == "positional"]
    named = {p.name: p for p in parameters if p.kind in ("positional", "keyword")}
    takes_any_keyword = any(p.kind == "var_keyword" for p in parameters)
    problems = []
    if positional > len(slots) and not any(p.kind == "var_positional" for p in parameters):
        problems.append(f"{positional} positional arguments, at most {len(slots)} taken")
    filled = {p.name for p in slots[:positional]}
    for keyword in keywords:
        if keyword in filled:
            problems.append(f"{keyword!r} given both by position and by keyword")
        elif keyword not in named and not takes_any_keyword:
            problems.append(f"no parameter named {keyword!r}")
        filled.add(keyword)
    missing = [n for n, p in named.items() if p.default is REQUIRED and n not in filled]
    if missing:
        problems.append(f"required parameters not given: {missing}")
    return problems


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of an attribute chain of names, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _api_of(callee: str) -> str | None:
    """The schema-file key of a dotted callee: ``torch_npu.<op>`` -> ``<op>``,
    ``torch_npu.npu.<api>`` / ``torch.npu.<api>`` -> ``npu.<api>``, and ``<...>mstx.<fn>`` (an
    mstx object held under another name, e.g. ``self._mstx``) -> ``npu.mstx.<fn>``; else None."""
    if callee.startswith("torch_npu."):
        return callee.removeprefix("torch_npu.")
    if callee.startswith("torch.npu."):
        return callee.removeprefix("torch.")
    owner, _, function = callee.rpartition(".")
    if owner.rpartition(".")[2].lstrip("_") == "mstx" and not owner.startswith("torch"):
        return f"npu.mstx.{function}"
    return None


def find_call_sites(paths: Iterable[Path]) -> list[CallSite]:
    """Every call of a torch_npu API (see :func:`_api_of`) in the Python files ``paths``."""
    sites = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            callee = _dotted(node.func) if isinstance(node, ast.Call) else None
            api = _api_of(callee) if callee else None
            if api is None:
                continue
            sites.append(
                CallSite(
                    path=path,
                    line=node.lineno,
                    api=api,
                    positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                    keywords=tuple(k.arg for k in node.keywords if k.arg is not None),
                    unpacked=any(isinstance(a, ast.Starred) for a in node.args)
                    or any(k.arg is None for k in node.keywords),
                )
            )
    return sites
