"""Run transformers' own model tests for ascend_vlm's families stock and patched, and diff them.

    python scripts/run_transformers_tests.py TRANSFORMERS_DIR [--families qwen2_vl llava ...]
        [--work /tmp/ascend_vlm_tf_suite] [--timeout 300] [-k EXPR]

TRANSFORMERS_DIR is a transformers checkout (or unpacked sdist) of the installed version; its
``tests/`` holds ``test_modeling_common.py``. Each family's ``tests/models/<family>/
test_modeling_<family>.py`` runs twice under pytest with the plugin
``ascend_vlm.testing.transformers_suite``: stock, then with ``--ascend-vlm-patch`` (every model a
test builds is patched, the NPU path running under the mock torch_npu), one family at a time.

What the checkout lacks is filled in a copy under ``--work`` (and said so in the summary): a
family without its test file gets ``ascend_vlm.testing.transformers_tiny_tester``'s tiny-model
test case, ``tests/generation/test_utils.py`` / ``tests/exporters/test_export.py`` an empty mixin
(so no generation / export tests run). Needs ``parameterized`` and ``pytest-timeout``.

Writes ``--work``/summary.md (and summary.json): per family the stock/patched counts and run
times, and every test that passes stock but not patched, with its message. Tests that assert the
attention implementation's name (patching renames it on purpose) are listed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ascend_vlm.models import supported_model_types

PLUGIN = "ascend_vlm.testing.transformers_suite"
# Tests that assert which attention implementation a model runs; a patched model reports
# ascend_vlm's on purpose (issue 16 lists them in the README instead of fixing them).
ATTENTION_NAME_TESTS = re.compile(
    r"test_can_set_attention_dynamically|test_\w*attn_implementation|test_sdpa_can_dispatch"
)
STAND_IN_MIXINS = {
    "generation/test_utils.py": "GenerationTesterMixin",
    "exporters/test_export.py": "ExportTesterMixin",
}
GENERATED_FAMILY = '''"""Written by scripts/run_transformers_tests.py: this checkout has no test file for {family}."""

from ascend_vlm.testing.transformers_tiny_tester import family_test_case

from ...generation.test_utils import GenerationTesterMixin
from ...test_modeling_common import ModelTesterMixin

TinyModelTest = family_test_case("{family}", ModelTesterMixin, GenerationTesterMixin)
'''


@dataclass
class Outcome:
    outcome: str  # passed, failed, error, skipped
    message: str = ""
    patched_models: int = 0


@dataclass
class FamilyResult:
    family: str
    source: str  # "transformers" or "generated"
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    patched_only_failures: dict[str, str] = field(default_factory=dict)
    attention_name_failures: dict[str, str] = field(default_factory=dict)
    patched_only_passes: list[str] = field(default_factory=list)
    # subtests (``self.subTest``) that fail only patched, inside tests that fail in both runs
    patched_only_subtest_failures: list[str] = field(default_factory=list)


def family_test_file(tests: Path, family: str) -> Path:
    return tests / "models" / family / f"test_modeling_{family}.py"


def prepare_tests(checkout: Path, work: Path, families: list[str]) -> tuple[Path, list[str]]:
    """The tests/ directory to run and what had to be filled in (empty when run in place)."""
    tests = checkout / "tests"
    if not (tests / "test_modeling_common.py").is_file():
        raise ValueError(
            f"transformers_dir: expected a checkout with tests/test_modeling_common.py, got {checkout}"
        )
    missing = [rel for rel in STAND_IN_MIXINS if not (tests / rel).is_file()]
    missing += [
        str(family_test_file(tests, f).relative_to(tests))
        for f in families
        if not family_test_file(tests, f).is_file()
    ]
    if not missing:
        return tests, []
    copy = work / "tree" / "tests"
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(tests, copy, ignore=shutil.ignore_patterns("__pycache__", "fixtures"))
    for rel, mixin in STAND_IN_MIXINS.items():
        if rel in missing:
            stand_in = copy / rel
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.write_text(f'class {mixin}:\n    """Stand-in: not in this checkout."""\n')
    for family in families:
        path = family_test_file(copy, family)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(GENERATED_FAMILY.format(family=family))
    for directory in [copy, *[p for p in copy.rglob("*") if p.is_dir()]]:
        (directory / "__init__.py").touch()
    return copy, missing


def run_pytest(test_file: Path, root: Path, xml: Path, log: Path, args, patched: bool) -> float:
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(test_file),
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN,
        f"--timeout={args.timeout}",
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
        f"--rootdir={root}",
    ]
    if args.k:
        command += ["-k", args.k]
    if patched:
        command.append("--ascend-vlm-patch")
    env = {**os.environ, "ASCEND_VLM_BACKEND": args.backend, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run(
            command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    return time.perf_counter() - start


def read_junit(xml: Path) -> dict[str, Outcome]:
    """Test id (``path::Class::test``) -> outcome, from a pytest junit xml (xunit1)."""
    outcomes: dict[str, Outcome] = {}
    if not xml.is_file():
        return outcomes
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        test_id = (
            f"{case.get('file')}::{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        )
        outcome = Outcome("passed")
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = Outcome(
                    {"failure": "failed"}.get(kind, kind), first_line(element.get("message", ""))
                )
                if kind != "skipped":
                    break
        for prop in case.iter("property"):
            if prop.get("name") == "ascend_vlm_patched":
                outcome.patched_models = int(prop.get("value"))
        outcomes[test_id] = outcome
    return outcomes


def read_subtest_failures(log: Path) -> set[str]:
    """``SUBFAILED[<subtest>] <test id>`` lines of pytest's short summary in `log`."""
    if not log.is_file():
        return set()
    return {line.strip() for line in log.read_text().splitlines() if line.startswith("SUBFAILED")}


