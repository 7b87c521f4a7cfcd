"""Exact mode over parameter rows (:func:`rows_reduce`): each rank sends the rows it touched, ids
and values, to every other rank in one all-gather and adds what it receives.

Where the ranks touch different rows (each rank's batch holds other tokens), this moves each
rank's own rows once, where an all-reduce of the union would move the union twice.
"""

from typing import Any

import torch
import torch.distributed as dist

from ascend_vlm.distributed.bucket_reduction import BucketReduction
from ascend_vlm.distributed.gradient_chunks import SAME_WIDTH_INT, GradientChunks
from ascend_vlm.distributed.parameter_rows import ParameterRows

# Chunk ids travel as int32 (4 bytes a row) in front of the values, in one byte message.
ROW_ID_DTYPE = torch.int32
# One flat output for every rank's slot: the list form of all_gather copies each slot out of a
# flat buffer of its own. torch 2.13 renamed all_gather_into_tensor to all_gather_single
# (the old name warns); the getattr can go once torch >= 2.13 is required.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Messages are padded to a multiple of this many bytes, so that every rank's slot in the
# receive buffer starts aligned for the int32 ids and for any float dtype.
MESSAGE_ALIGN = 8
# The density sample (:func:`_sample_says_dense`): how many elements it reads, the sampling
# error it allows for (eight standard deviations of a fraction over that many samples, at
# most), and the bucket size under which a full mask costs about as little as the sample.
DENSITY_SAMPLES = 1024
DENSITY_SAMPLE_MARGIN = 0.125
DENSITY_SAMPLE_MIN_NUMEL = 16 * DENSITY_SAMPLES
GOLDEN_RATIO_FRACTION = (5**0.5 - 1) / 2


def rows_reduce(reduction: BucketReduction, bucket_index: int, rows: ParameterRows) -> None:
    """Start one bucket's exact reduction over its parameter rows.

    1. If a sample of the bucket's elements (:func:`_sample_says_dense`) shows this rank alone
       makes it too dense (step 3), skip the mask: announce the whole bucket as touched.
       Else mask the rows holding any bit pattern other than +0.0 (one pass over the bucket)
       and count them per segment.
    2. All-gather each rank's ``[rows touched, elements touched]`` (queued, pipelined) and,
       while those travel, pack ``[int32 ids | values / world]`` unless this rank alone
       already makes the bucket too dense (decided from the counts, before listing ids).
    3. If the padded messages, all gathered, would carry more than ``density_threshold`` of
       the dense ring all-reduce's ``2 * bucket bytes``, fall back to it (see
       :class:`~ascend_vlm.distributed.sparse_allreduce.SparseAllReduceState`).
    4. Else all-gather the messages; while they travel, write this rank's averaged rows back
       into the bucket; then add every other rank's (see :func:`_add_received`).
    """
    state, buffer = reduction.state, reduction.buffer
    group = state._group()
    if group.size() == 1 or state._stays_dense(bucket_index, buffer.numel()):
        reduction.send(buffer)
        return
    chunks = rows.chunks(buffer)
    own = _OwnRows(rows, chunks, buffer, state)
    sizes = torch.tensor([own.count, own.numel], dtype=torch.int64, device=buffer.device)
    gathered = sizes.new_empty(group.size() * 2)
    work = _all_gather_flat(gathered, sizes, group=group, async_op=True)
    state._count(bytes_sent=sizes.numel() * sizes.element_size())
    own_bytes = _message_bytes(own.count, own.numel, buffer)
    if own.count and not _too_dense(state, own_bytes, buffer):
        own.list_ids(rows)
        send, _ = state._message_space(bucket_index, own_bytes, 0, buffer.device)
        own.pack(send, chunks, buffer, group.size())
    reduction.after_round(
        work,
        lambda: _with_sizes(reduction, bucket_index, rows, chunks, own, gathered.view(-1, 2)),
    )


