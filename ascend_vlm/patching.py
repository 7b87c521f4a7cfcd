"""`patch(model)` / `unpatch(model)`: route one Hugging Face VLM *instance* to `ascend_vlm.ops`.

How (the *what* lives in `ascend_vlm.models`):

* attention: our function is registered in transformers' `AttentionInterface` and
  `AttentionMaskInterface` under ``ATTENTION_NAME`` (it contains "flash", so Qwen2-VL-style vision
  towers take their single varlen call instead of a per-image loop with a host sync). The
  modules inside the model read private copies of their configs naming it (`_route_attention`);
  the configs the caller holds, and every other model sharing them, are untouched. A call asked
  for attention weights (``output_attentions``) runs eager's math for that call only.
* norms, MLPs: ``forward`` is rebound on the module instance (``module.__dict__["forward"]``);
  weights are the module's own Parameters, read at call time (no copies), and ``extra_repr``
  says which fused op runs. A gated MLP hands ``cat(gate, up)`` to ``ops.swiglu`` only when the
  fused kernel runs; on the CPU reference path it computes the same formula without that copy
  (``ascend_vlm.ops.swiglu.swiglu_projections``).
* RoPE: the attention module's own ``forward`` code is rebound on the instance with the
  module-level rotary function (e.g. ``apply_rotary_pos_emb``) resolved to an adapter around
  ``ops.rotary_embedding_pair`` (q and k in one call); the transformers module and class stay
  untouched. Decorators on that forward (``deprecate_kwarg``, kernels' ``use_kernelized_func``)
  are rebuilt around the rebound code (`ascend_vlm._compat.rewrap`), so they keep working.

Modules wrapped by accelerate hooks (``device_map`` / offload) keep their hook: the forward it
wraps (``_old_forward``) is rebound instead of ``forward``. Every change is recorded on the base
model and ``unpatch`` restores exactly what was there.

A patched model pickles (``torch.save(model)``, ``copy.deepcopy``) whenever the stock one does:
everything rebound refers to importable functions, and unpickling registers our attention
function with transformers, so the loaded model runs patched and still unpatches exactly.
"""

from __future__ import annotations

import copy
import enum
import functools
import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ascend_vlm._compat import (
    ATTENTION_NAME,
    SILU_ACTIVATIONS,
    check_transformers_version,
    rewrap,
    rope_problem,
)
from ascend_vlm._errors import PatchError
from ascend_vlm.models import (
    KINDS,
    TEXT_BACKBONES,
    ModelSpec,
    PartSpec,
    Rope,
    spec_for,
    supported_model_types,
)

_STATE_KEY = "_ascend_vlm_patch_state"
_FLOAT32 = torch.float32  # the vision RoPE adapter compares dtypes per call


class _Missing(enum.Enum):
    """Marks an instance attribute that did not exist before `patch`; an enum member stays the
    same object through pickling, so `unpatch` still recognises it on an unpickled model."""

    MISSING = "missing"


_MISSING = _Missing.MISSING


@functools.cache
def _ops():
    # Imported on first use so that `import ascend_vlm.patching` does not load the op library;
    # cached because the patched forwards call this per layer.
    from ascend_vlm import ops

    return ops


@functools.cache
def _op_module(name: str) -> types.ModuleType:
    # Helpers of an op module that are not ops themselves (swiglu_projections,
    # equal_segment_count), imported on first use like `_ops`.
    return importlib.import_module(f"ascend_vlm.ops.{name}")


# --------------------------------------------------------------------------- attention function


