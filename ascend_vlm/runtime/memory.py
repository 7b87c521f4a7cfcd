"""Device, pinned and mapped (UVA zero-copy) buffers, and synchronous copies.

Every buffer has ``.ptr`` (the address copies use), ``.nbytes``, ``.device``, ``.free()`` and
works as a context manager (``free()`` on exit). Host-visible buffers (:class:`PinnedBuffer`,
:class:`MappedBuffer`) export the Python buffer protocol, so ``numpy.frombuffer(buf, dtype)`` and
``torch.frombuffer(buf, dtype=...)`` are zero-copy views. Each view holds a reference to the
buffer object, so the memory outlives the Python name that created it; ``free()`` on a
host-visible buffer therefore only closes the handle, and the memory is returned when the last
view is gone. ``free()`` on a :class:`DeviceBuffer` first waits for the streams whose queued
work still uses it (see :mod:`ascend_vlm.runtime.stream`), then returns the memory to the device.

Copy endpoints are buffers, objects that carry their length (a CPU ``torch.Tensor``, a numpy
array, ``bytearray``, ``memoryview`` or anything exporting a C-contiguous buffer), contiguous
``torch_npu`` tensors (device memory of the same AscendCL context; the caller orders the copy
against the torch_npu streams that write or read the tensor), or int addresses inside a live
buffer of this runtime (e.g. ``buf.ptr + offset``). An int the runtime
does not know (a foreign or freed address) raises ``ValueError`` instead of reaching AscendCL,
and every endpoint is checked to hold the bytes copied: nothing is read or written past it.
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any, ClassVar, Protocol

import numpy as np

from ascend_vlm import _C
from ascend_vlm._errors import AclError
from ascend_vlm.runtime._arguments import require_byte_count

# aclrtMemMallocPolicy values (acl_rt.h).
MALLOC_POLICIES: dict[str, int] = {
    "huge_first": 0,
    "huge_only": 1,
    "normal_only": 2,
    "huge_first_p2p": 3,
    "huge_only_p2p": 4,
    "normal_only_p2p": 5,
    "huge1g_only": 6,
    "huge1g_only_p2p": 7,
}

# aclrtMemcpyKind values (acl_rt.h); "default" lets the runtime infer the direction. CANN works
# the direction out from the addresses whatever the kind says (aclrtMemcpy: `kind` is reserved).
MEMCPY_KINDS: dict[str, int] = {"h2h": 0, "h2d": 1, "d2h": 2, "d2d": 3, "default": 4}

ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000

# A copy endpoint: a buffer, a length-carrying host object, or an int inside a live buffer.
Endpoint = Any


class CopyStream(Protocol):
    """What a buffer asks of a stream it was queued on
    (:class:`ascend_vlm.runtime.stream.Stream`, which imports this module)."""

    def memcpy_async(self, dst: Any, src: Any, nbytes: int, kind: str | None = None) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst``."""
        ...

    def finish_work_on(self, buffer: _C.Buffer) -> None:
        """Synchronize if work queued on the stream may still use ``buffer``."""
        ...


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
        # Streams this buffer was queued on; they hold it while the work may be pending. Weak,
        # so a buffer never keeps a stream alive.
        self._streams: weakref.WeakSet[CopyStream] = weakref.WeakSet()

    def used_on(self, stream: CopyStream) -> None:
        """Record that work queued on ``stream`` may use this buffer, so :meth:`free` first
        waits for it (``stream.finish_work_on(self)``).
        :meth:`~ascend_vlm.runtime.stream.Stream.hold_until_done` calls this for the device
        buffers it holds."""
        self._streams.add(stream)

    def free(self) -> None:
        """Return the memory to the device now (``aclrtFree``); idempotent.

        Streams whose queued work may still use the buffer are synchronized first, so a copy or
        kernel never touches freed memory (a stream error from that wait raises ``AclError``
        and leaves the buffer allocated). Must not be called from a host callback.
        """
        for stream in list(self._streams):
            stream.finish_work_on(self)
        super().free()


class PinnedBuffer(_Buffer):
    """``nbytes`` of page-locked host memory (``aclrtMallocHost``): fast copy source/target."""

    _kind = _C.BufferKind.PINNED
    _allocator = "aclrtMallocHost"

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)


class MappedBuffer(_Buffer):
    """Host memory registered for device access (``aclrtHostRegister``, mapped): UVA zero-copy.

    ``.host_ptr`` (also ``.ptr``) is the host address behind the buffer protocol views, on a
    4 KB page boundary; ``.device_ptr`` is the address device code (kernels) reads and writes
    directly, without a copy. CANN documents that the mapped device address cannot be used for
    memory copies, so copies take ``.ptr`` (a pinned host address); on the simulator,
    :func:`ascend_vlm.runtime.sim_copy_kernel` plays the kernel.

    Host registration needs CANN >= 8.1.RC1 on an Atlas A2/A3 SoC (see
    :func:`ascend_vlm.runtime.capabilities`). Elsewhere this raises
    ``AclError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, function="aclrtHostRegister")`` naming the
    requirement, unless ``fallback=True``: then the buffer is pinned host memory plus a device
    copy (``zero_copy`` is False, ``device_ptr`` is the device copy's address), and
    :meth:`sync_to_device` / :meth:`sync_to_host` move the bytes with async copies (counted as
    copied bytes). Call them around device code in both modes: with zero-copy they do nothing.
    """

    _kind = _C.BufferKind.MAPPED
    _allocator = "aclrtMallocHost"

    def __init__(self, nbytes: int, fallback: bool = False) -> None:
        if not isinstance(fallback, bool):
            raise TypeError(f"fallback: expected a bool, got {type(fallback).__name__}")
        self._mirror: DeviceBuffer | None = None
        try:
            super().__init__(nbytes)
        except AclError as error:
            if not (fallback and error.code == ACL_ERROR_RT_FEATURE_NOT_SUPPORT):
                raise
            _C.Buffer.__init__(self, _C.BufferKind.PINNED, nbytes, 0)
            self._mirror = DeviceBuffer(nbytes)

    @property
    def zero_copy(self) -> bool:
        """True if device code reaches the host bytes directly (registered host memory)."""
        return self._mirror is None

    @property
    def device_ptr(self) -> int:  # type: ignore[override]
        """The address device code uses: the mapped alias, or the device copy's address."""
        return _C.Buffer.device_ptr.__get__(self) if self._mirror is None else self._mirror.ptr

    def sync_to_device(self, stream: CopyStream) -> None:
        """Make host writes visible to device code on ``stream`` (a queued copy in fallback)."""
        if self._mirror is not None:
            stream.memcpy_async(self._mirror, self, self.nbytes)

    def sync_to_host(self, stream: CopyStream) -> None:
        """Make device writes visible to the host once ``stream`` is synchronized (fallback)."""
        if self._mirror is not None:
            stream.memcpy_async(self, self._mirror, self.nbytes)

    def free(self) -> None:
        """Close the buffer (and return a fallback's device copy now)."""
        if self._mirror is not None:
            self._mirror.free()
        super().free()


