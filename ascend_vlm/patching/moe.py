"""The sparse MoE adapter: a block's routed experts through ``ops.moe_experts``, its router and
shared expert left as they are.

Two routings (``family_spec.MOE_ROUTINGS``):

* ``"experts-call"`` (Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V): the block calls its experts module
  with the router's ``(hidden, top_k_index, top_k_weights)``; the experts module's ``forward`` is
  rebound to `moe_experts_forward`, which replaces whichever experts implementation transformers
  dispatched to (eager, grouped_mm, batched_mm). The block's forward stays stock, so its router,
  shared expert and the router-logits recorder run as before.
* ``"dense-scores"`` (Llama 4): the block runs every expert on every token, weighted by dense
  router scores; the block's ``forward`` is rebound to `dense_scores_moe_forward`, which calls the
  block's own router and shared expert and hands only the top-k choices to the op.

Weights are the modules' own Parameters, read at call time: a PEFT ``target_parameters`` LoRA,
which parametrizes the experts' weights while its wrapper calls the experts module, reaches the
op (experts-call). A dense-scores block whose experts module was replaced (e.g. by a PEFT
wrapper) after patching runs its stock forward, which calls that replacement.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat.experts import experts_call_problem, experts_problem
from ascend_vlm.models.family_spec import SparseMoe
from ascend_vlm.patching.state import PartOptions, PatchState, disabled_by

# The dense-scores block's router and shared expert (Llama4TextMoe's attributes).
_ROUTER, _SHARED_EXPERT, _TOP_K = "router", "shared_expert", "top_k"


def moe_experts_forward(
    experts: nn.Module,
    transposed: bool,
    routing_weights_on: str,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's forward (``(hidden_states (T, H), top_k_index (T, K), top_k_weights
    (T, K)) -> (T, H)``) through ``ops.moe_experts``."""
    return ops.moe_experts(
        hidden_states,
        top_k_weights,
        top_k_index,
        experts.gate_up_proj,
        experts.down_proj,
        transposed=transposed,
        routing_weights_on=routing_weights_on,
    )


def dense_scores_moe_forward(
    block: nn.Module,
    experts_name: str,
    experts: nn.Module,
    transposed: bool,
    routing_weights_on: str,
    hidden_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's block forward: ``(shared_expert(x) + routed(x), router_logits)`` for x the
    (T, H) tokens, the routed part only over each token's top-k experts (the others' scores are
    0, and a gated-SiLU expert maps a zero input to zero). The top-k indices are the router's
    own ``topk`` of its logits, their weights its scores there. Runs the block's class forward
    when the module at ``block.<experts_name>`` is no longer ``experts``."""
    if getattr(block, experts_name, None) is not experts:
        return type(block).forward(block, hidden_states)
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    scores, logits = getattr(block, _ROUTER)(tokens)
    indices = torch.topk(logits, getattr(block, _TOP_K), dim=1).indices
    routed = ops.moe_experts(
        tokens,
        scores.gather(1, indices),
        indices,
        experts.gate_up_proj,
        experts.down_proj,
        transposed=transposed,
        routing_weights_on=routing_weights_on,
    )
    return getattr(block, _SHARED_EXPERT)(tokens) + routed, logits


def _problem(block: nn.Module, experts: object, moe: SparseMoe) -> str | None:
    """Why `block` (with its experts module `experts`) cannot go to the op, or None."""
    if not isinstance(experts, nn.Module):
        return f"no experts module at .{moe.experts}"
    if hasattr(experts, "get_base_layer"):
        return f".{moe.experts} is wrapped by {type(experts).__name__}; patch before wrapping"
    problem = experts_problem(experts, moe.transposed)
    if problem is None and moe.routing == "experts-call":
        problem = experts_call_problem(type(experts))
    if problem is None and moe.routing == "dense-scores":
        absent = [a for a in (_ROUTER, _SHARED_EXPERT, _TOP_K) if not hasattr(block, a)]
        problem = f"no {', '.join(absent)} for dense-scores routing" if absent else None
    return problem


def patch_moe(state: PatchState, block: nn.Module, moe: SparseMoe, part: PartOptions) -> None:
    """Route `block`'s experts to ``ops.moe_experts`` (or record why not), reported under kind
    "moe" with the block's class; `patch(mlp=False)` leaves MoE blocks alone too."""
    name = type(block).__name__
    experts = getattr(block, moe.experts, None)
    problem = _problem(block, experts, moe) if part.enabled("mlp") else disabled_by("mlp")
    if problem is not None:
        state.report.record_left_alone("moe", name, problem)
        return
    options = (moe.transposed, moe.routing_weights_on)
    if moe.routing == "experts-call":
        state.rebind(experts, "forward", functools.partial(moe_experts_forward, experts, *options))
    else:
        forward = functools.partial(dense_scores_moe_forward, block, moe.experts, experts, *options)
        state.rebind(block, "forward", forward)
    state.tag(experts, "moe_experts")
    layout = ", transposed" if moe.transposed else ""
    state.report.record_swapped(
        "moe", name, f"ops.moe_experts (weights on {moe.routing_weights_on}{layout})"
    )