def ascend_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function backed by `ascend_vlm.ops`.

    q [B, Nq, S, D], k/v [B, Nkv, Skv, D] -> ([B, S, Nq, D], None). Calling conventions handled:

    * varlen (``cu_seq_lens_q``/``cu_seq_lens_k`` given, B == 1): packed segments attend only
      within themselves -> ``ops.varlen_attention`` (Qwen2-VL vision, padding-free training).
    * padded/masked: ``attention_mask`` is the 4-D boolean (True = attend) or additive float mask
      made by the mask function registered with this name (`sdpa_mask`), or None. As in
      transformers' sdpa path, causal is ``module.is_causal`` (or the ``is_causal`` kwarg) when no
      mask is given and more than one query is present -> ``ops.fused_attention``. A causal
      call with more keys than queries and no mask is a prefill into an empty StaticCache (the
      mask function relies on SDPA's top-left alignment): only the first Sq keys are used.

    Sliding windows and packed-sequence boundaries arrive encoded in the mask; the varlen path
    raises ValueError for ``dropout > 0`` and a ``sliding_window`` (it can honour neither).
    Raises ValueError for logit soft-capping and attention sinks.

    Attention weights: fused kernels do not materialise them, so they are ``None`` unless this
    call's caller collects them (`_attention_weights_requested`); that call alone then runs
    transformers' eager math (`_attention_with_weights`) and returns (output, weights
    [B, Nq, S, Skv]) as eager attention does.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"softcap: {ATTENTION_NAME!r} attention has no logit soft-capping, got "
            f"softcap={kwargs['softcap']}; use attn_implementation='eager' for this model"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"s_aux: {ATTENTION_NAME!r} attention has no attention sinks")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if _attention_weights_requested(kwargs):
        mask = _mask_for_weights(query, key, attention_mask, bool(is_causal), dropout, kwargs)
        return _attention_with_weights(query, key, value, mask, scaling, dropout)
    ops = _ops()
    cu_seqlens_q = kwargs.get("cu_seq_lens_q")
    if cu_seqlens_q is not None:
        cu_seqlens_k = _checked_varlen_call(query, dropout, kwargs)
        segments = _op_module("varlen_attention").equal_segment_count(
            cu_seqlens_q,
            cu_seqlens_k,
            query.shape[2],
            key.shape[2],
            kwargs.get("max_length_q"),
            kwargs.get("max_length_k"),
        )
        if segments == 1:  # one image: the inputs as they are (the views and reshape of the
            # same-size branch below cost ~2 us per vision layer more, measured warm)
            output = ops.fused_attention(query, key, value, causal=bool(is_causal), scale=scaling)
            return output.transpose(1, 2).contiguous(), None
        if segments is not None:
            # Same-size images: one batched call, [1, N, n*L, D] -> [n, N, L, D] as views,
            # instead of the round trip through the packed [T, N, D] layout.
            batched = [  # `view` splits the sequence axis; `unflatten` is a Python wrapper
                t.view(t.shape[1], segments, -1, t.shape[3]).transpose(0, 1)
                for t in (query, key, value)
            ]
            output = ops.fused_attention(*batched, causal=bool(is_causal), scale=scaling)
            return output.transpose(1, 2).reshape(1, query.shape[2], output.shape[1], -1), None
        packed = [t[0].transpose(0, 1) for t in (query, key, value)]  # [T, N, D]
        output = ops.varlen_attention(
            *packed,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q=kwargs.get("max_length_q"),
            max_seqlen_k=kwargs.get("max_length_k"),
            causal=bool(is_causal),
            scale=scaling,
        )
        return output.unsqueeze(0), None
    if (
        attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[-1] != key.shape[-2]
    ):
        # Sliced only when longer than the keys: every layer then hands the op the same mask
        # object, so its host reads (dead rows, additive bias) happen once per forward.
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    query_length, key_length = query.shape[2], key.shape[2]
    causal = bool(is_causal) and attention_mask is None and query_length > 1
    if causal and key_length > query_length:
        # Prefill into an empty StaticCache: `sdpa_mask` returns None relying on SDPA's top-left
        # causal alignment, and the keys past the queries are empty cache slots. ops.fused_attention
        # aligns causal masks bottom-right, so keep only the first `query_length` keys (as
        # transformers' sdpa_attention_forward does), where both alignments agree.
        key, value = key[:, :, :query_length], value[:, :, :query_length]
    output = ops.fused_attention(
        query,
        key,
        value,
        layout="BNSD",
        attention_mask=attention_mask,
        causal=causal,
        scale=scaling,
        dropout_p=dropout,
    )
    return output.transpose(1, 2).contiguous(), None


def _checked_varlen_call(query: torch.Tensor, dropout: float, kwargs: dict) -> torch.Tensor:
    """The key offsets of a packed varlen call (``cu_seq_lens_q`` given), after refusing what
    packed attention cannot honour; ``cu_seq_lens_k`` defaults to ``cu_seq_lens_q``."""
    if query.shape[0] != 1:
        raise ValueError(
            f"query: expected batch 1 for packed varlen attention (cu_seq_lens_q given), "
            f"got shape {tuple(query.shape)}"
        )
    _check_varlen_honours(dropout, kwargs.get("sliding_window"))
    cu_seqlens_k = kwargs.get("cu_seq_lens_k")
    return kwargs["cu_seq_lens_q"] if cu_seqlens_k is None else cu_seqlens_k