def resolve_copy(
    dst: Endpoint, src: Endpoint, nbytes: int, kind: str | None, function: str
) -> tuple[int, int, int, int, int]:
    """Turn copy arguments into ``(dst, dst_max, src, count, kind)`` for AscendCL.

    ``dst``/``src`` are endpoints as described in the module docstring; ``nbytes`` must fit in
    each (``ValueError`` naming the endpoint otherwise). ``kind`` (a :data:`MEMCPY_KINDS` name)
    defaults to the direction the endpoints imply.
    """
    count = require_byte_count("nbytes", nbytes, function)
    dst_address, dst_max, dst_on_device = _endpoint("dst", dst, count, writable=True)
    src_address, _, src_on_device = _endpoint("src", src, count, writable=False)
    if kind is None:
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


def known_address(name: str, address: int, count: int) -> tuple[int, bool]:
    """``(bytes available, device_side)`` at an int ``address`` inside a live runtime buffer.

    Raises ``ValueError`` naming the argument if no live buffer contains the address, or if
    ``count`` bytes from it run past the buffer.
    """
    found = _C.find_buffer_range(address)
    if found is None:
        raise ValueError(
            f"{name}: address {address:#x} is not inside a live buffer of this runtime; pass "
            "foreign host memory as an object that carries its length (a CPU tensor, a numpy "
            "array, bytearray or memoryview), not as a bare int"
        )
    base, size, kind, device_side = found
    available = base + size - address
    if count > available:
        raise ValueError(
            f"nbytes: {count} bytes from {name} ({address:#x}) run past the end of its "
            f"{_C.BufferKind(kind).name.lower()} buffer ({available} bytes left)"
        )
    return available, device_side


def _endpoint(name: str, value: Endpoint, count: int, writable: bool) -> tuple[int, int, bool]:
    """``(address, capacity, on_device)`` of a copy endpoint, checked to hold ``count`` bytes."""
    if isinstance(value, _C.Buffer):
        require_fits(name, value, count)
        return value.ptr, value.nbytes, value.kind == _C.BufferKind.DEVICE
    if isinstance(value, int) and not isinstance(value, bool):
        available, device_side = known_address(name, value, count)
        return value, available, device_side
    if hasattr(value, "data_ptr") and getattr(value.device, "type", None) == "npu":
        return (*_npu_tensor(name, value, count), True)
    address, size = _host_object(name, value, writable)
    if count > size:
        raise ValueError(
            f"nbytes: {count} bytes do not fit in {name} ({type(value).__name__} of {size} bytes)"
        )
    return address, size, False


def _npu_tensor(name: str, tensor: Any, count: int) -> tuple[int, int]:
    """``(address, nbytes)`` of a torch_npu tensor's device memory, checked to hold ``count``."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous NPU tensor, got a strided one")
    size = tensor.numel() * tensor.element_size()
    if count > size:
        raise ValueError(f"nbytes: {count} bytes do not fit in {name} (NPU tensor of {size} bytes)")
    return tensor.data_ptr(), size


def _host_object(name: str, value: object, writable: bool) -> tuple[int, int]:
    """``(address, nbytes)`` of a length-carrying host object (CPU tensor or buffer exporter)."""
    if hasattr(value, "data_ptr") and hasattr(value, "is_contiguous"):  # a torch.Tensor
        if value.device.type != "cpu" or not value.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous CPU tensor, got one on {value.device} "
                f"(contiguous={value.is_contiguous()})"
            )
        return value.data_ptr(), value.numel() * value.element_size()
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(
            f"{name}: expected a DeviceBuffer, PinnedBuffer, MappedBuffer, a CPU tensor, an "
            f"object exporting the buffer protocol or an int address inside a live buffer, "
            f"got {type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous buffer, got a strided one")
    if writable and view.readonly:
        raise ValueError(
            f"{name}: expected a writable buffer, got a read-only {type(value).__name__}"
        )
    if view.nbytes == 0:
        return 0, 0
    return np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data, view.nbytes


def memcpy(dst: Endpoint, src: Endpoint, nbytes: int, kind: str | None = None) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` and wait for it (``aclrtMemcpy``).

    Endpoints and ``kind`` as in :func:`resolve_copy`. The direction is the one the addresses
    imply (AscendCL infers it whatever ``kind`` says).
    """
    _C.memcpy(*resolve_copy(dst, src, nbytes, kind, "aclrtMemcpy"))
