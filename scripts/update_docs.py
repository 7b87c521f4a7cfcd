"""Regenerate the generated tables in README.md and docs/ (supported models, ops, kernel limits,
benchmark runs) in place.

    python scripts/update_docs.py          # rewrite every stale file
    python scripts/update_docs.py --check  # exit 1 naming the stale files

Each table sits between ``<!-- BEGIN GENERATED: <name> -->`` and ``<!-- END GENERATED: <name> -->``
and is the output of the command :data:`GENERATORS` names for it, so no table is hand-kept. A
file may hold any of the blocks; every generator must fill at least one block somewhere, so a
committed bench run (``docs/benchmarks/<name>.json``) needs a ``bench-<name>`` block.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATORS = {
    "models": [sys.executable, "-m", "ascend_vlm", "models", "--markdown"],
    "features": [sys.executable, "-m", "ascend_vlm", "models", "--features"],
    "ops": [sys.executable, "-m", "ascend_vlm.ops", "--markdown"],
    "kernel-limits": [sys.executable, "-m", "ascend_vlm.ops", "--kernel-limits"],
    # Benchmark tables come from committed runs, not from re-running: docs/benchmarks/<name>.json
    # fills the block "bench-<name>".
    **{
        f"bench-{record.stem}": [
            sys.executable,
            str(ROOT / "scripts" / "_bench_record.py"),
            str(record),
        ]
        for record in sorted((ROOT / "docs" / "benchmarks").glob("*.json"))
    },
}


BENCH_BLOCK = re.compile(r"<!-- BEGIN GENERATED: (bench-\S+) -->")


def documents() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@functools.cache
def generated(name: str) -> str:
    return subprocess.run(GENERATORS[name], check=True, capture_output=True, text=True).stdout


def block(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S
    )


def render(text: str) -> str:
    """``text`` with every generated block it holds replaced by its generator's current output."""
    for name in GENERATORS:
        pattern = block(name)
        if pattern.search(text):
            output = generated(name).rstrip() + "\n"
            text = pattern.sub(lambda m, out=output: m.group(1) + out + m.group(2), text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is stale")
    args = parser.parse_args()
    texts = {path: path.read_text(encoding="utf-8") for path in documents()}
    unused = [name for name in GENERATORS if not any(block(name).search(t) for t in texts.values())]
    if unused:
        raise SystemExit(f"no file holds the generated block markers for {', '.join(unused)}")
    unrecorded = sorted(
        {name for text in texts.values() for name in BENCH_BLOCK.findall(text)} - set(GENERATORS)
    )
    if unrecorded:
        files = ", ".join(
            f"docs/benchmarks/{name.removeprefix('bench-')}.json" for name in unrecorded
        )
        raise SystemExit(f"no committed bench run for the generated blocks: {files} missing")
    stale = []
    for path, current in texts.items():
        fresh = render(current)
        if fresh != current:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(fresh, encoding="utf-8")
    if args.check and stale:
        names = ", ".join(map(str, stale))
        print(f"stale: {names}; run python scripts/update_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