def first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def diff(family: str, source: str, stock: dict, patched: dict) -> FamilyResult:
    result = FamilyResult(family, source)
    for mode, outcomes in (("stock", stock), ("patched", patched)):
        counts: dict[str, int] = {}
        for outcome in outcomes.values():
            counts[outcome.outcome] = counts.get(outcome.outcome, 0) + 1
        result.counts[mode] = counts
    for test_id, before in sorted(stock.items()):
        after = patched.get(test_id, Outcome("missing"))
        if before.outcome == "passed" and after.outcome != "passed" and after.outcome != "skipped":
            target = (
                result.attention_name_failures
                if ATTENTION_NAME_TESTS.search(test_id)
                else result.patched_only_failures
            )
            target[test_id] = f"{after.outcome}: {after.message}"
        elif before.outcome in ("failed", "error") and after.outcome == "passed":
            result.patched_only_passes.append(test_id)
    result.counts["patched"]["tests_that_patched_a_model"] = sum(
        1 for o in patched.values() if o.patched_models
    )
    return result


def _pass_fail_skip(counts: dict[str, int]) -> str:
    failed = counts.get("failed", 0) + counts.get("error", 0)
    return f"{counts.get('passed', 0)}/{failed}/{counts.get('skipped', 0)}"


def summary_markdown(results: list[FamilyResult], filled_in: list[str], command: str) -> str:
    lines = [f"`{command}`", ""]
    if filled_in:
        lines += ["Filled in (not in the checkout): " + ", ".join(filled_in), ""]
    lines += [
        "| family | tests | stock pass/fail/skip | patched pass/fail/skip | tests that patched"
        " a model | patched-only failures | attention-name tests | stock s | patched s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        stock, patched = r.counts["stock"], r.counts["patched"]
        lines.append(
            f"| {r.family} ({r.source}) | {sum(stock.values())} | {_pass_fail_skip(stock)} | "
            f"{_pass_fail_skip(patched)} | {patched['tests_that_patched_a_model']} | "
            f"{len(r.patched_only_failures)} | {len(r.attention_name_failures)} | "
            f"{r.seconds['stock']:.0f} | {r.seconds['patched']:.0f} |"
        )
    for r in results:
        if r.patched_only_failures or r.attention_name_failures or r.patched_only_subtest_failures:
            lines += ["", f"## {r.family}", ""]
            lines += [f"- {line}" for line in r.patched_only_subtest_failures]
            for test_id, message in {
                **r.patched_only_failures,
                **r.attention_name_failures,
            }.items():
                tag = " (attention name)" if test_id in r.attention_name_failures else ""
                lines.append(f"- `{test_id.rsplit('::', 1)[-1]}`{tag}: {message}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transformers_dir", type=Path)
    parser.add_argument("--families", nargs="+", default=supported_model_types())
    parser.add_argument("--work", type=Path, default=Path("/tmp/ascend_vlm_tf_suite"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("-k", default="", help="pytest -k expression")
    parser.add_argument("--backend", default="mock", choices=("mock", "cpu"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(supported_model_types()))
    if unknown:
        parser.error(f"--families: expected some of {supported_model_types()}, got {unknown}")
    args.work.mkdir(parents=True, exist_ok=True)
    tests, filled_in = prepare_tests(args.transformers_dir.resolve(), args.work, args.families)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    results = []
    for family in args.families:
        generated = str(family_test_file(Path(), family)) in filled_in
        source = "generated" if generated else "transformers"
        outcomes = {}
        seconds = {}
        for mode in ("stock", "patched"):
            xml = logs / f"{family}.{mode}.xml"
            xml.unlink(missing_ok=True)
            seconds[mode] = run_pytest(
                family_test_file(tests, family),
                tests.parent,
                xml,
                logs / f"{family}.{mode}.log",
                args,
                patched=mode == "patched",
            )
            outcomes[mode] = read_junit(xml)
            print(
                f"{family} {mode}: {len(outcomes[mode])} tests in {seconds[mode]:.0f} s", flush=True
            )
        result = diff(family, source, outcomes["stock"], outcomes["patched"])
        subtests = {m: read_subtest_failures(logs / f"{family}.{m}.log") for m in outcomes}
        result.patched_only_subtest_failures = sorted(subtests["patched"] - subtests["stock"])
        result.seconds = seconds
        results.append(result)
        command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
        (args.work / "summary.md").write_text(summary_markdown(results, filled_in, command))
        (args.work / "summary.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"summary: {args.work / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
