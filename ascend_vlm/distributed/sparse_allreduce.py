"""Sparse-mask all-reduce: a DDP communication hook that only sends gradient chunks in use.

Each gradient bucket is cut into fixed-size chunks. The ranks agree, through one small int8
all-reduce, on the union of chunks that are non-zero anywhere; only those chunks travel, packed
into one contiguous buffer. In ``"exact"`` mode the result is the same as DDP's default
``allreduce_hook``; in ``"topk"`` mode each rank keeps only its largest chunks and carries the
rest over to the next step (error feedback, as in Deep Gradient Compression).

Usage::

    state = SparseAllReduceState(chunk_size=1024)
    ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    ...
    print(state.stats.summary())

Where VLM fine-tuning gradients are chunk-sparse (frozen weights never enter DDP buckets; only
``requires_grad`` parameters do):

- Trainable token embeddings (added special tokens, ``modules_to_save=["embed_tokens"]``):
  the embedding backward only writes the rows of tokens present in the local batch, so most
  rows are +0.0. Choose ``chunk_size`` dividing the hidden size; a row may still straddle two
  chunks because a parameter's offset in its bucket is not chunk-aligned. A *tied* or trained
  ``lm_head`` is dense (the softmax touches every vocabulary row).
- Modality-specific parameters (LoRA on the vision tower, the projector/merger) on ranks whose
  micro-batch has no images: DDP (``find_unused_parameters=True``) hands their bucket slots
  over as zeros. Only if no rank saw an image is nothing sent; else the union travels.
- Mixture-of-experts layers: experts that no local token was routed to get no gradient.
- Not sparse: LoRA A/B matrices of layers every token passes through. Exact mode falls back to
  the dense all-reduce for such buckets (one mask probe per ``dense_recheck_steps`` steps);
  ``mode="topk"`` is the option that compresses them.
"""

import contextlib
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ascend_vlm.distributed.allreduce_stats import SparseAllReduceStats
from ascend_vlm.distributed.gradient_chunks import (
    MASK_DTYPE,
    SUPPORTED_DTYPES,
    GradientChunks,
    union_rows,
)

__all__ = [
    "SparseAllReduceState",
    "register_sparse_allreduce",
    "sparse_allreduce_hook",
]

# Both collectives use only async all_reduce, Work.wait() and Work.get_future()/.then, which HCCL
# provides too (Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp); this
# hook has only run on gloo here, not on NPU hardware.

MODES = ("exact", "topk")


