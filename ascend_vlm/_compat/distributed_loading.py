"""transformers' FSDP2 at load time, as `ascend_vlm.integrations.fsdp.fsdp_distributed_config`
uses it: ``from_pretrained(distributed_config=DistributedConfig(fsdp_size=..., fsdp_plan=...))``
shards the model with ``fully_shard`` per rule ("path.*" -> "free_full_weight"), the model then
says ``is_distributed_loading_by_transformers``, and Trainer, reading that, skips accelerate's
DDP wrap and keeps the parameters left replicated (LoRA added after loading) in step across ranks.

transformers 5.25 has each detail and 5.17 none, so `load_time_fsdp_problem` is no probe of the
version gate (which needs every supported version to pass): the function using it raises with
its reason. It can go once the lowest supported version has them all.
"""

from __future__ import annotations

import dataclasses


def load_time_fsdp_problem() -> str | None:
    """Why the installed transformers cannot shard a model with FSDP2 at load time for Trainer,
    or None when it can."""
    import transformers
    from transformers import PreTrainedModel, Trainer

    try:
        from transformers.distributed import DistributedConfig
    except ImportError as error:
        return f"transformers {transformers.__version__} has no transformers.distributed: {error}"
    fields = {field.name for field in dataclasses.fields(DistributedConfig)}
    absent = sorted({"fsdp_size", "fsdp_plan"} - fields)
    if absent:
        return (
            f"transformers {transformers.__version__}: DistributedConfig has no {', '.join(absent)}"
        )
    if not hasattr(PreTrainedModel, "is_distributed_loading_by_transformers"):
        return (
            f"transformers {transformers.__version__}: models do not say "
            f"is_distributed_loading_by_transformers, so Trainer wraps them in DDP"
        )
    if not hasattr(Trainer, "_sync_replicated_trainable_parameters"):
        return (
            f"transformers {transformers.__version__}: Trainer does not keep the replicated "
            f"trainable parameters (LoRA) of a model sharded at load time in step"
        )
    return None
