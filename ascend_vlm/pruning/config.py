"""What to prune: :class:`PruneConfig` (visual tokens at prefill) and :class:`SnapKVConfig`
(the prompt's KV cache after prefill), each validated once, on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# method -> whether its scores need the attention of the layer before the cut
TOKEN_METHODS = {"fastv": True, "divprune": False, "random": False, "uniform": False}
POOLINGS = ("avg", "max")


def _check_fraction(name: str, value: object, *, closed_low: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (0.0 <= value < 1.0) if closed_low else (0.0 < value <= 1.0)
    if not ok:
        accepted = "0 <= x < 1" if closed_low else "0 < x <= 1"
        raise ValueError(f"{name}: expected a number with {accepted}, got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def kept_count(keep: float, visual_tokens: int) -> int:
    """Visual tokens a row keeps: ``ceil(keep * n)`` (a pure function of the row's count, so a
    row keeps as many alone as inside any batch)."""
    return math.ceil(keep * visual_tokens - 1e-9)


@dataclass(frozen=True)
class PruneConfig:
    """Drop visual tokens between decoder layers ``layer - 1`` and ``layer`` of the language model.

    method: ``"fastv"`` ranks each visual token by the attention it receives from the prompt's
    last query at layer ``layer - 1`` (mean over heads; FastV); ``"divprune"`` keeps a max-min
    diverse subset of the visual hidden states entering ``layer`` (cosine distance, greedy;
    DivPrune); ``"random"`` (seeded by ``seed``) and ``"uniform"`` (evenly spaced in prompt order)
    are the baselines.
    layer: the first decoder layer that no longer sees the dropped tokens, ``1 <= layer <
    num_hidden_layers`` (layer 0 always sees every token: transformers reads positions and mask
    sizes from layer 0's cache, which therefore keeps the prompt's full length).
    keep: fraction of each row's visual tokens kept, ``0 < keep <= 1``; a row with ``n`` visual
    tokens keeps ``ceil(keep * n)``; the prompt's last position is always kept (generation reads
    its logits).
    seed: the random stream of ``"random"`` (ignored by the other methods).
    """

    method: str = "fastv"
    layer: int = 2
    keep: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in TOKEN_METHODS:
            raise ValueError(
                f"method: expected one of {', '.join(TOKEN_METHODS)}, got {self.method!r}"
            )
        _check_int("layer", self.layer, 1)
        _check_fraction("keep", self.keep, closed_low=False)
        _check_int("seed", self.seed, 0)

    @property
    def needs_attention(self) -> bool:
        """Whether the method scores from the attention of layer ``layer - 1``."""
        return TOKEN_METHODS[self.method]


@dataclass(frozen=True)
class SnapKVConfig:
    """Compress each decoder layer's prompt KV cache once prefill is done (SnapKV).

    The last ``window`` prompt queries vote: a prompt position's score is the attention those
    queries give it (summed over the window), pooled over neighbouring positions
    (``pooling`` over ``kernel_size``, stride 1), and averaged over the query heads reading one
    KV head (``per_head=True``: each KV head keeps its own positions) or over all heads
    (``per_head=False``: one set for the whole layer). The window itself is always kept; of the
    ``S`` prompt positions of a row, ``S - floor(compression_ratio * S)`` stay (at least the
    window; a batch keeps the longest row's count, marking the surplus dead). Layer 0 is left whole (transformers reads the prompt length from it). Needs a dynamic cache.
    """

    compression_ratio: float = 0.5
    window: int = 32
    kernel_size: int = 7
    pooling: str = "avg"
    per_head: bool = True

    def __post_init__(self) -> None:
        _check_fraction("compression_ratio", self.compression_ratio, closed_low=True)
        _check_int("window", self.window, 1)
        _check_int("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size: expected an odd int, got {self.kernel_size}")
        if self.pooling not in POOLINGS:
            raise ValueError(
                f"pooling: expected one of {', '.join(POOLINGS)}, got {self.pooling!r}"
            )
        if not isinstance(self.per_head, bool):
            raise ValueError(f"per_head: expected True or False, got {self.per_head!r}")

    def kept_slots(self, prompt_length: int | torch.Tensor) -> int | torch.Tensor:
        """Prompt slots a layer of ``S`` keeps: ``S - floor(ratio * S)``, at least the window (at
        most ``S``); elementwise for a tensor of lengths."""
        if isinstance(prompt_length, torch.Tensor):
            dropped = (self.compression_ratio * prompt_length.double()).floor().long()
            return torch.minimum((prompt_length - dropped).clamp(min=self.window), prompt_length)
        kept = prompt_length - math.floor(self.compression_ratio * prompt_length)
        return min(prompt_length, max(kept, self.window))
