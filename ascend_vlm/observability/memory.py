"""Peak host memory of a block of code: the rise of the process's resident set size.

Linux keeps each process's RSS high-water mark (``VmHWM`` in ``/proc/self/status``) and resets
it to the current RSS when ``5`` is written to ``/proc/self/clear_refs`` (Linux >= 4.0).
:class:`PeakRSS` resets it on entry and reads it on exit, so the figure is the kernel's own
peak over the block (every allocation, whichever allocator made it: torch's, Python's,
libraries'), minus the RSS at entry, to within the kernel's batching of RSS counter
updates (up to 64 pages per thread and counter, well under 1 MiB). It is a host figure: memory
that a device allocates is not in it. Where ``clear_refs`` cannot be written (not Linux, a
locked-down ``/proc``) the figure is None.

:func:`peak_tensor_bytes` is the allocator-side figure instead: the highest sum of live CPU
tensor bytes during one call, which freed-and-reused memory does not hide (RSS only rises when
the allocator needs pages it has not had before).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
MEASURE = "host RSS peak minus the RSS at the start; Linux VmHWM, reset on entry"


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB$", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{_STATUS} has no {field} line")
    return int(match.group(1))


class PeakRSS:
    """Context manager; ``peak_bytes`` is the RSS peak over the block minus the RSS at entry
    (None when the kernel's high-water mark cannot be reset, see the module docstring)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._start_kib: int | None = None

    def __enter__(self) -> PeakRSS:
        try:
            _CLEAR_REFS.write_text("5")
            self._start_kib = _status_kib("VmRSS")
        except OSError:
            self._start_kib = None
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._start_kib is not None:
            self.peak_bytes = max(_status_kib("VmHWM") - self._start_kib, 0) * 1024


def peak_tensor_bytes(function: Callable[[], object]) -> int:
    """Peak bytes of CPU tensors that ``function()`` allocated and held at once, from
    ``torch.profiler`` (``profile_memory=True``): the running sum, in start-time order, of each
    op's net self allocation (frees count negative)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak
