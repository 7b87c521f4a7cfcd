"""Which checkpoint a ``--model`` value names, and loading it with its processor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The --model value that names the trained reference checkpoint (built on first use).
REFERENCE = "reference"


def resolve_model(spec: str) -> Path:
    """The checkpoint folder ``spec`` names: the reference checkpoint for ``REFERENCE``
    (:func:`ascend_vlm.finetune.reference_model.reference_model_path`, built on first use),
    else ``spec`` as a path."""
    if spec == REFERENCE:
        from ascend_vlm.finetune import reference_model

        return reference_model.reference_model_path()
    return Path(spec)


def check_checkpoint(path: str | os.PathLike, argument: str = "path") -> None:
    """Raise ``FileNotFoundError`` naming ``argument`` unless ``path`` is a checkpoint folder
    with ``config.json``, a tokenizer and an image processor."""
    from ascend_vlm.default_model import require_processor_files

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{argument}: expected a local checkpoint directory with config.json, got {path}"
        )
    require_processor_files(path, argument)


def load_model_and_processor(path: str | os.PathLike, argument: str = "path") -> tuple[Any, Any]:
    """``(model, processor)`` of the checkpoint folder ``path``, the model in eval mode.

    Raises ``FileNotFoundError`` naming ``argument`` as :func:`check_checkpoint` does.
    """
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    check_checkpoint(path, argument)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return model, load_processor(path)
