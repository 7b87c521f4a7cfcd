"""A named check of one internal of another library that ascend_vlm relies on.

Every probe says when it can go (``removable``): "needed on every supported version" when the
internal is relied on from ``LOWEST_SUPPORTED`` to ``NEWEST_TESTED`` alike, or "removable once
<version> is the lowest supported" when it guards a difference older versions still have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def probe_failure(probe: Probe) -> str | None:
    """Why ``probe`` does not hold in the installed packages, or None; a probe that raises
    fails with the exception (the internal it reaches for changed)."""
    try:
        return probe.check()
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def require_probes(
    probes: Iterable[Probe],
    relying: str,
    library: str,
    error: type[Exception],
    failure: Callable[[Probe], str | None] = probe_failure,
) -> None:
    """Raise ``error`` naming the first of ``probes`` that fails (by ``failure``, e.g. a cached
    :func:`probe_failure`): "<relying> relies on an internal that <library> changed: probe
    '<name>': <why>" (``library`` names the package and its installed version)."""
    for probe in probes:
        why = failure(probe)
        if why is not None:
            raise error(
                f"{relying} relies on an internal that {library} changed: "
                f"probe {probe.name!r}: {why}"
            )
