"""``rotary_embedding``: ``out = x * cos + rotate(x) * sin`` on the first ``Dr`` dims of ``x``.

``rotate`` is NeoX "half" (``cat(-x2, x1)`` of the two halves) or, with ``interleaved=True``,
GPT-J pairs (``(-x[1::2], x[0::2])`` interleaved). ``Dr = cos.shape[-1]`` may be smaller than
``x.shape[-1]`` (partial rotary); the remaining dims pass through. With ``mrope_section``
(Qwen2-VL multimodal RoPE) cos/sin are ``[3, B, S, Dr]`` and chunk ``i`` of the D axis, split by
``mrope_section * 2``, comes from component ``i % 3`` (temporal, height, width) — the rule of
transformers' ``apply_multimodal_rotary_pos_emb``.

Scaled tables: transformers multiplies cos/sin by the rotary module's ``attention_scaling``
(YaRN, longrope: a factor > 1), so ``|cos|`` and ``|sin|`` may exceed 1. ``table_scale`` is a
bound on them, supplied by the caller, which knows it ahead of time (e.g. at patch time from the
model's rotary embedding module); it does not change the result, which is the formula above for
any bound ``>= max(|cos|, |sin|)``. The reference ignores it.

NPU: ``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="half"|"interleave")``; all inputs 4-D,
D even and < 896; for BNSD x, r1/r2 are 11SD, B1SD or BNSD in half mode and only 11SD in
interleave mode; r1/r2 values in [-1, 1]; B and N < 1000 (half), B * N < 1000 (interleave)
(:func:`~ascend_vlm.ops.kernel_constraints.rotary_mul_refusal`; outside, the reference runs;
Ascend/op-plugin
docs/context/torch_npu-npu_rotary_mul.md; torch_npu 7.0.0 API reference). With ``table_scale``
!= 1 the kernel gets ``cos / table_scale`` and ``sin / table_scale`` and its output is multiplied
by ``table_scale``: within the kernel's range, with no host read of the tables.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from ascend_vlm.ops._checks import check_dtype, check_rank, invalid
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op, empty_like_first_input
from ascend_vlm.ops.kernel_constraints import rotary_mul_refusal

SPEC = load_spec("rotary_embedding")
_X_DTYPES = SPEC.input_dtypes("x")
_TABLE_DTYPES = SPEC.input_dtypes("cos")


def _check_rotated(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: list[int] | None,
    name: str,
) -> None:
    """Validate ``x`` (called ``name`` in errors) against the cos/sin tables."""
    if (  # the common call, every rule below at once; the rest runs to explain a failure
        mrope_section is None
        and x.dtype in _X_DTYPES
        and cos.dtype in _TABLE_DTYPES
        and sin.dtype == cos.dtype
        and sin.shape == cos.shape
        and x.dim() == 4
        and 2 <= cos.dim() <= 3
        and cos.shape[-2] == x.shape[2]
        and cos.shape[-1] <= x.shape[3]
        and not cos.shape[-1] % 2
        and (cos.dim() == 2 or cos.shape[0] == 1 or cos.shape[0] == x.shape[0])
    ):
        return
    check_dtype(name, x, _X_DTYPES)
    check_dtype("cos", cos, _TABLE_DTYPES)
    check_rank(name, x, 4, "4-D [B, N, S, D] (BNSD)")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise invalid(
            "sin",
            f"shape {tuple(cos.shape)} and dtype {cos.dtype} like cos",
            f"shape {tuple(sin.shape)} and dtype {sin.dtype}",
        )
    batch, _, seq, head_dim = x.shape
    if mrope_section is not None:
        check_rank("cos", cos, 4, "4-D [3, B, S, Dr] with mrope_section")
        if cos.shape[0] != 3:
            raise invalid("cos", "dim 0 of size 3 (temporal, height, width)", tuple(cos.shape))
        if any(s <= 0 for s in mrope_section) or 2 * sum(mrope_section) != cos.shape[-1]:
            raise invalid(
                "mrope_section",
                f"positive sizes summing to Dr/2={cos.shape[-1] / 2:g}",
                list(mrope_section),
            )
        table_shape = tuple(cos.shape[1:])
    else:
        if cos.dim() not in (2, 3):
            raise invalid("cos", "2-D [S, Dr] or 3-D [B|1, S, Dr]", f"shape {tuple(cos.shape)}")
        table_shape = tuple(cos.shape) if cos.dim() == 3 else (1, *cos.shape)
    table_batch, table_seq, rotary_dim = table_shape
    if table_batch not in (1, batch) or table_seq != seq:
        raise invalid(
            "cos", _accepted_table_shapes(batch, seq, mrope_section), f"shape {tuple(cos.shape)}"
        )
    if rotary_dim > head_dim or rotary_dim % 2:
        raise invalid("cos", f"an even last dim Dr <= D={head_dim}", f"shape {tuple(cos.shape)}")


def _accepted_table_shapes(batch: int, seq: int, mrope_section: list[int] | None) -> str:
    """The cos shapes accepted for an ``x`` of this batch and sequence length, in words."""
    leads = [(), (1,)] if batch == 1 else [(), (1,), (f"B={batch}",)]
    if mrope_section is not None:
        leads = [(3, *lead) for lead in leads[1:]]
    shapes = ["[" + "".join(f"{d}, " for d in lead) + f"S={seq}, Dr]" for lead in leads]
    return " or ".join(shapes) if len(shapes) < 3 else f"{shapes[0]}, {shapes[1]} or {shapes[2]}"


def _check_table_scale(table_scale: float) -> None:
    if type(table_scale) not in (float, int) or not 0.0 < table_scale < math.inf:
        raise invalid("table_scale", "a finite float > 0 (a bound on |cos| and |sin|)", table_scale)


def _select_tables(table: torch.Tensor, mrope_section: list[int] | None) -> torch.Tensor:
    """cos/sin as ``[B|1, 1, S, Dr]`` (mrope components merged section-wise)."""
    if mrope_section is not None:
        chunks = table.split(list(mrope_section) * 2, dim=-1)
        table = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    if table.dim() == 2:
        return table[None, None]  # one view op instead of two unsqueezes
    return table.unsqueeze(1)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


# (x, cos4, sin4, interleaved, table_scale, tables shared by the inputs of one call) -> rotated x
_Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float, dict], torch.Tensor]


def _rotated(
    x: torch.Tensor,
    cos4: torch.Tensor,
    sin4: torch.Tensor,
    interleaved: bool,
    _table_scale: float = 1.0,
    _tables: dict | None = None,
) -> torch.Tensor:
    """The reference rotation of one checked ``x`` with selected ``[B|1, 1, S, Dr]`` tables
    (a :data:`_Rotation`; the reference needs no kernel-ready tables)."""
    rotary_dim = cos4.shape[-1]
    partial = rotary_dim != x.shape[-1]
    rotated_part = x[..., :rotary_dim] if partial else x
    # x * cos + rotate(x) * sin; addcmul fuses the last multiply-add (one kernel fewer).
    rotated = torch.addcmul(rotated_part * cos4, _rotate(rotated_part, interleaved), sin4)
    if rotated.dtype != x.dtype:
        rotated = rotated.to(x.dtype)
    if not partial:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _npu_rotated(
    x: torch.Tensor,
    cos4: torch.Tensor,
    sin4: torch.Tensor,
    interleaved: bool,
    table_scale: float,
    tables: dict,
) -> torch.Tensor:
    """One checked ``x`` through ``npu_rotary_mul`` when the kernel takes it, else the
    reference. ``tables`` caches the kernel-ready (divided by ``table_scale``, dtype-cast,
    contiguous) r1/r2 per dtype, so q and k of one call share them."""
    rotary_dim = cos4.shape[-1]
    batch, heads = x.shape[0], x.shape[1]
    mode = "interleave" if interleaved else "half"
    kernel_fits = (
        rotary_mul_refusal(x.dtype, rotary_dim, batch, heads, mode, "BNSD") is None
        # interleave mode only takes 11SD tables
        and not (interleaved and cos4.shape[0] != 1)
    )
    if not kernel_fits:
        return _rotated(x, cos4, sin4, interleaved)
    if x.dtype not in tables:
        tables[x.dtype] = tuple(_kernel_table(t, x.dtype, table_scale) for t in (cos4, sin4))
    r1, r2 = tables[x.dtype]
    torch_npu = importlib.import_module("torch_npu")
    rotated = torch_npu.npu_rotary_mul(
        x[..., :rotary_dim].contiguous(),
        r1,
        r2,
        rotary_mode=mode,
    )
    if table_scale != 1.0:
        rotated = rotated * table_scale
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _kernel_table(table: torch.Tensor, dtype: torch.dtype, table_scale: float) -> torch.Tensor:
    """``table / table_scale`` as a contiguous ``dtype`` tensor for the kernel's r1/r2; the
    division runs in fp32 so that a unit table rounds to within one unit of 1 in ``dtype``."""
    if table_scale != 1.0:
        table = table.float() / table_scale
    return table.to(dtype).contiguous()


def _check(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: list[int] | None,
    _interleaved: bool,
    table_scale: float,
) -> None:
    _check_rotated(x, cos, sin, mrope_section, "x")
    _check_table_scale(table_scale)


def _rotation_op(rotate: _Rotation) -> Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]:
    """The implementation of rotary_embedding (``x``) and rotary_embedding_pair (``q, k``) that
    ``rotate``s: tables selected once, each input rotated separately (never joined), kernel-ready
    tables shared between them."""

    def implementation(_checked: None, *args: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
        *inputs, cos, sin, mrope_section, interleaved, table_scale = args
        cos4, sin4 = _select_tables(cos, mrope_section), _select_tables(sin, mrope_section)
        shared: dict = {}
        if len(inputs) == 1:
            return rotate(inputs[0], cos4, sin4, interleaved, table_scale, shared)
        q, k = inputs
        return rotate(q, cos4, sin4, interleaved, table_scale, shared), rotate(
            k, cos4, sin4, interleaved, table_scale, shared
        )

    return implementation


_reference, _npu = _rotation_op(_rotated), _rotation_op(_npu_rotated)
rotary_embedding = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=empty_like_first_input,
    doc="""Apply RoPE to ``x`` ``[B, N, S, D]``; cos/sin ``[B|1, S, Dr]``, ``[S, Dr]`` or, with
    ``mrope_section``, ``[3, B|1, S, Dr]``. ``table_scale``: a bound on ``|cos|`` and ``|sin|``
    (1.0 for unit tables; transformers' ``attention_scaling`` for scaled ones). Returns ``x``'s
    shape and dtype (see module docstring for the formula). Raises ValueError naming the
    argument for bad shapes, dtypes or a ``table_scale`` that is not a finite float > 0.""",
)


PAIR_SPEC = load_spec("rotary_embedding_pair")


def _check_pair(q: torch.Tensor, k: torch.Tensor, *tables_and_options: Any) -> None:
    """Check a rotary_embedding_pair call: ``tables_and_options`` are its arguments after k."""
    cos, sin, mrope_section, _interleaved, table_scale = tables_and_options
    _check_rotated(q, cos, sin, mrope_section, "q")
    _check_rotated(k, cos, sin, mrope_section, "k")
    _check_table_scale(table_scale)
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise invalid("k", f"batch and sequence (dims 0, 2) of q {tuple(q.shape)}", tuple(k.shape))


def _pair_fake(
    _checked: None, q: torch.Tensor, k: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


rotary_embedding_pair = define_op(
    PAIR_SPEC,
    check=_check_pair,
    reference=_reference,
    npu=_npu,
    fake=_pair_fake,
    doc="""``(rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin))`` (same options) in one
    call: the tables are selected once, q and k are never joined. ``k`` may have fewer heads than
    ``q`` (GQA) but shares its batch and sequence length. Bad inputs raise ``ValueError``
    naming the argument.""",
)


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _cast_like(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rotary_embedding_pair_vision(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    table_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on a vision tower's packed q ``[T, Nq, D]`` and k ``[T, Nk, D]`` with cos/sin
    ``[T, Dr]``, in fp32 whatever the inputs' dtypes (transformers'
    ``apply_rotary_pos_emb_vision``): :func:`rotary_embedding_pair` on fp32 copies of q, k, cos
    and sin viewed as ``[1, N, T, D]``, each output cast back to the dtype of its input.
    ``table_scale`` as in :func:`rotary_embedding`. Raises ValueError naming the argument for bad
    shapes or dtypes."""
    check_rank("q", q, 3, "3-D [T, N, D]")
    check_rank("k", k, 3, "3-D [T, N, D]")
    q_bnsd = _float32(q).transpose(0, 1).unsqueeze(0)
    k_bnsd = _float32(k).transpose(0, 1).unsqueeze(0)
    q_out, k_out = rotary_embedding_pair(
        q_bnsd, k_bnsd, _float32(cos), _float32(sin), table_scale=table_scale
    )
    q_out, k_out = q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)  # -> [T, N, D]
    return _cast_like(q_out, q), _cast_like(k_out, k)


