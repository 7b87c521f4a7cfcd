"""The transformers versions ascend_vlm supports: ``LOWEST_SUPPORTED`` .. ``NEWEST_TESTED``.

CI runs the suite on ``NEWEST_TESTED`` (requirements-dev.txt) and the family tests on
``LOWEST_SUPPORTED`` (requirements-lowest.txt). ``patch``'s version gate
(:mod:`ascend_vlm.patching.version_gate`) refuses older versions and probes newer ones.
"""

from __future__ import annotations

LOWEST_SUPPORTED = (5, 17)
NEWEST_TESTED = (5, 25)


def major_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string: "5.23.0.dev0" -> (5, 23)."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
