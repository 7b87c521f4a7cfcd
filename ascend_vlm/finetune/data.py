"""Fine-tuning data: VQA samples, JSONL / LLaVA record loading, and processor collation."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True)
class VQASample:
    """One visual question with its gold single-turn ``answer`` about ``image`` (RGB)."""

    image: Image.Image
    question: str
    answer: str
