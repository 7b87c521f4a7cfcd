"""The command-line flags of a :class:`~ascend_vlm.batching.BatchGenerator`'s budgets
(:class:`~ascend_vlm.batching.BatchBudgets`) and KV cache, shared by every command that runs
one (``generate-batch``, ``serve``): adding them to a parser, reading them back as the
generator's keywords, and naming the flag in a :class:`~ascend_vlm.batching.BudgetError`'s
message.
"""

from __future__ import annotations

import argparse
from typing import Any

from ascend_vlm._byte_units import MIB

# The flag that sets each budget (errors name the flag the user typed).
BUDGET_FLAGS = {
    "max_batch_tokens": "--max-batch-tokens",
    "max_visual_tokens_per_step": "--max-visual-tokens",
    "max_kv_bytes": "--max-kv-mib",
    "max_batch_size": "--max-batch-size",
}


def add_budget_arguments(parser: Any) -> None:
    """Add the batch's budget flags (:data:`BUDGET_FLAGS`) to ``parser`` (or a group)."""
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=4096,
        help="tokens through the language model per step (prompts being prefilled + 1 per "
        "decoding sequence)",
    )
    parser.add_argument(
        "--max-visual-tokens", type=int, default=4096, help="visual tokens encoded per step"
    )
    parser.add_argument("--max-kv-mib", type=int, help="KV cache of the batch (default: none)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="sequences running at once")


def add_kv_cache_arguments(parser: Any) -> None:
    """Add the flags of the batch's KV blocks and prefix cache to ``parser`` (or a group)."""
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        help="tokens per KV block (a multiple of 16 up to 512 lets the NPU's page attention "
        "read the blocks in place)",
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a prompt prefix an earlier request computed (same tokens, "
        "same images, same adapter)",
    )


def kv_cache_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The :class:`~ascend_vlm.batching.BatchGenerator` keywords of the KV-cache flags in
    ``args``; ``parser.error`` names a block size below 1."""
    if args.kv_block_size < 1:
        parser.error(f"--kv-block-size: expected an int >= 1, got {args.kv_block_size}")
    return {"kv_block_size": args.kv_block_size, "prefix_cache": args.prefix_cache}


def budget_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The :class:`~ascend_vlm.batching.BatchBudgets` keywords of the budget flags in
    ``args``; ``parser.error`` names a flag below 1."""
    for flag in ("max_batch_tokens", "max_visual_tokens", "max_kv_mib", "max_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1, got {value}")
    return {
        "max_batch_tokens": args.max_batch_tokens,
        "max_visual_tokens_per_step": args.max_visual_tokens,
        "max_kv_bytes": None if args.max_kv_mib is None else args.max_kv_mib * MIB,
        "max_batch_size": args.max_batch_size,
    }


def budget_message(error: Exception) -> str:
    """A :class:`~ascend_vlm.batching.BudgetError`'s message naming the budget's flag instead
    of its field."""
    budget, _, why = str(error).partition(": ")
    return f"{BUDGET_FLAGS.get(budget, budget)}: {why}"
