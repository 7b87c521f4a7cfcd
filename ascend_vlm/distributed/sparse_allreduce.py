"""Sparse-mask all-reduce: a DDP communication hook that only sends gradient chunks in use.

By default (``chunk_size=None``) each gradient bucket is cut along its parameters' rows (an
embedding's token rows, a LoRA matrix's rows): every rank sends the rows it touched, ids and
values, to the others in one all-gather and adds theirs (:mod:`.row_exchange`). With a fixed
``chunk_size`` the bucket is cut into chunks of that many elements; the ranks agree, through
one small int8 all-reduce, on the union of chunks non-zero anywhere, and only those travel,
packed into one all-reduce. In ``"exact"`` mode the result is the same as DDP's default
``allreduce_hook``; in ``"topk"`` mode each rank keeps only its largest chunks and carries the
rest over to the next step (error feedback, as in Deep Gradient Compression).

Usage::

    state = SparseAllReduceState()
    ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    ...
    print(state.stats.summary())

Where VLM fine-tuning gradients are chunk-sparse (frozen weights never enter DDP buckets; only
``requires_grad`` parameters do):

- Trainable token embeddings (added special tokens, ``modules_to_save=["embed_tokens"]``):
  the embedding backward only writes the rows of tokens present in the local batch, so most
  rows are +0.0; the default chunks are exactly those rows. A *tied* or trained
  ``lm_head`` is dense (the softmax touches every vocabulary row).
- Modality-specific parameters (LoRA on the vision tower, the projector/merger) on ranks whose
  micro-batch has no images: DDP (``find_unused_parameters=True``) hands their bucket slots
  over as zeros. Only if no rank saw an image is nothing sent; else the union travels.
- Mixture-of-experts layers: experts that no local token was routed to get no gradient.
- Not sparse: LoRA A/B matrices of layers every token passes through. Exact mode falls back to
  the dense all-reduce for such buckets (one mask probe per ``dense_recheck_steps`` steps);
  ``mode="topk"`` is the option that compresses them.
"""

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ascend_vlm.distributed.allreduce_stats import SparseAllReduceStats
from ascend_vlm.distributed.bucket_reduction import BucketReduction, finish_rounds
from ascend_vlm.distributed.gradient_chunks import (
    MASK_DTYPE,
    SUPPORTED_DTYPES,
    GradientChunks,
    union_rows,
)
from ascend_vlm.distributed.parameter_rows import ParameterRows
from ascend_vlm.distributed.row_exchange import rows_reduce

__all__ = [
    "SparseAllReduceState",
    "register_sparse_allreduce",
    "sparse_allreduce_hook",
]

MODES = ("exact", "topk")
# Top-k ranks fixed-size chunks; this is their size when ``chunk_size`` is left to None.
TOPK_CHUNK_SIZE = 1024


