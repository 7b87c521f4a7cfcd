"""What the MoE adapter reads of transformers' experts modules: their weights and activation, the
layout flags ``@use_experts_implementation`` stores on them, and the call the sparse blocks make.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
experts-implementation     a class decorated by ``use_experts_implementation`` stores the layout
                           flags `experts_problem` reads (``has_gate``, ``has_bias``,
                           ``is_concatenated``, ``is_transposed``) and its dispatching forward hands
                           ``(hidden_states, top_k_index, top_k_weights)`` to the class's own
                           forward under ``"eager"``, so an experts module called that way is fed
                           the router's choices as `experts_call_problem` expects.
========================== ==========================================================================

Needed on every supported version: the decorator and its call are the same on 5.17 and 5.25
(5.25 adds ``has_post_expert_norm`` and ``_is_expert_parallel``, read here when present).
"""

from __future__ import annotations

import inspect

from ascend_vlm._compat.module_internals import SILU_ACTIVATIONS
from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

EXPERTS_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERTS_ACTIVATION = "act_fn"
# The parameters of an experts forward that `use_experts_implementation` dispatches.
EXPERTS_CALL_PARAMETERS = ("hidden_states", "top_k_index", "top_k_weights")
# Layout flags `use_experts_implementation` stores, with the value ops.moe_experts computes:
# stacked [gate; up] projections without biases. Flags absent before 5.25 read as False.
_REQUIRED_FLAGS = {"has_gate": True, "has_bias": False, "is_concatenated": True}
_ABSENT_FLAGS = ("has_post_expert_norm", "_is_expert_parallel")


def experts_problem(experts: object, transposed: bool) -> str | None:
    """Why ``ops.moe_experts(..., transposed=transposed)`` does not compute what the experts
    module ``experts`` computes, or None when it does: it must hold 3-D ``gate_up_proj`` and
    ``down_proj`` and a SiLU ``act_fn``, and the flags `use_experts_implementation` stores (when
    it stores them) must say stacked [gate; up], no bias, no post-expert norm, no expert
    parallelism and the layout ``transposed``."""
    name = type(experts).__name__
    weights = [getattr(experts, weight, None) for weight in EXPERTS_WEIGHTS]
    if not all(getattr(weight, "dim", lambda: 0)() == 3 for weight in weights):
        return f"{name} holds no 3-D {' and '.join(EXPERTS_WEIGHTS)}"
    activation = type(getattr(experts, EXPERTS_ACTIVATION, None)).__name__
    if activation not in SILU_ACTIVATIONS:
        return (
            f"{name}.{EXPERTS_ACTIVATION} is {activation}, ops.moe_experts computes silu(gate) * up"
        )
    for flag, value in _REQUIRED_FLAGS.items():
        if getattr(experts, flag, value) != value:
            return f"{name}.{flag} is {getattr(experts, flag)!r}, ops.moe_experts needs {value!r}"
    for flag in _ABSENT_FLAGS:
        if getattr(experts, flag, False):
            return f"{name}.{flag} is set, which ops.moe_experts does not compute"
    if getattr(experts, "is_transposed", transposed) != transposed:
        return (
            f"{name}.is_transposed is {experts.is_transposed!r}, the family spec says {transposed}"
        )
    return None


def experts_call_problem(experts_class: type) -> str | None:
    """Why the class's forward is not called as ``forward(hidden_states, top_k_index,
    top_k_weights)``, or None when it is."""
    parameters = tuple(inspect.signature(inspect.unwrap(experts_class.forward)).parameters)[1:]
    if parameters != EXPERTS_CALL_PARAMETERS:
        return (
            f"{experts_class.__name__}.forward{parameters} is not forward{EXPERTS_CALL_PARAMETERS}"
        )
    return None


def _experts_implementation() -> str | None:
    import types

    import torch
    from transformers.integrations import use_experts_implementation

    calls = []

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 4, 3))
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 3, 2))
            self.act_fn = torch.nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            calls.append((hidden_states, top_k_index, top_k_weights))
            return hidden_states

    decorated = use_experts_implementation(Experts)
    module = decorated(types.SimpleNamespace(_experts_implementation="eager"))
    problem = experts_problem(module, transposed=False) or experts_call_problem(decorated)
    if problem:
        return problem
    module("hidden", "index", "weights")
    if calls != [("hidden", "index", "weights")]:
        return f"the dispatching forward passed {calls} instead of ('hidden', 'index', 'weights')"
    return None


EXPERTS_PROBES = (
    Probe("experts-implementation", _experts_implementation, NEEDED_ON_EVERY_SUPPORTED_VERSION),
)
