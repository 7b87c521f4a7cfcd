"""AscendCL runtime: sessions, devices, buffers (incl. UVA zero-copy), streams, events, op registry.

Backed by ``ascend_vlm._C``, built against the real AscendCL when CANN is installed and against
the simulated AscendCL in ``csrc/sim`` otherwise (see :func:`acl_backend`). Every AscendCL failure
raises :class:`ascend_vlm.AclError` carrying the ACL error code, its name and the failing call.
"""

from __future__ import annotations

from ascend_vlm.runtime.device import (
    acl_backend,
    capabilities,
    current_device,
    device_count,
    finalize,
    init,
    is_initialized,
    mem_info,
    set_device,
    set_sync_timeout_ms,
    sim_reset_stats,
    sim_resources,
    sim_set_device_memory,
    sim_stats,
    sync_timeout_ms,
)
from ascend_vlm.runtime.memory import DeviceBuffer, MappedBuffer, PinnedBuffer, memcpy
from ascend_vlm.runtime.op_registry import (
    op_descriptor,
    register_op,
    registered_ops,
    unregister_op,
)
from ascend_vlm.runtime.stream import Event, Stream, memcpy_async, sim_copy_kernel

__all__ = [
    "DeviceBuffer",
    "Event",
    "MappedBuffer",
    "PinnedBuffer",
    "Stream",
    "acl_backend",
    "capabilities",
    "current_device",
    "device_count",
    "finalize",
    "init",
    "is_initialized",
    "mem_info",
    "memcpy",
    "memcpy_async",
    "op_descriptor",
    "register_op",
    "registered_ops",
    "set_device",
    "set_sync_timeout_ms",
    "sim_copy_kernel",
    "sim_reset_stats",
    "sim_resources",
    "sim_set_device_memory",
    "sim_stats",
    "sync_timeout_ms",
    "unregister_op",
]
