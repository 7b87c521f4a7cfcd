"""`RowCache`: one ``DynamicCache`` holding every running sequence, one batch row each,
right-aligned: row ``r`` holds its ``lengths[r]`` tokens in the last columns and zeros before
them, which the attention mask hides. A decode step appends one column for all rows; rows
join (their own prefill cache, padded on the left to the common length, or the others padded
to theirs) and leave (dropped, then columns no row uses any more are trimmed on the left).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ascend_vlm._compat.cache import cache_layer_kind, replace_cached_states


def _layers(cache: Any) -> int:
    return len(cache.layers)


class RowCache:
    """The shared cache of the running sequences (see the module docstring)."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.lengths: list[int] = []

    @property
    def width(self) -> int:
        """Columns of the cache (the longest row's length)."""
        return max(self.lengths, default=0)

    def attention_mask(self, extra: int = 0) -> torch.Tensor:
        """``(rows, width + extra)``: 1 on each row's tokens (and the ``extra`` new ones)."""
        width = self.width + extra
        columns = torch.arange(width)
        starts = torch.tensor([self.width - length for length in self.lengths])
        return (columns[None, :] >= starts[:, None]).long()

    def add(self, cache: Any, lengths: list[int]) -> None:
        """Append the rows of a prefill ``cache`` (right-aligned, row ``i`` holding
        ``lengths[i]`` tokens) as the last rows."""
        for layer in range(_layers(cache)):
            if cache_layer_kind(cache, layer) != "dynamic":
                raise ValueError(
                    f"cache: expected dynamic cache layers, got {cache_layer_kind(cache, layer)} "
                    f"at layer {layer} (sliding-window or static caches cannot share rows)"
                )
        if self.cache is None:
            self.cache, self.lengths = cache, list(lengths)
            return
        added = max(lengths)
        width = max(self.width, added)
        for layer in range(_layers(self.cache)):
            old, new = self.cache.layers[layer], cache.layers[layer]
            keys = torch.cat(
                [_left_pad(old.keys, width - self.width), _left_pad(new.keys, width - added)]
            )
            values = torch.cat(
                [_left_pad(old.values, width - self.width), _left_pad(new.values, width - added)]
            )
            replace_cached_states(self.cache, layer, keys, values)
        self.lengths.extend(lengths)

    def grow(self) -> None:
        """Every row gained the token a decode step just wrote."""
        self.lengths = [length + 1 for length in self.lengths]

    def remove(self, rows: list[int]) -> None:
        """Drop ``rows`` (indices), then the left columns no remaining row uses."""
        if not rows:
            return
        leaving = set(rows)
        keep = [row for row in range(len(self.lengths)) if row not in leaving]
        if not keep:
            self.cache, self.lengths = None, []
            return
        old_width = self.width
        self.lengths = [self.lengths[row] for row in keep]
        trim = old_width - self.width
        index = torch.tensor(keep)
        for layer in range(_layers(self.cache)):
            cached = self.cache.layers[layer]
            keys = cached.keys.index_select(0, index.to(cached.keys.device))[:, :, trim:]
            values = cached.values.index_select(0, index.to(cached.values.device))[:, :, trim:]
            replace_cached_states(self.cache, layer, keys, values)


def _left_pad(states: torch.Tensor, columns: int) -> torch.Tensor:
    """``states`` ``[B, N, L, D]`` with ``columns`` zero positions prepended."""
    return F.pad(states, (0, 0, columns, 0)) if columns else states
