"""What the Gated DeltaNet adapter relies on in transformers' linear-attention modules
(Qwen3.5): the module-level functions their forward calls, by name, and those functions'
parameters.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
linear-attention:<mt>      (in :mod:`ascend_vlm.patching.family_probes`) each Gated DeltaNet class's
                           forward, under decorators `rewrap` can rebuild, calls ``RULES`` and the
                           ``CONVOLUTIONS`` (itself or through ``CONV_FORWARD``), each with the
                           parameters of ``PARAMETERS`` (`linear_attention_problem`).
========================== ==========================================================================

Needed on every supported version. 5.17 and 5.25 differ in one place: 5.17's forward calls
``causal_conv1d_update`` (one cached token) and ``causal_conv1d_fn`` (a whole sequence) itself,
5.25's through ``causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, ...)``, which
reads and writes the conv state in the cache and calls them; the adapter rebinds the conv
functions inside that function too. The 5.17 branch can go once 5.25 is the lowest supported.
"""

from __future__ import annotations

import types

from ascend_vlm._compat.decorators import parameters_problem, plain_function, undecorated_forward

CHUNK_RULE = "torch_chunk_gated_delta_rule"  # prefill (and any call without a cached state)
RECURRENT_RULE = "torch_recurrent_gated_delta_rule"  # one token continuing the cached state
RULES = (CHUNK_RULE, RECURRENT_RULE)
CONV_UPDATE = "causal_conv1d_update"  # one token, conv state updated in place
CONV_WHOLE = "causal_conv1d_fn"  # a whole sequence, zero-padded in front
CONVOLUTIONS = (CONV_UPDATE, CONV_WHOLE)
CONV_FORWARD = "causal_conv1d_forward"  # 5.25: the forward reaches CONVOLUTIONS through it
_RULE_TAIL = ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "kwargs")
PARAMETERS = {
    CHUNK_RULE: ("query", "key", "value", "g", "beta", "chunk_size", *_RULE_TAIL),
    RECURRENT_RULE: ("query", "key", "value", "g", "beta", *_RULE_TAIL),
    CONV_UPDATE: ("hidden_states", "conv_state", "weight", "bias", "activation"),
    CONV_WHOLE: ("hidden_states", "weight", "bias", "activation", "kwargs"),
}


def conv_forward(forward: types.FunctionType) -> types.FunctionType | None:
    """The plain ``causal_conv1d_forward`` that `forward` (an undecorated Gated DeltaNet
    forward) calls, or None when it calls the convolution functions itself (5.17)."""
    if CONV_FORWARD not in forward.__code__.co_names:
        return None
    function = plain_function(forward.__globals__.get(CONV_FORWARD))
    return function if isinstance(function, types.FunctionType) else None


def linear_attention_problem(cls: type) -> str | None:
    """Why `cls` (a Gated DeltaNet module class) cannot have the gated delta rule and
    convolution functions its forward calls resolved to adapters, or None when it can."""
    forward = undecorated_forward(cls)
    if isinstance(forward, str):
        return forward
    callers = {name: forward for name in RULES}
    through = conv_forward(forward)
    if CONV_FORWARD in forward.__code__.co_names and through is None:
        return f"{CONV_FORWARD} is not a Python function"
    callers.update(dict.fromkeys(CONVOLUTIONS, through or forward))
    for name, caller in callers.items():
        if name not in caller.__code__.co_names:
            return f"{caller.__qualname__} does not call {name}"
        problem = parameters_problem(caller.__globals__.get(name), name, PARAMETERS[name])
        if problem:
            return problem
    return None
