"""Numerical probes: does our op compute what a module of a class no family names computes?

Each probe runs the stock module (or rotary function) and the fused op the generic path would
put in its place on the same seeded random inputs, of the module's own widths, dtype and
device, and compares the outputs within the dtype's tolerance (those of
``torch.testing.assert_close``: ``|ours - stock| <= atol + rtol * |stock|``). A probe returns a
`Verdict`: the variant that agrees (a norm's offset, 0 or 1 for ``(1 + weight)`` norms) or why
none does, with the largest error seen. Probes run under ``torch.no_grad`` and change nothing:
a norm is probed on a copy with random weights (a forward ignoring its weight then disagrees),
an MLP on its own weights.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat.decorators import plain_function
from ascend_vlm._compat.module_internals import MLP_PROJECTIONS
from ascend_vlm.patching.adapters import rope_adapter, swiglu_mlp_forward

# (rtol, atol) per dtype: torch.testing.assert_close's defaults.
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}
# The (1 + weight) variant (Gemma) is probed after the plain one.
NORM_OFFSETS = (0.0, 1.0)
# Batch, sequence, query heads and key/value heads of the random probe inputs.
_BATCH, _SEQUENCE, _HEADS, _KV_HEADS = 2, 5, 4, 2
_SEED = 0


@dataclass(frozen=True)
class Verdict:
    """What one probe found: ``setting`` is the variant that agrees (a norm's offset, True for
    an MLP or rotary function), or None with ``reason`` saying why none does (with each
    variant's largest absolute error); ``max_error`` is the agreeing variant's largest absolute
    error, else the smallest over the variants."""

    setting: object | None
    max_error: float
    reason: str | None = None


def _random(shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=like.device, dtype=like.dtype)


def _error(ours: object, stock: object) -> tuple[float, bool]:
    """(largest absolute error, within the dtype's tolerance) of `ours` against `stock`, each a
    tensor or a tuple of tensors; (inf, False) when their structure, shapes or dtypes differ."""
    ours = ours if isinstance(ours, tuple) else (ours,)
    stock = stock if isinstance(stock, tuple) else (stock,)
    if len(ours) != len(stock):
        return float("inf"), False
    worst, close = 0.0, True
    for mine, theirs in zip(ours, stock, strict=True):
        if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
            return float("inf"), False
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            return float("inf"), False
        rtol, atol = TOLERANCES.get(theirs.dtype, TOLERANCES[torch.float32])
        difference = (mine.double() - theirs.double()).abs()
        worst = max(worst, float(difference.max()) if difference.numel() else 0.0)
        close &= bool((difference <= atol + rtol * theirs.double().abs()).all())
    return worst, close


def _compare(
    variants: list[tuple[object, str, Callable[[], object]]], stock: Callable[[], object], op: str
) -> Verdict:
    """The `Verdict` of running each variant (setting, label, call of our op) against `stock`:
    the first variant that agrees, else why none does."""
    try:
        with torch.no_grad():
            expected = stock()
    except Exception as error:  # whatever it raises, the swap cannot be verified
        return Verdict(None, float("inf"), f"probe: the stock forward raised {error!r}")
    failures, errors = [], []
    for setting, label, call in variants:
        try:
            with torch.no_grad():
                worst, close = _error(call(), expected)
        except Exception as error:  # likewise
            failures.append(f"{op} raised {type(error).__name__}{label}")
            continue
        if close:
            return Verdict(setting, worst)
        errors.append(worst)
        failures.append(f"max abs error {worst:.3g}{label}")
    why = f"probe: {op} disagrees with the stock forward: {', '.join(failures)}"
    return Verdict(None, min(errors, default=float("inf")), why)


def _takes_one_input(module: nn.Module) -> bool:
    """Whether the module's forward takes exactly one argument (what our forwards take)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def probe_norm(module: nn.Module, eps: float) -> Verdict:
    """Whether ``ops.rms_norm_promoting(x, weight, eps, offset=o)`` equals the norm's forward for
    an ``o`` of ``NORM_OFFSETS``, on x [2, 5, H] and a random weight [H] of the module's dtype."""
    if not _takes_one_input(module):
        return Verdict(None, float("inf"), "probe: forward takes more than the hidden states")
    generator = torch.Generator().manual_seed(_SEED)
    probed = copy.deepcopy(module)
    weight = probed.weight
    with torch.no_grad():
        weight.copy_(_random(tuple(weight.shape), weight, generator))
    x = _random((_BATCH, _SEQUENCE, weight.shape[0]), weight, generator)
    variants = [
        (
            offset,
            f" with offset {offset:g}",
            lambda offset=offset: ops.rms_norm_promoting(x, weight, eps, offset=offset),
        )
        for offset in NORM_OFFSETS
    ]
    return _compare(variants, lambda: probed(x), "ops.rms_norm")


def probe_mlp(module: nn.Module) -> Verdict:
    """Whether `swiglu_mlp_forward` equals the gated MLP's forward on x [2, 5, in_features] of
    its gate projection's dtype, with the MLP's own weights."""
    if not _takes_one_input(module):
        return Verdict(None, float("inf"), "probe: forward takes more than the hidden states")
    gate = getattr(module, MLP_PROJECTIONS[0])
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return Verdict(None, float("inf"), "probe: the gate projection has no float weight")
    generator = torch.Generator().manual_seed(_SEED)
    x = _random((_BATCH, _SEQUENCE, weight.shape[-1]), weight, generator)
    variants = [(True, "", lambda: swiglu_mlp_forward(module, x))]
    return _compare(variants, lambda: module(x), "ops.swiglu")


def probe_rope(
    function: Callable,
    style: str,
    head_dim: int,
    like: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    table_scale: float,
) -> Verdict:
    """Whether our adapter for rotary `style` equals the module-level rotary `function`.

    style "text": q [2, 4, 5, D], k [2, 2, 5, D] and cos/sin [2, 5, Dr]; style "vision": q/k
    [5, 4, D] and cos/sin [5, Dr]; D is `head_dim`, the dtype and device those of `like`. cos/sin
    are `tables` (the model's own rotary module's, of that shape) when given, else
    ``cos/sin(cat(a, a))`` of random angles ``a`` [..., D / 2].
    """
    generator = torch.Generator().manual_seed(_SEED)
    leading = (_BATCH, _SEQUENCE) if style == "text" else (_SEQUENCE,)
    if tables is None:
        angles = _random((*leading, head_dim // 2), like, generator) * 3
        angles = torch.cat((angles, angles), dim=-1)
        tables = (angles.cos(), angles.sin())
    if style == "text":
        q = _random((_BATCH, _HEADS, _SEQUENCE, head_dim), like, generator)
        k = _random((_BATCH, _KV_HEADS, _SEQUENCE, head_dim), like, generator)
    else:
        q = _random((_SEQUENCE, _HEADS, head_dim), like, generator)
        k = _random((_SEQUENCE, _HEADS, head_dim), like, generator)
    stock = plain_function(function)
    ours = rope_adapter(style, table_scale)
    variants = [(True, "", lambda: tuple(ours(q, k, *tables)))]
    return _compare(variants, lambda: tuple(stock(q, k, *tables)), "ops.rotary_embedding_pair")