def _check_fraction(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: expected a number in (0, 1], got {value!r}")
    return float(value)


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


class SparseAllReduceState:
    r"""Hyperparameters and per-bucket memory of :func:`sparse_allreduce_hook`.

    1. ``mode``: ``"exact"`` (default) sends every chunk that is non-zero on some rank, so the
       averaged gradient equals the default hook's (bitwise for 2 ranks; for more ranks the
       all-reduce may add in another order, a few ulp). ``"topk"`` additionally drops all but
       the largest chunks per rank and feeds the rest back into the next step (delayed, never
       dropped): far fewer bytes for dense gradients, a different optimisation trajectory.

    2. ``chunk_size`` (elements, default 1024): the sparsity granularity. Smaller chunks find
       finer sparsity but make the mask (1 byte per chunk) and the gather/scatter index larger.
       Match it to the natural unit of sparsity, e.g. one embedding row (hidden size).

    3. ``density_threshold`` (``"exact"`` only, default 0.5): if more than this fraction of a
       bucket's chunks is non-zero on some rank, the bucket is all-reduced densely instead,
       since packing would then cost more than it saves. Each bucket that is sent sparsely
       keeps a packing buffer across steps, sized to its largest union so far plus 25% (at
       most the bucket): extra memory of up to ``1.25 * density_threshold`` of the bucket.

    4. ``dense_recheck_steps`` (``"exact"`` only, default 16): after a dense fallback the
       bucket stays dense, without computing or exchanging a mask, for this many further steps
       and is probed again afterwards. 0 probes every step. All ranks take the same decision
       because it depends only on the all-reduced mask.

    5. ``topk_ratio`` (``"topk"`` only, default 0.01): fraction of chunks each rank keeps per
       bucket, ranked by L2 norm after adding its residual. The union over ranks is sent, so up
       to ``world_size * topk_ratio`` of the bucket travels.

    6. ``start_topk_iter`` (``"topk"`` only, default 10): plain all-reduce for the first steps.
       Must be >= 2 because DDP rebuilds its buckets after the first iteration, which would
       invalidate residuals memorised by bucket index (the same rule as PowerSGD's
       ``start_powerSGD_iter``); residuals are also reset if a bucket's size changes.

    ``process_group`` defaults to the world group, which must already be initialised.
    Statistics accumulate in :attr:`stats` (:class:`SparseAllReduceStats`). The state pickles
    (for checkpoints, keeping top-k residuals) without its process group, which comes back as
    the default group.
    """

    __slots__ = [  # noqa: RUF023 -- grouped by role, not sorted
        "process_group",
        # Hyperparameters.
        "mode",
        "chunk_size",
        "density_threshold",
        "dense_recheck_steps",
        "topk_ratio",
        "start_topk_iter",
        # Internal state.
        "iter",
        "dense_until",
        "residuals",
        "packing_spaces",
        "mask_rounds",
        # Statistics.
        "stats",
        "stats_lock",
        "__weakref__",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        mode: str = "exact",
        chunk_size: int = 1024,
        density_threshold: float = 0.5,
        dense_recheck_steps: int = 16,
        topk_ratio: float = 0.01,
        start_topk_iter: int = 10,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.mode = mode
        self.chunk_size = _check_count("chunk_size", chunk_size, 1)
        self.density_threshold = _check_fraction("density_threshold", density_threshold)
        self.dense_recheck_steps = _check_count("dense_recheck_steps", dense_recheck_steps, 0)
        self.topk_ratio = _check_fraction("topk_ratio", topk_ratio)
        self.start_topk_iter = _check_count("start_topk_iter", start_topk_iter, 2)
        if process_group is None and not dist.is_initialized():
            raise RuntimeError(
                "process_group: none given and torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) before creating SparseAllReduceState"
            )
        self.process_group = process_group
        self.iter = 0
        # bucket index -> (bucket numel, first step at which the bucket is probed again).
        self.dense_until: dict[int, tuple[int, int]] = {}
        # bucket index -> float32 residual of the chunks not yet sent (top-k mode).
        self.residuals: dict[int, torch.Tensor] = {}
        # bucket index -> flat buffer the union's chunks are packed into (exact mode), kept
        # across steps: a fresh multi-MiB allocation costs more page faults than the copy.
        self.packing_spaces: dict[int, torch.Tensor] = {}
        # Buckets whose chunk-mask all-reduce is in flight, oldest first (at most two).
        self.mask_rounds: deque[_BucketReduction] = deque()
        self.stats = SparseAllReduceStats()
        self.stats_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """For checkpoints: everything but the process group, the lock and collectives in flight."""
        unpicklable = (
            "process_group",
            "packing_spaces",
            "mask_rounds",
            "stats_lock",
            "__weakref__",
        )
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in unpicklable}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """Restore from :meth:`__getstate__`; the process group becomes the default group."""
        for slot, value in saved.items():
            setattr(self, slot, value)
        self.process_group = None
        self.packing_spaces = {}
        self.mask_rounds = deque()
        self.stats_lock = threading.Lock()

    def reset_stats(self) -> None:
        """Zero the counters in :attr:`stats` (the step count restarts too)."""
        with self.stats_lock:
            self.stats = SparseAllReduceStats()

    def _group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _count(self, **increments: float) -> None:
        """Add ``increments`` to the :attr:`stats` counters of the same names.

        Every update and :meth:`reset_stats` hold ``stats_lock``: completions run on the
        backend's worker threads and a reset may come from any thread, so each update lands
        wholly before or wholly after a reset, never lost in between.
        """
        with self.stats_lock:
            for counter, amount in increments.items():
                setattr(self.stats, counter, getattr(self.stats, counter) + amount)

    def _packing_space(
        self, bucket_index: int, chunks: "GradientChunks", row_ids: torch.Tensor, with_tail: bool
    ) -> torch.Tensor:
        """This bucket's packing buffer, grown (with 25% slack, at most the bucket) to fit."""
        numel = chunks.packed_numel(row_ids, with_tail)
        space = self.packing_spaces.get(bucket_index)
        if space is None or space.numel() < numel or space.dtype != chunks.flat.dtype:
            capacity = min(chunks.flat.numel(), numel + numel // 4)
            space = chunks.flat.new_empty(capacity)
            self.packing_spaces[bucket_index] = space
        return space

    def _record_completion(self, started: float) -> None:
        self._count(seconds=time.perf_counter() - started)

    def _end_bucket(self, is_last: bool) -> None:
        # DDP hooks its buckets in index order; the highest index (``is_last``) comes last.
        if is_last:
            self.iter += 1
            self._count(steps=1)


class _BucketReduction:
    """One bucket's way through the hook; :attr:`result` is the future handed to DDP.

    ``result`` resolves to the bucket buffer once its all-reduce is done, or to the error of
    whichever step failed. Every collective is issued on the hook's thread, in hook order, so
    their order is the same on every rank with any backend.
    """

    __slots__ = ("buffer", "continue_with", "mask", "mask_work", "result", "started", "state")

    def __init__(self, state: SparseAllReduceState, buffer: torch.Tensor) -> None:
        # A weak reference: completions run on backend threads, and a callback holding the last
        # reference to the state (and so to its process group) would destroy the group on that
        # group's own worker thread, which aborts the process.
        self.state = weakref.proxy(state)
        self.buffer = buffer
        self.started = time.perf_counter()
        self.mask: torch.Tensor | None = None
        self.mask_work: dist.Work | None = None
        self.continue_with: Callable[[torch.Tensor], None] | None = None
        # UNVERIFIED on NPU: a manual Future over device tensors needs the device list for
        # stream synchronisation (documented for CUDA; torch_npu registers the same guard).
        devices = None if buffer.device.type == "cpu" else [buffer.device]
        self.result: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)

    def after_mask(self, mask: torch.Tensor, continue_with: Callable[[torch.Tensor], None]) -> None:
        """Start the MAX all-reduce of ``mask``; :meth:`finish_mask_round` continues it later.

        The round is queued on the state: the next bucket's hook (or this one's, if last) waits
        for it and calls ``continue_with(union)``, so the mask travels while that next bucket's
        gradients are computed and its chunks scanned.
        """
        self.mask, self.continue_with = mask, continue_with
        self.mask_work = dist.all_reduce(
            mask, op=dist.ReduceOp.MAX, group=self.state._group(), async_op=True
        )
        self.state.mask_rounds.append(self)

    def finish_mask_round(self) -> None:
        """Wait for the mask round started by :meth:`after_mask`, then continue with the union.

        Drops its references to the round first: a finished ``Work`` kept alive by this object
        (itself referenced from the data all-reduce's callback) would outlive its process group.
        """
        work, mask, continue_with = self.mask_work, self.mask, self.continue_with
        self.mask_work = self.mask = self.continue_with = None
        work.wait()
        continue_with(mask)

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

        def finish(averaged: torch.Tensor) -> None:
            if unpack is not None:
                unpack(averaged)
            self._resolve()

        work.get_future().then(lambda fut: self.guarded(lambda: finish(fut.value()[0])))

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


def _finish_mask_rounds(state: SparseAllReduceState, keep: int) -> None:
    """Finish the oldest queued mask rounds, in bucket order, until ``keep`` are left."""
    while len(state.mask_rounds) > keep:
        reduction = state.mask_rounds.popleft()
        reduction.guarded(reduction.finish_mask_round)


def _exact_reduce(reduction: _BucketReduction, bucket_index: int) -> None:
    state, buffer = reduction.state, reduction.buffer
    numel_dense_until = state.dense_until.get(bucket_index)
    if numel_dense_until is not None:
        numel, until = numel_dense_until
        if numel == buffer.numel() and state.iter < until:
            state._count(dense_fallbacks=1)
            reduction.send(buffer)
            return
        del state.dense_until[bucket_index]

    chunks = GradientChunks(buffer, state.chunk_size)

    def with_union(union: torch.Tensor) -> None:
        row_ids, with_tail, num_sent = union_rows(union, chunks)
        _count_mask(state, union, chunks.count, num_sent)
        if num_sent > state.density_threshold * chunks.count:
            state._count(dense_fallbacks=1)
            if state.dense_recheck_steps:
                state.dense_until[bucket_index] = (
                    buffer.numel(),
                    state.iter + 1 + state.dense_recheck_steps,
                )
            reduction.send(buffer)
        elif num_sent == 0:
            reduction.send(None)
        else:
            reduction.send(
                chunks.gather(
                    row_ids,
                    with_tail,
                    state._packing_space(bucket_index, chunks, row_ids, with_tail),
                ),
                unpack=lambda averaged: chunks.scatter_(row_ids, with_tail, averaged),
            )

    reduction.after_mask(chunks.nonzero_mask(), with_union)


def _count_mask(
    state: SparseAllReduceState, mask: torch.Tensor, num_chunks: int, num_sent: int
) -> None:
    """Count a bucket's mask exchange: its bytes, the chunks probed and the chunks sent."""
    state._count(
        bytes_sent=mask.numel() * mask.element_size(),
        chunks_probed=num_chunks,
        chunks_nonzero=num_sent,
    )


def _topk_reduce(reduction: _BucketReduction, bucket_index: int) -> None:
    """Chunk-level DGC: send the union of each rank's top chunks, keep the rest as residual."""
    state, buffer = reduction.state, reduction.buffer
    if state.iter < state.start_topk_iter:
        state._count(warmup_buckets=1)
        reduction.send(buffer)
        return
    residual = state.residuals.get(bucket_index)
    if residual is None or residual.numel() != buffer.numel():
        residual = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        state.residuals[bucket_index] = residual
    accumulated = residual.add_(buffer)  # the residual tensor now holds residual + gradient
    acc_chunks = GradientChunks(accumulated, state.chunk_size)

    norms = acc_chunks.norms()
    keep = max(1, math.ceil(state.topk_ratio * acc_chunks.count))
    mask = torch.zeros(acc_chunks.count, dtype=MASK_DTYPE, device=buffer.device)
    mask[norms.topk(keep).indices] = 1  # keep <= count because topk_ratio <= 1
    mask.mul_(norms > 0)

    def with_union(union: torch.Tensor) -> None:
        row_ids, with_tail, num_sent = union_rows(union, acc_chunks)
        _count_mask(state, union, acc_chunks.count, num_sent)
        # What is sent is the bucket-dtype rounding of the accumulated chunks; the residual
        # keeps everything else, including that rounding error, so nothing is lost over steps.
        accumulated_sent = acc_chunks.gather(row_ids, with_tail)
        sent = accumulated_sent.to(buffer.dtype, copy=True)
        acc_chunks.scatter_(row_ids, with_tail, accumulated_sent.sub_(sent))
        buffer.zero_()
        if num_sent == 0:
            reduction.send(None)
            return
        out_chunks = GradientChunks(buffer, state.chunk_size)
        reduction.send(
            sent, unpack=lambda averaged: out_chunks.scatter_(row_ids, with_tail, averaged)
        )

    reduction.after_mask(mask, with_union)


def sparse_allreduce_hook(
    state: SparseAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""DDP communication hook that all-reduces only the chunks of a bucket that are in use.

    Exact mode, per bucket of ``n`` elements split into ``ceil(n / chunk_size)`` chunks:

    1. If the bucket fell back to dense within the last ``dense_recheck_steps`` steps, do what
       the default hook does (``buffer /= world_size``; all-reduce SUM) and stop.
    2. Local mask: chunk ``c`` is 1 if any element's bit pattern is not +0.0.
    3. All-reduce the int8 mask with MAX: every rank now holds the union ``U``. This round is
       not waited for here: the next bucket's hook (or this one, if it is the last) waits for
       it and carries on with steps 4-5, so the mask travels while the next bucket's gradients
       are computed. Every collective is issued from the hook, in bucket order, so all ranks
       issue them in the same order with any backend, on the one process group.
    4. If ``|U| > density_threshold * num_chunks``, fall back to step 1's dense all-reduce.
    5. Gather the chunks in ``U`` into one contiguous buffer, divide it by ``world_size``
       (the same op the default hook applies, so the values match bit for bit), all-reduce it
       with SUM, and scatter it back. Chunks outside ``U`` are +0.0 on every rank, which is
       also what the dense average gives there.

    Top-k mode adds before step 2: ``acc = residual + gradient``; the local mask keeps the
    ``ceil(topk_ratio * num_chunks)`` chunks of largest L2 norm; every rank sends ``acc`` on
    the union ``U``; ``residual = acc - sent`` (zero on ``U`` up to dtype rounding, ``acc``
    elsewhere); the bucket result is the averaged ``U`` chunks and zero elsewhere. The first
    ``start_topk_iter`` steps are plain dense all-reduces.

    Returns a future holding the bucket buffer (same shape), reduced in place.

    Raises:
        TypeError: ``state`` is not a :class:`SparseAllReduceState`, ``bucket`` is not a
            ``torch.distributed.GradBucket`` (the hook only works under
            ``DistributedDataParallel.register_comm_hook``), or the bucket dtype is not
            float32, bfloat16 or float16.

    Example::
        >>> state = SparseAllReduceState(chunk_size=4096)
        >>> ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    """
    if not isinstance(state, SparseAllReduceState):
        raise TypeError(f"state: expected SparseAllReduceState, got {type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            "bucket: expected torch.distributed.GradBucket (register the hook with "
            "DistributedDataParallel.register_comm_hook), got " + type(bucket).__name__
        )
    return _reduce_bucket(state, bucket.buffer(), bucket.index(), bucket.is_last())


def _reduce_bucket(
    state: SparseAllReduceState, buffer: torch.Tensor, bucket_index: int, is_last: bool
) -> torch.futures.Future[torch.Tensor]:
    """The hook on a bare flat buffer (used by the hook itself and by the benchmark)."""
    if buffer.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"bucket: expected gradients of dtype float32, bfloat16 or float16, got {buffer.dtype}"
        )
    state._count(buckets=1, bytes_dense=buffer.numel() * buffer.element_size())
    reduction = _BucketReduction(state, buffer)
    reduce = _exact_reduce if state.mode == "exact" else _topk_reduce
    reduction.guarded(lambda: reduce(reduction, bucket_index))
    # The previous bucket's mask round had this bucket's backward and scan to complete in; its
    # data all-reduce goes out now. The last bucket of a step finishes every round.
    _finish_mask_rounds(state, keep=0 if is_last else 1)
    state._end_bucket(is_last)
    return reduction.result


def register_sparse_allreduce(
    model: DistributedDataParallel, state: SparseAllReduceState
) -> SparseAllReduceState:
    """``model.register_comm_hook(state, sparse_allreduce_hook)``, type-checked; returns state."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            "model: expected torch.nn.parallel.DistributedDataParallel (the hook reduces DDP "
            f"gradient buckets), got {type(model).__name__}"
        )
    model.register_comm_hook(state, sparse_allreduce_hook)
    return state
