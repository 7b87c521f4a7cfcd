"""Host-to-device uploads of prepared batches on a dedicated runtime stream.

The copies are queued on a :class:`~ascend_vlm.runtime.Stream` of this runtime, so they
overlap with the model's compute on torch_npu's stream, and an
:class:`~ascend_vlm.runtime.Event` recorded after them orders the consumer:
``aclrtStreamWaitEvent`` on torch_npu's current stream through its raw handle
(``torch.npu.current_stream().npu_stream``), so the consumer's thread never waits for a copy.

torch_npu's caching allocator reuses a freed block for the next allocation on the same stream
at once, assuming that allocation's work is queued after the block's last reader. A copy on
another stream breaks that assumption, so the destination tensors are allocated on a side
stream of the uploader's own (no kernel ever runs on it; its blocks are reused only by later
uploads, each issued after the previous one completed), and :meth:`UploadedBatch.ready`
records the consumer's stream on them (``Tensor.record_stream``), so a block the consumer
frees is not handed out again before the consumer's queued work is done.

Two destinations:

* ``"npu"``: torch_npu tensors on the given device. Under the mock torch_npu
  (:mod:`ascend_vlm.testing.mock_npu`) NPU tensors are CPU tensors: each copy goes up to a
  simulated device buffer and back into the tensor on the same stream (``h2d`` then ``d2h``
  bytes in the simulator's counters), and the stream ordering runs through the simulated
  AscendCL.
* ``"runtime"``: :class:`~ascend_vlm.runtime.DeviceBuffer` s, for consumers of runtime memory
  (and the simulator's byte counters: a staged batch shows only host-to-device bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ascend_vlm import kernel_backend, runtime
from ascend_vlm.runtime import DeviceBuffer, Event, Stream

UPLOAD_DESTINATIONS = ("npu", "runtime")


class UploadedBatch:
    """A batch whose tensors were queued for upload; :meth:`ready` hands them out in order.

    ``values`` maps each key of the host batch to its device copy (a tensor or a
    ``DeviceBuffer``; non-tensor values as they were); ``event`` completes with the copies
    (and with any later upload's: the uploader records one event again each time).
    """

    def __init__(self, values: dict[str, Any], event: Event, consumer_stream: Any) -> None:
        self.values = values
        self.event = event
        self._consumer_stream = consumer_stream

    def ready(self) -> dict[str, Any]:
        """``values``, with the consumer ordered after the copies: torch_npu's stream waits
        for ``event`` on the device and is recorded on the NPU tensors ("npu"); the host
        waits for it ("runtime")."""
        consumer = self._consumer_stream
        if consumer is None:
            self.event.synchronize()
            return self.values
        self.event.make_stream_wait(consumer.npu_stream)
        for value in self.values.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(consumer)
        return self.values


class BatchUploader:
    """Copies the CPU tensors of a batch to ``destination`` on its own runtime stream.

    ``device`` (``"npu"`` only): the NPU the tensors go to, which must be torch_npu's current
    device (default: that one); its current stream at construction is the consumer, and the
    runtime's device is set to it, since a runtime stream belongs to the device current when
    it is made. Create the uploader in the consumer's thread; ``upload`` may then be called
    from one thread at a time.
    """

    def __init__(self, destination: str = "npu", device: torch.device | None = None) -> None:
        if destination not in UPLOAD_DESTINATIONS:
            raise ValueError(
                f"destination: expected one of {UPLOAD_DESTINATIONS}, got {destination!r}"
            )
        self.destination = destination
        self._consumer_stream = None
        self._allocation_stream = None
        self._device = torch.device("cpu")
        if destination == "npu":
            backend = kernel_backend.active_backend()
            if backend == "cpu":
                raise ValueError(
                    "destination: 'npu' needs torch_npu (or the mock), and the kernel backend "
                    "is 'cpu'; use 'runtime' or no uploader"
                )
            index = torch.npu.current_device()
            if device is not None and device.type == "npu" and device.index not in (None, index):
                raise ValueError(
                    f"device: expected torch_npu's current device npu:{index} (the uploader's "
                    f"streams belong to it), got {device}; call torch.npu.set_device"
                    f"({device.index}) first"
                )
            runtime.set_device(index)
            self._consumer_stream = torch.npu.current_stream(index)
            self._allocation_stream = torch.npu.Stream(index)
            if backend == "npu":
                self._device = torch.device("npu", index)
        self.stream = Stream()
        # Made now, on the stream's device, and recorded again by each upload: a consumer
        # that waits for an earlier batch may wait for later copies too, never for fewer.
        self._event = Event(timing=False)

    def upload(self, batch: Mapping[str, Any]) -> UploadedBatch:
        """Queue a copy of every CPU tensor of ``batch`` and record the event after them.

        A tensor in page-locked memory (a :class:`~ascend_vlm.vision_input.StagingPool`
        slot) is copied asynchronously; a pageable one makes its copy synchronous, as
        ``aclrtMemcpyAsync`` does. The stream keeps the host tensors alive until the copies
        are known done.
        """
        values: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                values[key] = self._copy(key, value)
            else:
                values[key] = value
        self._event.record(self.stream)
        return UploadedBatch(values, self._event, self._consumer_stream)

    def _copy(self, key: str, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cpu":
            raise ValueError(f"batch[{key!r}]: expected a CPU tensor, got one on {tensor.device}")
        source = tensor.contiguous()
        nbytes = source.numel() * source.element_size()
        if self._allocation_stream is None:
            target: Any = DeviceBuffer(max(nbytes, 1))
            if nbytes:
                self.stream.memcpy_async(target, source, nbytes)
            return target
        with torch.npu.stream(self._allocation_stream):
            target = torch.empty(source.shape, dtype=source.dtype, device=self._device)
        if not nbytes:
            return target
        if target.device.type == "npu":
            self.stream.memcpy_async(target, source, nbytes)
        else:
            # The mock: its NPU tensors are host memory, which an asynchronous copy may not
            # target (AscendCL refuses host-to-host). The bytes go up to simulated device
            # memory and come back into the tensor on the same stream.
            staged = DeviceBuffer(nbytes)
            self.stream.memcpy_async(staged, source, nbytes)
            self.stream.memcpy_async(target, staged, nbytes)
        return target

    def close(self) -> None:
        """Wait for the queued copies and destroy the stream (idempotent)."""
        if not self.stream.destroyed:
            self.stream.destroy()
