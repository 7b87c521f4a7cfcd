"""``causal_conv1d``: a causal depthwise 1-D convolution continuing a conv state (the short
convolution before Qwen3.5's gated delta rule), optionally followed by SiLU.

With ``W`` the kernel width and ``xs = cat(conv_state, x^T)`` along time (zeros for a None
state): ``out[b, t, c] = act(bias[c] + sum_j weight[c, j] * xs[b, c, t + S - W + 1 + j])`` for
``j < W``, ``S`` the state length; ``new_state = xs[..., -S:]`` (the last ``S`` inputs).
Layouts: x ``[B, T, C]`` (channels last, as the model's projections give it and the NPU kernel
takes it), weight ``[C, W]`` (a depthwise ``nn.Conv1d`` weight without its middle axis),
conv_state ``[B, C, S]`` with ``S >= W - 1`` (transformers' cache keeps ``S = W``). Computed in
float32 (float64 for float64 x); out in x's dtype, new_state in the state's dtype (x's and
``S = W - 1`` for a None state).

NPU: ``torch_npu.npu_fused_causal_conv1d(x, weight, conv_states, *, query_start_loc,
cache_indices, ...) -> Tensor`` (doc in ``torch_npu/_op_plugin_docs.py``): float16/bfloat16 x,
packed ``[cu_seq_len, dim]`` with ``query_start_loc`` int32 ``[batch + 1]`` and
``cache_indices`` int32 ``[batch]`` naming each sequence's state (newer docs also allow ``[batch,
seq_len, dim]``), weight ``[K, dim]`` with K fixed at 3, conv_states ``[..., K - 1, dim]``:
each sequence is padded in front with its state, which is then overwritten in place with the
sequence's tail. Its registered signature and doc differ across wheels: 2.8.0.post5 and 2.9.1
name the activation ``activation_mode``, stop at ``residual_connection`` and document
``cu_seq_len <= 65536``, ``64 <= dim <= 16384``, ``batch <= 256`` and the "昇腾910_95";
2.7.1.post11, 2.9.0.post9 and 2.10.0.post7 onwards name it ``activation``, add APC arguments,
require ``dim % 128 == 0``, list the "昇腾950" and mark bias, activation,
``initial_state_mode`` and ``run_mode`` as not supported yet; 2.6.0.post5 lacks the kernel. We
pass the packed form and only arguments every wheel takes, within every wheel's limits, and add
bias and apply the activation after the kernel; other calls (Qwen3.5's ``W = 4`` among them),
or another SoC, run the reference. That the kernel's ``weight[K - 1]`` multiplies the newest
step, as PyTorch's conv1d does, is our reading (the docs give no formula).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_vlm.ops._checks import check_dtype, check_rank, check_same_dtype, invalid
from ascend_vlm.ops._gated_delta import NPU_LENGTH_DTYPE, compute_dtype, torch_npu_with
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op
from ascend_vlm.ops.kernel_constraints import (
    CAUSAL_CONV1D_MAX_BATCH,
    CAUSAL_CONV1D_MAX_CHANNELS,
    CAUSAL_CONV1D_MAX_TOKENS,
    CAUSAL_CONV1D_SOCS,
    CAUSAL_CONV1D_WIDTH,
    fused_causal_conv1d_refusal,
)

SPEC = load_spec("causal_conv1d")
_DTYPES = SPEC.input_dtypes("x")
ACTIVATIONS = (None, "silu", "swish")  # swish is silu
NPU_KERNEL = "npu_fused_causal_conv1d"


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str | None,
) -> int:
    """Validate and return the state length ``S``."""
    check_dtype("x", x, _DTYPES)
    check_rank("x", x, 3, "3-D [B, T, C]")
    batch, _, channels = x.shape
    check_dtype("weight", weight, _DTYPES)
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise invalid("weight", f"2-D [C={channels}, W >= 1]", f"shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if conv_state is not None:
        check_dtype("conv_state", conv_state, _DTYPES)
        if (
            conv_state.dim() != 3
            or conv_state.shape[:2] != (batch, channels)
            or conv_state.shape[2] < width - 1
        ):
            raise invalid(
                "conv_state",
                f"3-D [B={batch}, C={channels}, S >= W - 1 = {width - 1}]",
                f"shape {tuple(conv_state.shape)}",
            )
    if bias is not None:
        check_same_dtype("bias", bias, "weight", weight.dtype)
        if bias.shape != (channels,):
            raise invalid("bias", f"shape ({channels},) [C]", f"shape {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise invalid("activation", f"one of {ACTIVATIONS}", repr(activation))
    return width - 1 if conv_state is None else conv_state.shape[2]


def _past_steps(
    state_len: int, x: torch.Tensor, conv_state: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The state's steps as ``[B, S, C]`` in ``dtype`` (zeros for a None state)."""
    if conv_state is None:
        return x.new_zeros((x.shape[0], state_len, x.shape[2]), dtype=dtype)
    return conv_state.transpose(1, 2).to(dtype)


