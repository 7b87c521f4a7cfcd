"""scripts/bench_trace.py end to end on a 1-layer model."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_trace")


def test_both_workloads_are_measured_on_off_and_off_again(bench, tmp_path, capsys, monkeypatch):
    import contextlib

    from ascend_vlm.observability import trace

    timelines = []

    @contextlib.contextmanager
    def recording_trace(model):
        with trace(model) as timeline:
            yield timeline
        timelines.append(timeline)

    monkeypatch.setattr(bench.ascend_vlm, "trace", recording_trace)
    out = tmp_path / "bench.json"
    argv = ["--rounds", "1", "--calls", "1", "--new-tokens", "2", "--layers", "1"]
    assert bench.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    assert [row[0] for row in record["rows"]] == [
        "forward (prompt with 1 image)",
        "generate 2 tokens",
    ]
    for _, off, on, again, on_over_off, aa in record["rows"]:
        assert float(off) > 0 and float(on) > 0 and float(again) > 0
        assert float(on_over_off[:-1]) == pytest.approx(float(on) / float(off), rel=0.01, abs=0.006)
        assert float(aa[:-1]) == pytest.approx(float(again) / float(off), rel=0.01, abs=0.006)
    assert "| generate 2 tokens |" in capsys.readouterr().out
    # "on" really traced: one timed call per workload (1 round x 1 call), each a full request
    assert [[r.kind for r in t.requests] for t in timelines] == [["forward"], ["generate"]]
    assert [len(t.spans) for t in timelines] == [3, 4]  # vision, projector, prefill (+ decode 1)


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds: expected an int >= 1" in capsys.readouterr().err
