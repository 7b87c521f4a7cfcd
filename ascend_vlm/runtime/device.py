"""Runtime lifecycle, devices, capabilities and (simulator only) statistics.

``init``/``finalize`` are reference counted and open/close a *session*. AscendCL itself is
initialised once per process (``aclInit`` on first use; if torch_npu initialised it first, it
stays torch_npu's) and finalized only at interpreter exit, and only if this runtime was first.
The last ``finalize`` ends the session: its streams are drained and destroyed, its events
destroyed, its device memory freed, and the devices it opened are reset (one ``aclrtResetDevice``
per ``aclrtSetDevice``), in the order CANN documents. Pinned and mapped host memory may still be
viewed by numpy/torch, so it is released when its buffer object goes (or at exit). Extra
``finalize`` calls do nothing. Using any runtime object without ``init`` opens a session
implicitly with one reference. Objects of an ended session raise
``AclError(ACL_ERROR_UNINITIALIZE)`` when used.
"""

from __future__ import annotations

import atexit

from ascend_vlm import _C
from ascend_vlm.runtime._arguments import require_byte_count, require_int

atexit.register(_C.shutdown)


def acl_backend() -> str:
    """The AscendCL this runtime is built against: ``"cann"`` for a real CANN toolkit, ``"sim"``
    for the simulated runtime (``csrc/sim``)."""
    return _C.acl_backend()


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


def capabilities() -> dict[str, object]:
    """What this AscendCL (CANN release and SoC) offers the runtime.

    Keys: ``"backend"`` (``"cann"``/``"sim"``), ``"soc_name"`` (``aclrtGetSocName``, ``""`` if
    unavailable), ``"host_mapping"`` (:class:`~ascend_vlm.runtime.MappedBuffer` zero-copy: the
    loaded AscendCL exports ``aclrtHostRegister``, CANN >= 8.1.RC1, and the SoC is an Atlas
    A2/A3 one, ``Ascend910B*``/``Ascend910_93*``), ``"host_register_exported"`` and
    ``"host_register_soc"`` (the two halves), ``"stream_sync_timeout"`` and
    ``"event_sync_timeout"`` (``aclrtSynchronize{Stream,Event}WithTimeout`` exist: without them
    synchronisations wait unbounded), and ``"host_mapping_requirement"`` (the sentence errors
    quote).
    """
    native = dict(_C.capabilities())
    native["host_mapping"] = native["host_register_exported"] and native["host_register_soc"]
    native["host_mapping_requirement"] = _C.host_register_requirement()
    return {"backend": acl_backend(), **native}


def sync_timeout_ms() -> int:
    """Milliseconds stream/event synchronisations wait by default (-1: forever).

    Initially ``ASCEND_VLM_SYNC_TIMEOUT_MS`` or 600000 (ten minutes, far above any healthy wait).
    """
    return _C.sync_timeout_ms()


def set_sync_timeout_ms(timeout_ms: int) -> None:
    """Set the default of :func:`sync_timeout_ms` for every thread (-1 waits forever)."""
    timeout = require_int("timeout_ms", timeout_ms)
    if timeout < -1:
        raise ValueError(f"timeout_ms: expected -1 (forever) or >= 0, got {timeout}")
    _C.set_sync_timeout_ms(timeout)


def sim_resources() -> dict[str, int]:
    """Live AscendCL resources the simulator counts (simulator only), for leak checks.

    Keys: ``streams``, ``events``, ``device_allocations``, ``host_allocations``,
    ``host_registrations``, ``subscribed_streams``, ``device_refs`` (unbalanced
    ``aclrtSetDevice`` calls), ``live_contexts``, ``resets_with_live_handles`` (device resets
    that found streams or events still alive), ``init_calls`` and ``finalize_calls``.
    """
    return dict(_C.sim_resources())


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
