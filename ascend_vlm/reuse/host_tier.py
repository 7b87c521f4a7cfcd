"""The host tier of a :class:`~ascend_vlm.reuse.vision_cache.VisionCache`: entries the device
tier evicts, kept in page-locked host memory and brought back when looked up again.

Each entry is one :class:`ascend_vlm.runtime.PinnedBuffer` holding its tensors back to back
(each at a 64-byte aligned offset). Tensors on an accelerator leave and come back through
``aclrtMemcpyAsync`` on a dedicated :class:`ascend_vlm.runtime.Stream` per device: a demotion
first waits for the event recorded when the features were made (the copy must not overtake the
work that writes them), and a restore allocates the device tensors, queues the copies and
records an :class:`ascend_vlm.runtime.Event` that the consumer waits on
(:meth:`~ascend_vlm.reuse.cache_entry.CachedFeatures.wait_ready`) just before reading them, so
the copies overlap whatever the caller does in between (encoding the images that missed).
Tensors already in host memory (the CPU, the mock NPU) are written into the pinned buffer directly and come back as zero-copy views
of it, without AscendCL copies.

The tier is a byte-bounded LRU like the device tier; entries leave it when looked up (they move
back to the device tier) or, least recently used first, when its bytes pass ``max_bytes``.
Callers hold the owning cache's lock around every method.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ascend_vlm import runtime
from ascend_vlm.reuse.cache_entry import CachedFeatures

_ALIGNMENT = 64


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of an entry lies in its pinned buffer, and where it came from."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class _HostEntry:
    value: CachedFeatures
    buffer: runtime.PinnedBuffer
    slots: tuple[_Slot, ...]


def _layout(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[_Slot, ...], int]:
    slots, end = [], 0
    for tensor in tensors:
        offset = -(-end // _ALIGNMENT) * _ALIGNMENT
        slots.append(_Slot(offset, tuple(tensor.shape), tensor.dtype, tensor.device))
        end = offset + tensor.numel() * tensor.element_size()
    return tuple(slots), max(end, 1)


def _host_view(buffer: runtime.PinnedBuffer, slot: _Slot) -> torch.Tensor:
    """A tensor over ``slot``'s bytes of ``buffer`` (no copy; it keeps the memory alive)."""
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
    return flat.view(slot.dtype).view(slot.shape)


def _device_tensor(slot: _Slot) -> torch.Tensor:
    """A new tensor on ``slot``'s device for its bytes to come back to."""
    return torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)


def produced_event(value: CachedFeatures) -> CachedFeatures:
    """``value`` with an event recorded on its device's current stream after the work that
    makes its tensors (none for host tensors): a later demotion waits for it."""
    device = value.tensors[0].device
    if device.type != "npu":
        return value
    event = torch.npu.Event()
    event.record(torch.npu.current_stream(device.index))
    return dataclasses.replace(value, produced=event)


class HostTier:
    """Evicted entries in pinned host memory, at most ``max_bytes`` of them (see the module
    docstring). Holds an AscendCL session reference until :meth:`close`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, _HostEntry] = OrderedDict()
        self._bytes = 0
        self._streams: dict[int, runtime.Stream] = {}
        self._closed = False
        runtime.init()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def held_keys(self) -> list[Hashable]:
        """The held keys, least recently used first."""
        return list(self._entries)

    def keep(self, key: Hashable, value: CachedFeatures) -> int:
        """Copy ``value`` into pinned memory under ``key``; returns how many entries left the
        tier for room (``value`` itself counts when it alone exceeds ``max_bytes``)."""
        self.discard(key)
        slots, size = _layout(value.tensors)
        if size > self.max_bytes:
            return 1
        dropped = 0
        while self._bytes + size > self.max_bytes:
            self.discard(next(iter(self._entries)))
            dropped += 1
        buffer = runtime.PinnedBuffer(size)
        if value.produced is not None:
            value.produced.synchronize()
        for tensor, slot in zip(value.tensors, slots, strict=True):
            if tensor.device.type == "cpu":
                _host_view(buffer, slot).copy_(tensor)
                continue
            stream = self._stream(tensor.device)
            stream.memcpy_async(buffer.ptr + slot.offset, tensor.contiguous(), slot.nbytes)
            stream.hold_until_done(buffer)
        stored = dataclasses.replace(value, tensors=(), produced=None, ready=None)
        self._entries[key] = _HostEntry(stored, buffer, slots)
        self._bytes += buffer.nbytes
        return dropped

    def take(self, key: Hashable) -> CachedFeatures | None:
        """Remove ``key``'s entry and return its features (None when not held): host views, or
        device tensors whose copies are queued (their ``ready`` event follows the copies)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._bytes -= entry.buffer.nbytes
        tensors, streams = [], set()
        for slot in entry.slots:
            if slot.device.type == "cpu":
                tensors.append(_host_view(entry.buffer, slot))
                continue
            target = _device_tensor(slot)
            stream = self._stream(slot.device)
            stream.memcpy_async(target, entry.buffer.ptr + slot.offset, slot.nbytes)
            stream.hold_until_done(entry.buffer)
            streams.add(stream)
            tensors.append(target)
        ready = None
        if streams:
            (stream,) = streams  # an entry's tensors share the device it was made on
            ready = runtime.Event(timing=False)
            ready.record(stream)
        return dataclasses.replace(entry.value, tensors=tuple(tensors), ready=ready)

    def discard(self, key: Hashable) -> None:
        """Drop ``key``'s entry if held. Its buffer is not freed here: it returns to the host
        when the last holder lets go (a stream with queued copies, zero-copy views)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.buffer.nbytes

    def clear(self) -> None:
        for key in list(self._entries):
            self.discard(key)

    def close(self) -> None:
        """Drop every entry, wait for and destroy the streams, and release the AscendCL
        session reference; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.clear()
        for stream in self._streams.values():
            stream.destroy()
        self._streams.clear()
        runtime.finalize()

    def _stream(self, device: torch.device) -> runtime.Stream:
        index = device.index or 0
        stream = self._streams.get(index)
        if stream is None:
            # A runtime stream belongs to the device current when it is made.
            runtime.set_device(index)
            stream = self._streams[index] = runtime.Stream()
        return stream
