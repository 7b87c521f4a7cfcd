"""``patch``'s transformers version gate (:func:`check_transformers_version`), which runs every
probe of the internals ascend_vlm relies on when the installed version is newer than tested.

* older than ``LOWEST_SUPPORTED``: refused with `PatchError` (the probes are not what fails
  there: e.g. Qwen-VL's text RoPE is a different function before 5.17).
* ``LOWEST_SUPPORTED`` .. ``NEWEST_TESTED``: accepted; CI runs the family tests on both ends.
* newer than ``NEWEST_TESTED``: every probe runs once per process; when all pass, `patch`
  proceeds with one `UserWarning` per process, otherwise it raises `PatchError` naming each
  failing probe and what it found.

The probes: the global ones of :mod:`ascend_vlm._compat` (one module per subject), then the
family ones of :mod:`ascend_vlm.patching.family_probes`.
"""

from __future__ import annotations

import functools
import warnings

from ascend_vlm._compat.attention import ATTENTION_PROBES
from ascend_vlm._compat.cache import CACHE_PROBES
from ascend_vlm._compat.decorators import DECORATOR_PROBES
from ascend_vlm._compat.experts import EXPERTS_PROBES
from ascend_vlm._compat.module_internals import MODULE_PROBES
from ascend_vlm._compat.probe import Probe, probe_failure
from ascend_vlm._compat.torch_internals import TORCH_PROBES
from ascend_vlm._compat.versions import LOWEST_SUPPORTED, NEWEST_TESTED, major_minor
from ascend_vlm._errors import PatchError
from ascend_vlm.patching.family_probes import family_probes

_warned: set[str] = set()


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_transformers_version(version: str | None = None) -> str:
    """Return the installed transformers version after the gate described in the module doc.

    `version` stands in for the installed version string (tests); the probes always examine the
    installed packages. Raises PatchError for a version older than ``LOWEST_SUPPORTED`` and for
    a newer-than-tested one where a probe fails; warns once per process for a newer one where
    every probe passes.
    """
    if version is None:
        import transformers

        version = transformers.__version__
    release = major_minor(version)
    supported = f">={_dotted(LOWEST_SUPPORTED)},<={_dotted(NEWEST_TESTED)}.*"
    if release < LOWEST_SUPPORTED:
        raise PatchError(
            f"transformers {version} is older than ascend_vlm.patch supports ({supported}); "
            f"upgrade transformers"
        )
    if release <= NEWEST_TESTED:
        return version
    failures = failed_probes()
    if failures:
        found = "; ".join(f"probe {name!r}: {why}" for name, why in failures.items())
        raise PatchError(
            f"transformers {version} is newer than the newest version ascend_vlm.patch is tested "
            f"with ({_dotted(NEWEST_TESTED)}) and changed internals patch relies on: {found}. "
            f"Install transformers{supported} or an ascend_vlm release made for {version}"
        )
    if version not in _warned:
        _warned.add(version)
        warnings.warn(
            f"transformers {version} is newer than the newest version ascend_vlm.patch is tested "
            f"with ({_dotted(NEWEST_TESTED)}); every internal it relies on passed its probe, so "
            f"patch proceeds",
            UserWarning,
            stacklevel=3,
        )
    return version


@functools.cache
def failed_probes() -> dict[str, str]:
    """Name -> what was found, for every probe that fails here (run once per process). A probe
    that raises fails with the exception."""
    failures = {}
    for probe in probes():
        why = probe_failure(probe)
        if why is not None:
            failures[probe.name] = why
    return failures


@functools.cache
def probes() -> tuple[Probe, ...]:
    """Every probe: the global ones, then per part and per family (built on first use; the
    family probes import the modeling modules they examine)."""
    return (
        *ATTENTION_PROBES,
        *MODULE_PROBES,
        *DECORATOR_PROBES,
        *EXPERTS_PROBES,
        *CACHE_PROBES,
        *TORCH_PROBES,
        *family_probes(),
    )
