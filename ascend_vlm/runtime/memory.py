"""Device, pinned and mapped (UVA zero-copy) buffers, and synchronous copies.

Every buffer has ``.ptr`` (the address copies use), ``.nbytes``, ``.device``, ``.free()`` and
works as a context manager (``free()`` on exit). Host-visible buffers (:class:`PinnedBuffer`,
:class:`MappedBuffer`) export the Python buffer protocol, so ``numpy.frombuffer(buf, dtype)`` and
``torch.frombuffer(buf, dtype=...)`` are zero-copy views. Each view holds a reference to the
buffer object, so the memory outlives the Python name that created it; ``free()`` on a
host-visible buffer therefore only closes the handle, and the memory is returned when the last
view is gone. ``free()`` on a :class:`DeviceBuffer` first waits for the streams whose queued
work still uses it (see :mod:`ascend_vlm.runtime.stream`), then returns the memory to the device.
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar

from ascend_vlm import _C
from ascend_vlm.runtime._checks import require_byte_count

if TYPE_CHECKING:
    from ascend_vlm.runtime.stream import Stream

# aclrtMemMallocPolicy values (acl_rt.h).
MALLOC_POLICIES: dict[str, int] = {
    "huge_first": 0,
    "huge_only": 1,
    "normal_only": 2,
    "huge_first_p2p": 3,
    "huge_only_p2p": 4,
    "normal_only_p2p": 5,
}

# aclrtMemcpyKind values (acl_rt.h); "default" lets the runtime infer the direction.
MEMCPY_KINDS: dict[str, int] = {"h2h": 0, "h2d": 1, "d2h": 2, "d2d": 3, "default": 4}


class _Buffer(_C.Buffer):
    """Shared behaviour of the three buffer kinds (allocation lives in ``_C.Buffer``)."""

    _kind: ClassVar[_C.BufferKind]
    _allocator: ClassVar[str]

    def __init__(self, nbytes: int, policy: int = 0) -> None:
        super().__init__(self._kind, require_byte_count("nbytes", nbytes, self._allocator), policy)

    def __enter__(self) -> _Buffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.closed else f"device={self.device}"
        return f"{type(self).__name__}(nbytes={self.nbytes}, {state})"


class DeviceBuffer(_Buffer):
    """``nbytes`` of device memory (``aclrtMalloc``); not host-accessible.

    ``policy`` is an ``aclrtMemMallocPolicy`` name from :data:`MALLOC_POLICIES` (default
    ``"huge_first"``). A full device raises ``AclError(ACL_ERROR_RT_MEMORY_ALLOCATION)``,
    ``nbytes == 0`` or a negative ``nbytes`` ``AclError(ACL_ERROR_INVALID_PARAM)``.
    """

    _kind = _C.BufferKind.DEVICE
    _allocator = "aclrtMalloc"

    def __init__(self, nbytes: int, policy: str = "huge_first") -> None:
        if policy not in MALLOC_POLICIES:
            raise ValueError(f"policy: expected one of {sorted(MALLOC_POLICIES)}, got {policy!r}")
        super().__init__(nbytes, MALLOC_POLICIES[policy])
        # Streams this buffer was queued on; they hold it while the work may be pending.
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()

    def free(self) -> None:
        """Return the memory to the device now (``aclrtFree``); idempotent.

        Streams whose queued work may still use the buffer are synchronized first, so a copy or
        kernel never touches freed memory (a stream error from that wait raises ``AclError``
        and leaves the buffer allocated). Must not be called from a host callback.
        """
        for stream in list(self._streams):
            stream._finish_work_on(self)
        super().free()


class PinnedBuffer(_Buffer):
    """``nbytes`` of page-locked host memory (``aclrtMallocHost``): fast copy source/target."""

    _kind = _C.BufferKind.PINNED
    _allocator = "aclrtMallocHost"

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)


class MappedBuffer(_Buffer):
    """Host memory registered for device access (``aclrtHostRegister``, mapped): UVA zero-copy.

    ``.host_ptr`` (also ``.ptr``) is the host address behind the buffer protocol views;
    ``.device_ptr`` is the address device code (kernels) reads and writes directly, without a
    copy. CANN documents that the mapped device address cannot be used for memory copies, so
    copies take ``.ptr`` (a pinned host address); on the simulator,
    :func:`ascend_vlm.runtime.sim_copy_kernel` plays the kernel.
    """

    _kind = _C.BufferKind.MAPPED
    _allocator = "aclrtMallocHost"

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)


def resolve_copy(
    dst: _C.Buffer | int, src: _C.Buffer | int, nbytes: int, kind: str | None, function: str
) -> tuple[int, int, int, int, int]:
    """Turn copy arguments into ``(dst, dst_max, src, count, kind)`` for AscendCL.

    ``dst``/``src`` are buffers or raw int addresses (e.g. a CPU tensor's ``data_ptr()``). For a
    buffer the copy must fit in it; for a raw address the caller vouches for ``nbytes`` bytes.
    ``kind`` (a :data:`MEMCPY_KINDS` name) defaults to the direction implied by two buffers, or
    ``"default"`` (runtime-inferred) when an endpoint is a raw address.
    """
    count = require_byte_count("nbytes", nbytes, function)
    dst_address, dst_max, dst_on_device = _endpoint("dst", dst, count)
    src_address, _, src_on_device = _endpoint("src", src, count)
    if kind is None:
        if dst_on_device is None or src_on_device is None:
            kind = "default"
        else:
            kind = ("d" if src_on_device else "h") + "2" + ("d" if dst_on_device else "h")
    if kind not in MEMCPY_KINDS:
        raise ValueError(f"kind: expected one of {sorted(MEMCPY_KINDS)} or None, got {kind!r}")
    return dst_address, dst_max, src_address, count, MEMCPY_KINDS[kind]


def require_fits(name: str, buffer: _C.Buffer, count: int) -> None:
    """Raise ``ValueError`` unless ``count`` bytes fit in ``buffer`` (the argument ``name``)."""
    if count > buffer.nbytes:
        raise ValueError(
            f"nbytes: {count} bytes do not fit in {name} ({type(buffer).__name__} of "
            f"{buffer.nbytes} bytes)"
        )


def _endpoint(name: str, value: _C.Buffer | int, count: int) -> tuple[int, int, bool | None]:
    """``(address, capacity, on_device)`` of a copy endpoint; ``on_device`` is None if unknown."""
    if isinstance(value, _C.Buffer):
        require_fits(name, value, count)
        return value.ptr, value.nbytes, value.kind == _C.BufferKind.DEVICE
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name}: expected a non-null address, got {value}")
        return value, count, None
    raise TypeError(
        f"{name}: expected a DeviceBuffer, PinnedBuffer, MappedBuffer or an int address, "
        f"got {type(value).__name__}"
    )


def memcpy(
    dst: _C.Buffer | int, src: _C.Buffer | int, nbytes: int, kind: str | None = None
) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` and wait for it (``aclrtMemcpy``).

    Endpoints and ``kind`` as in :func:`resolve_copy`. A direction that contradicts the addresses
    raises ``AclError(ACL_ERROR_RT_PARAM_INVALID)``.
    """
    _C.memcpy(*resolve_copy(dst, src, nbytes, kind, "aclrtMemcpy"))
