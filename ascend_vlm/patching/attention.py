"""The attention function transformers calls under ``ATTENTION_NAME``, and its registration."""

from __future__ import annotations

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat.attention import (
    ATTENTION_NAME,
    VARLEN_BOUND_KWARGS,
    VARLEN_KWARGS,
    mark_flash_functions_loaded,
    output_collector,
    register_attention_function,
)

_CU_Q, _CU_K = VARLEN_KWARGS
_MAX_Q, _MAX_K = VARLEN_BOUND_KWARGS


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
      within themselves -> ``ops.packed_attention`` (Qwen2-VL vision, padding-free training).
    * padded/masked: ``attention_mask`` is the 4-D boolean (True = attend) or additive float mask
      made by the mask function registered with this name (`sdpa_mask`), or None. As in
      transformers' sdpa path, causal is ``module.is_causal`` (or the ``is_causal`` kwarg) when no
      mask is given and more than one query is present -> ``ops.fused_attention``. A causal
      call with more keys than queries and no mask is a prefill into an empty StaticCache (the
      mask function relies on SDPA's top-left alignment): only the first Sq keys are used.

    Sliding windows, attention chunks (Llama 4) and packed-sequence boundaries arrive encoded in
    the mask; the varlen path raises ValueError for ``dropout > 0``, a ``sliding_window`` and a
    chunked-attention layer (it can honour none of them).
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
    if attention_mask is None and kwargs.get(_CU_Q) is None:
        _check_unmasked_chunks(module, query.shape[2], key.shape[2], bool(is_causal))
    if _attention_weights_requested(kwargs):
        mask = _mask_for_weights(
            module, query, key, attention_mask, bool(is_causal), dropout, kwargs
        )
        return _attention_with_weights(query, key, value, mask, scaling, dropout)
    cu_seqlens_q = kwargs.get(_CU_Q)
    if cu_seqlens_q is not None:
        output = ops.packed_attention(
            query,
            key,
            value,
            cu_seqlens_q,
            _checked_varlen_call(module, query, dropout, kwargs),
            max_seqlen_q=kwargs.get(_MAX_Q),
            max_seqlen_k=kwargs.get(_MAX_K),
            causal=bool(is_causal),
            scale=scaling,
        )
        return output, None
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


def _checked_varlen_call(
    module: nn.Module, query: torch.Tensor, dropout: float, kwargs: dict
) -> torch.Tensor:
    """The key offsets of a packed varlen call (``cu_seq_lens_q`` given) by ``module``, after
    refusing what packed attention cannot honour; ``cu_seq_lens_k`` defaults to
    ``cu_seq_lens_q``."""
    if query.shape[0] != 1:
        raise ValueError(
            f"query: expected batch 1 for packed varlen attention ({_CU_Q} given), "
            f"got shape {tuple(query.shape)}"
        )
    _check_varlen_honours(dropout, kwargs.get("sliding_window"), _attention_chunk(module))
    cu_seqlens_k = kwargs.get(_CU_K)
    return kwargs[_CU_Q] if cu_seqlens_k is None else cu_seqlens_k


def _attention_chunk(module: nn.Module) -> int | None:
    """The chunk size of ``module``'s layer when its config makes it a chunked-attention layer
    (Llama 4: ``layer_types[layer_idx]`` is "chunked_attention", ``attention_chunk_size`` set),
    else None."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if chunk is None or not layer_types or not isinstance(index, int):
        return None
    return chunk if layer_types[index] == "chunked_attention" else None


def _check_unmasked_chunks(
    module: nn.Module, query_length: int, key_length: int, is_causal: bool
) -> None:
    """Raise when a chunked-attention layer gets no mask although its keys span more than one
    chunk: without the mask the chunks are lost. The mask functions return None for such a
    layer only while every key lies in one chunk (a causal prefill into an empty StaticCache
    uses its first ``query_length`` keys)."""
    chunk = _attention_chunk(module)
    used = min(query_length, key_length) if is_causal and query_length > 1 else key_length
    if chunk is not None and used > chunk:
        raise ValueError(
            f"attention_mask: expected the chunked-attention mask of a layer with chunks of "
            f"{chunk} over {used} keys, got None; build the masks with transformers' "
            f"create_chunked_causal_mask (the model's forward does)"
        )


def _check_varlen_honours(
    dropout: float, sliding_window: int | None, attention_chunk: int | None
) -> None:
    """Raise for what ``ops.varlen_attention`` cannot compute, rather than dropping it silently.

    On the padded path all three arrive honoured: dropout goes to ``ops.fused_attention``, and
    the sliding window and the attention chunks are encoded in the mask made by the mask
    function. Packed varlen calls get no mask.
    """
    if attention_chunk is not None:
        raise ValueError(
            f"attention_chunk_size: packed varlen attention ({_CU_Q} given) attends to whole "
            f"segments, got a chunked-attention layer (chunks of {attention_chunk}); use padded "
            f"batches (the mask then carries the chunks) or attn_implementation='eager'"
        )
    if dropout > 0.0:
        raise ValueError(
            f"dropout: packed varlen attention ({_CU_Q} given) has no attention dropout, "
            f"got dropout={dropout}; set the config's attention_dropout to 0 or train with padded "
            f"batches (no flash-attention kwargs) to keep it"
        )
    if sliding_window is not None:
        raise ValueError(
            f"sliding_window: packed varlen attention ({_CU_Q} given) attends to whole "
            f"segments, got sliding_window={sliding_window}; use padded batches (the mask then "
            f"carries the window) or attn_implementation='eager'"
        )


def _attention_weights_requested(kwargs: dict) -> bool:
    """Whether this call's caller collects attention weights: ``output_attentions=True`` passed
    down to the attention function, or an output capture collecting an "*attentions" output."""
    if kwargs.get("output_attentions"):
        return True
    collected = output_collector()()
    return collected is not None and any(name.endswith("attentions") for name in collected)


def _mask_for_weights(
    module: nn.Module,
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
    if kwargs.get(_CU_Q) is not None:
        cu_seqlens_k = _checked_varlen_call(module, query, dropout, kwargs)
        return _segment_mask(kwargs[_CU_Q], cu_seqlens_k, query, key, is_causal)
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
    weights = ops.attention_probabilities(query, key, mask, scale=scaling).to(query.dtype)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        value = value.repeat_interleave(groups, dim=1)
    if dropout > 0.0:
        weights = nn.functional.dropout(weights, p=dropout, training=True)
    output = torch.matmul(weights, value)
    return output.transpose(1, 2).contiguous(), weights


def register_attention() -> None:
    """Register `ascend_attention_forward` (and `sdpa_mask` as its mask function) with
    transformers under ``ATTENTION_NAME``, and mark its flash functions loaded so that
    ``from_pretrained(..., attn_implementation=ATTENTION_NAME)`` and ``set_attn_implementation``
    accept the name (`mark_flash_functions_loaded`). Idempotent, process-wide but inert: only
    configs whose ``_attn_implementation`` is ATTENTION_NAME use it."""
    register_attention_function(ATTENTION_NAME, ascend_attention_forward)
    mark_flash_functions_loaded(ATTENTION_NAME)
