"""A bounded pool of page-locked host buffers that preprocessing writes into and uploads read.

Pixels written into pageable memory are copied once more by the driver into a page-locked
bounce buffer before every host-to-device copy, and an ``aclrtMemcpyAsync`` from pageable
memory does not overlap with compute. Writing them straight into ``aclrtMallocHost`` memory
(:class:`~ascend_vlm.runtime.PinnedBuffer`) removes that copy and lets the upload run on its
own stream. Allocating page-locked memory is slow and pins physical pages, so a few buffers
are reused across batches.

A slot is handed out as a flat uint8 numpy array over the buffer (no copy); views, reshapes
and ``torch.from_numpy`` of it keep it in use. The slot returns to the pool when the last of
them is gone, so a batch the caller still references is never overwritten. Pinned memory is
used rather than :class:`~ascend_vlm.runtime.MappedBuffer` because the consumers are torch
tensors and copies: CANN documents that a mapped device address cannot be a copy endpoint,
and torch_npu documents no way to wrap foreign device memory as a tensor, so a mapped buffer
would still be uploaded through its host address, exactly like a pinned one.
"""

from __future__ import annotations

import math
import threading
import time
import weakref

import numpy as np
import torch

from ascend_vlm.runtime import PinnedBuffer


class StagingExhausted(TimeoutError):
    """No staging slot became free within the timeout: every slot is still referenced."""


class StagingPool:
    """At most ``slots`` page-locked host buffers, reused across batches.

    :meth:`acquire` returns a writable uint8 array of the requested size over the smallest free
    buffer that holds it; when none does, the largest is replaced by one of the next power of
    two bytes (one ``aclrtMallocHost`` per growth, at most twice the bytes asked for). It
    blocks while all ``slots`` are in use: that wait is the backpressure of a pipeline that
    prepares batches ahead of its consumer. ``allocations`` counts the buffers ever allocated
    and ``in_use`` the slots currently handed out.

    A slot returns when the last Python reference to its array goes: a copy still reading it
    that holds no reference (``tensor.to("npu", non_blocking=True)`` of a dropped tensor) is
    not covered; upload slots with :class:`~ascend_vlm.vision_input.BatchUploader`, which
    keeps them until its copies are done, or synchronously.
    """

    def __init__(self, slots: int = 3) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots: expected an int >= 1, got {slots!r}")
        self.slots = slots
        self.allocations = 0
        self._free: list[PinnedBuffer | None] = [None] * slots  # None: not allocated yet
        self._in_use = 0
        self._waiting = 0
        self._closed = False
        self._changed = threading.Condition()

    @property
    def waiting(self) -> int:
        """Threads blocked in :meth:`acquire` for a slot."""
        with self._changed:
            return self._waiting

    @property
    def in_use(self) -> int:
        """Slots handed out whose arrays are still referenced."""
        with self._changed:
            return self._in_use

    def acquire(self, nbytes: int, timeout: float | None = None) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` over a free page-locked buffer.

        Blocks until a slot is free, at most ``timeout`` seconds (None: forever), then raises
        :class:`StagingExhausted`. Raises ``RuntimeError`` after :meth:`close`.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise ValueError(f"nbytes: expected an int >= 1, got {nbytes!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._waiting += 1
            try:
                while not self._free and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise StagingExhausted(
                            f"acquire: all {self.slots} staging slots are still referenced "
                            f"after {timeout} s; drop earlier batches or use more slots"
                        )
                    self._changed.wait(remaining)
            finally:
                self._waiting -= 1
            if self._closed:
                raise RuntimeError("acquire: the staging pool is closed")
            buffer = self._free.pop(self._best_fit(nbytes))
            self._in_use += 1
        try:
            if buffer is None or buffer.nbytes < nbytes:
                if buffer is not None:
                    buffer.free()
                # Powers of two: a stream of slightly growing batches reallocates rarely.
                buffer = PinnedBuffer(1 << (nbytes - 1).bit_length())
                with self._changed:
                    self.allocations += 1
        except BaseException:
            self._put_back(None)
            raise
        array = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._put_back, buffer)
        return array

    def _best_fit(self, nbytes: int) -> int:
        """Index in the free list of the smallest buffer holding ``nbytes``, else of the
        largest one (grown, or an unallocated slot)."""
        sizes = [0 if buffer is None else buffer.nbytes for buffer in self._free]
        fitting = [i for i, size in enumerate(sizes) if size >= nbytes]
        if fitting:
            return min(fitting, key=sizes.__getitem__)
        return max(range(len(sizes)), key=sizes.__getitem__)

    def tensor(
        self, shape: tuple[int, ...], dtype: torch.dtype, timeout: float | None = None
    ) -> torch.Tensor:
        """A ``torch.Tensor`` of ``shape`` and ``dtype`` in a slot (:meth:`acquire`); the slot
        stays taken while the tensor or any view of it lives."""
        nbytes = math.prod(shape) * dtype.itemsize
        return torch.frombuffer(self.acquire(nbytes, timeout), dtype=dtype).view(shape)

    def _put_back(self, buffer: PinnedBuffer | None) -> None:
        with self._changed:
            self._in_use -= 1
            if self._closed:
                if buffer is not None:
                    buffer.free()
            else:
                self._free.append(buffer)
            self._changed.notify()

    def close(self) -> None:
        """Free the idle buffers now and the others when their arrays go; waiting and later
        :meth:`acquire` calls raise ``RuntimeError``.

        Idempotent. Arrays already handed out stay valid until they are dropped.
        """
        with self._changed:
            self._closed = True
            idle, self._free = self._free, []
            self._changed.notify_all()
        for buffer in idle:
            if buffer is not None:
                buffer.free()

    def __enter__(self) -> StagingPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
