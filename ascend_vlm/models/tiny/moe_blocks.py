"""The sparse MoE blocks of the MoE families built alone from tiny text configs (hidden 16, 8
experts of width 8, top-2), with random weights: what the MoE op's and the MoE adapter's tests
compare against transformers."""

from __future__ import annotations

import importlib

import torch

MOE_HIDDEN, MOE_INTERMEDIATE, MOE_EXPERTS, MOE_TOP_K = 16, 8, 8, 2
_COMMON = {"hidden_size": MOE_HIDDEN, "hidden_act": "silu", "num_experts_per_tok": MOE_TOP_K}
# model_type -> (block class, text config class, the config's MoE fields)
_BLOCKS = {
    "qwen3_vl_moe": (
        "Qwen3VLMoeTextSparseMoeBlock",
        "Qwen3VLMoeTextConfig",
        {"moe_intermediate_size": MOE_INTERMEDIATE, "num_experts": MOE_EXPERTS},
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeSparseMoeBlock",
        "Qwen3_5MoeTextConfig",
        {
            "moe_intermediate_size": MOE_INTERMEDIATE,
            "shared_expert_intermediate_size": MOE_INTERMEDIATE,
            "num_experts": MOE_EXPERTS,
        },
    ),
    "glm4v_moe": (
        "Glm4vMoeTextMoE",
        "Glm4vMoeTextConfig",
        {
            "moe_intermediate_size": MOE_INTERMEDIATE,
            "n_routed_experts": MOE_EXPERTS,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
    ),
    "llama4": (
        "Llama4TextMoe",
        "Llama4TextConfig",
        {"intermediate_size": MOE_INTERMEDIATE, "num_local_experts": MOE_EXPERTS},
    ),
}
MOE_BLOCK_FAMILIES = tuple(_BLOCKS)


def build_moe_block(model_type: str, implementation: str = "eager") -> torch.nn.Module:
    """The MoE block of ``model_type`` (one of :data:`MOE_BLOCK_FAMILIES`) under transformers'
    experts ``implementation``, every parameter and buffer drawn from N(0, 0.3) (seed 0):
    transformers leaves routers, GLM's correction bias and the experts at zeros or empty."""
    import transformers

    if model_type not in _BLOCKS:
        raise ValueError(f"model_type: expected one of {MOE_BLOCK_FAMILIES}, got {model_type!r}")
    block_class, config_class, fields = _BLOCKS[model_type]
    config = getattr(transformers, config_class)(**_COMMON, **fields)
    config._experts_implementation = implementation
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    block = getattr(modeling, block_class)(config)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.normal_(0.0, 0.3)
    return block
