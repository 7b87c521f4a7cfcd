"""One question about one or more images, answered and explained: the stage timeline, where
each answer token looked in the images, and which tokens look anomalous.

:func:`explain` generates greedily under the tracer, then runs one teacher-forced forward over
prompt + answer for the attention rows (:mod:`~ascend_vlm.observability.attention_maps`).
:func:`save_explanation` writes what ``python -m ascend_vlm explain`` writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_vlm.data.vqa import with_appended_tokens
from ascend_vlm.observability.attention_maps import AnswerAttention, answer_attention
from ascend_vlm.observability.timeline import Trace
from ascend_vlm.observability.token_report import anomalous_token_report
from ascend_vlm.observability.tracer import trace
from ascend_vlm.observability.visual_grid import ImageCells, visual_token_cells


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the answer (text and token ids, end-of-sequence included
    when generated), the timeline of its generation, the answer's attention rows, the images'
    visual-token cells and the anomalous-token report (JSON-ready)."""

    question: str
    answer: str
    answer_ids: tuple[int, ...]
    answer_texts: tuple[str, ...]
    trace: Trace
    attention: AnswerAttention
    cells: tuple[ImageCells, ...]
    report: dict[str, Any]

    def image_weights(self, token: int) -> list[torch.Tensor]:
        """Answer token ``token``'s layer-mean attention on each image's visual tokens, one
        tensor per image (in prompt order, matching :attr:`cells`)."""
        if not 0 <= token < len(self.answer_ids):
            raise ValueError(
                f"token: expected an answer token index in [0, {len(self.answer_ids)}), got {token}"
            )
        row = self.attention.visual_weights()[token]
        counts = [cells.num_tokens for cells in self.cells]
        return list(row.split(counts))


def explain(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    question: str,
    *,
    max_new_tokens: int = 16,
    layers: Sequence[int] | None = None,
) -> Explanation:
    """Answer ``question`` about ``images`` (PIL images, in prompt order) greedily with
    ``model`` (a Qwen2/2.5/3-VL or LLaVA VLM for generation) and explain the answer; ``layers``:
    the decoder layers whose attention is averaged (default all)."""
    if not images:
        raise ValueError("images: expected at least one image to explain an answer about")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=prompt, images=list(images), return_tensors="pt")
    # Unsupported families fail here, before any generation.
    cells = tuple(visual_token_cells(model.config, processor.image_processor, images, inputs))
    device = next(model.parameters()).device
    inputs = {key: value.to(device) for key, value in inputs.items()}
    with torch.no_grad(), trace(model) as timeline:
        sequence = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    answer_ids = tuple(sequence[0, prompt_length:].tolist())
    full_inputs = with_appended_tokens(inputs, sequence[:1, prompt_length:])
    attention = answer_attention(model, full_inputs, prompt_length, layers=layers)
    visual = int(attention.visual.sum())
    if sum(c.num_tokens for c in cells) != visual:
        raise RuntimeError(
            f"visual tokens: the prompt holds {visual} but the image geometry gives "
            f"{sum(c.num_tokens for c in cells)}; the processor and model disagree"
        )
    texts = tuple(processor.decode([token]) for token in answer_ids)
    report = anomalous_token_report(attention, answer_ids, texts, cells)
    answer = processor.decode(list(answer_ids), skip_special_tokens=True)
    report = {"question": question, "answer": answer, **report}
    return Explanation(question, answer, answer_ids, texts, timeline, attention, cells, report)


def save_explanation(
    explanation: Explanation, images: Sequence[Any], out: str | Path, *, token: int = 0
) -> dict[str, Path]:
    """Write into folder ``out`` (created if needed): ``attention_image{k}.png`` (answer token
    ``token``'s attention over image ``k``), ``stages.png`` (the stage heat map),
    ``trace.json`` (Chrome trace) and ``report.json``. Returns the paths by name."""
    from ascend_vlm.observability.pictures import save_attention_overlay

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = explanation.image_weights(token)
    text = explanation.answer_texts[token]
    layers = explanation.attention.layers
    contiguous = list(layers) == list(range(layers[0], layers[-1] + 1))
    if len(layers) == 1:
        layer_text = f"layer {layers[0]}"
    elif contiguous:
        layer_text = f"layers {layers[0]}-{layers[-1]}"
    else:
        layer_text = "layers " + ",".join(map(str, layers))
    paths: dict[str, Path] = {}
    for cells, image, image_weights in zip(explanation.cells, images, weights, strict=True):
        name = f"attention_image{cells.image_index}"
        paths[name] = save_attention_overlay(
            out / f"{name}.png",
            image,
            cells,
            image_weights,
            title=f"answer token {token} {text!r}, {layer_text}",
        )
    paths["stages"] = explanation.trace.save_heatmap(out / "stages.png", title="stage latency (ms)")
    paths["trace"] = explanation.trace.save_chrome_trace(out / "trace.json")
    report_path = out / "report.json"
    report_path.write_text(json.dumps(explanation.report, indent=1))
    paths["report"] = report_path
    return paths
