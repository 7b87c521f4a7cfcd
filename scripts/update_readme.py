"""Regenerate the generated tables in README.md (supported models, ops) in place.

    python scripts/update_readme.py          # rewrite README.md
    python scripts/update_readme.py --check  # exit 1 if README.md is stale

Each table sits between ``<!-- BEGIN GENERATED: <name> -->`` and ``<!-- END GENERATED: <name> -->``
and is the output of the command named there, so the README is never hand-kept.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
GENERATORS = {
    "models": [sys.executable, "-m", "ascend_vlm", "models", "--markdown"],
    "ops": [sys.executable, "-m", "ascend_vlm.ops", "--markdown"],
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by its generator's current output."""
    for name, command in GENERATORS.items():
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        pattern = re.compile(
            rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S
        )
        if not pattern.search(text):
            raise SystemExit(f"README.md: missing the generated block markers for {name!r}")
        text = pattern.sub(
            lambda m, out=output: m.group(1) + out.rstrip() + "\n" + m.group(2), text
        )
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is stale")
    args = parser.parse_args()
    current = README.read_text(encoding="utf-8")
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md is stale: run python scripts/update_readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