def _check_varlen_honours(dropout: float, sliding_window: int | None) -> None:
    """Raise for what ``ops.varlen_attention`` cannot compute, rather than dropping it silently.

    On the padded path both arrive honoured: dropout goes to ``ops.fused_attention`` and the
    sliding window is encoded in the mask made by `sdpa_mask`. Packed varlen calls get no mask.
    """
    if dropout > 0.0:
        raise ValueError(
            f"dropout: packed varlen attention (cu_seq_lens_q given) has no attention dropout, "
            f"got dropout={dropout}; set the config's attention_dropout to 0 or train with padded "
            f"batches (no flash-attention kwargs) to keep it"
        )
    if sliding_window is not None:
        raise ValueError(
            f"sliding_window: packed varlen attention (cu_seq_lens_q given) attends to whole "
            f"segments, got sliding_window={sliding_window}; use padded batches (the mask then "
            f"carries the window) or attn_implementation='eager'"
        )


@functools.cache
def _output_collector() -> Callable[[], dict | None]:
    """The getter of transformers' active output collector (None when it has none).

    transformers 5 asks for attention weights through its output capture: the ``capture_outputs``
    decorator of a model's forward (reading ``output_attentions`` from the call or the config)
    sets a per-context dict of the outputs to collect, and forward hooks on the attention
    modules append element 1 of their result, the weights, to its "attentions" list.
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return lambda: None
    return _active_collector.get


def _attention_weights_requested(kwargs: dict) -> bool:
    """Whether this call's caller collects attention weights: ``output_attentions=True`` passed
    down to the attention function, or an output capture collecting an "*attentions" output."""
    if kwargs.get("output_attentions"):
        return True
    collected = _output_collector()()
    return collected is not None and any(name.endswith("attentions") for name in collected)


def _mask_for_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
    dropout: float,
    kwargs: dict,
) -> torch.Tensor | None:
    """The explicit mask (bool, True = attend, or additive float) `_attention_with_weights`
    needs for the call `ascend_attention_forward` received, or None when every key is attended.

    Packed varlen calls: a block-diagonal [1, 1, Tq, Tk] mask over their segments (causal within a
    segment aligned bottom-right, as the varlen op does). Padded calls: the given mask sliced to
    the keys; with none, a causal call with several queries is aligned top-left, as SDPA's
    ``is_causal`` that `sdpa_mask` relies on when it returns None.
    """
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_seqlens_k = _checked_varlen_call(query, dropout, kwargs)
        return _segment_mask(kwargs["cu_seq_lens_q"], cu_seqlens_k, query, key, is_causal)
    if attention_mask is not None:
        return attention_mask[..., : key.shape[-2]]
    if is_causal and query.shape[2] > 1:
        shape = (query.shape[2], key.shape[2])
        return torch.ones(shape, dtype=torch.bool, device=query.device).tril()
    return None


def _segment_mask(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """[1, 1, Tq, Tk] bool: query i attends key j when both lie in the same segment (tokens past
    the last offset lie in none); with ``causal``, when j is no later than i counted from the
    segment's end."""

    def segments(offsets: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = offsets.to(device=query.device, dtype=torch.long)
        positions = torch.arange(length, device=query.device)
        index = torch.searchsorted(offsets, positions, right=True) - 1
        inside = (positions >= offsets[0]) & (positions < offsets[-1])
        index = torch.where(inside, index, -1)
        from_end = positions - offsets[(index + 1).clamp(max=offsets.numel() - 1)]
        return index, from_end

    segment_q, from_end_q = segments(cu_seqlens_q, query.shape[2])
    segment_k, from_end_k = segments(cu_seqlens_k, key.shape[2])
    mask = (segment_q[:, None] == segment_k[None, :]) & (segment_q[:, None] >= 0)
    if causal:
        mask &= from_end_k[None, :] <= from_end_q[:, None]
    return mask[None, None]


def _attention_with_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, S, Nq, D], weights [B, Nq, S, Skv]) with transformers' eager attention math,
    step for step in the inputs' dtype: ``softmax(q k^T * scale + mask)`` in fp32 rounded to
    the dtype, dropout, ``@ v``. A bool mask becomes eager's additive one (0 where True, the
    dtype's min elsewhere), so fully masked rows get uniform weights as in eager. GQA/MQA
    repeats each key/value head for its group of query heads."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            mask = additive.masked_fill_(~mask, torch.finfo(query.dtype).min)
        weights = weights + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout > 0.0:
        weights = nn.functional.dropout(weights, p=dropout, training=True)
    output = torch.matmul(weights, value)
    return output.transpose(1, 2).contiguous(), weights


