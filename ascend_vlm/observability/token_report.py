"""Anomalous answer tokens: per-token attention and hidden-state statistics, robust outliers.

For each answer token (the row of the position that produced it, averaged over the chosen
layers, see :mod:`~ascend_vlm.observability.attention_maps`):

* ``visual_share``: the attention mass on visual tokens, ``sum_{j visual} w_j`` (rows sum to 1);
* ``visual_entropy``: entropy of the attention renormalised over the visual tokens,
  ``-sum p_j log p_j / log V`` with ``p = w_visual / sum w_visual`` (0: one token, 1: uniform);
* ``hidden_norm``: L2 norm of the last decoder layer's output at that position.

A token is an outlier on a statistic when its robust z-score ``(x - median) / s`` exceeds
:data:`OUTLIER_THRESHOLD` in absolute value (Iglewicz and Hoaglin's modified z-score). ``s`` is
the median absolute deviation from the median scaled to a normal's standard deviation,
``1.4826 MAD``; when more than half the values share one (MAD 0), the mean absolute deviation,
``1.253314 meanAD``. ``s`` is at least :data:`RELATIVE_SCALE_FLOOR` of ``|median|``: values
that agree to a few parts in a thousand (an entropy of 0.9999 among 0.99995s) are not
anomalous however tightly the others cluster. All values equal score 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ascend_vlm.observability.attention_maps import AnswerAttention
from ascend_vlm.observability.visual_grid import ImageCells

OUTLIER_THRESHOLD = 3.5
RELATIVE_SCALE_FLOOR = 0.01
STATISTICS = ("visual_share", "visual_entropy", "hidden_norm")


def robust_z_scores(values: torch.Tensor) -> torch.Tensor:
    """Modified z-scores of a 1-D float tensor (see the module docstring)."""
    values = values.double()
    median = values.median()
    deviation = (values - median).abs()
    mad = deviation.median()
    scale = 1.4826 * mad if mad > 0 else 1.253314 * deviation.mean()
    scale = torch.maximum(scale, RELATIVE_SCALE_FLOOR * median.abs())
    if scale == 0:
        return torch.zeros_like(values)
    return (values - median) / scale


def token_statistics(attention: AnswerAttention) -> dict[str, torch.Tensor]:
    """The :data:`STATISTICS` of each answer token, float64 ``[T]`` each."""
    rows = attention.layer_mean().double()
    visual = rows[:, attention.visual]
    share = visual.sum(dim=1)
    count = visual.shape[1]
    if count > 1:
        p = visual / share.clamp_min(torch.finfo(torch.float64).tiny)[:, None]
        entropy = -(p * p.clamp_min(1e-300).log()).sum(dim=1) / torch.log(torch.tensor(count))
    else:
        entropy = torch.zeros_like(share)
    return {
        "visual_share": share,
        "visual_entropy": entropy,
        "hidden_norm": attention.hidden_norms.double(),
    }


def _attended_region(weights: torch.Tensor, cells: Sequence[ImageCells]) -> dict[str, Any] | None:
    """The visual token with the most attention: its image, box in that image's pixels, weight."""
    if not cells or weights.numel() == 0:
        return None
    index = int(weights.argmax())
    for image in cells:
        count = image.num_tokens
        if index < count:
            return {
                "image": image.image_index,
                "box": [round(float(v), 2) for v in image.boxes[index]],
                "weight": float(weights.max()),
            }
        index -= count
    return None


def anomalous_token_report(
    attention: AnswerAttention,
    token_ids: Sequence[int],
    token_texts: Sequence[str],
    cells: Sequence[ImageCells],
) -> dict[str, Any]:
    """JSON-ready report: every answer token (its index in the answer, its own ``position`` in
    prompt + answer, id and text) with its statistics, robust z-scores and most attended image
    region, then the outliers (tokens with ``|z| > OUTLIER_THRESHOLD`` on any
    statistic, naming which). ``token_ids``/``token_texts``: the answer's tokens, one per row
    of ``attention``; ``cells``: the prompt's images' visual tokens (:mod:`visual_grid`)."""
    count = len(attention.query_positions)
    if len(token_ids) != count or len(token_texts) != count:
        raise ValueError(
            f"token_ids, token_texts: expected {count} entries (one per answer token), got "
            f"{len(token_ids)} and {len(token_texts)}"
        )
    statistics = token_statistics(attention)
    scores = {name: robust_z_scores(values) for name, values in statistics.items()}
    visual_rows = attention.visual_weights()
    tokens, outliers = [], []
    for index in range(count):
        flagged = [n for n in STATISTICS if abs(float(scores[n][index])) > OUTLIER_THRESHOLD]
        entry = {
            "index": index,
            "position": attention.query_positions[index] + 1,  # the token's own position
            "token_id": int(token_ids[index]),
            "text": token_texts[index],
            **{name: float(statistics[name][index]) for name in STATISTICS},
            "z": {name: round(float(scores[name][index]), 3) for name in STATISTICS},
            "attended": _attended_region(visual_rows[index], cells),
        }
        tokens.append(entry)
        if flagged:
            outliers.append({**entry, "outlier_on": flagged})
    return {
        "layers": list(attention.layers),
        "threshold": OUTLIER_THRESHOLD,
        "statistics": list(STATISTICS),
        "tokens": tokens,
        "outliers": outliers,
    }
