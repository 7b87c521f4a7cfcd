"""Continuous batching of VLM generation under token, visual and memory budgets.

``BatchGenerator(model, processor, max_batch_tokens=..., max_visual_tokens_per_step=...,
max_kv_bytes=..., max_batch_size=...)`` takes :class:`GenerationRequest`s (``submit``), runs
them continuously batched (``run`` yields tokens and results as they come) or all at once
(``generate_many``, results in input order). Running sequences keep their KV in blocks
(``kv_block_size``) that joins and leaves never move, and a prefix cache (``prefix_cache``)
lets a later request reuse the blocks of an earlier prompt it starts with. The command-line
flags of the budgets and the KV cache, shared by the commands that run a generator, are in
:mod:`~ascend_vlm.batching.command_line`.
"""

from __future__ import annotations

from ascend_vlm.batching.budgets import BatchBudgets, BudgetError, StepUsage
from ascend_vlm.batching.generator import BatchGenerator
from ascend_vlm.batching.request import (
    GenerationRequest,
    RequestHandle,
    RequestResult,
    TokenEvent,
)
from ascend_vlm.batching.stats import RunStats

__all__ = [
    "BatchBudgets",
    "BatchGenerator",
    "BudgetError",
    "GenerationRequest",
    "RequestHandle",
    "RequestResult",
    "RunStats",
    "StepUsage",
    "TokenEvent",
]