def _register_attention() -> None:
    """Register our attention and mask functions with transformers (idempotent, process-wide
    but inert: only configs whose `_attn_implementation` is ATTENTION_NAME use them)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ascend_attention_forward)
    # Without a mask function transformers returns mask None and causal masking is silently lost.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# --------------------------------------------------------------------------- norm / mlp / rope


def _rms_norm_forward(
    rms_norm: Callable, module: nn.Module, eps: float, offset: float, hidden_states: torch.Tensor
):
    """The module's norm through ``ops.rms_norm``, with the stock module's output dtype.

    Gemma-style norms (``offset`` 1) compute ``(x_norm * (1 + w)).to(x.dtype)``, which is the op.
    Llama-style norms (``offset`` 0) compute ``w * x_norm.to(x.dtype)``: when ``w`` has another
    dtype than ``x`` (fp32 weights, bf16 activations) the result is ``promote(w, x)`` with
    ``x_norm`` rounded to ``x.dtype`` first, so the op normalises with a unit weight and ``w`` is
    applied after it. With equal dtypes the op applies ``w`` inside its fp32 math and rounds once
    where the stock module rounds twice (within one unit of the last place of ``x.dtype``).

    ``rms_norm`` is ``ops.rms_norm``, bound once instead of looked up per call.
    """
    weight = module.weight
    if offset or weight.dtype == hidden_states.dtype:
        return rms_norm(hidden_states, weight, eps, offset=offset)
    unit = torch.ones(
        hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device
    )
    return weight * rms_norm(hidden_states, unit, eps)


def _swiglu_mlp_forward(
    swiglu_projections: Callable, module: nn.Module, hidden_states: torch.Tensor
) -> torch.Tensor:
    gated = swiglu_projections(hidden_states, module.gate_proj, module.up_proj)
    return module.down_proj(gated)


def _rope_text(rotary_pair: Callable, table_scale: float, q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for transformers' `apply_rotary_pos_emb` (once ``rotary_pair``,
    ``ops.rotary_embedding_pair``, and ``table_scale``, a bound on the model's |cos| and |sin|,
    are bound): q/k [B, N, S, D], cos/sin [B, S, D]."""
    if unsqueeze_dim != 1:
        raise ValueError(
            f"unsqueeze_dim: expected 1 (heads axis of [B, N, S, D]), got {unsqueeze_dim}"
        )
    return rotary_pair(q, k, cos, sin, table_scale=table_scale)


def _rope_vision(rotary_pair: Callable, table_scale: float, q, k, cos, sin):
    """Drop-in for `apply_rotary_pos_emb_vision` (once ``rotary_pair`` and ``table_scale`` are
    bound): q/k [T, N, D], cos/sin [T, D], fp32 math. The op sees q/k as [1, N, T, D] views."""
    q_bnsd = (q if q.dtype == _FLOAT32 else q.float()).transpose(0, 1).unsqueeze(0)
    k_bnsd = (k if k.dtype == _FLOAT32 else k.float()).transpose(0, 1).unsqueeze(0)
    cos = cos if cos.dtype == _FLOAT32 else cos.float()
    sin = sin if sin.dtype == _FLOAT32 else sin.float()
    q_out, k_out = rotary_pair(q_bnsd, k_bnsd, cos, sin, table_scale=table_scale)
    q_out, k_out = q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)  # -> [T, N, D]
    return (
        q_out if q_out.dtype == q.dtype else q_out.to(q.dtype),
        k_out if k_out.dtype == k.dtype else k_out.to(k.dtype),
    )


_ROPE_STYLES = {"text": _rope_text, "vision": _rope_vision}


def _rope_adapter(style: str, table_scale: float = 1.0) -> Callable:
    """The drop-in for the module-level rotary function of ``style`` ("text" or "vision"), for
    tables bounded by ``table_scale`` (1.0: unit tables)."""
    return functools.partial(
        _ROPE_STYLES[style],
        _ops().rotary_embedding_pair,
        table_scale,
    )


def _rope_table_scale(modules: list[nn.Module]) -> float:
    """A bound on |cos| and |sin| of the RoPE tables made in one part of a model: the largest
    ``attention_scaling`` (or per-layer-type ``<type>_attention_scaling``, Gemma3) that its
    rotary embedding modules multiply their tables by, and at least 1.0 (unit tables).

    Read once at patch time; the factor is fixed at the module's construction (dynamic and
    longrope updates change the frequencies, not the factor). Any bound gives the same result
    (ops.rotary_embedding's ``table_scale``), so one bound serves every rotary module.
    """
    scales = [
        value
        for module in modules
        for name, value in vars(module).items()
        if name.endswith("attention_scaling") and type(value) in (float, int)
    ]
    return float(max([1.0, *scales]))


