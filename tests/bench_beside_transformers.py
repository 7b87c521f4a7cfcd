"""The record check shared by the tests of the benchmarks that time our function beside
transformers' and beside a second run of transformers' (the A/A twin): scripts/bench_gdn.py and
scripts/bench_ops.py, whose ``HEADER`` is ``[label, ours ms, transformers ms, transformers
(A/A) ms, A/A, ratio]``."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

# The A/A and ratio cells are printed with two decimals.
ROUNDING = 0.006


def checked_rows(bench: ModuleType, argv: list[str], out: Path, rel: float) -> list[list[str]]:
    """Run ``bench.main(argv)`` with ``--json out``, assert that the record's header is
    ``bench.HEADER`` and that every row holds three positive times whose A/A cell is the twin's
    time over transformers' and whose ratio cell is ours over transformers' (within ``rel``, or
    the cells' rounding); return the record's rows."""
    bench.main([*argv, "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    for row in record["rows"]:
        ours, theirs, twin, aa, ratio = map(float, row[1:])
        assert min(ours, theirs, twin) > 0
        assert aa == pytest.approx(twin / theirs, rel=rel, abs=ROUNDING)
        assert ratio == pytest.approx(ours / theirs, rel=rel, abs=ROUNDING)
    return record["rows"]
