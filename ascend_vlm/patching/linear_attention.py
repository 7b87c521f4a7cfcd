"""The Gated DeltaNet adapter: a linear-attention module's forward with transformers' gated
delta rule and short-convolution functions resolved to ``ascend_vlm.ops``.

transformers' ``Qwen3_5GatedDeltaNet.forward`` decides itself when to run the chunked rule
(prefill, or no cache) and the recurrent one (one token continuing a cached state), and keeps
the recurrent and conv states in its own cache object. Patching rebuilds that forward (and, in
transformers >= 5.25, the ``causal_conv1d_forward`` it calls) with the module-level names of
:mod:`ascend_vlm._compat.gated_delta` resolved to the drop-ins below (`with_globals`), so every
decision and every cache read or write stays transformers' own, and each computation runs one
op: ``torch_chunk_gated_delta_rule`` -> ``ops.chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule`` -> ``ops.recurrent_gated_delta_rule``,
``causal_conv1d_update`` / ``causal_conv1d_fn`` -> ``ops.causal_conv1d``.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat.decorators import undecorated_forward
from ascend_vlm._compat.gated_delta import (
    CHUNK_RULE,
    CONV_FORWARD,
    CONV_UPDATE,
    CONV_WHOLE,
    RECURRENT_RULE,
    conv_forward,
    linear_attention_problem,
)
from ascend_vlm.models.family_spec import GatedDeltaNet
from ascend_vlm.ops.causal_conv1d import ACTIVATIONS
from ascend_vlm.patching.part import Part
from ascend_vlm.patching.rebound_globals import ReboundForward, with_globals
from ascend_vlm.patching.state import PatchState, disabled_by

SWAPPED_TO = (
    "ops.chunk_gated_delta_rule (prefill), ops.recurrent_gated_delta_rule (cached decode), "
    "ops.causal_conv1d"
)
# Keyword arguments of packed sequences, which transformers' torch functions refuse as well.
_PACKED = ("cu_seqlens", "seq_idx")


def _refuse_packed(function: str, kwargs: dict) -> None:
    packed = [name for name in _PACKED if kwargs.get(name) is not None]
    if packed:
        raise ValueError(
            f"{packed[0]}: expected None ({function} runs on [B, T] batches, not packed "
            f"sequences), got a tensor"
        )


def _run_rule(op, function: str, query, key, value, g, beta, initial_state, final, l2norm, kwargs):
    """`op` on transformers' arguments of `function`: ``(out, final_state if final else None)``."""
    _refuse_packed(function, kwargs)
    out, state = op(query, key, value, g, beta, initial_state, use_qk_l2norm=l2norm)
    return out, state if final else None


def chunk_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for transformers' ``torch_chunk_gated_delta_rule`` through
    ``ops.chunk_gated_delta_rule`` (same layouts; ``chunk_size`` only moves rounding, the op
    chunks by its own). Returns ``(out, final_state or None)``."""
    return _run_rule(
        ops.chunk_gated_delta_rule, CHUNK_RULE, query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, kwargs,
    )  # fmt: skip


def recurrent_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for transformers' ``torch_recurrent_gated_delta_rule`` through
    ``ops.recurrent_gated_delta_rule``. Returns ``(out, final_state or None)``."""
    return _run_rule(
        ops.recurrent_gated_delta_rule, RECURRENT_RULE, query, key, value, g, beta,
        initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs,
    )  # fmt: skip


def conv_update(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Drop-in for transformers' ``causal_conv1d_update``: hidden_states ``[B, C, T]``
    continuing the cache's ``conv_state`` ``[B, C, S]``, which is overwritten with its new
    value, as transformers' function does; returns ``[B, C, T]``."""
    out, new_state = ops.causal_conv1d(
        hidden_states.transpose(1, 2), weight, conv_state, bias, activation=activation
    )
    conv_state.copy_(new_state)
    return out.transpose(1, 2)


def conv_whole(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for transformers' ``causal_conv1d_fn``: hidden_states ``[B, C, T]`` with zeros
    before it (transformers' cache prepends the cached steps itself); returns ``[B, C, T]``."""
    _refuse_packed(CONV_WHOLE, kwargs)
    out, _ = ops.causal_conv1d(
        hidden_states.transpose(1, 2), weight, None, bias, activation=activation
    )
    return out.transpose(1, 2)


_CONVOLUTION_ADAPTERS = {CONV_UPDATE: conv_update, CONV_WHOLE: conv_whole}


@functools.cache
def _forward_with_ops(cls: type) -> types.FunctionType:
    """``cls.forward`` (a Gated DeltaNet's, which `linear_attention_problem` accepts) with the
    rules and convolutions it calls, directly or through ``causal_conv1d_forward``, resolved
    to the drop-ins above."""
    replacements = {CHUNK_RULE: chunk_rule, RECURRENT_RULE: recurrent_rule}
    replacements.update(_CONVOLUTION_ADAPTERS)
    through = conv_forward(undecorated_forward(cls))
    if through is not None:
        replacements[CONV_FORWARD] = with_globals(through, _CONVOLUTION_ADAPTERS)
    return with_globals(cls.forward, replacements)


def gated_delta_forward(module: nn.Module) -> ReboundForward:
    """``module.forward`` running the gated delta rule and its convolution on our ops."""
    forward = ReboundForward(_forward_with_ops(type(module)), module)
    forward.recipe = (gated_delta_forward,)
    return forward


def patch_linear_attention(
    state: PatchState, module: nn.Module, entry: GatedDeltaNet, part: Part
) -> None:
    """Rebind a Gated DeltaNet's forward (`gated_delta_forward`), or record why it stays: the
    ``attention`` option is off, its forward no longer calls the functions the adapter
    replaces, or its convolution's activation is one ``ops.causal_conv1d`` does not apply."""
    name = type(module).__name__
    activation = getattr(module, "activation", None)
    if not part.enabled("attention"):
        refusal = disabled_by("attention")
    elif activation not in ACTIVATIONS:
        refusal = f"activation is {activation!r}, ops.causal_conv1d applies one of {ACTIVATIONS}"
    else:
        refusal = linear_attention_problem(type(module))
    if refusal is not None:
        state.report.record_left_alone("linear-attention", name, refusal)
        return
    state.rebind(module, "forward", gated_delta_forward(module))
    state.tag(module, "chunk_gated_delta_rule")
    state.report.record_swapped("linear-attention", name, SWAPPED_TO)
