"""What one scheduling step may spend, and what each step spent.

A step admits waiting requests (each prefilled alone, its images encoded then) and runs one
decode step for every sequence already running. Budgets per step:

* ``max_batch_tokens``: tokens through the language model, prefill tokens of the admitted
  requests plus one per running sequence;
* ``max_visual_tokens_per_step``: image tokens encoded (the vision tower's work);
* ``max_kv_bytes``: the KV cache the running sequences may grow to. Each sequence holds its
  own KV blocks (``kv_block_size`` tokens each), so the projection is the sum over running
  sequences of their length at its longest (prompt + ``max_new_tokens``) rounded up to whole
  blocks (blocks a sequence shares through the prefix cache count for each holder);
* ``max_batch_size``: running sequences.

A request that alone exceeds a budget can never run: it is refused when submitted, naming the
budget and its size. Every other request runs once the batch ahead of it drains, so full
budgets delay, never deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


class BudgetError(ValueError):
    """A request that no batch could ever admit (it alone exceeds a budget)."""


@dataclass(frozen=True)
class BatchBudgets:
    """Per-step limits (see the module docstring); None leaves one unbounded."""

    max_batch_tokens: int | None = 4096
    max_visual_tokens_per_step: int | None = 4096
    max_kv_bytes: int | None = None
    max_batch_size: int | None = 16

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_visual_tokens_per_step", "max_kv_bytes",
                     "max_batch_size"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name}: expected None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class RequestSize:
    """What admitting a request costs: its ``prompt_tokens`` (prefilled at once), its
    ``visual_tokens`` (image tokens encoded) and ``longest`` (prompt + max_new_tokens)."""

    prompt_tokens: int
    visual_tokens: int
    longest: int


@dataclass(frozen=True)
class StepUsage:
    """What one step spent: ``prefill_tokens`` + ``decode_tokens`` (the batch tokens),
    ``visual_tokens``, ``kv_bytes`` projected for the running sequences, ``batch_size``."""

    prefill_tokens: int
    decode_tokens: int
    visual_tokens: int
    kv_bytes: int
    batch_size: int

    @property
    def batch_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


def budget_utilisation(budgets: BatchBudgets, steps: list[StepUsage]) -> dict[str, float]:
    """The mean share of each bounded budget ``steps`` used (name -> fraction)."""
    used = {
        "max_batch_tokens": lambda usage: usage.batch_tokens,
        "max_visual_tokens_per_step": lambda usage: usage.visual_tokens,
        "max_kv_bytes": lambda usage: usage.kv_bytes,
        "max_batch_size": lambda usage: usage.batch_size,
    }
    shares = {}
    for name, amount in used.items():
        limit = getattr(budgets, name)
        if limit is not None and steps:
            shares[name] = sum(amount(usage) / limit for usage in steps) / len(steps)
    return shares


def projected_kv_bytes(longest: list[int], bytes_per_token: int, block_size: int) -> int:
    """KV bytes of sequences growing to ``longest`` tokens each, in blocks of ``block_size``
    tokens."""
    blocks = sum(-(-length // block_size) for length in longest)
    return blocks * block_size * bytes_per_token


def refusal(
    budgets: BatchBudgets, size: RequestSize, bytes_per_token: int, block_size: int
) -> str | None:
    """Why a request of ``size`` can never be admitted (None when it can)."""
    alone_kv = projected_kv_bytes([size.longest], bytes_per_token, block_size)
    checks = (
        ("max_batch_tokens", size.prompt_tokens, "prompt tokens"),
        ("max_visual_tokens_per_step", size.visual_tokens, "image tokens"),
        ("max_kv_bytes", alone_kv, "KV bytes at its longest (prompt + max_new_tokens)"),
    )
    for name, need, what in checks:
        limit = getattr(budgets, name)
        if limit is not None and need > limit:
            return f"{name}: the request needs {need} {what}, more than the budget of {limit}"
    return None


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes of keys and values one token adds to the cache, over every decoder layer."""
    config = model.config
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    element = model.get_input_embeddings().weight.element_size()  # the language model's dtype
    return 2 * text.num_hidden_layers * kv_heads * head_dim * element


def cached_kv_bytes(cache: Any) -> int:
    """Bytes of the keys and values ``cache`` (a transformers ``Cache``) holds, over every layer."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)
