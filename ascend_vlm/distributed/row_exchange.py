"""Exact mode over parameter rows (:func:`rows_reduce`): each rank sends the rows it touched, ids
and values, to every other rank in one all-gather and adds what it receives.

Where the ranks touch different rows (each rank's batch holds other tokens), this moves each
rank's own rows once, where an all-reduce of the union would move the union twice.
"""

import torch
import torch.distributed as dist

from ascend_vlm.distributed.bucket_reduction import BucketReduction
from ascend_vlm.distributed.gradient_chunks import GradientChunks
from ascend_vlm.distributed.parameter_rows import ParameterRows

# Chunk ids travel as int32 (4 bytes a row) in front of the values, in one byte message.
ROW_ID_DTYPE = torch.int32
# Messages are padded to a multiple of this many bytes, so that every rank's slot in the
# receive buffer starts aligned for the int32 ids and for any float dtype.
MESSAGE_ALIGN = 8


def rows_reduce(reduction: BucketReduction, bucket_index: int, rows: ParameterRows) -> None:
    """Start one bucket's exact reduction over its parameter rows.

    1. Mask the rows holding any bit pattern other than +0.0 (one pass over the bucket).
    2. All-gather each rank's ``[rows touched, elements touched]`` (queued, pipelined).
    3. If the padded messages, all gathered, would carry more than ``density_threshold`` of
       the dense ring all-reduce's ``2 * bucket bytes``, fall back to it (see
       :meth:`~ascend_vlm.distributed.sparse_allreduce.SparseAllReduceState`).
    4. Else pack ``[ids | values / world]``, all-gather it, and add (see :func:`_add_received`).
    """
    state, buffer = reduction.state, reduction.buffer
    group = state._group()
    if group.size() == 1 or state._stays_dense(bucket_index, buffer.numel()):
        reduction.send(buffer)
        return
    chunks = rows.chunks(buffer)
    own_ids = rows.nonzero_mask(chunks).bool().nonzero().view(-1)
    parts = rows.split(own_ids)
    sizes = torch.tensor(
        [own_ids.numel(), rows.packed_numel(parts)], dtype=torch.int64, device=buffer.device
    )
    gathered = [torch.empty_like(sizes) for _ in range(group.size())]
    work = dist.all_gather(gathered, sizes, group=group, async_op=True)
    state._count(bytes_sent=sizes.numel() * sizes.element_size())
    reduction.after_round(
        work,
        lambda: _with_sizes(
            reduction, bucket_index, rows, chunks, own_ids, parts, torch.stack(gathered)
        ),
    )


def _with_sizes(
    reduction: BucketReduction,
    bucket_index: int,
    rows: ParameterRows,
    chunks: list[GradientChunks],
    own_ids: torch.Tensor,
    parts: list,
    sizes: torch.Tensor,
) -> None:
    """Steps 3-4 of :func:`rows_reduce`, once every rank's sizes are known."""
    state, buffer = reduction.state, reduction.buffer
    group = state._group()
    world, itemsize = group.size(), buffer.element_size()
    id_bytes = ROW_ID_DTYPE.itemsize
    message_bytes = int((sizes[:, 0] * id_bytes + sizes[:, 1] * itemsize).max())
    padded = -(-message_bytes // MESSAGE_ALIGN) * MESSAGE_ALIGN
    touched = int(sizes[:, 0].sum())
    if world * padded > state.density_threshold * 2 * buffer.numel() * itemsize:
        state._count(chunks_probed=rows.count, chunks_nonzero=min(rows.count, touched))
        state._fall_back_dense(bucket_index, buffer.numel())
        reduction.send(buffer)
        return
    if touched == 0:
        state._count(chunks_probed=rows.count)
        reduction.send(None)
        return
    send, receive = state._message_space(bucket_index, padded, world, buffer.device)
    own_values = _message_values(send, own_ids.numel(), int(sizes[dist.get_rank(group), 1]), buffer)
    send[: own_ids.numel() * id_bytes].view(ROW_ID_DTYPE).copy_(own_ids)
    for segment, _, offset, local in parts:
        chunks[segment].gather(local, False, own_values[offset:])
    own_values.div_(world)  # the default hook's op on the same values: the same bits
    messages = [receive[rank * padded : (rank + 1) * padded] for rank in range(world)]
    work = dist.all_gather(messages, send[:padded], group=group, async_op=True)
    state._count(bytes_sent=padded)
    reduction.then(
        work,
        lambda: _add_received(
            reduction, rows, chunks, (own_ids, parts, own_values), messages, sizes
        ),
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
    own: tuple[torch.Tensor, list, torch.Tensor],
    messages: list[torch.Tensor],
    sizes: torch.Tensor,
) -> None:
    """Write this rank's averaged rows back, then add every other rank's, in rank order.

    For 2 ranks the result equals the default hook bit for bit (NaN payloads aside): a row
    both touched gets ``own + other`` (addition commutes exactly); a row only the other touched
    gets ``+0.0 + other``; a row only this rank touched gets ``own + 0.0``, which the default
    computes too (it turns -0.0 into +0.0), so it is added here as well. With 3+ ranks the
    additions run in rank order, the all-reduce's in its own: equal within a few ulp.
    """
    state, buffer = reduction.state, reduction.buffer
    own_ids, own_parts, own_values = own
    me = dist.get_rank(state._group())
    seen = torch.zeros(rows.count, dtype=torch.bool, device=buffer.device)
    received = []
    for rank, message in enumerate(messages):
        num_ids, numel = sizes[rank].tolist()
        if rank == me or num_ids == 0:
            continue
        ids = message[: num_ids * ROW_ID_DTYPE.itemsize].view(ROW_ID_DTYPE).long()
        seen[ids] = True
        received.append((ids, _message_values(message, num_ids, numel, buffer)))
    shared = seen[own_ids]
    signed_zero = torch.where(
        shared,
        torch.tensor(-0.0, dtype=buffer.dtype, device=buffer.device),
        torch.tensor(0.0, dtype=buffer.dtype, device=buffer.device),
    )
    for segment, position, offset, local in own_parts:
        width = rows.segments[segment][2]
        values = own_values[offset : offset + local.numel() * width]
        zeros = signed_zero[position : position + local.numel()]
        values.view(-1, width).add_(zeros.unsqueeze(1))
        chunks[segment].scatter_(local, False, values)
    for ids, values in received:
        for segment, _, offset, local in rows.split(ids):
            width = rows.segments[segment][2]
            chunks[segment].add_(local, values[offset : offset + local.numel() * width])
    seen[own_ids] = True
    state._count(chunks_probed=rows.count, chunks_nonzero=int(seen.sum()))
