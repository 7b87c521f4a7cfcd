"""`verify(model, inputs)`: where a model drifts from its stock reference, module by module.

For each input, three forwards run with the same capture points (`capture_points`):

1. the **reference** (the same weights in stock transformers, ``float32`` on the CPU, or
   ``float64``): every capture is kept on the CPU until the input is done (one copy of one
   input's activations at the points, the only full activations kept);
2. the **noise floor** (the stock model in the test dtype on the CPU): each capture is reduced
   at once to its error sums against the reference's (`errors.error_sums`) and dropped;
3. the **model under test** as it is (its device, dtype, patched or not): reduced the same way,
   on its device (the reference's capture is moved there for the reduction).

A module is flagged when the model's relative L2 exceeds ``k`` times the floor's plus ``slack``
(an absolute slack, so a module that rounding leaves exact does not flag on a zero floor); the
report names the first flagged one in execution order and the kind of op there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm.data.vqa import VQASample
from ascend_vlm.kernel_backend import active_backend
from ascend_vlm.observability.memory import PeakRSS
from ascend_vlm.patching import is_patched
from ascend_vlm.verification.capture import CaptureKey, capturing
from ascend_vlm.verification.capture_points import CapturePoint, capture_points
from ascend_vlm.verification.end_to_end import DEFAULT_MAX_NEW_TOKENS, compare_end_to_end
from ascend_vlm.verification.errors import ErrorSums, error_sums
from ascend_vlm.verification.flagged_repro import save_flagged_repro
from ascend_vlm.verification.reference import (
    REFERENCE_DTYPES,
    check_reference,
    floor_model,
    reference_model,
    require_transformers_model,
)
from ascend_vlm.verification.report import ModuleError, VerifyReport, capture_label

# Keys of model inputs that carry images (or video frames); verify needs one per input.
IMAGE_KEYS = ("pixel_values", "pixel_values_videos")


def _checked_inputs(inputs: Any) -> list[Mapping[str, Any]]:
    """``inputs`` as a list of model-input mappings, each carrying images; ValueError naming
    ``inputs`` otherwise."""
    batches = [inputs] if isinstance(inputs, Mapping) else inputs
    if not isinstance(batches, Sequence) or not batches:
        raise ValueError(
            f"inputs: expected a mapping of model inputs or a non-empty sequence of them, "
            f"got {type(inputs).__name__}"
        )
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"inputs: expected mappings of model inputs, got {type(batch).__name__} at {index}"
            )
        if not any(isinstance(batch.get(key), torch.Tensor) for key in IMAGE_KEYS):
            raise ValueError(
                f"inputs: expected images ({' or '.join(IMAGE_KEYS)}) in every input, since "
                f"verify checks the vision tower and projector too; got keys {sorted(batch)} "
                f"in input {index}"
            )
    return list(batches)


def model_inputs(
    device: torch.device | str, dtype: torch.dtype, batch: Mapping[str, Any]
) -> dict[str, Any]:
    """``batch`` on ``device``, its floating tensors (pixels) in ``dtype``, the run's dtype."""
    return {
        key: value.to(device, dtype if value.is_floating_point() else value.dtype)
        if isinstance(value, torch.Tensor)
        else value
        for key, value in batch.items()
    }


def _floating_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _check_settings(k: float, slack: float, reference_dtype: torch.dtype, model: nn.Module) -> None:
    if not (isinstance(k, (int, float)) and k > 0 and math.isfinite(k)):
        raise ValueError(f"k: expected a finite number > 0, got {k!r}")
    if not (isinstance(slack, (int, float)) and slack >= 0 and math.isfinite(slack)):
        raise ValueError(f"slack: expected a finite number >= 0, got {slack!r}")
    if reference_dtype not in REFERENCE_DTYPES:
        raise ValueError(
            f"reference_dtype: expected torch.float32 or torch.float64, got {reference_dtype}"
        )
    if model.training:
        raise ValueError("model: expected eval mode (dropout off; call model.eval()), got training")


class _Comparison:
    """The sums of one model's captures against the reference's, over every input."""

    def __init__(self) -> None:
        self.sums: dict[CaptureKey, ErrorSums] = {}
        self.pending: dict[CaptureKey, torch.Tensor] = {}
        self.reference: dict[CaptureKey, tuple[torch.Tensor, ...]] = {}

    def compare(self, key: CaptureKey, tensors: tuple[torch.Tensor, ...]) -> None:
        if key in self.reference:
            self.pending[key] = error_sums(tensors, self.reference[key])

    def settle(self) -> None:
        """Fold the input's sums in (one copy from the device per input)."""
        if self.pending:
            values = torch.stack(list(self.pending.values())).double().cpu().tolist()
            for key, sums in zip(self.pending, values, strict=True):
                self.sums.setdefault(key, ErrorSums()).add(sums)
        self.pending = {}


def _run(model: nn.Module, points: list[CapturePoint], sink, batch: dict) -> None:
    with capturing(model, points, sink), torch.no_grad():
        model(**batch)


