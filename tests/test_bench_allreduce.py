"""scripts/bench_allreduce.py end to end on a 1 MiB embedding over loopback (the emulated link
of the real run needs root and minutes)."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    module = script_module("bench_allreduce")
    # The spawned ranks unpickle rank_main by module name: register the module under it.
    previous = sys.modules.get("bench_allreduce")
    sys.modules["bench_allreduce"] = module
    yield module
    if previous is None:
        del sys.modules["bench_allreduce"]
    else:
        sys.modules["bench_allreduce"] = previous


@pytest.mark.slow
def test_every_method_is_timed_and_exact_ones_do_not_deviate(bench, tmp_path, capsys) -> None:
    out = tmp_path / "allreduce.json"
    argv = ["--total-mib", "1", "--densities", "0.1", "--rounds", "1", "--warmup", "2"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER and "A/A" in record["header"]
    rows = {row[1]: row for row in record["rows"]}
    assert list(rows) == [*bench.STEP_METHODS, bench.SEND, "bound"]
    assert all(row[0] == "10%" and float(row[2]) > 0 for row in rows.values())
    deviation = {name: row[5] for name, row in rows.items()}
    for exact in ("default (A/A)", "ours", "sparse embedding"):
        assert float(deviation[exact]) == 0.0, exact
    assert float(deviation["PowerSGD r1"]) > 0.0 and float(deviation["fp16"]) > 0.0
    printed = capsys.readouterr().out
    assert "10%: ours / bound = " in printed
    assert "dense_fallbacks=0" in printed  # 10% of the rows: the sparse path ran


def test_bad_arguments_are_refused(bench, capsys) -> None:
    for argv in (["--warmup", "1"], ["--densities", "0"], ["--link-rate", ""]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2
    assert "--warmup: expected >= 2" in capsys.readouterr().err
