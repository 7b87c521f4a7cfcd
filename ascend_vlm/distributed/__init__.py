"""Distributed training helpers: DDP communication hooks and their state objects.

:func:`sparse_allreduce_hook` with :class:`SparseAllReduceState` all-reduces only the gradient
chunks that are non-zero on some rank (exactly, or DGC-style top-k with error feedback).
"""

from ascend_vlm.distributed.allreduce_stats import SparseAllReduceStats
from ascend_vlm.distributed.sparse_allreduce import (
    SparseAllReduceState,
    register_sparse_allreduce,
    sparse_allreduce_hook,
)

__all__ = [
    "SparseAllReduceState",
    "SparseAllReduceStats",
    "register_sparse_allreduce",
    "sparse_allreduce_hook",
]