def rotary_embedding_pair_complex(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor,
    *,
    table_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in Llama 4's complex convention (transformers' llama4 ``apply_rotary_emb`` and
    ``vision_apply_rotary_emb``) on q ``[B, S, Nq, D]`` and k ``[B, S, Nk, D]`` (BSND).

    Each pair ``(x[2i], x[2i+1])`` is the complex number ``x[2i] + j x[2i+1]``, multiplied by
    ``freqs[b, s, i]``; ``freqs`` is complex with ``B*S*D/2`` elements (text: ``[B, S, D/2]``)
    or ``S*D/2`` (vision: ``[S, 1, D/2]``, shared by the batch), broadcast over heads. That
    product is the GPT-J interleaved rotation with ``cos = Re(freqs)`` and ``sin = Im(freqs)``
    each repeated for both members of a pair: :func:`rotary_embedding_pair` with
    ``interleaved=True`` on fp32 copies of q and k viewed as ``[B, N, S, D]`` (the stock math
    runs in fp32 / complex64), each output cast back to its input's dtype. ``table_scale``: a
    bound on ``|freqs|`` (transformers scales the text table by ``attention_scaling``). Raises
    ValueError naming the argument for bad ranks, a real ``freqs`` or one of another size."""
    check_rank("q", q, 4, "4-D [B, S, N, D] (BSND)")
    check_rank("k", k, 4, "4-D [B, S, N, D] (BSND)")
    if not freqs.is_complex():
        raise invalid("freqs", "a complex tensor", f"dtype {freqs.dtype}")
    batch, seq, _, head_dim = q.shape
    pairs = head_dim // 2
    if head_dim % 2 or freqs.numel() not in (seq * pairs, batch * seq * pairs):
        raise invalid(
            "freqs",
            f"S*D/2={seq * pairs} or B*S*D/2={batch * seq * pairs} elements for q of shape "
            f"{tuple(q.shape)} (even D)",
            f"shape {tuple(freqs.shape)}",
        )
    table = freqs.reshape(-1, seq, pairs)
    cos = _float32(table.real).repeat_interleave(2, dim=-1)
    sin = _float32(table.imag).repeat_interleave(2, dim=-1)
    q_out, k_out = rotary_embedding_pair(
        _float32(q).transpose(1, 2),
        _float32(k).transpose(1, 2),
        cos,
        sin,
        interleaved=True,
        table_scale=table_scale,
    )
    return _cast_like(q_out.transpose(1, 2), q), _cast_like(k_out.transpose(1, 2), k)