@functools.cache
def _forward_with_rope(
    forward: types.FunctionType, function_name: str, style: str, table_scale: float = 1.0
):
    """`forward`'s own code with the global `function_name` resolved to our RoPE adapter.

    One globals snapshot per (forward, function, style, scale); the original module is not
    modified. A decorated forward is rebuilt around the rebound function it decorates (`rewrap`).
    The snapshot drops ``__name__``: Dynamo resolves the globals of a function it inlines
    through the module of that name when there is one, and would then guard on the module's own
    `function_name` (transformers' function) instead of our adapter; without it, Dynamo reads
    and guards on this dict, so torch.compile and torch.export see the adapter.
    """
    if hasattr(forward, "__wrapped__"):
        return rewrap(
            forward,
            _forward_with_rope(forward.__wrapped__, function_name, style, table_scale),
        )
    rebound_globals = dict(forward.__globals__)
    rebound_globals[function_name] = _rope_adapter(style, table_scale)
    del rebound_globals["__name__"]
    clone = types.FunctionType(
        forward.__code__,
        rebound_globals,
        forward.__name__,
        forward.__defaults__,
        forward.__closure__,
    )
    clone.__kwdefaults__ = forward.__kwdefaults__
    clone.__qualname__ = forward.__qualname__
    return clone


class _RopeForward(functools.partial):
    """A module's ``forward`` rebound by `_forward_with_rope`, bound to the module (called like
    the bound method). Pickles as its recipe: the rebound function has no importable name."""

    recipe: tuple[str, str, float]  # (function_name, style, table_scale)

    def __reduce__(self):
        return _rope_forward, (self.args[0], *self.recipe)


def _rope_forward(
    module: nn.Module, function_name: str, style: str, table_scale: float = 1.0
) -> _RopeForward:
    """``module.forward`` with its class forward's `function_name` resolved to our adapter,
    which hands the op ``table_scale`` (a bound on the tables' |cos| and |sin|)."""
    clone = _forward_with_rope(type(module).forward, function_name, style, table_scale)
    forward = _RopeForward(clone, module)
    forward.recipe = (function_name, style, table_scale)
    return forward


# --------------------------------------------------------------------------- report


@dataclass
class PatchReport:
    """What `patch` did to one model: swapped modules per kind and what was left alone and why."""

    model_type: str
    swapped: dict[tuple[str, str, str], int] = field(default_factory=dict)
    left_alone: dict[tuple[str, str, str], int] = field(default_factory=dict)
    attention_implementation: str = ATTENTION_NAME

    def _count(self, table: dict, key: tuple[str, str, str]) -> None:
        table[key] = table.get(key, 0) + 1

    def swapped_count(self, kind: str) -> int:
        """Number of modules of `kind` (one of KINDS) routed to a fused op."""
        return sum(n for (k, _, _), n in self.swapped.items() if k == kind)

    def left_alone_count(self, kind: str) -> int:
        return sum(n for (k, _, _), n in self.left_alone.items() if k == kind)

    def as_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "attention_implementation": self.attention_implementation,
            "swapped": [
                {"kind": k, "module": m, "op": op, "count": n}
                for (k, m, op), n in sorted(self.swapped.items())
            ],
            "left_alone": [
                {"kind": k, "module": m, "reason": why, "count": n}
                for (k, m, why), n in sorted(self.left_alone.items())
            ],
            "totals": {
                kind: {
                    "swapped": self.swapped_count(kind),
                    "left_alone": self.left_alone_count(kind),
                }
                for kind in KINDS
            },
        }

    def __str__(self) -> str:
        rows = [("kind", "module", "count", "-> op / left alone because")]
        rows += [(k, m, str(n), f"-> {op}") for (k, m, op), n in sorted(self.swapped.items())]
        rows += [
            (k, m, str(n), f"kept: {why}") for (k, m, why), n in sorted(self.left_alone.items())
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"ascend_vlm.patch report for model_type={self.model_type!r}"]
        for index, row in enumerate(rows):
            lines.append(
                "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
                + "  "
                + row[3]
            )
            if index == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(row[3]))
        return "\n".join(lines)