def _three_runs(
    models: tuple[nn.Module, nn.Module, nn.Module],
    points: list[CapturePoint],
    batches: list[Mapping[str, Any]],
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[list[CaptureKey], _Comparison, _Comparison]:
    """Per input: the reference's captures kept, the floor's and the model's reduced against
    them (module docstring). ``models``: (reference, floor, model under test); ``dtypes``: the
    reference's and the test dtype. Returns the capture keys in execution order, the model's
    comparison and the floor's."""
    reference, floor, model = models
    reference_dtype, dtype = dtypes
    device = next(model.parameters()).device
    test, noise = _Comparison(), _Comparison()
    order: dict[CaptureKey, None] = {}
    for batch in batches:
        kept: dict[CaptureKey, tuple[torch.Tensor, ...]] = {}

        def keep(key: CaptureKey, tensors: tuple[torch.Tensor, ...], kept=kept) -> None:
            kept[key] = tuple(t.detach().clone() for t in tensors)
            order.setdefault(key)

        _run(reference, points, keep, model_inputs("cpu", reference_dtype, batch))
        for comparison, runner, where in ((noise, floor, "cpu"), (test, model, device)):
            comparison.reference = kept
            _run(runner, points, comparison.compare, model_inputs(where, dtype, batch))
            comparison.settle()
            comparison.reference = {}
    return list(order), test, noise


def verify(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    reference: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    reference_dtype: torch.dtype = torch.float32,
    k: float = 4.0,
    slack: float = 1e-4,
    processor: Any = None,
    samples: Sequence[VQASample] | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    replay_dir: str | os.PathLike | None = None,
) -> VerifyReport:
    """Compare what ``model`` computes at every capture point with its stock reference, against
    the noise floor of ``dtype`` (module docstring); returns the :class:`VerifyReport`.

    ``model``: a transformers VLM for generation in eval mode (optionally PEFT-wrapped), on any
    device and dtype, patched or not. ``inputs``: model kwargs (tensors with a batch axis,
    images included) or a sequence of them. ``reference``: a stock model with the same weights
    (moved to the CPU and cast to ``reference_dtype`` in place), or None to build one from
    ``model``'s weights. ``dtype``: the test dtype of the noise floor (default: ``model``'s).
    ``k`` and ``slack``: a module is flagged when its relative L2 > k * floor + slack.

    With ``processor``, the report's ``end_to_end`` compares the model with the reference end
    to end (`end_to_end.compare_end_to_end`: top-1 agreement, KL, the first differing greedy
    token among ``max_new_tokens``) on ``samples`` (VQA samples: with the paired accuracy) or,
    without them, on ``inputs`` (batches of one). With ``replay_dir``, a flagged module's call
    on the first input is saved there as a repro (`replay`; the report's ``repro``, or
    ``repro_problem`` when its inputs have no plain-data form).

    ValueError naming the argument for: inputs without images, a model the reference cannot be
    built for (not a transformers model, quantized or otherwise non-stock weights), a reference
    with other weights or carrying an ascend_vlm feature, bad settings, ``samples`` without a
    ``processor``.
    """
    base = base_model(model)
    require_transformers_model(base)
    if samples is not None and processor is None:
        raise ValueError(
            "samples: expected a processor with them (the end-to-end comparison runs samples "
            "through it), got samples and processor=None"
        )
    batches = _checked_inputs(inputs)
    _check_settings(k, slack, reference_dtype, base)
    dtype = dtype or _floating_dtype(base)
    device = next(base.parameters()).device
    with PeakRSS() as memory:
        if reference is None:
            reference = reference_model(base, reference_dtype)
        else:
            reference = check_reference(base_model(reference), base, reference_dtype)
        floor = floor_model(base, dtype)
        points = capture_points(floor)
        runs = (reference, floor, base)
        order, test, noise = _three_runs(runs, points, batches, (reference_dtype, dtype))
        del floor, runs
        end_to_end = None
        if processor is not None:
            compared = batches if samples is None else samples
            end_to_end = compare_end_to_end(
                base, reference, processor, compared, max_new_tokens=max_new_tokens
            )
        del reference
    kinds = {point.name: point.kind for point in points}
    report = VerifyReport(
        model_type=base.config.model_type,
        patched=is_patched(base),
        device=str(device),
        backend=active_backend(),
        dtype=str(dtype).removeprefix("torch."),
        reference_dtype=str(reference_dtype).removeprefix("torch."),
        k=float(k),
        slack=float(slack),
        inputs=len(batches),
        modules=[
            _module_error(depth, key, kinds[key[0]], test.sums[key], noise.sums.get(key), k, slack)
            for depth, key in enumerate(key for key in order if key in test.sums)
        ],
        not_captured=[capture_label(*key) for key in order if key not in test.sums],
        peak_host_bytes=memory.peak_bytes,
        end_to_end=end_to_end,
    )
    if replay_dir is not None and report.first_flagged is not None:
        _save_repro(report, base, model_inputs(device, dtype, batches[0]), replay_dir, dtype)
    return report


def _save_repro(
    report: VerifyReport,
    model: nn.Module,
    batch: dict[str, Any],
    directory: str | os.PathLike,
    dtype: torch.dtype,
) -> None:
    """Set ``report.repro`` to the repro of its first flagged call on ``batch``, or
    ``report.repro_problem`` to why it cannot be written."""
    try:
        path = save_flagged_repro(model, report.first_flagged, batch, directory, dtype)
    except ValueError as error:
        report.repro_problem = str(error)
    else:
        report.repro = str(path)


def _module_error(
    depth: int,
    key: CaptureKey,
    kind: str,
    test: ErrorSums,
    floor: ErrorSums | None,
    k: float,
    slack: float,
) -> ModuleError:
    """The row of one capture; a capture the floor did not make has a zero floor."""
    floor = floor or ErrorSums()
    return ModuleError(
        depth=depth,
        name=key[0],
        call=key[1],
        kind=kind,
        relative_l2=test.relative_l2,
        max_abs=test.max_abs,
        cosine=test.cosine,
        floor_relative_l2=floor.relative_l2,
        floor_max_abs=floor.max_abs,
        floor_cosine=floor.cosine,
        threshold=k * floor.relative_l2 + slack,
    )
