"""Which checkpoint a ``--model`` value names, and loading it with its processor."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

# The --model value that names the trained reference checkpoint (built on first use).
REFERENCE = "reference"


# A Hugging Face Hub repository id: "name" or "namespace/name".
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def resolve_model(spec: str | os.PathLike, argument: str = "--model") -> Path:
    """The local checkpoint folder ``spec`` names, as ``from_pretrained`` reads it: the
    reference checkpoint for ``REFERENCE`` (:func:`ascend_vlm.finetune.reference_model.
    reference_model_path`, built on first use), an existing path as it is, else a Hub id,
    fetched into (or found in, offline) the Hugging Face cache with a progress bar.

    Raises ``FileNotFoundError`` naming ``argument`` when ``spec`` is neither an existing path
    nor a Hub id that can be fetched (offline and not cached, no such repository, no network).
    """
    if spec == REFERENCE:
        from ascend_vlm.finetune import reference_model

        return reference_model.reference_model_path()
    path = Path(spec)
    if path.exists() or not HUB_ID.match(str(spec)):
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(spec)))
    except Exception as error:  # offline, unknown repository, network: each its own kind
        raise FileNotFoundError(
            f"{argument}: expected a local checkpoint folder or a Hugging Face Hub id, got "
            f"{str(spec)!r}: no such folder, and fetching it from the Hub failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from None


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


def checkpoint_folder(spec: str | os.PathLike, argument: str = "--model") -> Path:
    """The checkpoint folder ``spec`` names (:func:`resolve_model`), checked to hold a model and
    its processor (:func:`check_checkpoint`); ``FileNotFoundError`` naming ``argument``
    otherwise."""
    path = resolve_model(spec, argument)
    check_checkpoint(path, argument)
    return path


def load_model_and_processor(path: str | os.PathLike, argument: str = "path") -> tuple[Any, Any]:
    """``(model, processor)`` of the checkpoint folder ``path``, the model in eval mode.

    Raises ``FileNotFoundError`` naming ``argument`` as :func:`check_checkpoint` does.
    """
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    check_checkpoint(path, argument)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return model, load_processor(path)
