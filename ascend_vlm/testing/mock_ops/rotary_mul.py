"""Stand-in for ``torch_npu.npu_rotary_mul`` (doc: ``docs/context/torch_npu-npu_rotary_mul.md`` and
the torch-npu wheel's ``torch_npu/_op_plugin_docs.py``; shared/reference/npu_api.md §1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_vlm.ops.kernel_constraints import NPU_DTYPES, rotary_mul_refusal
from ascend_vlm.testing._checks import bad, check_dtype, refuse

ROPE_MODES = ("half", "interleave")


@dataclass(frozen=True)
class _RopeLayout:
    """One x layout of npu_rotary_mul by the axes of its B, N and S (D is last). Its r1/r2
    tables share S and D with x and are 1 elsewhere (11SD-like); in half mode they may also
    share B (B1SD-like) or be x's full shape."""

    name: str
    batch_axis: int
    heads_axis: int
    seq_axis: int

    def table_patterns(self, rotary_mode: str) -> tuple[frozenset[int], ...]:
        """The sets of axes a table may share with x (all its other dims are 1)."""
        shared = frozenset({self.seq_axis, 3})
        if rotary_mode == "interleave":
            return (shared,)
        return (shared, shared | {self.batch_axis}, frozenset(range(4)))


# The kernel infers the layout from the tables; a table that fits several (full-shape tables,
# or unit dims) is read as the first here, in the docs' order.
ROPE_LAYOUTS = (
    _RopeLayout("BNSD", batch_axis=0, heads_axis=1, seq_axis=2),
    _RopeLayout("BSND", batch_axis=0, heads_axis=2, seq_axis=1),
    _RopeLayout("SBND", batch_axis=1, heads_axis=2, seq_axis=0),
)


def _rope_layout(input: torch.Tensor, r1: torch.Tensor, rotary_mode: str) -> _RopeLayout:
    """The layout whose documented table pattern `r1` fits (see ROPE_LAYOUTS), else ValueError."""
    for layout in ROPE_LAYOUTS:
        for pattern in layout.table_patterns(rotary_mode):
            if all(r1.shape[i] == (input.shape[i] if i in pattern else 1) for i in range(4)):
                return layout
    patterns = (
        "11SD/1S1D/S11D"
        if rotary_mode == "interleave"
        else "11SD, B1SD, BNSD (or the BSND/SBND equivalents)"
    )
    raise bad(
        "r1",
        f"a {patterns} table for input {tuple(input.shape)} in {rotary_mode!r} mode",
        f"shape {tuple(r1.shape)}",
    )


def _check_rotate(rotate: torch.Tensor, input: torch.Tensor) -> None:
    """``rotate``: a 2-D (D, D) matrix in input's dtype (the doc: 2-D, fp16/bf16/fp32; square
    of side D because ``input @ rotate`` has input's shape; its dtype equal to input's is
    UNVERIFIED and chosen to be conservative)."""
    head_dim = input.shape[-1]
    check_dtype("rotate", rotate, NPU_DTYPES)
    if tuple(rotate.shape) != (head_dim, head_dim):
        raise bad("rotate", f"a 2-D (D, D) = ({head_dim}, {head_dim}) matrix", tuple(rotate.shape))
    if rotate.dtype != input.dtype:
        raise bad("rotate", f"dtype {input.dtype} like input", rotate.dtype)


def _check_rope_arguments(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str
) -> None:
    """The documented constraints on x, r1, r2 and the mode (ValueError naming the argument)."""
    if rotary_mode not in ROPE_MODES:
        raise bad("rotary_mode", f"one of {ROPE_MODES}", repr(rotary_mode))
    for name, tensor in (("input", input), ("r1", r1), ("r2", r2)):
        check_dtype(name, tensor, NPU_DTYPES)
        if tensor.dim() != 4:
            raise bad(name, "a 4-D tensor (BNSD, BSND or SBND)", f"shape {tuple(tensor.shape)}")
    if r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise bad("r1/r2", f"dtype {input.dtype} like input", (r1.dtype, r2.dtype))
    if r2.shape != r1.shape:
        raise bad("r2", f"shape {tuple(r1.shape)} like r1", f"shape {tuple(r2.shape)}")
    layout = _rope_layout(input, r1, rotary_mode)
    batch, heads = input.shape[layout.batch_axis], input.shape[layout.heads_axis]
    refusal = rotary_mul_refusal(
        input.dtype, input.shape[-1], batch, heads, rotary_mode, layout.name
    )
    if refusal is not None:
        raise refuse("npu_rotary_mul", refusal)
    for name, table in (("r1", r1), ("r2", r2)):
        # A unit table computed in fp32 and rounded to r1's dtype stays within one unit of
        # rounding (eps) of 1; anything beyond is a scaled table the kernel does not take.
        if bool((table.abs() > 1.0 + torch.finfo(table.dtype).eps).any()):
            raise bad(name, "values in [-1, 1] (cos/sin)", f"max |value| {table.abs().max():g}")


def npu_rotary_mul(
    input: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_rotary_mul``: ``out = r1 * x + r2 * x_new`` with ``x_new``
    = ``cat(-x2, x1)`` of the halves ("half") or ``(-x[1::2], x[0::2])`` pairs ("interleave");
    with ``rotate`` given, ``x_new = x @ rotate`` in either mode (the mode still sets the table
    layouts and size limits). All 4-D; r1/r2 in [-1, 1] with a documented broadcast pattern."""
    _check_rope_arguments(input, r1, r2, rotary_mode)
    x = input.float()
    if rotate is not None:
        _check_rotate(rotate, input)
        rotated = x @ rotate.float()
    elif rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)
