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


def markdown(record: dict) -> str:
    """The record as the command, its date and machine, then a Markdown table."""
    lines = [
        f"`{record['command']}` ({record['date']}; {record['machine']})",
        "",
        "| " + " | ".join(record["header"]) + " |",
        "|" + "|".join("---:" for _ in record["header"]) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in record["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))))
