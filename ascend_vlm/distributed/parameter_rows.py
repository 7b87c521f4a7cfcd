"""A gradient bucket seen as the rows of its parameters (:class:`ParameterRows`): an embedding's
token rows, a LoRA matrix's rows, a bias as one piece. The chunking behind the default
(``chunk_size=None``) exact mode of
:func:`~ascend_vlm.distributed.sparse_allreduce.sparse_allreduce_hook`; no processes.

The bucket is cut into *segments*, each a run of equally wide chunks laid out back to back, so
every per-bucket step (mask, pack, write back, add) is one vectorised call per segment, never
one per chunk. DDP lays a bucket's gradients out contiguously in the order of
``GradBucket.parameters()``, with no padding between them (dense tensors).
"""

from collections.abc import Sequence

import torch

from ascend_vlm.distributed.gradient_chunks import GradientChunks

# Rows narrower than this are grouped (a LoRA B matrix of rank 8 has 32-byte fp32 rows), so
# the 4-byte row index sent with each chunk stays under 2% of its payload.
MIN_CHUNK_BYTES = 256


class ParameterRows:
    """The chunk geometry of one bucket: ``segments`` of ``(start, rows, width)`` elements.

    Chunk ids run over the segments in order: segment ``s`` holds ids ``first_ids[s]`` to
    ``first_ids[s] + rows - 1``. A parameter of shape ``[d0, ...]`` with two or more dimensions
    gives one chunk per ``d0`` row (rows narrower than :data:`MIN_CHUNK_BYTES` grouped, the
    leftover rows one shorter chunk); a run of adjacent 1-D or 0-D parameters (biases, norms)
    gives one chunk. Adjacent segments of the same width merge.
    """

    __slots__ = ("count", "first_ids", "numel", "segments", "shapes")

    def __init__(self, shapes: Sequence[torch.Size], element_size: int) -> None:
        self.shapes = tuple(tuple(shape) for shape in shapes)
        pieces: list[list[int]] = []  # [start, rows, width], merged as they come
        start = 0
        for shape in self.shapes:
            numel = _numel(shape)
            if numel == 0:
                continue
            for rows, width in _parameter_pieces(shape, numel, element_size):
                _append_piece(pieces, start, rows, width, vector=len(shape) < 2)
                start += rows * width
        self.numel = start
        self.segments = tuple((s, r, abs(w)) for s, r, w in pieces)
        first_ids, count = [], 0
        for _, rows, _ in self.segments:
            first_ids.append(count)
            count += rows
        self.first_ids = first_ids
        self.count = count

    def matches(self, shapes: Sequence[torch.Size], numel: int) -> bool:
        """Whether this geometry was built for these parameter shapes and bucket size."""
        return self.numel == numel and self.shapes == tuple(tuple(shape) for shape in shapes)

    def chunks(self, flat: torch.Tensor) -> list[GradientChunks]:
        """Each segment of ``flat`` (the bucket buffer) as full chunks of its width."""
        return [GradientChunks(flat[s : s + r * w], w) for s, r, w in self.segments]

    def nonzero_mask(self, chunks: list[GradientChunks]) -> torch.Tensor:
        """int8 [count]: 1 for each chunk of ``chunks`` (from :meth:`chunks`) holding a bit
        pattern other than +0.0, in id order."""
        return torch.cat([segment.nonzero_mask() for segment in chunks])

    def split(self, chunk_ids: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
        """Sorted global ``chunk_ids`` per segment: ``(segment, position, offset, local ids)``.

        ``position`` is where the segment's ids start in ``chunk_ids``; ``offset`` is where its
        chunks start in a buffer holding the selected chunks back to back in id order (see
        :meth:`packed_numel`). Segments with no selected chunk are left out.
        """
        ends = torch.tensor(
            [*self.first_ids[1:], self.count], dtype=chunk_ids.dtype, device=chunk_ids.device
        )
        bounds = torch.searchsorted(chunk_ids, ends).tolist()
        parts, low, offset = [], 0, 0
        for segment, high in enumerate(bounds):
            if high > low:
                local = chunk_ids[low:high] - self.first_ids[segment]
                parts.append((segment, low, offset, local))
                offset += (high - low) * self.segments[segment][2]
            low = high
        return parts

    def packed_numel(self, parts: list[tuple[int, int, int, torch.Tensor]]) -> int:
        """Elements of the chunks in ``parts`` (from :meth:`split`), packed back to back."""
        return sum(local.numel() * self.segments[segment][2] for segment, _, _, local in parts)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _parameter_pieces(
    shape: tuple[int, ...], numel: int, element_size: int
) -> list[tuple[int, int]]:
    """``(rows, width)`` runs of one parameter: its rows, grouped to :data:`MIN_CHUNK_BYTES`."""
    if len(shape) < 2:
        return [(1, numel)]
    width = numel // shape[0]
    group = max(1, -(-MIN_CHUNK_BYTES // (width * element_size)))
    full, leftover = divmod(shape[0], group)
    pieces = [(full, group * width)] if full else []
    if leftover:
        pieces.append((1, leftover * width))
    return pieces


def _append_piece(pieces: list[list[int]], start: int, rows: int, width: int, vector: bool) -> None:
    """Add a run to ``pieces``: 1-D runs join a preceding 1-D chunk, equal widths merge.

    A 1-D run is stored with a negative width while it may still grow, so that a following
    matrix whose rows happen to be as wide does not merge into it.
    """
    if pieces:
        last = pieces[-1]
        if vector and last[2] < 0 and last[1] == 1:
            last[2] -= width
            return
        if not vector and last[2] == width:
            last[1] += rows
            return
    pieces.append([start, rows, -width if vector else width])