def _sample_says_dense(state: Any, buffer: torch.Tensor) -> bool:
    """Whether :data:`DENSITY_SAMPLES` spread elements of ``buffer`` show, beyond sampling
    error, that this rank's message alone would make the bucket too dense.

    Every element in a touched row travels, so the fraction of elements whose bits are not
    +0.0 is at most the message's share of the bucket: the sample can only under-state it, and
    the margin :data:`DENSITY_SAMPLE_MARGIN` keeps a sparse bucket from being taken as dense
    (for positions unrelated to the gradient's pattern, Hoeffding's bound puts the chance
    below 1e-13). Taken as dense wrongly, a bucket is still reduced exactly, only densely.
    Buckets under
    :data:`DENSITY_SAMPLE_MIN_NUMEL` elements are always masked in full.
    """
    numel = buffer.numel()
    if numel < DENSITY_SAMPLE_MIN_NUMEL:
        return False
    # Golden-ratio steps spread the positions evenly without touching any RNG stream.
    steps = torch.arange(DENSITY_SAMPLES, dtype=torch.float64, device=buffer.device)
    positions = (steps.mul_(GOLDEN_RATIO_FRACTION).frac_().mul_(numel)).long()
    bits = buffer.view(SAME_WIDTH_INT[buffer.dtype])[positions]
    fraction = float(bits.ne(0).sum()) / DENSITY_SAMPLES - DENSITY_SAMPLE_MARGIN
    if fraction <= 0.0:
        return False
    lowest_bytes = int(fraction * numel * buffer.element_size())
    return _too_dense(state, lowest_bytes, buffer)


class _OwnRows:
    """This rank's touched chunks of one bucket: how many (``count``) and their elements
    (``numel``); once :meth:`list_ids` ran, their sorted ``ids`` and :meth:`ParameterRows.split`
    (``parts``); once packed, the values section of the outgoing message (``values``).

    If the sample already shows the bucket too dense (:func:`_sample_says_dense`), the whole
    bucket is announced (``count`` and ``numel`` of all of it) and nothing is masked.
    """

    __slots__ = ("count", "ids", "mask", "numel", "parts", "values")

    def __init__(
        self, rows: ParameterRows, chunks: list[GradientChunks], buffer: torch.Tensor, state: Any
    ) -> None:
        self.ids = torch.empty(0, dtype=torch.int64, device=buffer.device)
        self.parts: list = []
        self.values: torch.Tensor | None = None
        if _sample_says_dense(state, buffer):
            self.mask = None
            self.count, self.numel = rows.count, rows.numel
            return
        self.mask = rows.nonzero_mask(chunks)
        # One read of the device's counts per bucket, not one per parameter.
        sums = [part.sum() for part in self.mask.split([r for _, r, _ in rows.segments])]
        touched = torch.stack(sums).tolist()
        self.count = sum(touched)
        self.numel = sum(t * width for t, (_, _, width) in zip(touched, rows.segments, strict=True))

    def list_ids(self, rows: ParameterRows) -> None:
        """Turn the mask into sorted ``ids`` and their ``parts``."""
        self.ids = self.mask.bool().nonzero().view(-1)
        self.parts = rows.split(self.ids)

    def pack(
        self, send: torch.Tensor, chunks: list[GradientChunks], buffer: torch.Tensor, world: int
    ) -> None:
        """Write ``[ids | values / world]`` to the front of the byte buffer ``send``."""
        send[: self.ids.numel() * ROW_ID_DTYPE.itemsize].view(ROW_ID_DTYPE).copy_(self.ids)
        self.values = _message_values(send, self.ids.numel(), self.numel, buffer)
        for segment, _, offset, local in self.parts:
            chunks[segment].gather(local, False, self.values[offset:])
        self.values.div_(world)  # the default hook's op on the same values: the same bits

    def write_back(self, rows: ParameterRows, chunks: list[GradientChunks]) -> bool:
        """Put the averaged values back into their chunks; whether any of them is -0.0."""
        for segment, _, offset, local in self.parts:
            width = rows.segments[segment][2]
            chunks[segment].scatter_(
                local, False, self.values[offset : offset + local.numel() * width]
            )
        # -0.0 is the smallest same-width integer: one min pass, no mask tensor.
        bits = self.values.view(SAME_WIDTH_INT[self.values.dtype])
        return bool(bits.amin() == torch.iinfo(bits.dtype).min)