# --------------------------------------------------------------------------- state and recording


@dataclass
class _PatchState:
    options: dict
    report: PatchReport
    rebinds: list[tuple[nn.Module, str, object]] = field(default_factory=list)

    def rebind(self, module: nn.Module, name: str, value: object) -> None:
        """Set instance attribute `name` of `module` to `value`, recording what was there.

        A module carrying an accelerate hook (``device_map=...``, CPU/disk offload) has the hook's
        wrapper as its instance ``forward`` and the wrapped forward in ``_old_forward``; the
        wrapper looks ``_old_forward`` up at every call (accelerate/hooks.py,
        `add_hook_to_module`). Rebinding ``_old_forward`` instead keeps the hook's device moves
        and offload loads around our forward.
        """
        if name == "forward" and hasattr(module, "_hf_hook") and "_old_forward" in vars(module):
            name = "_old_forward"
        self.rebinds.append((module, name, module.__dict__.get(name, _MISSING)))
        module.__dict__[name] = value

    def __setstate__(self, state: dict) -> None:
        # Unpickling a patched model (possibly in a fresh process): its configs name our
        # attention function, so transformers must know it before the first forward.
        _register_attention()
        self.__dict__.update(state)

    def revert(self) -> None:
        for module, name, previous in reversed(self.rebinds):
            if previous is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = previous


