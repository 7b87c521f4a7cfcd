"""Simulated instruction, cache-miss and mispredict counts per forward: patched vs sdpa.

Wall-clock ratios of tiny models move by several percent between runs on a shared VM (see the
A/A column of scripts/bench_patch.py), which is as large as the differences to measure. The
counts of valgrind's callgrind are deterministic: the same code on the same inputs gives the same
counts within ~0.1%, whatever the machine load. For each family and implementation (unpatched
sdpa, sdpa + `ascend_vlm.patch`) one child process builds the model (`ascend_vlm.models.tiny`,
one image + text, batch 1), runs warm-up forwards, and is counted only around `--forwards` more
(collection switched on and off with callgrind_control). Printed per forward: Ir (instructions
executed), I1 and D1 misses (simulated first-level instruction/data cache misses), mispredicts
(conditional + indirect branches), each with its patched / sdpa ratio (< 1: patched does less).
The sdpa model is counted twice, in two child processes (the A/A pair): the A/A column is the
second count's ratio to the first in the column where it lies furthest from 1, the floor under
every other ratio (hash seeds are fixed, so it stays within ~0.1%).

What it cannot see: time spent waiting on memory beyond the simulated caches, real hardware
prediction, placement in memory, and other processes. It says how much work the patched model
does, not how fast a given machine runs it. Needs valgrind (with callgrind_control) on PATH;
under it a forward runs ~50x slower, so keep `--forwards` small.
Run: python scripts/bench_patch_instructions.py [--families qwen2_vl llava_clip] [--forwards 5]
[--json OUT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench_record import show_table

# "sdpa (A/A)" counts the unpatched sdpa model a second time, in its own child process.
IMPLEMENTATIONS = ("sdpa", "sdpa (A/A)", "patched")
# callgrind event names -> printed columns (sums of events)
COLUMNS = {
    "Ir": ("Ir",),
    "I1 miss": ("I1mr",),
    "D1 miss": ("D1mr", "D1mw"),
    "mispredicts": ("Bcm", "Bim"),
}
_HANDSHAKE_TIMEOUT_S = 900.0


def _child(family: str, size: str, implementation: str, forwards: int, handshake: Path) -> None:
    """Runs under valgrind: warm up, then run `forwards` forwards between two handshakes."""
    import torch

    import ascend_vlm
    from ascend_vlm.models.tiny import build_model, make_inputs

    torch.set_num_threads(1)
    model = build_model(family, attn_implementation="sdpa", size=size)
    if implementation == "patched":
        ascend_vlm.patch(model)
    inputs = make_inputs(family, model, n_images=1)
    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        _signal_and_wait(handshake, "ready", "go")
        for _ in range(forwards):
            model(**inputs)
        _signal_and_wait(handshake, "done", "off")


def _signal_and_wait(handshake: Path, signal: str, wait_for: str) -> None:
    (handshake / signal).touch()
    _wait_for(handshake / wait_for, lambda: True)


def _wait_for(path: Path, alive) -> None:
    deadline = time.monotonic() + _HANDSHAKE_TIMEOUT_S
    while not path.exists():
        if not alive():
            raise RuntimeError(f"child exited before writing {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} within {_HANDSHAKE_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _callgrind_control(switch: str, pid: int) -> None:
    subprocess.run(
        ["callgrind_control", "-i", switch, str(pid)], check=True, capture_output=True, text=True
    )


def count(family: str, size: str, implementation: str, forwards: int) -> dict[str, float]:
    """Per-forward callgrind event counts of one implementation, from a fresh child process."""
    with tempfile.TemporaryDirectory(prefix="bench_instructions_") as directory:
        handshake = Path(directory)
        log = handshake / "valgrind.log"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--cache-sim=yes",
            "--branch-sim=yes",
            "--instr-atstart=no",
            f"--callgrind-out-file={handshake / 'callgrind.out'}",
            f"--log-file={log}",
            sys.executable,
            __file__,
            "--child",
            family,
            size,
            implementation,
            str(forwards),
            str(handshake),
        ]
        child = subprocess.Popen(command, env={**os.environ, "PYTHONHASHSEED": "0"})

        def alive() -> bool:
            return child.poll() is None

        try:
            _wait_for(handshake / "ready", alive)
            _callgrind_control("on", child.pid)
            (handshake / "go").touch()
            _wait_for(handshake / "done", alive)
            _callgrind_control("off", child.pid)
            (handshake / "off").touch()
            if child.wait(timeout=_HANDSHAKE_TIMEOUT_S) != 0:
                raise RuntimeError(f"child failed; valgrind log:\n{log.read_text()[-2000:]}")
        finally:
            if child.poll() is None:
                child.kill()
        return _parse_counts(log.read_text(), forwards)


def _parse_counts(log: str, forwards: int) -> dict[str, float]:
    names = values = None
    for line in log.splitlines():
        _, _, rest = line.partition("== ")
        if rest.startswith("Events"):
            names = rest.split(":", 1)[1].split()
        elif rest.startswith("Collected"):
            values = [int(v) for v in rest.split(":", 1)[1].split()]
    if names is None or values is None:
        raise RuntimeError(f"no callgrind totals in the valgrind log:\n{log[-2000:]}")
    events = dict(zip(names, values, strict=True))
    return {
        column: sum(events[name] for name in parts) / forwards for column, parts in COLUMNS.items()
    }


HEADER = ["family", *COLUMNS, "A/A"]


def family_row(family: str, counts: dict[str, dict[str, float]]) -> list[str]:
    """Cells under :data:`HEADER` from one family's per-forward counts per implementation."""
    sdpa, again, patched = (counts[name] for name in IMPLEMENTATIONS)
    cells = [
        f"{sdpa[c] / 1e3:.0f}k -> {patched[c] / 1e3:.0f}k ({patched[c] / sdpa[c]:.2f})"
        for c in COLUMNS
    ]
    noise = max((again[c] / sdpa[c] for c in COLUMNS), key=lambda ratio: abs(ratio - 1))
    return [family, *cells, f"{noise:.3f}"]


def main(argv: list[str] | None = None) -> int:
    from ascend_vlm.models.tiny import FAMILIES, SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--forwards", type=int, default=5, help="counted forwards (>= 1)")
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.forwards < 1:
        parser.error(f"--forwards: expected an int >= 1, got {args.forwards}")
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        parser.error(f"needs {' and '.join(missing)} on PATH (install valgrind)")
    argv = list(sys.argv[1:] if argv is None else argv)
    print("command: python scripts/bench_patch_instructions.py " + " ".join(argv))
    print(f"size={args.size} forwards={args.forwards}; per forward, patched / sdpa in ()\n")
    rows = []
    for family in args.families:
        print(f"[bench_patch_instructions] {family}", flush=True)
        counts = {name: count(family, args.size, name, args.forwards) for name in IMPLEMENTATIONS}
        rows.append(family_row(family, counts))
    show_table(HEADER, rows, args.json, sys.argv[0], argv)
    print("\nk = thousands per forward: sdpa -> patched (patched / sdpa)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        family, size, implementation, forwards, handshake = sys.argv[2:]
        _child(family, size, implementation, int(forwards), Path(handshake))
        sys.exit(0)
    sys.exit(main())
