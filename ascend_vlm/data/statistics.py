"""Interval estimates and tests for accuracies measured on a finite sample.

* :func:`wilson_interval`: the Wilson score interval of one proportion (scipy's
  ``binomtest(...).proportion_ci(method="wilson")``);
* :func:`mcnemar_exact_p`: McNemar's exact test of two paired accuracies, i.e. the two-sided
  exact binomial test of the discordant pairs against 1/2 (scipy's ``binomtest``);
* :func:`paired_difference_interval`: Newcombe's (1998) method 10 interval for the difference
  of two paired proportions, built from the two Wilson intervals. scipy has no paired
  difference interval, so its four lines of algebra are written out here;
* :func:`paired_accuracies`: both accuracies of two configurations' per-sample outcomes, their
  difference with that interval, the 2x2 table and McNemar's p;
* :func:`latency_summary`: mean and 95th percentile of a list of durations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name}: expected a count >= 0, got {value!r}")


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a level in (0, 1), got {confidence!r}")


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for ``successes`` out of ``trials`` (>= 1)."""
    from scipy.stats import binomtest

    _check_counts(successes=successes, trials=trials)
    _check_confidence(confidence)
    if trials == 0 or successes > trials:
        raise ValueError(f"trials: expected >= max(1, successes={successes}), got {trials}")
    interval = binomtest(int(successes), int(trials)).proportion_ci(
        confidence_level=confidence, method="wilson"
    )
    return float(interval.low), float(interval.high)


def mcnemar_exact_p(first_only: int, second_only: int) -> float:
    """Two-sided exact McNemar p-value for paired outcomes.

    ``first_only`` pairs were right under the first configuration only, ``second_only`` under
    the second only. Under the null hypothesis (equal accuracy) each of the ``n = first_only +
    second_only`` discordant pairs falls either way with probability 1/2, so the p-value is
    the two-sided exact binomial test of ``first_only`` out of ``n`` against 1/2; 1.0 when
    there is no discordant pair.
    """
    from scipy.stats import binomtest

    _check_counts(first_only=first_only, second_only=second_only)
    discordant = first_only + second_only
    if discordant == 0:
        return 1.0
    return float(binomtest(int(first_only), int(discordant), 0.5).pvalue)


def paired_difference_interval(
    both: int, first_only: int, second_only: int, neither: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Newcombe's method 10 interval for ``p1 - p2`` from a paired 2x2 table.

    With ``n = both + first_only + second_only + neither``, ``p1 = (both + first_only) / n``
    and ``p2 = (both + second_only) / n`` have Wilson intervals ``(l1, u1)`` and ``(l2, u2)``;
    ``D = p1 - p2``; ``phi`` is the correlation of the table with its numerator
    ``both * neither - first_only * second_only`` replaced by ``max(that - n/2, 0)`` when
    positive (0 when a margin is empty). Then

        low  = D - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        high = D + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)

    Newcombe, "Improved confidence intervals for the difference between binomial proportions
    based on paired data", Statistics in Medicine 17 (1998) 2635-2650.
    """
    _check_counts(both=both, first_only=first_only, second_only=second_only, neither=neither)
    n = both + first_only + second_only + neither
    if n == 0:
        raise ValueError("table: expected at least one pair, got an empty table")
    p1, p2 = (both + first_only) / n, (both + second_only) / n
    l1, u1 = wilson_interval(both + first_only, n, confidence)
    l2, u2 = wilson_interval(both + second_only, n, confidence)
    margins = (
        (both + first_only)
        * (second_only + neither)
        * (both + second_only)
        * (first_only + neither)
    )
    numerator = both * neither - first_only * second_only
    if numerator > 0:
        numerator = max(numerator - n / 2, 0.0)
    phi = numerator / math.sqrt(margins) if margins else 0.0
    difference = p1 - p2
    low = math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    high = math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return difference - low, difference + high


def paired_accuracies(first: Sequence[bool], second: Sequence[bool]) -> dict[str, object]:
    """The paired comparison of per-sample outcomes (True: right) of two configurations on the
    same samples: ``first_accuracy``, ``second_accuracy``, ``difference`` (second - first),
    ``ci95`` (its 95% paired interval, :func:`paired_difference_interval`), the table's
    ``both`` / ``first_only`` / ``second_only`` / ``neither`` counts and ``mcnemar_p``.
    Raises ValueError for outcome lists of different lengths or none."""
    if len(first) != len(second) or not first:
        raise ValueError(
            f"second: expected outcomes of the same {len(first)} samples as first (at least "
            f"one), got {len(second)}"
        )
    table = {"both": 0, "first_only": 0, "second_only": 0, "neither": 0}
    for a, b in zip(first, second, strict=True):
        cell = ("both" if b else "first_only") if a else ("second_only" if b else "neither")
        table[cell] += 1
    n = len(first)
    first_accuracy = (table["both"] + table["first_only"]) / n
    second_accuracy = (table["both"] + table["second_only"]) / n
    low, high = paired_difference_interval(
        table["both"], table["second_only"], table["first_only"], table["neither"]
    )
    return {
        "first_accuracy": first_accuracy,
        "second_accuracy": second_accuracy,
        "difference": second_accuracy - first_accuracy,
        "ci95": [low, high],
        **table,
        "mcnemar_p": mcnemar_exact_p(table["first_only"], table["second_only"]),
    }


def latency_summary(seconds: Sequence[float]) -> dict[str, float | int | None]:
    """``{"mean_ms", "p95_ms", "count"}`` of ``seconds`` (milliseconds; the 95th percentile is
    numpy's linear interpolation); the two times are None for an empty list."""
    if not seconds:
        return {"mean_ms": None, "p95_ms": None, "count": 0}
    values = np.asarray(seconds, dtype=np.float64) * 1e3
    return {
        "mean_ms": float(values.mean()),
        "p95_ms": float(np.percentile(values, 95)),
        "count": len(values),
    }
