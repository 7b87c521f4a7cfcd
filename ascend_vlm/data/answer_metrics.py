"""Answer metrics: each maps (prediction, gold answer) to right or wrong.

* ``exact``: the prediction equals the answer after stripping surrounding whitespace;
* ``normalised``: equal after :func:`ascend_vlm.data.vqa.normalise_answer` (also
  lowercased, trailing full stop dropped), the metric the fine-tune script's
  ``eval_accuracy`` uses.
"""

from __future__ import annotations

from collections.abc import Callable

from ascend_vlm.data.vqa import normalise_answer


def exact_match(prediction: str, answer: str) -> bool:
    """True when ``prediction`` and ``answer`` are equal up to surrounding whitespace."""
    return prediction.strip() == answer.strip()


def normalised_match(prediction: str, answer: str) -> bool:
    """True when ``prediction`` and ``answer`` have the same :func:`normalise_answer` form."""
    return normalise_answer(prediction) == normalise_answer(answer)


METRICS: dict[str, Callable[[str, str], bool]] = {
    "exact": exact_match,
    "normalised": normalised_match,
}
# The metric the one-line summaries and --compare's headline use.
PRIMARY_METRIC = "normalised"


def score(prediction: str, answer: str) -> dict[str, bool]:
    """Every metric's verdict on one prediction, keyed by metric name."""
    return {name: metric(prediction, answer) for name, metric in METRICS.items()}
