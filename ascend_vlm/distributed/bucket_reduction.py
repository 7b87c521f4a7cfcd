"""One gradient bucket's way through the sparse all-reduce hook (:class:`BucketReduction`): its
pipelined first round (chunk masks or sizes), the data collective, and the future DDP waits on.
"""

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Both exchanges use only async all_reduce / all_gather, Work.wait() and
# Work.get_future()/.then, which HCCL provides too (Ascend/pytorch
# torch_npu/csrc/distributed/ProcessGroupHCCL.cpp); the hook has only run on gloo here.


class BucketReduction:
    """One bucket's way through the hook; :attr:`result` is the future handed to DDP.

    ``result`` resolves to the bucket buffer once its exchange is done, or to the error of
    whichever step failed. Every collective is issued on the hook's thread, in hook order, so
    their order is the same on every rank with any backend. ``state`` is the hook's
    :class:`~ascend_vlm.distributed.sparse_allreduce.SparseAllReduceState`.
    """

    __slots__ = ("buffer", "continue_with", "first_work", "result", "started", "state")

    def __init__(self, state: Any, buffer: torch.Tensor) -> None:
        # A weak reference: completions run on backend threads, and a callback holding the last
        # reference to the state (and so to its process group) would destroy the group on that
        # group's own worker thread, which aborts the process.
        self.state = weakref.proxy(state)
        self.buffer = buffer
        self.started = time.perf_counter()
        self.first_work: dist.Work | None = None
        self.continue_with: Callable[[], None] | None = None
        # UNVERIFIED on NPU: a manual Future over device tensors needs the device list for
        # stream synchronisation (documented for CUDA; torch_npu registers the same guard).
        devices = None if buffer.device.type == "cpu" else [buffer.device]
        self.result: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)

    def after_round(self, work: dist.Work, continue_with: Callable[[], None]) -> None:
        """Queue the first round ``work``; :meth:`finish_round` waits and continues later.

        The next bucket's hook (or this one's, if last) waits for it and calls
        ``continue_with()``, so the small round travels while that next bucket's gradients are
        computed and scanned.
        """
        self.first_work, self.continue_with = work, continue_with
        self.state.mask_rounds.append(self)

    def after_mask(self, mask: torch.Tensor, continue_with: Callable[[torch.Tensor], None]) -> None:
        """Start the MAX all-reduce of ``mask`` and continue with ``continue_with(union)``."""
        work = dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.state._group(), async_op=True)
        self.after_round(work, lambda: continue_with(mask))

    def finish_round(self) -> None:
        """Wait for the round queued by :meth:`after_round`, then continue.

        Drops its references to the round first: a finished ``Work`` kept alive by this object
        (itself referenced from the data exchange's callback) would outlive its process group.
        """
        work, continue_with = self.first_work, self.continue_with
        self.first_work = self.continue_with = None
        work.wait()
        continue_with()

    def send(
        self,
        tensor: torch.Tensor | None,
        unpack: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Average ``tensor`` over ranks as the default hook does, then ``unpack(averaged)``.

        Divides by world size first (the default hook's order, which avoids fp16 overflow) and
        sums with an async all-reduce. ``None``: nothing to send anywhere; the bucket resolves
        unchanged.
        """
        if tensor is None:
            self._resolve()
            return
        tensor.div_(self.state._group().size())
        self.state._count(bytes_sent=tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, group=self.state._group(), async_op=True)
        self.then(work, None if unpack is None else lambda: unpack(tensor))

    def then(self, work: dist.Work, finish: Callable[[], None] | None) -> None:
        """When ``work`` completes, run ``finish()`` (if any) and resolve :attr:`result`."""

        def complete(future: torch.futures.Future) -> None:
            future.value()  # raises the collective's error, if it failed
            if finish is not None:
                finish()
            self._resolve()

        work.get_future().then(lambda future: self.guarded(lambda: complete(future)))

    def guarded(self, step: Callable[[], None]) -> None:
        """Run ``step``; an exception resolves :attr:`result` with it instead of propagating."""
        try:
            step()
        except Exception as error:
            if not self.result.done():
                self.result.set_exception(error)

    def _resolve(self) -> None:
        with contextlib.suppress(ReferenceError):  # the state is gone: nobody reads its stats
            self.state._record_completion(self.started)
        self.result.set_result(self.buffer)


def finish_rounds(state: Any, keep: int) -> None:
    """Finish the oldest queued first rounds of ``state``, in bucket order, until ``keep`` are
    left."""
    while len(state.mask_rounds) > keep:
        reduction = state.mask_rounds.popleft()
        reduction.guarded(reduction.finish_round)
