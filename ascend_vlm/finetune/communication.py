"""What DDP communicates per step: the sparse all-reduce hook when asked for, and the byte
counts ``metrics.jsonl`` records (:class:`CommCounter`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.placement import ProcessPlacement


def install_comm_hook(config: TrainConfig, ddp_model: Any, placement: ProcessPlacement) -> Any:
    """Register the sparse-mask AllReduce hook when asked for; return its state (or None)."""
    if config.comm_hook == "none" or placement.world_size == 1:
        return None
    from ascend_vlm.distributed import SparseAllReduceState, sparse_allreduce_hook

    state = SparseAllReduceState()  # exact mode: same averaged gradient as plain DDP
    ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    return state


class CommCounter:
    """Per-step all-reduce payload of this rank, for ``metrics.jsonl``.

    ``comm_bytes_sent``: bytes this rank handed to all-reduce in the step, the sparse hook's
    chunk masks included (so a step whose gradients are all dense sends a little more than
    plain DDP). ``comm_bytes_dense``: bytes plain DDP hands over, every trainable gradient
    once. Both are 0 in a single process, where nothing is communicated.
    """

    def __init__(self, hook_state: Any, trainable: Sequence[torch.Tensor], world_size: int):
        self.hook_state = hook_state
        gradient_bytes = tensor_bytes(trainable)
        self.dense_per_step = gradient_bytes if world_size > 1 else 0
        self.counted = (0, 0)

    def step(self) -> dict[str, int]:
        """The fields of the step that just ran (call once per optimizer step)."""
        if self.hook_state is None:
            return {"comm_bytes_sent": self.dense_per_step, "comm_bytes_dense": self.dense_per_step}
        stats = self.hook_state.stats
        sent, dense = stats.bytes_sent - self.counted[0], stats.bytes_dense - self.counted[1]
        self.counted = (stats.bytes_sent, stats.bytes_dense)
        return {"comm_bytes_sent": int(sent), "comm_bytes_dense": int(dense)}


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors``: what DDP hands to all-reduce for their gradients each step."""
    return sum(t.numel() * t.element_size() for t in tensors)


def whole_table_bytes(model: Any, world_size: int) -> int:
    """Bytes DDP would hand over per step if the input embedding (and an untied output head)
    trained whole instead of only the new rows; 0 in a single process."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is None or head.weight is embedding
    return tensor_bytes([embedding] + ([] if tied else [head.weight])) if world_size > 1 else 0
