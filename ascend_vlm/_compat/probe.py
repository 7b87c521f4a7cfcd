"""A named check of one internal of another library that ascend_vlm relies on.

Every probe says when it can go (``removable``): "needed on every supported version" when the
internal is relied on from ``LOWEST_SUPPORTED`` to ``NEWEST_TESTED`` alike, or "removable once
<version> is the lowest supported" when it guards a difference older versions still have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The removal note of a probe whose internal every supported version has and ascend_vlm uses.
NEEDED_ON_EVERY_SUPPORTED_VERSION = "needed on every supported version"


@dataclass(frozen=True)
class Probe:
    """One internal of another library that ascend_vlm relies on: ``check()`` returns why it
    does not hold in the installed packages, or None when it holds; ``removable`` says from
    which transformers version the probe (and what it guards) can go."""

    name: str
    check: Callable[[], str | None]
    removable: str
