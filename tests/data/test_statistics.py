"""Wilson intervals, McNemar's exact test and Newcombe's paired interval on known answers."""

from __future__ import annotations

import math

import pytest

from ascend_vlm.data.statistics import (
    latency_summary,
    mcnemar_exact_p,
    paired_difference_interval,
    wilson_interval,
)

# Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I,
# method 3 (score interval without continuity correction), to 4 decimals.
PUBLISHED_WILSON = [
    ((81, 263), (0.2553, 0.3662)),
    ((15, 148), (0.0624, 0.1605)),
    ((0, 20), (0.0, 0.1611)),
    ((1, 29), (0.0061, 0.1718)),
]
# Newcombe (1998), "Improved confidence intervals for the difference between binomial
# proportions based on paired data", worked examples of method 10: table (both, first only,
# second only, neither) -> 95% interval for p1 - p2, to 4 decimals.
PUBLISHED_PAIRED = [
    ((36, 12, 2, 0), (0.0569, 0.3404)),
    ((18, 12, 2, 18), (0.0562, 0.3290)),
    ((53, 0, 0, 1), (-0.0729, 0.0729)),
    ((0, 30, 0, 0), (0.8395, 1.0)),
]


@pytest.mark.parametrize(("counts", "expected"), PUBLISHED_WILSON)
def test_wilson_interval_matches_published_values(counts, expected):
    low, high = wilson_interval(*counts)
    assert (round(low, 4), round(high, 4)) == expected


def test_wilson_interval_at_other_levels_and_extremes():
    # 5/10 at 90%: p +- z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n) with z = 1.6449, i.e.
    # 0.5 +- 0.2307 (the interval is symmetric at p = 1/2).
    low, high = wilson_interval(5, 10, confidence=0.9)
    assert low == pytest.approx(0.2692718, abs=1e-7)
    assert high == pytest.approx(0.7307282, abs=1e-7)
    # n/n: the upper limit is 1 and the lower one n / (n + z^2).
    low, high = wilson_interval(32, 32)
    assert high == 1.0
    assert low == pytest.approx(32 / (32 + 1.959964**2), abs=1e-6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: wilson_interval(3, 0), "trials: expected >= max(1, successes=3), got 0"),
        (lambda: wilson_interval(-1, 4), "successes: expected a count >= 0, got -1"),
        (lambda: wilson_interval(1, 4, confidence=1.0), "confidence: expected a level in"),
        (lambda: mcnemar_exact_p(1.5, 2), "first_only: expected a count >= 0, got 1.5"),
        (lambda: paired_difference_interval(0, 0, 0, 0), "table: expected at least one pair"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_mcnemar_exact_p_is_the_two_sided_binomial_tail_of_the_discordant_pairs():
    # 2 vs 9 discordant pairs: P = 2 * P(X <= 2), X ~ Bin(11, 1/2)
    #   = 2 * (C(11,0) + C(11,1) + C(11,2)) / 2^11 = 2 * (1 + 11 + 55) / 2048 = 134 / 2048.
    assert mcnemar_exact_p(2, 9) == 134 / 2048
    assert mcnemar_exact_p(9, 2) == 134 / 2048
    # 0 vs 6: 2 * (1/2)^6 = 1/32.
    assert mcnemar_exact_p(0, 6) == 1 / 32
    # balanced or no discordant pairs: no evidence of a difference.
    assert mcnemar_exact_p(4, 4) == 1.0
    assert mcnemar_exact_p(0, 0) == 1.0


@pytest.mark.parametrize(("table", "expected"), PUBLISHED_PAIRED)
def test_paired_difference_interval_matches_newcombes_examples(table, expected):
    low, high = paired_difference_interval(*table)
    assert (round(low, 4), round(high, 4)) == expected


def test_paired_difference_interval_without_discordant_pairs_is_centred_on_zero():
    low, high = paired_difference_interval(40, 0, 0, 10)
    assert low == pytest.approx(-high)
    assert low < 0 < high


def test_latency_summary_in_milliseconds():
    # p95 of [1, 2, 3, 4] ms by linear interpolation: 3 + 0.85 * (4 - 3) = 3.85.
    summary = latency_summary([0.001, 0.002, 0.003, 0.004])
    assert summary["count"] == 4
    assert math.isclose(summary["mean_ms"], 2.5)
    assert math.isclose(summary["p95_ms"], 3.85)
    assert latency_summary([]) == {"mean_ms": None, "p95_ms": None, "count": 0}
