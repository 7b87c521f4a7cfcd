"""scripts/_bench_record.py: a bench table to JSON and back to the Markdown the docs show."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def record(script_module):
    return script_module("_bench_record")


def test_a_record_names_its_command_date_machine_and_renders_its_rows(record, tmp_path):
    path = tmp_path / "run.json"
    header, rows = ["E", "ours", "A/A"], [["8", "1.00", "1.02"], ["16", "2.00", "0.98"]]
    record.write_record(path, "scripts/bench_x.py", ["--json", str(path)], header, rows)
    saved = json.loads(path.read_text())
    assert saved["command"] == f"python scripts/bench_x.py --json {path}"
    assert saved["date"][:2] == "20" and "CPUs" in saved["machine"]
    text = record.markdown(saved).splitlines()
    assert text[0].startswith(f"`{saved['command']}` ({saved['date']}; ")
    assert text[2:] == [
        "| E | ours | A/A |",
        "|---:|---:|---:|",
        "| 8 | 1.00 | 1.02 |",
        "| 16 | 2.00 | 0.98 |",
    ]


def test_a_table_without_an_a_a_column_is_refused(record, tmp_path):
    with pytest.raises(ValueError, match="header: expected an 'A/A' column"):
        record.write_record(tmp_path / "run.json", "x.py", [], ["E", "ours"], [])
