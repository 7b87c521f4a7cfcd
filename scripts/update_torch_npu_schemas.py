"""Regenerate ``ascend_vlm/testing/torch_npu_schemas.json`` from the torch-npu wheels.

The file records, per supported torch-npu release, the signature of every torch_npu API that
ascend_vlm calls and the mock (``ascend_vlm.testing``) stands in for; the test
``tests/testing/test_torch_npu_schemas.py`` holds the mock and every call site to it.

Run from the repository root (needs only PyPI; nothing is installed or imported from the wheels):

    python scripts/update_torch_npu_schemas.py            # download, read, write the file
    python scripts/update_torch_npu_schemas.py --check    # exit 1 if the file is out of date
    python scripts/update_torch_npu_schemas.py --wheels DIR   # reuse/keep the wheels in DIR

What is read from each wheel (``torch_npu-<version>-cp311-cp311-manylinux_*_x86_64.whl``):

* ``ops.<op>.declared``: the op's ``func:`` line in
  ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (what op-plugin declares);
* ``ops.<op>.registered``: the schema string that ``torch_npu/lib/libtorch_npu.so`` registers
  with the dispatcher. ``torch_npu.<op>`` is ``torch.ops.npu.<op>`` (``torch_npu/utils/
  custom_ops.py``), so this is what Python calls bind to: torchnpugen renames ``self`` to
  ``input`` when registering (``torchnpugen/custom_functions.py``, ``RegisterCustomSchema``);
* ``absent``: the ops of the mock this release does not have (newer kernels; the op modules
  run their reference when ``torch_npu`` lacks the kernel);
* ``python.<api>``: the Python signature of ``torch_npu.<api>`` (``npu.get_device_name``,
  ``npu.mstx.range_start``, ``npu.Stream`` ...) from the wheel's ``torch_npu/npu/*.py``, read
  with ``ast`` (a class gives its ``__new__``/``__init__`` without the first parameter).

To support another release, add it to ``SUPPORTED_RELEASES``. When the project starts calling
another op, the mock gains a stand-in for it (``ascend_vlm.testing.mock_ops.MOCK_OPS``, read
here); another ``torch_npu.npu`` API goes into ``PYTHON_APIS``. The test names what is missing.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a source checkout

from ascend_vlm.testing.mock_ops import MOCK_OPS  # noqa: E402
from ascend_vlm.testing.torch_npu_schemas import SCHEMAS_PATH  # noqa: E402

# The newest release of each torch-npu line that pairs with a torch ascend_vlm supports
# (setup.py: torch>=2.6; torch-npu X.Y.Z pairs with torch X.Y.Z; 2.9.0 and 2.9.1 both exist).
SUPPORTED_RELEASES = (
    "2.6.0.post5",
    "2.7.1.post11",
    "2.8.0.post5",
    "2.9.0.post9",
    "2.9.1",
    "2.10.0.post7",
    "2.11.0.post3",
    "2.12.0.post3",
    "2.13.0",
    "2.14.0",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PYTHON_VERSION = "311"
OPS = tuple(sorted(MOCK_OPS))  # the mock stands in for every op the project calls
PYTHON_APIS = (
    "npu.Event",
    "npu.Event.elapsed_time",
    "npu.Event.query",
    "npu.Event.record",
    "npu.Event.synchronize",
    "npu.Event.wait",
    "npu.Stream",
    "npu.Stream.query",
    "npu.Stream.record_event",
    "npu.Stream.synchronize",
    "npu.Stream.wait_event",
    "npu.Stream.wait_stream",
    "npu.current_device",
    "npu.current_stream",
    "npu.default_stream",
    "npu.device_count",
    "npu.get_device_name",
    "npu.is_available",
    "npu.mstx.range_end",
    "npu.mstx.range_start",
    "npu.set_device",
    "npu.stream",
    "npu.synchronize",
)
DECLARATIONS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
LIBRARY = "torch_npu/lib/libtorch_npu.so"


def download(release: str, directory: Path) -> Path:
    """The cp311 manylinux x86_64 wheel of torch-npu ``release`` in ``directory`` (downloaded
    with ``pip download --no-deps`` unless already there)."""
    pattern = f"torch_npu-{release}-cp{PYTHON_VERSION}-*x86_64*.whl"
    found = sorted(directory.glob(pattern))
    if not found:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += [*platforms, "--python-version", PYTHON_VERSION, f"torch-npu=={release}"]
        subprocess.run(
            [*command, "-d", str(directory), "--quiet"],
            check=True,
        )
        found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise RuntimeError(f"{release}: expected one wheel matching {pattern}, got {found}")
    return found[0]


def declared_schemas(wheel: zipfile.ZipFile) -> dict[str, str]:
    """``{op: func line}`` of :data:`OPS` in the wheel's op declarations (no overloads; an op
    may be declared in two sections, e.g. ``custom`` and ``symint``, with the same line)."""
    sections = yaml.safe_load(wheel.read(DECLARATIONS))
    found: dict[str, str] = {}
    for entries in sections.values():
        for entry in entries if isinstance(entries, list) else ():
            func = entry.get("func", "") if isinstance(entry, dict) else ""
            name = func.partition("(")[0]
            if name in OPS:
                if found.get(name, func) != func:
                    raise RuntimeError(f"{DECLARATIONS}: {name} declared twice, differently")
                found[name] = func
    return found


def registered_schemas(wheel: zipfile.ZipFile) -> dict[str, str]:
    """``{op: schema}`` of :data:`OPS` as the library registers them (NUL-terminated strings
    ``<op>(... ) -> ...`` in its read-only data)."""
    library = wheel.read(LIBRARY)
    found: dict[str, str] = {}
    for op in OPS:
        strings = set(
            re.findall(rb"\x00(" + op.encode() + rb"\([^\x00]*\) -> [^\x00]+)\x00", library)
        )
        if not strings:  # an op this release does not have (see read_wheel)
            continue
        if len(strings) != 1:
            raise RuntimeError(f"{LIBRARY}: expected one schema of {op}, got {sorted(strings)}")
        found[op] = strings.pop().decode()
    return found


def _signature_text(function: ast.FunctionDef, drop_first: bool) -> str:
    """``name(params) -> returns`` of a ``def`` as ast unparses it."""
    args = function.args
    if drop_first:
        positional = args.posonlyargs + args.args
        args = ast.arguments(
            posonlyargs=[],
            args=positional[1:],
            vararg=args.vararg,
            kwonlyargs=args.kwonlyargs,
            kw_defaults=args.kw_defaults,
            kwarg=args.kwarg,
            defaults=args.defaults,
        )
    returns = f" -> {ast.unparse(function.returns)}" if function.returns else ""
    return f"{function.name}({ast.unparse(args)}){returns}"


def _member(body: list[ast.stmt], name: str) -> ast.FunctionDef | ast.ClassDef | None:
    members = [
        node
        for node in body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
    ]
    return members[-1] if members else None


def python_signature(wheel: zipfile.ZipFile, api: str) -> str:
    """The signature of ``torch_npu.<api>``: ``npu.<name>`` is a top-level def or class of
    ``torch_npu/npu/*.py``, ``npu.<class>.<method>`` a method of it (without self/cls unless
    a staticmethod); a class stands for its constructor (``__new__``, else ``__init__``)."""
    package, name, *rest = api.split(".")
    modules = [
        path for path in wheel.namelist() if re.fullmatch(rf"torch_npu/{package}/[^/]+\.py", path)
    ]
    found = {}
    for path in modules:
        node = _member(ast.parse(wheel.read(path)).body, name)
        if node is not None:
            found[path] = node
    if len(found) != 1:
        raise RuntimeError(f"torch_npu.{api}: expected one definition, got {sorted(found)}")
    node = found.popitem()[1]
    if rest:
        node = _member(node.body, rest[0])
    elif isinstance(node, ast.ClassDef):
        node = _member(node.body, "__new__") or _member(node.body, "__init__")
    if not isinstance(node, ast.FunctionDef):
        raise RuntimeError(f"torch_npu.{api}: no function definition found")
    static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
    text = _signature_text(node, drop_first=bool(rest or node.name.startswith("__")) and not static)
    return text.replace(f"{node.name}(", f"{api.rsplit('.', 1)[-1]}(", 1)


def read_wheel(path: Path) -> dict[str, object]:
    """Everything the schema file records for one wheel."""
    with zipfile.ZipFile(path) as wheel:
        declared, registered = declared_schemas(wheel), registered_schemas(wheel)
        if set(declared) != set(registered):
            raise RuntimeError(
                f"{path.name}: declared {sorted(declared)} but registered {sorted(registered)}"
            )
        return {
            "wheel": path.name,
            "ops": {
                op: {"declared": declared[op], "registered": registered[op]}
                for op in OPS
                if op in declared
            },
            "absent": sorted(set(OPS) - set(declared)),
            "python": {api: python_signature(wheel, api) for api in PYTHON_APIS},
        }


def build(wheels: Path) -> dict[str, object]:
    """The whole schema file's content, downloading into ``wheels`` what is missing."""
    return {
        "about": (
            "Signatures of the torch_npu APIs ascend_vlm calls, per supported torch-npu "
            "release, read from the wheels by scripts/update_torch_npu_schemas.py (facts, "
            "do not edit). ops.<op>.registered is what torch_npu.<op> binds to."
        ),
        "releases": {
            release: read_wheel(download(release, wheels)) for release in SUPPORTED_RELEASES
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--wheels", type=Path, help="wheel directory (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        wheels = args.wheels or Path(scratch)
        wheels.mkdir(parents=True, exist_ok=True)
        text = json.dumps(build(wheels), indent=1, ensure_ascii=False) + "\n"
    if args.check:
        current = SCHEMAS_PATH.read_text(encoding="utf-8") if SCHEMAS_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMAS_PATH.relative_to(ROOT)} is out of date; run {Path(__file__).name}")
            return 1
        print(f"{SCHEMAS_PATH.relative_to(ROOT)} is up to date")
        return 0
    SCHEMAS_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMAS_PATH.relative_to(ROOT)} ({len(SUPPORTED_RELEASES)} releases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
