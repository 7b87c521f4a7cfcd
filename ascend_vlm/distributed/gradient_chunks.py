"""A flat gradient bucket seen as fixed-size chunks (:class:`GradientChunks`): which chunks are
non-zero, their norms, and packing the selected ones into one buffer and back. The geometry
behind :func:`~ascend_vlm.distributed.sparse_allreduce.sparse_allreduce_hook`; no processes.
"""

from collections.abc import Callable

import torch

# float64 is left out on purpose: HcclAllReduce on Atlas training products accepts int8, int32,
# int64, float16, float32 (A2 adds bfp16) but not float64 (hiascend hcclapiref hcclcpp_07_0015).
SAME_WIDTH_INT = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
SUPPORTED_DTYPES = tuple(SAME_WIDTH_INT)
# The chunk mask travels as int8 with MAX: HCCL reduces int8 but not uint8 (same page as above),
# and gloo supports int8 MAX too.
MASK_DTYPE = torch.int8


class GradientChunks:
    """A flat tensor seen as ``num_full`` rows of ``chunk_size`` plus a shorter tail chunk."""

    __slots__ = ("chunk_size", "flat", "num_full", "rows", "tail")

    def __init__(self, flat: torch.Tensor, chunk_size: int) -> None:
        self.flat = flat
        self.chunk_size = chunk_size
        self.num_full = flat.numel() // chunk_size
        self.rows = flat[: self.num_full * chunk_size].view(self.num_full, chunk_size)
        self.tail = flat[self.num_full * chunk_size :]

    @property
    def count(self) -> int:
        return self.num_full + (1 if self.tail.numel() else 0)

    def _per_chunk(self, reduce_rows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``reduce_rows`` maps [rows, width] to [rows]; applied to the full rows and the tail."""
        result = reduce_rows(self.rows)
        if self.tail.numel():
            result = torch.cat([result, reduce_rows(self.tail.view(1, -1))])
        return result

    def nonzero_mask(self, via_bytes: bool | None = None) -> torch.Tensor:
        """int8 [count]: 1 where some element's bit pattern is not +0.0, else 0.

        Tested on raw bits so that -0.0 and NaN count as non-zero: a chunk is skipped only if
        it is all +0.0, and +0.0 / world_size summed over ranks is +0.0, exactly what the dense
        hook produces there. On CPU a uint8 max over the bytes is one vectorised pass, cheaper
        than an integer max plus min or ``any``; whether NPU reduces uint8 is UNVERIFIED, so
        other devices compare same-width integers with 0.
        ``via_bytes`` forces one formulation (both give the same mask); None picks by device.
        """
        if via_bytes is None:
            via_bytes = self.flat.device.type == "cpu"
        if via_bytes:
            width = self.chunk_size * self.flat.element_size()
            raw = GradientChunks(self.flat.view(torch.uint8), width)
            return raw._per_chunk(lambda rows: rows.amax(dim=1).clamp_(max=1)).view(MASK_DTYPE)
        bits = GradientChunks(self.flat.view(SAME_WIDTH_INT[self.flat.dtype]), self.chunk_size)
        return bits._per_chunk(lambda rows: rows.ne(0).any(dim=1)).to(MASK_DTYPE)

    def norms(self) -> torch.Tensor:
        """float32 [count]: L2 norm of each chunk."""
        return self._per_chunk(
            lambda rows: torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)
        )

    def packed_numel(self, row_ids: torch.Tensor, with_tail: bool) -> int:
        """Elements of the selected rows (and the tail, if ``with_tail``)."""
        return row_ids.numel() * self.chunk_size + (self.tail.numel() if with_tail else 0)

    def gather(
        self, row_ids: torch.Tensor, with_tail: bool, space: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Concatenate the selected rows (and the tail) into one flat tensor.

        The result is a new tensor, or the front of ``space`` (flat, same dtype, at least
        :meth:`packed_numel` elements) if given.
        """
        tail_len = self.tail.numel() if with_tail else 0
        numel = self.packed_numel(row_ids, with_tail)
        packed = self.flat.new_empty(numel) if space is None else space[:numel]
        rows_out = packed[: row_ids.numel() * self.chunk_size].view(-1, self.chunk_size)
        torch.index_select(self.rows, 0, row_ids, out=rows_out)
        if with_tail:
            packed[-tail_len:].copy_(self.tail)
        return packed

    def scatter_(
        self,
        row_ids: torch.Tensor,
        with_tail: bool,
        packed: torch.Tensor,
        via_numpy: bool | None = None,
    ) -> None:
        """Inverse of :meth:`gather`: write ``packed`` back into the selected chunks.

        On CPU the rows are copied by NumPy's row assignment on same-width integer views (a
        bit-exact copy of whole contiguous rows, where ``index_copy_`` copies element by
        element; README's benchmark section has the ratio). Other devices use ``index_copy_``.
        ``via_numpy`` forces one of the two (same result); None picks by device.
        """
        rows_in = packed[: row_ids.numel() * self.chunk_size].view(-1, self.chunk_size)
        rows_in = rows_in.to(self.rows.dtype)
        if via_numpy is None:
            via_numpy = self.rows.device.type == "cpu"
        if via_numpy:
            as_bits = SAME_WIDTH_INT[self.rows.dtype]
            self.rows.view(as_bits).numpy()[row_ids.numpy()] = rows_in.view(as_bits).numpy()
        else:
            self.rows.index_copy_(0, row_ids, rows_in)
        if with_tail:
            self.tail.copy_(packed[-self.tail.numel() :])

    def add_(self, row_ids: torch.Tensor, packed: torch.Tensor) -> None:
        """Add ``packed`` (the selected full rows back to back) onto the rows ``row_ids``.

        ``row_ids`` must not repeat: each selected element then gets one addition,
        ``row + packed``, rounded once in the bucket dtype.
        """
        self.rows.index_add_(0, row_ids, packed.view(-1, self.chunk_size))


def union_rows(union: torch.Tensor, chunks: GradientChunks) -> tuple[torch.Tensor, bool, int]:
    """Row ids of the full chunks set in the int8 ``union`` mask, the tail flag, and their count."""
    row_ids = union[: chunks.num_full].bool().nonzero().view(-1)
    with_tail = chunks.count > chunks.num_full and bool(union[-1])
    return row_ids, with_tail, row_ids.numel() + int(with_tail)
