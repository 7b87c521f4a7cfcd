"""Prepare the next batches in a background thread while the current one computes.

:class:`Prefetcher` runs ``prepare(item)`` for the items of a source, in order, on one
producer thread, at most ``depth`` batches ahead of the consumer (a bounded queue: a slow
consumer stops the producer). With a :class:`~ascend_vlm.vision_input.upload.BatchUploader`
each prepared batch is also uploaded on the uploader's stream before it is queued, and handed
to the consumer ordered after its copies. A failure in ``prepare`` (or in the source) is raised
in the consumer at the position of the batch that failed, with a note naming it; the producer
stops there. :meth:`Prefetcher.close` (also on exhaustion, on error, at ``with`` exit and on
garbage collection) stops and joins the thread and drops every queued batch, which returns
their staging slots.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from ascend_vlm.vision_input.staging import StagingPool
from ascend_vlm.vision_input.upload import BatchUploader

Item = TypeVar("Item")

# How often a waiting consumer looks for a producer stuck on a staging pool it holds itself.
_STALL_CHECK_S = 0.5


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
_NO_ITEM = object()  # the source failed before yielding the batch's item


def _noted(
    error: BaseException, position: int, item: Any, describe: Callable[[Any], str]
) -> BaseException:
    """``error`` with a note naming the batch it was raised for (``__notes__``, which
    tracebacks show from Python 3.11 on)."""
    if item is _NO_ITEM:
        described = "the source"
    else:
        try:
            described = describe(item)
        except Exception as describe_error:  # the note must not hide the error itself
            described = f"an item describe() failed on: {describe_error!r}"
    note = f"while preparing batch {position} ({described}) ahead"
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]
    return error


class _Producer:
    """The producer thread's state. It does not reference the :class:`Prefetcher`, so an
    abandoned prefetcher is collected, and its ``__del__`` stops the thread."""

    def __init__(
        self,
        source: Iterator[Any],
        prepare: Callable[[Any], Any],
        depth: int,
        uploader: BatchUploader | None,
        staging: StagingPool | None,
        describe: Callable[[Any], str],
    ) -> None:
        self.source = source
        self.prepare = prepare
        self.uploader = uploader
        self.staging = staging
        self.describe = describe
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="ascend-vlm-prefetch", daemon=True)

    def run(self) -> None:
        position = 0
        while not self.stopping.is_set():
            item: Any = _NO_ITEM
            try:
                try:
                    item = next(self.source)
                except StopIteration:
                    self.put(_END)
                    return
                prepared = self.prepare(item)
                if self.uploader is not None:
                    if not isinstance(prepared, Mapping):
                        raise TypeError(
                            f"prepare: an uploaded batch must be a mapping of tensors, got "
                            f"{type(prepared).__name__}"
                        )
                    uploaded = self.uploader.upload(prepared)
                    # The host batch's staging slots return once its copies are done.
                    uploaded.event.synchronize()
                    prepared = uploaded
            except BaseException as error:  # every failure is handed to the consumer
                if self.stopping.is_set():
                    return
                self.put(_Failure(_noted(error, position, item, self.describe)))
                return
            self.put(prepared)
            del prepared, item
            position += 1

    def put(self, value: Any) -> None:
        """Queue ``value``, waiting for room unless the prefetcher stops meanwhile."""
        while not self.stopping.is_set():
            try:
                self.queue.put(value, timeout=0.1)
                return
            except queue.Full:
                continue

    def stop(self) -> None:
        """Stop the thread (also out of a wait for a staging slot), join it, drop the queue,
        close the uploader and the staging pool."""
        self.stopping.set()
        if self.staging is not None:
            # Closing first makes any wait for a slot, now or later, raise in the producer.
            self.staging.close()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.uploader is not None:
            self.uploader.close()


class Prefetcher(Generic[Item]):
    """Iterate over ``prepare(item)`` for ``item`` in ``source``, prepared ``depth`` ahead.

    ``describe(item)`` names an item in error notes (default ``repr``). ``uploader``: batches
    (mappings of tensors) are uploaded in the producer thread and the consumer receives
    :meth:`~ascend_vlm.vision_input.upload.UploadedBatch.ready` values. ``staging``: the pool
    ``prepare`` writes into; when the producer waits for a slot while the consumer waits for a
    batch and every slot is held by batches already handed out, the consumer raises
    ``RuntimeError`` instead of waiting forever. The prefetcher owns ``uploader`` and
    ``staging``: :meth:`close` closes them.
    """

    def __init__(
        self,
        source: Iterable[Any],
        prepare: Callable[[Any], Item],
        depth: int = 2,
        *,
        uploader: BatchUploader | None = None,
        staging: StagingPool | None = None,
        describe: Callable[[Any], str] = repr,
    ) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
        if not callable(prepare):
            raise TypeError(f"prepare: expected a callable, got {type(prepare).__name__}")
        self.depth = depth
        self._finished = False
        self._producer = _Producer(iter(source), prepare, depth, uploader, staging, describe)
        self._producer.thread.start()

    def __iter__(self) -> Prefetcher[Item]:
        return self

    def __next__(self) -> Item:
        if self._finished:
            raise StopIteration
        value = self._get()
        if value is _END:
            self.close()
            raise StopIteration
        if isinstance(value, _Failure):
            self.close()
            raise value.error
        if self._producer.uploader is not None:
            return value.ready()
        return value

    def _get(self) -> Any:
        producer = self._producer
        while True:
            try:
                return producer.queue.get(timeout=_STALL_CHECK_S)
            except queue.Empty:
                if not producer.thread.is_alive() and producer.queue.empty():
                    self.close()
                    raise RuntimeError("the prefetch thread ended without a result") from None
                self._check_stall()

    def _check_stall(self) -> None:
        staging = self._producer.staging
        if staging is None or not staging.waiting or staging.in_use < staging.slots:
            return
        gc.collect()  # a batch may only be held by a reference cycle
        if staging.waiting and staging.in_use >= staging.slots and self._producer.queue.empty():
            self.close()
            raise RuntimeError(
                f"all {staging.slots} staging slots are held, by batches already taken from "
                f"the prefetcher or by the batch being prepared, so the next one cannot be "
                f"prepared; drop each batch before taking the next, take at most one slot per "
                f"batch, or give the pool more slots (depth + 2 for one held batch)"
            )

    def close(self) -> None:
        """Stop the producer, join it, drop the queued batches and close the uploader and the
        staging pool (idempotent; batches already taken stay valid)."""
        self._finished = True
        self._producer.stop()

    def __enter__(self) -> Prefetcher[Item]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if "_producer" in self.__dict__:
            self.close()


def device_prefetcher(
    source: Iterable[Any],
    prepare: Callable[[Any, StagingPool | None], Mapping[str, Any]],
    device: torch.device,
    depth: int = 2,
    describe: Callable[[Any], str] = repr,
    upload: bool | None = None,
) -> Prefetcher[dict[str, Any]]:
    """A :class:`Prefetcher` of batches for a model on ``device``, as the library's paths use it.

    ``prepare(item, staging)`` builds one batch (a mapping; its tensors on the CPU), writing its
    pixels into ``staging`` when that is not None. On an NPU, ``staging`` is a page-locked pool
    and batches are uploaded to ``device`` by a :class:`BatchUploader` on its own stream,
    arriving as NPU tensors ordered before the consumer's stream. The producer waits for each
    batch's copies before preparing the next, so its slot is back by then and one slot serves:
    ``prepare`` may take at most one slot per batch.
    On the CPU the batches are the prepared ones.
    ``upload`` overrides that choice (True: the NPU path, e.g. under the mock torch_npu).
    """
    if not (device.type == "npu" if upload is None else upload):
        return Prefetcher(source, lambda item: prepare(item, None), depth, describe=describe)
    staging = StagingPool(slots=1)
    return Prefetcher(
        source,
        lambda item: prepare(item, staging),
        depth,
        uploader=BatchUploader("npu", device),
        staging=staging,
        describe=describe,
    )