def _base_model(model: object, **flags: object) -> nn.Module:
    """The transformers model under a PEFT wrapper (or `model` itself), once the arguments of
    `patch` / `unpatch` are checked: TypeError naming the argument unless `model` is an
    ``nn.Module`` and every flag (``attention=``, ``strict=``, ...) a bool."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model: expected a torch.nn.Module (a transformers model, optionally PEFT-wrapped), "
            f"got {type(model).__name__}"
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected True or False, got {value!r}")
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _tagged_extra_repr(original: Callable[[], str], op_name: str) -> str:
    text = original()
    return f"{text}, fused=ascend_vlm.ops.{op_name}" if text else f"fused=ascend_vlm.ops.{op_name}"


# --------------------------------------------------------------------------- applying a spec


def _find_vision_tower(base: nn.Module, paths: tuple[str, ...]) -> nn.Module | None:
    for path in paths:
        module = base
        for attribute in path.split("."):
            module = getattr(module, attribute, None)
            if not isinstance(module, nn.Module):
                break
        else:
            return module
    return None


def _modules_by_part(base: nn.Module, tower: nn.Module | None) -> dict[str, list[nn.Module]]:
    vision = [] if tower is None else list(tower.modules())
    vision_ids = {id(m) for m in vision}
    text = [m for m in base.modules() if id(m) not in vision_ids]
    return {"text": text, "vision": vision}


def _attention_configs(modules: list[nn.Module], classes: tuple[str, ...]) -> tuple[list, int]:
    """Distinct configs of the attention modules (and of the PreTrainedModels holding them)."""
    from transformers import PreTrainedConfig, PreTrainedModel

    configs: dict[int, object] = {}
    count = 0
    for module in modules:
        is_attention = type(module).__name__ in classes
        count += is_attention
        config = getattr(module, "config", None)
        if (is_attention or isinstance(module, PreTrainedModel)) and isinstance(
            config, PreTrainedConfig
        ):
            configs.setdefault(id(config), config)
    return list(configs.values()), count


def _patch_attention(state: _PatchState, part: str, modules, spec: PartSpec) -> list:
    """Report the attention of one part; returns the configs to route to our attention."""
    kind = f"attention-{part}"
    report = state.report
    configs, count = _attention_configs(modules, spec.attention)
    label = "/".join(spec.attention)
    if count == 0:
        return []
    if not state.options["attention" if part == "text" else "vision"]:
        why = (
            "disabled by patch(attention=False)"
            if part == "text"
            else "disabled by patch(vision=False)"
        )
        report.left_alone[(kind, label, why)] = count
        return []
    softcapped = [c for c in configs if getattr(c, "attn_logit_softcapping", None) is not None]
    if softcapped:
        why = "attention logit soft-capping is not supported by ops.fused_attention"
        report.left_alone[(kind, label, why)] = count
        return []
    report.swapped[(kind, label, "ops.fused_attention / ops.varlen_attention")] = count
    return configs


def _route_attention(state: _PatchState, base: nn.Module, routed: list) -> None:
    """Point the modules inside `base` at private copies of their configs, the copies of the
    `routed` configs naming our attention.

    transformers reads the attention implementation from the config object each module holds,
    and that object is shared: with the caller, with every other model built from it, and
    between a composite config and the sub-configs it holds by reference. Writing our name into
    it would route those other models through our function (and a model built from it later
    would fail to initialise: transformers takes a "flash" name for a hub kernel). So each
    distinct config reachable from `base`'s submodules is copied once (a shallow copy: its own
    attribute table, shared values), a composite copy holds the copies of its sub-configs, and
    the submodules' ``config`` attributes are rebound to the copies. ``base.config`` and the
    configs of the sub-models inside it (``PreTrainedModel`` submodules: language model, vision
    tower) stay the caller's objects, so ``model.config``, ``save_pretrained`` and models built
    from it are stock, and a sub-model's config is still the very sub-config of
    ``model.config`` it was built from (transformers relies on that identity). Those sub-models
    build their masks under the caller's implementation name; `ascend_attention_forward` takes
    every mask those make (boolean, additive float or None).
    """
    if not routed:
        return
    from transformers import PreTrainedConfig, PreTrainedModel

    routed_ids = {id(config) for config in routed}
    copies: dict[int, PreTrainedConfig] = {}

    def owned(config: PreTrainedConfig) -> PreTrainedConfig:
        private = copies.get(id(config))
        if private is None:
            private = copies[id(config)] = copy.copy(config)
            if id(config) in routed_ids:
                private._attn_implementation_internal = ATTENTION_NAME
            for name in type(config).sub_configs:
                sub_config = config.__dict__.get(name)
                if isinstance(sub_config, PreTrainedConfig):
                    private.__dict__[name] = owned(sub_config)
        return private

    for module in base.modules():
        config = module.__dict__.get("config")
        if isinstance(config, PreTrainedConfig) and not isinstance(module, PreTrainedModel):
            state.rebind(module, "config", owned(config))


def _patch_modules(state: _PatchState, part: str, modules, spec: PartSpec) -> None:
    options, report = state.options, state.report
    enabled_part = part == "text" or options["vision"]
    table_scale = _rope_table_scale(modules) if spec.ropes else 1.0
    for module in modules:
        name = type(module).__name__
        for norm in spec.norms:
            if name in norm.classes:
                _patch_norm(state, module, norm.offset, enabled_part and options["norm"])
        for mlp in spec.mlps:
            if name in mlp.classes:
                _patch_mlp(state, module, enabled_part and options["mlp"])
        for rope in spec.ropes:
            if name in rope.classes:
                _patch_rope(state, module, rope, enabled_part and options["rope"], table_scale)
        for leave in spec.left_alone:
            if name in leave.classes:
                report._count(report.left_alone, (leave.kind, name, leave.reason))


def _disabled(kind: str) -> str:
    return f"disabled by patch({kind}=False) or patch(vision=False)"


def _patch_norm(state: _PatchState, module: nn.Module, offset: float, enabled: bool) -> None:
    name, report = type(module).__name__, state.report
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not enabled:
        report._count(report.left_alone, ("norm", name, _disabled("norm")))
    elif not isinstance(getattr(module, "weight", None), torch.Tensor) or eps is None:
        report._count(
            report.left_alone, ("norm", name, "no weight/eps attributes to hand to the op")
        )
    else:
        forward = functools.partial(_rms_norm_forward, _ops().rms_norm, module, float(eps), offset)
        state.rebind(module, "forward", forward)
        state.rebind(
            module,
            "extra_repr",
            functools.partial(_tagged_extra_repr, module.extra_repr, "rms_norm"),
        )
        report._count(report.swapped, ("norm", name, f"ops.rms_norm(offset={offset:g})"))


def _patch_mlp(state: _PatchState, module: nn.Module, enabled: bool) -> None:
    name, report = type(module).__name__, state.report
    activation = type(getattr(module, "act_fn", None)).__name__
    has_projections = all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
    if not enabled:
        report._count(report.left_alone, ("mlp", name, _disabled("mlp")))
    elif not has_projections:
        report._count(report.left_alone, ("mlp", name, "no gate_proj/up_proj/down_proj"))
    elif activation not in SILU_ACTIVATIONS:
        why = f"activation is {activation}, ops.swiglu computes silu(gate) * up"
        report._count(report.left_alone, ("mlp", name, why))
    else:
        projections = _op_module("swiglu").swiglu_projections
        state.rebind(module, "forward", functools.partial(_swiglu_mlp_forward, projections, module))
        state.rebind(
            module, "extra_repr", functools.partial(_tagged_extra_repr, module.extra_repr, "swiglu")
        )
        report._count(report.swapped, ("mlp", name, "ops.swiglu"))


def _patch_rope(
    state: _PatchState, module: nn.Module, rope: Rope, enabled: bool, table_scale: float
) -> None:
    name, report = type(module).__name__, state.report
    refusal = (
        _disabled("rope") if not enabled else rope_problem(type(module), rope.function, rope.style)
    )
    if refusal is not None:
        report._count(report.left_alone, ("rope", name, refusal))
        return
    state.rebind(module, "forward", _rope_forward(module, rope.function, rope.style, table_scale))
    scaled = f", table_scale={table_scale:g}" if table_scale != 1.0 else ""
    report._count(
        report.swapped, ("rope", name, f"ops.rotary_embedding_pair (via {rope.function}{scaled})")
    )


def _resolve_spec(base: nn.Module, strict: bool) -> tuple[str, ModelSpec, str | None]:
    """(model_type, spec, reason the model is only partly recognised or None)."""
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise PatchError(
            f"model: expected a Hugging Face PreTrainedModel with config.model_type, got "
            f"{type(base).__name__}"
        )
    spec = spec_for(config)
    if spec is not None:
        return model_type, spec, None
    if strict:
        raise PatchError(
            f"model_type {model_type!r} is not supported by ascend_vlm.patch; supported "
            f"model_types: {', '.join(supported_model_types())}. Pass strict=False to patch "
            f"the recognised parts only."
        )
    # strict=False: a plain decoder we know still gets its text side patched.
    text = TEXT_BACKBONES.get(model_type, PartSpec())
    return model_type, ModelSpec(text=text), f"model_type {model_type!r} is not supported"


def _has_vision_config(config) -> bool:
    """Whether `config` describes a vision tower: a composite config with a vision sub-config."""
    return any("vision" in name for name in getattr(type(config), "sub_configs", {}))


def patch(
    model: nn.Module,
    *,
    attention: bool = True,
    vision: bool = True,
    norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    strict: bool = True,
) -> PatchReport:
    """Route `model` (a transformers VLM instance, optionally PEFT-wrapped) to `ascend_vlm.ops`.

    attention: text attention -> fused attention; vision: patch the vision tower at all (its
    attention, norms, RoPE, MLPs); norm / rope / mlp: those module kinds in every patched part.
    Idempotent: patching an already patched model with the same options returns the first
    report; different options raise PatchError (call `unpatch` first). Unsupported model_type:
    PatchError listing the supported ones when `strict`, else only the recognised parts are
    patched and the report says what was skipped. Returns the PatchReport.
    """
    options = {"attention": attention, "vision": vision, "norm": norm, "rope": rope, "mlp": mlp}
    base = _base_model(model, **options, strict=strict)
    check_transformers_version()
    existing: _PatchState | None = base.__dict__.get(_STATE_KEY)
    if existing is not None:
        if existing.options != options:
            raise PatchError(
                f"model is already patched with {existing.options}; call ascend_vlm.unpatch(model) "
                f"before patching with {options}"
            )
        return existing.report
    model_type, spec, unsupported = _resolve_spec(base, strict)
    state = _PatchState(options=options, report=PatchReport(model_type=model_type))
    if unsupported is not None:
        report = state.report
        if _has_vision_config(base.config):
            why = f"{unsupported} (strict=False)"
            report.left_alone[("attention-vision", "vision tower", why)] = 1
        if not spec.text.attention:
            report.left_alone[("attention-text", model_type, f"{unsupported} (strict=False)")] = 1
    _register_attention()
    tower = _find_vision_tower(base, spec.vision_towers)
    routed = []
    for part, modules in _modules_by_part(base, tower).items():
        part_spec = getattr(spec, part)
        routed += _patch_attention(state, part, modules, part_spec)
        _patch_modules(state, part, modules, part_spec)
    _route_attention(state, base, routed)
    base.__dict__[_STATE_KEY] = state
    return state.report


def unpatch(model: nn.Module) -> None:
    """Undo `patch` exactly: rebound methods and attention implementations are restored, so the
    model's outputs are bit-identical to before. A model that is not patched is left as is.
    TypeError unless `model` is an ``nn.Module``."""
    base = _base_model(model)
    state: _PatchState | None = base.__dict__.pop(_STATE_KEY, None)
    if state is not None:
        state.revert()


def is_patched(model: nn.Module) -> bool:
    return _STATE_KEY in _base_model(model).__dict__