def _check_fraction(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: expected a number in (0, 1], got {value!r}")
    return float(value)


def _check_count(name: str, value: int, minimum: int, none_ok: bool = False) -> int | None:
    if none_ok and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


class SparseAllReduceState:
    r"""Hyperparameters and per-bucket memory of :func:`sparse_allreduce_hook`.

    1. ``mode``: ``"exact"`` (default) sends every chunk that is non-zero on some rank, so the
       averaged gradient equals the default hook's (bitwise for 2 ranks, NaN payloads aside;
       for more ranks the additions may run in another order, a few ulp). ``"topk"``
       additionally drops all but the largest chunks per rank and feeds the rest back into the
       next step (delayed, never dropped): far fewer bytes for dense gradients, a different
       optimisation trajectory.

    2. ``chunk_size`` (default None): the sparsity granularity. None follows the parameters'
       shapes: one chunk per row of each matrix in the bucket (an embedding's token row;
       rows under 256 bytes grouped), one per run of adjacent 1-D parameters
       (:class:`~ascend_vlm.distributed.parameter_rows.ParameterRows`); each rank then sends
       its own touched rows with their int32 ids to every other rank in one all-gather, which
       moves each rank's rows once where an all-reduce of the union moves the union twice. An
       int cuts the flat bucket into chunks of that many elements, agrees on their union with
       an int8 MAX all-reduce (1 byte per chunk) and all-reduces the union: better when every
       rank touches the same chunks and there are more than 2 ranks. Top-k mode ranks chunks
       of ``chunk_size`` elements, :data:`TOPK_CHUNK_SIZE` if None.

    3. ``density_threshold`` (``"exact"`` only, default 0.5): above it a bucket is
       all-reduced densely instead, since packing would then cost more than it saves. With an
       int ``chunk_size``: when more than this fraction of the bucket's chunks is non-zero on
       some rank. With row chunks: when the all-gathered messages (``world_size`` times the
       largest rank's ids and values) would exceed this fraction of the dense ring
       all-reduce's ``2 * bucket bytes`` (2 ranks: each touching more than about half the
       bucket). Each bucket sent sparsely keeps its packing buffers across steps, sized to the
       largest use so far plus 25% (the row exchange's receive buffer holds ``world_size``
       messages).

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
        "row_layouts",
        "message_spaces",
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
        chunk_size: int | None = None,
        density_threshold: float = 0.5,
        dense_recheck_steps: int = 16,
        topk_ratio: float = 0.01,
        start_topk_iter: int = 10,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.mode = mode
        self.chunk_size = _check_count("chunk_size", chunk_size, 1, none_ok=True)
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
        # bucket index -> its parameters' row geometry (row chunks), rebuilt if DDP rebuckets.
        self.row_layouts: dict[int, ParameterRows] = {}
        # bucket index -> (send, receive) byte buffers of the row exchange, kept as above.
        self.message_spaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Buckets whose first round (mask or sizes) is in flight, oldest first (at most two).
        self.mask_rounds: deque[BucketReduction] = deque()
        self.stats = SparseAllReduceStats()
        self.stats_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """For checkpoints: everything but the process group, the lock and collectives in flight."""
        unpicklable = (
            "process_group",
            "packing_spaces",
            "row_layouts",
            "message_spaces",
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
        self.row_layouts = {}
        self.message_spaces = {}
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

    def _message_space(
        self,
        bucket_index: int,
        send_bytes: int,
        receive_bytes: int,
        device: torch.device,
        keep_bytes: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This bucket's row-exchange byte buffers (send, receive), each grown with 25% slack to
        at least ``send_bytes`` / ``receive_bytes``; a grown send buffer keeps its first
        ``keep_bytes`` (a message packed before the sizes were known)."""
        send, receive = self.message_spaces.get(bucket_index, (None, None))
        if send is None or send.numel() < send_bytes:
            grown = torch.empty(send_bytes + send_bytes // 4, dtype=torch.uint8, device=device)
            if keep_bytes:
                grown[:keep_bytes].copy_(send[:keep_bytes])
            send = grown
        if receive is None or receive.numel() < receive_bytes:
            capacity = receive_bytes + receive_bytes // 4
            receive = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.message_spaces[bucket_index] = (send, receive)
        return send, receive

    def _row_layout(
        self, bucket_index: int, shapes: Sequence[torch.Size], buffer: torch.Tensor
    ) -> ParameterRows:
        """This bucket's :class:`ParameterRows`, rebuilt when its parameters change."""
        layout = self.row_layouts.get(bucket_index)
        if layout is None or not layout.matches(shapes, buffer.numel()):
            layout = ParameterRows(shapes, buffer.element_size())
            if layout.numel != buffer.numel():
                raise ValueError(
                    f"bucket: expected {layout.numel} elements from its parameters' shapes "
                    f"{[tuple(shape) for shape in shapes]}, got a buffer of {buffer.numel()}"
                )
            self.row_layouts[bucket_index] = layout
        return layout

    def _stays_dense(self, bucket_index: int, numel: int) -> bool:
        """Whether this bucket fell back to dense within the last ``dense_recheck_steps`` steps
        (counted as a dense fallback); a bucket whose size changed is probed again."""
        numel_dense_until = self.dense_until.get(bucket_index)
        if numel_dense_until is None:
            return False
        cached_numel, until = numel_dense_until
        if cached_numel == numel and self.iter < until:
            self._count(dense_fallbacks=1)
            return True
        del self.dense_until[bucket_index]
        return False

    def _fall_back_dense(self, bucket_index: int, numel: int) -> None:
        """Count a dense fallback and keep the bucket dense for ``dense_recheck_steps`` steps."""
        self._count(dense_fallbacks=1)
        if self.dense_recheck_steps:
            self.dense_until[bucket_index] = (numel, self.iter + 1 + self.dense_recheck_steps)

    def _record_completion(self, started: float) -> None:
        self._count(seconds=time.perf_counter() - started)

    def _end_bucket(self, is_last: bool) -> None:
        # DDP hooks its buckets in index order; the highest index (``is_last``) comes last.
        if is_last:
            self.iter += 1
            self._count(steps=1)


def _exact_reduce(reduction: BucketReduction, bucket_index: int) -> None:
    state, buffer = reduction.state, reduction.buffer
    if state._stays_dense(bucket_index, buffer.numel()):
        reduction.send(buffer)
        return
    chunks = GradientChunks(buffer, state.chunk_size)

    def with_union(union: torch.Tensor) -> None:
        row_ids, with_tail, num_sent = union_rows(union, chunks)
        _count_mask(state, union, chunks.count, num_sent)
        if num_sent > state.density_threshold * chunks.count:
            state._fall_back_dense(bucket_index, buffer.numel())
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


def _topk_reduce(reduction: BucketReduction, bucket_index: int) -> None:
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
    chunk_size = state.chunk_size or TOPK_CHUNK_SIZE
    acc_chunks = GradientChunks(accumulated, chunk_size)

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
        out_chunks = GradientChunks(buffer, chunk_size)
        reduction.send(
            sent, unpack=lambda averaged: out_chunks.scatter_(row_ids, with_tail, averaged)
        )

    reduction.after_mask(mask, with_union)


def sparse_allreduce_hook(
    state: SparseAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""DDP communication hook that exchanges only the chunks of a bucket that are in use.

    Exact mode with row chunks (``chunk_size=None``, the default), per bucket:

    1. If the bucket fell back to dense within the last ``dense_recheck_steps`` steps, or the
       group has one rank, do what the default hook does (``buffer /= world_size``;
       all-reduce SUM) and stop.
    2. Local mask: a row chunk (see :class:`ParameterRows`) is touched if any element's bit
       pattern is not +0.0; one vectorised pass per run of equally wide rows. Skipped (the
       whole bucket announced as touched) when a sample of spread elements already shows this
       rank alone makes the bucket too dense (step 4), so a dense bucket's probe costs about
       nothing but step 3.
    3. All-gather every rank's (rows touched, elements touched). Not waited for here: the next
       bucket's hook (or this one, if it is the last) waits and carries on, so the sizes
       travel while the next bucket's gradients are computed. Every collective is issued from
       the hook, in bucket order, so all ranks issue them in the same order with any backend.
    4. If the gathered messages would exceed ``density_threshold`` of the dense all-reduce's
       bytes, fall back to step 1's dense all-reduce (and stay dense for a while).
    5. Pack ``[int32 row ids | touched rows / world_size]`` and all-gather it; write this
       rank's rows back and add every other rank's into the bucket (rows nobody touched are
       +0.0 everywhere, which is also what the dense average gives there).

    Exact mode with an int ``chunk_size``: step 2 marks fixed chunks; step 3 all-reduces the
    int8 chunk mask with MAX, giving every rank the union ``U``; step 4 falls back if ``|U| >
    density_threshold * num_chunks``; step 5 gathers the chunks in ``U``, divides by
    ``world_size``, all-reduces them with SUM and scatters them back.

    Top-k mode (fixed chunks) adds before step 2: ``acc = residual + gradient``; the local mask
    keeps the ``ceil(topk_ratio * num_chunks)`` chunks of largest L2 norm; every rank sends
    ``acc`` on the union ``U``; ``residual = acc - sent`` (zero on ``U`` up to dtype rounding,
    ``acc`` elsewhere); the bucket result is the averaged ``U`` chunks and zero elsewhere. The
    first ``start_topk_iter`` steps are plain dense all-reduces.

    Returns a future holding the bucket buffer (same shape), reduced in place.

    Raises:
        TypeError: ``state`` is not a :class:`SparseAllReduceState`, ``bucket`` is not a
            ``torch.distributed.GradBucket`` (the hook only works under
            ``DistributedDataParallel.register_comm_hook``), or the bucket dtype is not
            float32, bfloat16 or float16.

    Example::
        >>> state = SparseAllReduceState()
        >>> ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    """
    if not isinstance(state, SparseAllReduceState):
        raise TypeError(f"state: expected SparseAllReduceState, got {type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            "bucket: expected torch.distributed.GradBucket (register the hook with "
            "DistributedDataParallel.register_comm_hook), got " + type(bucket).__name__
        )
    buffer, bucket_index, is_last = bucket.buffer(), bucket.index(), bucket.is_last()
    if buffer.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"bucket: expected gradients of dtype float32, bfloat16 or float16, got {buffer.dtype}"
        )
    state._count(buckets=1, bytes_dense=buffer.numel() * buffer.element_size())
    reduction = BucketReduction(state, buffer)
    if state.mode == "topk":
        reduction.guarded(lambda: _topk_reduce(reduction, bucket_index))
    elif state.chunk_size is not None:
        reduction.guarded(lambda: _exact_reduce(reduction, bucket_index))
    else:
        shapes = [parameter.shape for parameter in bucket.parameters()]
        reduction.guarded(
            lambda: rows_reduce(
                reduction, bucket_index, state._row_layout(bucket_index, shapes, buffer)
            )
        )
    # The previous bucket's first round had this bucket's backward and scan to complete in;
    # its data exchange goes out now. The last bucket of a step finishes every round.
    finish_rounds(state, keep=0 if is_last else 1)
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