def _new_state(state_len: int, x: torch.Tensor, conv_state: torch.Tensor | None) -> torch.Tensor:
    """The last ``S`` steps of the state followed by x, as a new ``[B, C, S]`` tensor in the
    state's dtype (x's for a None state)."""
    dtype = x.dtype if conv_state is None else conv_state.dtype
    recent = x[:, max(x.shape[1] - state_len, 0) :].to(dtype)
    steps = torch.cat((_past_steps(state_len, x, conv_state, dtype), recent), dim=1)
    # a copy, not a view: a cache holding the state would otherwise keep the steps alive
    return (
        steps[:, steps.shape[1] - state_len :]
        .transpose(1, 2)
        .clone(memory_format=torch.contiguous_format)
    )


def _activated(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``out`` (an intermediate the caller owns) through the activation, in place when no
    gradient is recorded (silu's backward reads its input)."""
    return out if activation is None else F.silu(out, inplace=not out.requires_grad)


def _reference(
    state_len: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(x.dtype)
    width, tokens = weight.shape[1], x.shape[1]
    # channels last throughout: W shifted products of [B, T, C] (only the last W - 1 state
    # steps reach the output), so neither x nor the output is transposed
    past = _past_steps(state_len, x, conv_state, dtype)[:, state_len - (width - 1) :]
    steps = torch.cat((past, x.to(dtype)), dim=1)
    w = weight.to(dtype)
    first = steps[:, :tokens]
    out = first * w[:, 0] if bias is None else torch.addcmul(bias.to(dtype), first, w[:, 0])
    for j in range(1, width):  # in place: out is this function's own intermediate
        out.addcmul_(steps[:, j : j + tokens], w[:, j])
    return _activated(out, activation).to(x.dtype), _new_state(state_len, x, conv_state)


def _npu(
    state_len: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch_npu = torch_npu_with(NPU_KERNEL)
    if (
        torch_npu is None
        or fused_causal_conv1d_refusal(x.dtype, weight.shape[1], x.shape[2]) is not None
        or x.shape[2] > CAUSAL_CONV1D_MAX_CHANNELS
        or not 0 < x.shape[0] * x.shape[1] <= CAUSAL_CONV1D_MAX_TOKENS
        or x.shape[0] > CAUSAL_CONV1D_MAX_BATCH
        or not torch.npu.get_device_name(x.device).startswith(CAUSAL_CONV1D_SOCS)
    ):
        return _reference(state_len, x, weight, conv_state, bias, activation)
    batch, tokens, channels = x.shape
    if conv_state is None:
        states = x.new_zeros((batch, CAUSAL_CONV1D_WIDTH - 1, channels))
    else:  # a copy: the kernel overwrites it
        states = conv_state[..., -(CAUSAL_CONV1D_WIDTH - 1) :].transpose(1, 2).to(x.dtype)
        states = states.clone(memory_format=torch.contiguous_format)
    out = torch_npu.npu_fused_causal_conv1d(
        x.reshape(batch * tokens, channels),
        weight.t().to(x.dtype).contiguous(),
        states,
        query_start_loc=torch.arange(
            0, batch * tokens + 1, tokens, dtype=NPU_LENGTH_DTYPE, device=x.device
        ),
        cache_indices=torch.arange(batch, dtype=NPU_LENGTH_DTYPE, device=x.device),
    ).view(batch, tokens, channels)
    if bias is not None or activation is not None:
        out = out.to(compute_dtype(x.dtype))
        out = _activated(out if bias is None else out + bias.to(out.dtype), activation)
    return out.to(x.dtype), _new_state(state_len, x, conv_state)


def _fake(
    state_len: int,
    x: torch.Tensor,
    _weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    *_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both outputs are new contiguous tensors, whatever the inputs' strides."""
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    state = x.new_empty((x.shape[0], x.shape[2], state_len), dtype=state_dtype)
    return x.new_empty(x.shape), state


causal_conv1d = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=_fake,
    doc="""Causal depthwise convolution of x ``[B, T, C]`` with weight ``[C, W]``, continuing
    conv_state ``[B, C, S]`` (``S >= W - 1``; None: zeros, ``S = W - 1``).

    ``activation`` None, "silu" or "swish" (the same). Returns ``(out [B, T, C] in x's dtype,
    new_state [B, C, S])``: the new state is the last ``S`` inputs, so a prefill's state
    continues into decode. Bad inputs raise ``ValueError`` naming the argument.
    """,
)
