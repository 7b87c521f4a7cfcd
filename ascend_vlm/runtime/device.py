"""Runtime lifecycle, devices and (simulator only) copy statistics.

``init``/``finalize`` are reference counted: the first ``init`` calls ``aclInit``, the matching
last ``finalize`` tears the session down (devices, ``aclFinalize``, queued work); extra
``finalize`` calls do nothing. Using any runtime object without ``init`` initialises the runtime
implicitly with one reference. The session is always torn down at interpreter exit. Objects
created in a session that has since been finalized raise ``AclError(ACL_ERROR_UNINITIALIZE)``.
"""

from __future__ import annotations

import atexit

from ascend_vlm import _C
from ascend_vlm.runtime._checks import require_byte_count, require_int

atexit.register(_C.shutdown)


def backend() -> str:
    """``"cann"`` when built against a real CANN toolkit, ``"sim"`` for the simulated runtime."""
    return _C.backend()


def init() -> None:
    """Add a reference to the AscendCL session, initialising AscendCL on the first one."""
    _C.init()


def finalize() -> None:
    """Drop a reference; the last one finalizes AscendCL. A no-op without references."""
    _C.finalize()


def is_initialized() -> bool:
    """Whether an AscendCL session is open."""
    return _C.is_initialized()


def device_count() -> int:
    """Number of visible devices (``aclrtGetDeviceCount``)."""
    return _C.device_count()


def set_device(device: int) -> None:
    """Make ``device`` the device every thread of this process uses from now on.

    Raises ``AclError(ACL_ERROR_RT_INVALID_DEVICEID)`` if ``device`` is not in
    ``[0, device_count())``.
    """
    _C.set_device(require_int("device", device))


def current_device() -> int:
    """The device this thread uses (``aclrtGetDevice``)."""
    return _C.current_device()


def mem_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device's memory (``aclrtGetMemInfo``, HBM)."""
    free, total = _C.mem_info()
    return free, total


def sim_stats() -> dict[str, int]:
    """Bytes moved since the last reset: copies per direction, and device code.

    Keys ``"h2h"``, ``"h2d"``, ``"d2h"``, ``"d2d"`` (the direction the simulator resolved from
    the addresses) and ``"kernel"`` (bytes moved by :func:`sim_copy_kernel`). A zero-copy path
    (device code reading a ``MappedBuffer`` through its ``device_ptr``) shows only ``"kernel"``
    bytes. Raises ``RuntimeError`` on the ``cann`` backend.
    """
    return dict(_C.sim_stats())


def sim_reset_stats() -> None:
    """Zero the counters of :func:`sim_stats` (simulator only)."""
    _C.sim_reset_stats()


def sim_set_device_memory(nbytes: int, device: int | None = None) -> None:
    """Resize the simulated memory pool of ``device`` (default: the current one) to ``nbytes``.

    At start every pool holds ``ASCEND_VLM_SIM_DEVICE_MEM`` bytes (default 1 GiB). Shrinking below
    what is allocated raises ``AclError(ACL_ERROR_INVALID_PARAM)``. Simulator only.
    """
    count = require_byte_count("nbytes", nbytes, "aclsimSetDeviceMemoryCapacity")
    target = current_device() if device is None else require_int("device", device)
    _C.sim_set_device_memory(target, count)
