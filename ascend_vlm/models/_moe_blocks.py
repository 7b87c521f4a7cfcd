"""The sparse MoE blocks of the MoE families, one :class:`SparseMoe` entry each, for their text
part's ``moes``: the block class, its experts' weight layout and how its router's choices reach
the experts (``ops.moe_experts``'s docstring holds each family's routing)."""

from __future__ import annotations

from ascend_vlm.models.family_spec import SparseMoe

# Softmax top-k router renormalised to sum 1; stacked (E, 2I, H) / (E, H, I) experts.
QWEN3_VL_MOE_BLOCKS = SparseMoe(("Qwen3VLMoeTextSparseMoeBlock",))
# The same router and experts, plus a sigmoid-gated shared expert the block adds itself.
QWEN3_5_MOE_BLOCKS = SparseMoe(("Qwen3_5MoeSparseMoeBlock",))
# Grouped sigmoid router with a correction bias and a scaling factor (fp32 weights), plus shared
# experts the block adds itself.
GLM4V_MOE_BLOCKS = SparseMoe(("Glm4vMoeTextMoE",))
# Softmax router (greedy or group-limited top-k) scaled by routed_scaling_factor, without
# renormalising; stacked experts, plus shared experts the block adds itself.
DEEPSEEK_OCR2_MOE_BLOCKS = SparseMoe(("DeepseekOcr2TextMoe",))
# Top-k logits' sigmoid scales each expert's input; (E, H, 2I) / (E, I, H) experts run densely by
# the stock block, so its forward is what changes.
LLAMA4_MOE_BLOCKS = SparseMoe(
    ("Llama4TextMoe",), transposed=True, routing_weights_on="input", routing="dense-scores"
)
