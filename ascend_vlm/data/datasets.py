"""The samples an evaluation answers: ShapesVQA's held-out split or a JSONL/LLaVA file.

Both are :class:`EvalDataset`: indexable :class:`~ascend_vlm.data.vqa.VQASample`s, each
with a question type, and a JSON description recorded in the report.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from ascend_vlm.data.vqa import VQASample

# ShapesVQA records evaluated when no --limit is given: 100 per question type.
DEFAULT_SHAPES_SAMPLES = 500
# The question type of JSONL records without a "type" field.
UNTYPED = "all"


class EvalDataset:
    """``size`` samples read through ``sample(i)``, of question type ``question_type(i)``."""

    def __init__(
        self,
        size: int,
        sample: Callable[[int], VQASample],
        question_type: Callable[[int], str],
        description: dict[str, Any],
    ) -> None:
        self.size = size
        self._sample = sample
        self._question_type = question_type
        self.description = {**description, "samples": size}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> VQASample:
        if not 0 <= index < self.size:
            raise IndexError(f"index: expected in [0, {self.size}), got {index}")
        return self._sample(index)

    def question_type(self, index: int) -> str:
        """The question type of sample ``index``."""
        return self._question_type(index)

    def head(self, count: int) -> EvalDataset:
        """The first ``count`` samples (1 <= ``count`` <= ``len(self)``) as a dataset."""
        if not isinstance(count, int) or not 1 <= count <= self.size:
            raise ValueError(f"count: expected an int in [1, {self.size}], got {count!r}")
        return EvalDataset(count, self._sample, self._question_type, self.description)


def shapes_vqa(
    limit: int | None = None,
    seed: int = 0,
    image_size: int | None = None,
    new_kinds: Sequence[str] = (),
) -> EvalDataset:
    """The first ``limit`` (default ``DEFAULT_SHAPES_SAMPLES``) records of ShapesVQA's held-out
    "eval" split for ``seed``, rendered at ``image_size`` (None: ShapesVQA's default).

    With K ``new_kinds`` names the scenes show the first K new shape kinds instead of the base
    kinds, called by those names in order (``shapes_vqa.new_kind_names``), as a fine-tune run
    with ``--shapes-new-kinds --new-tokens`` evaluates them.

    Record ``i`` asks question type ``QUESTION_TYPES[i % len(QUESTION_TYPES)]``, as
    :class:`~ascend_vlm.data.shapes_vqa.ShapesVQA` documents. Raises ``ValueError`` (from
    ``ShapesVQA``) for a ``limit`` below 1, an ``image_size`` it does not take, more than four
    ``new_kinds`` or names that are not distinct.
    """
    from ascend_vlm.data.shapes_vqa import QUESTION_TYPES, ShapesVQA, new_kind_names

    size = DEFAULT_SHAPES_SAMPLES if limit is None else limit
    sizing = {} if image_size is None else {"image_size": image_size}
    if new_kinds:
        names = new_kind_names(new_kinds)
        sizing.update(kinds=tuple(names), kind_names=names)
    records = ShapesVQA(split="eval", size=size, seed=seed, **sizing)
    description = {
        "name": "shapes_vqa",
        "split": "eval",
        "seed": seed,
        "image_size": records.image_size,
        **({"kind_names": records.kind_names} if new_kinds else {}),
    }
    return EvalDataset(
        size,
        records.__getitem__,
        lambda index: QUESTION_TYPES[index % len(QUESTION_TYPES)],
        description,
    )


def jsonl(path: str | os.PathLike) -> EvalDataset:
    """Every sample of a JSONL/LLaVA file, loaded with the shared
    :class:`~ascend_vlm.data.vqa.JsonlVQA`; every record must be good.

    A sample's question type is its record's ``"type"`` field, ``UNTYPED`` without one.
    Raises ``FileNotFoundError`` (no such file) or
    :class:`~ascend_vlm.data.vqa.BadRecordError` (a bad record, named by its number).
    """
    from ascend_vlm.data.vqa import JsonlVQA

    records = JsonlVQA(path, on_bad_record="fail")
    return EvalDataset(
        len(records),
        records.__getitem__,
        lambda index: records.question_type(index) or UNTYPED,
        {"name": "jsonl", "path": str(records.path)},
    )
