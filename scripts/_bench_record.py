"""A benchmark's table as JSON (the command, date, machine and rows with their A/A column) and
back to Markdown, so docs/benchmarks.md shows committed runs instead of hand-copied numbers.

    python scripts/_bench_record.py docs/benchmarks/moe.json   # print that run as Markdown

A bench script writes the record with :func:`write_record` (its ``--json PATH``);
scripts/update_docs.py fills a generated block of docs/benchmarks.md from each committed record.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch


def write_record(path: Path, script: str, argv: list[str], header: list[str], rows: list) -> None:
    """Write ``rows`` (lists of cell strings under ``header``, which names an ``A/A`` column)
    to ``path`` with the command that produced them, the UTC date and the machine."""
    if "A/A" not in header:
        raise ValueError(f"header: expected an 'A/A' column (the noise floor), got {header}")
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in [script, *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
        ),
        "header": header,
        "rows": rows,
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def table(header: list[str], rows: list) -> str:
    """``rows`` (lists of cell strings) under ``header`` as a Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def show_table(
    header: list[str], rows: list, json_path: Path | None, script: str, argv: list[str]
) -> None:
    """Print the bench's table; with ``json_path`` (its ``--json``) also write it as a record
    (:func:`write_record`) of the command ``script`` with ``argv``."""
    print(table(header, rows))
    if json_path is not None:
        write_record(json_path, script, argv, header, rows)


def markdown(record: dict) -> str:
    """The record as the command, its date and machine, then a Markdown table."""
    heading = f"`{record['command']}` ({record['date']}; {record['machine']})"
    return f"{heading}\n\n{table(record['header'], record['rows'])}"


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))))
