"""The repro of a flagged capture: the one call of the model under test that `verify` flagged,
saved with its inputs by `replay.save_repro` for a kernel team.

The model runs one input again with a :class:`~ascend_vlm.verification.capture.Capture` on the
flagged point only; the call with the flagged call index hands its target (the module, or for a
RoPE point the rotary function the attention resolved: transformers' own in a stock model, the
`patching.adapters` drop-in in a patched one) and its arguments to ``save_repro`` as it happens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_vlm.verification.capture import CaptureKey, capturing
from ascend_vlm.verification.capture_points import capture_points
from ascend_vlm.verification.replay import save_repro
from ascend_vlm.verification.report import ModuleError


def repro_name(flagged: ModuleError) -> str:
    """The file name of ``flagged``'s repro: its capture's name (and call index after the
    first), ``.pt``."""
    return f"{flagged.name}{f'.call{flagged.call}' if flagged.call else ''}.pt"


def save_flagged_repro(
    model: nn.Module,
    flagged: ModuleError,
    inputs: Mapping[str, Any],
    directory: str | os.PathLike,
    dtype: torch.dtype,
) -> Path:
    """Run ``model`` on ``inputs`` (one input as `verify` ran it: on the model's device, pixels
    in ``dtype``) and write the repro of ``flagged``'s call into ``directory`` (created when
    missing); returns its path. ValueError (from ``save_repro``) when the call's inputs have no
    plain-data form, or when the call does not happen on ``inputs``."""
    point = next(p for p in capture_points(model) if p.name == flagged.name)
    path = Path(directory) / repro_name(flagged)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    device = next(model.parameters()).device

    def save(key: CaptureKey, target: Callable, args: tuple, kwargs: dict) -> None:
        if key == (flagged.name, flagged.call):
            saved.append(
                save_repro(
                    target,
                    args,
                    kwargs,
                    path,
                    kind=flagged.kind,
                    dtype=dtype,
                    device=device,
                    module_name=flagged.name,
                )
            )

    with capturing(model, [point], lambda key, tensors: None, save), torch.no_grad():
        model(**inputs)
    if not saved:
        raise ValueError(
            f"inputs: expected a call {flagged.call} of {flagged.name} to save, got none"
        )
    return saved[0]