def _message_bytes(num_ids: int, numel: int, like: torch.Tensor) -> int:
    """Bytes of a message of ``num_ids`` ids and ``numel`` values, padded to the alignment."""
    nbytes = num_ids * ROW_ID_DTYPE.itemsize + numel * like.element_size()
    return -(-nbytes // MESSAGE_ALIGN) * MESSAGE_ALIGN


def _too_dense(state: Any, message_bytes: int, buffer: torch.Tensor) -> bool:
    """Whether ``world_size`` messages of ``message_bytes`` exceed ``density_threshold`` of
    the dense ring all-reduce's ``2 * bucket bytes``."""
    gathered = state._group().size() * message_bytes
    return gathered > state.density_threshold * 2 * buffer.numel() * buffer.element_size()


def _with_sizes(
    reduction: BucketReduction,
    bucket_index: int,
    rows: ParameterRows,
    chunks: list[GradientChunks],
    own: _OwnRows,
    sizes: torch.Tensor,
) -> None:
    """Steps 3-4 of :func:`rows_reduce`, once every rank's sizes are known."""
    state, buffer = reduction.state, reduction.buffer
    group = state._group()
    world = group.size()
    padded = max(_message_bytes(num_ids, numel, buffer) for num_ids, numel in sizes.tolist())
    touched = int(sizes[:, 0].sum())
    if _too_dense(state, padded, buffer):
        state._count(chunks_probed=rows.count, chunks_nonzero=min(rows.count, touched))
        state._fall_back_dense(bucket_index, buffer.numel())
        reduction.send(buffer)
        return
    if touched == 0:
        state._count(chunks_probed=rows.count)
        reduction.send(None)
        return
    packed_bytes = (
        _message_bytes(own.ids.numel(), own.numel, buffer) if own.values is not None else 0
    )
    send, receive = state._message_space(
        bucket_index, padded, world * padded, buffer.device, keep_bytes=packed_bytes
    )
    work = _all_gather_flat(receive[: world * padded], send[:padded], group=group, async_op=True)
    messages = [receive[rank * padded : (rank + 1) * padded] for rank in range(world)]
    state._count(bytes_sent=padded)
    # While the messages travel: this rank's averaged rows go back into the bucket.
    negative_zero = own.values is not None and own.write_back(rows, chunks)
    reduction.then(
        work,
        lambda: _add_received(reduction, rows, chunks, own.ids, negative_zero, messages, sizes),
    )


def _message_values(
    message: torch.Tensor, num_ids: int, numel: int, like: torch.Tensor
) -> torch.Tensor:
    """The values section of a byte ``message`` holding ``num_ids`` ids then ``numel`` values."""
    start = num_ids * ROW_ID_DTYPE.itemsize
    return message[start : start + numel * like.element_size()].view(like.dtype)


def _add_received(
    reduction: BucketReduction,
    rows: ParameterRows,
    chunks: list[GradientChunks],
    own_ids: torch.Tensor,
    own_negative_zero: bool,
    messages: list[torch.Tensor],
    sizes: torch.Tensor,
) -> None:
    """Add every other rank's averaged rows into the bucket, in rank order.

    This rank's averaged rows are already in place. For 2 ranks the result equals the default
    hook bit for bit (NaN payloads aside): a row both touched gets ``own + other`` (addition
    commutes exactly); a row only the other touched gets ``+0.0 + other``; a row only this
    rank touched gets ``own + 0.0`` in the dense sum, which changes only -0.0 (to +0.0), so
    it is added here only if this rank's values hold a -0.0 (``own_negative_zero``). With 3+
    ranks the additions run in rank order, the all-reduce's in its own: within a few ulp.
    """
    state, buffer = reduction.state, reduction.buffer
    me = dist.get_rank(state._group())
    seen = torch.zeros(rows.count, dtype=torch.bool, device=buffer.device)
    for rank, message in enumerate(messages):
        num_ids, numel = sizes[rank].tolist()
        if rank == me or num_ids == 0:
            continue
        ids = message[: num_ids * ROW_ID_DTYPE.itemsize].view(ROW_ID_DTYPE).long()
        seen[ids] = True
        values = _message_values(message, num_ids, numel, buffer)
        for segment, _, offset, local in rows.split(ids):
            width = rows.segments[segment][2]
            chunks[segment].add_(local, values[offset : offset + local.numel() * width])
    if own_negative_zero:
        only_own = own_ids[~seen[own_ids]]
        for segment, _, _, local in rows.split(only_own):
            width = rows.segments[segment][2]
            chunks[segment].add_(local, buffer.new_zeros(local.numel() * width))
    seen[own_ids] = True
    state._count(chunks_probed=rows.count, chunks_nonzero=int(seen.sum()))
