"""rotary_embedding specifics: gradients, transformers' mrope rule, input errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _op_samples import RotaryCase
from transformers.models.qwen2_vl import modeling_qwen2_vl

from ascend_vlm import ops


def _case(**overrides) -> RotaryCase:
    base = dict(
        batch=2,
        heads=2,
        seq=3,
        head_dim=8,
        rotary_dim=8,
        table_form="BS",
        mrope_section=None,
        interleaved=False,
        dtype=torch.float64,
        seed=2,
    )
    return RotaryCase(**{**base, **overrides})


@pytest.mark.parametrize(
    "case",
    [
        _case(),
        _case(interleaved=True, rotary_dim=4, table_form="S"),
        _case(table_form="mrope", mrope_section=(1, 1, 2)),
    ],
    ids=["half", "interleaved-partial", "mrope"],
)
def test_gradcheck_fp64(case: RotaryCase) -> None:
    (x, cos, sin), kwargs = case.op_args()
    inputs = tuple(t.requires_grad_() for t in (x, cos, sin))
    assert torch.autograd.gradcheck(lambda *t: ops.rotary_embedding(*t, **kwargs), inputs)


def test_mrope_matches_transformers_qwen2_vl() -> None:
    """transformers 5.x merges the sections on the [3, B, S, D/2] frequencies inside the rotary
    module, then duplicates them; the op takes the duplicated [3, B, S, D] tables instead."""
    section = [1, 1, 2]
    freqs = torch.randn(3, 2, 5, 4)
    x = torch.randn(2, 3, 5, 8)
    recompose = modeling_qwen2_vl.Qwen2VLRotaryEmbedding.recomposition_frequencies
    holder = SimpleNamespace(mrope_section=section)
    cos_hf, sin_hf = recompose(holder, freqs.cos()), recompose(holder, freqs.sin())
    expected, _ = modeling_qwen2_vl.apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    tables = torch.cat((freqs, freqs), dim=-1)
    out = ops.rotary_embedding(x, tables.cos(), tables.sin(), mrope_section=section)
    torch.testing.assert_close(out, expected)
