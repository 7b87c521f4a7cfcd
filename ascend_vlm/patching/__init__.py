"""`patch(model)` / `unpatch(model)`: route one Hugging Face VLM *instance* to `ascend_vlm.ops`;
and the edit ledger every feature changes a model through.

How (the *what* lives in `ascend_vlm.models`), one module per concern:

* `ledger`: every change any feature makes to a model instance (an attribute, a submodule, a
  hook, a clean-up) is recorded per model and undone on removal; features stack in one
  canonical order (`FEATURE_ORDER`) whatever order they were applied in, so any combination
  can be applied and removed in any order. `applied_features(model)` lists what is on.
* `attention_tap`: the queries and keys of any attention call (`AttentionTap`, a feature).
* `core`: `patch` resolves the family spec, splits the model into its text and vision parts and
  applies the spec to each; `unpatch` reverts; `is_patched`.
* `attention`: our attention function, registered in transformers' `AttentionInterface` and
  `AttentionMaskInterface` under ``ATTENTION_NAME`` (it contains "flash", so Qwen2-VL-style
  vision towers take their single varlen call instead of a per-image loop with a host sync). A
  call asked for attention weights (``output_attentions``) runs eager's math for that call only.
* `routing`: the modules inside the model read private copies of their configs naming it; the
  configs the caller holds, and every other model sharing them, are untouched.
* `adapters`: norms and MLPs get ``forward`` rebound on the module instance
  (``module.__dict__["forward"]``) to a call of the public op (``ops.rms_norm_promoting``,
  ``ops.swiglu_projections``); weights are the module's own Parameters, read at call time (no
  copies), and ``extra_repr`` says which fused op runs. RoPE attention modules get their own
  class ``forward`` code rebound with the module-level rotary function (e.g.
  ``apply_rotary_pos_emb``) resolved to an adapter around ``ops.rotary_embedding_pair`` (q and
  k in one call); the transformers module and class stay untouched. Decorators on that forward
  (``deprecate_kwarg``, kernels' ``use_kernelized_func``) are rebuilt around the rebound code
  (`ascend_vlm._compat.decorators.rewrap`), so they keep working (`rebound_globals`). ``part``
  holds what every adapter shares. ``adapters.ADAPTERS`` maps each ``PartSpec`` field to its
  adapter.
* `linear_attention`: Gated DeltaNet modules (Qwen3.5) get their forward rebuilt the same way,
  with transformers' gated delta rule and short-convolution functions resolved to
  ``ops.chunk_gated_delta_rule`` (prefill), ``ops.recurrent_gated_delta_rule`` (cached decode)
  and ``ops.causal_conv1d``; transformers' cache keeps the states.
* `moe`: sparse MoE blocks' routed experts go to ``ops.moe_experts`` (the experts module's
  forward, or Llama 4's block forward, rebound); routers and shared experts stay stock.
* `generic`: what ``patch(model, strict=False)`` gives a model no family describes: attention
  that goes through transformers' ``AttentionInterface`` is routed (text and vision towers),
  and norms, gated MLPs and rotary functions found by structure are swapped where a numerical
  probe (`probes`: the stock module and our op on seeded random inputs of the module's widths
  and dtype, within the dtype's tolerance) agrees; ``PatchReport.probe_verified`` lists them.
* `state`: what the adapters work with: the options, the report, and the ledger's edits, so
  ``unpatch`` restores exactly what was there. Modules wrapped by accelerate hooks
  (``device_map`` / offload) keep their hook: the forward it wraps (``_old_forward``) is
  rebound instead of ``forward``.
* `report`: `PatchReport`, what was swapped and what was left alone, and why.

A patched model pickles (``torch.save(model)``, ``copy.deepcopy``) whenever the stock one does:
everything rebound refers to importable functions, and unpickling registers our attention
function with transformers, so the loaded model runs patched and still unpatches exactly.
"""

from __future__ import annotations

from ascend_vlm._compat.attention import ATTENTION_NAME
from ascend_vlm.patching.attention import ascend_attention_forward
from ascend_vlm.patching.core import is_patched, patch, unpatch
from ascend_vlm.patching.ledger import (
    FEATURE_ORDER,
    applied_features,
    apply_feature,
    remove_feature,
)
from ascend_vlm.patching.report import PatchReport

__all__ = [
    "ATTENTION_NAME",
    "FEATURE_ORDER",
    "PatchReport",
    "applied_features",
    "apply_feature",
    "ascend_attention_forward",
    "is_patched",
    "patch",
    "remove_feature",
    "unpatch",
]
