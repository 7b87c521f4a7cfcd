"""Side-by-side timing shared by the bench scripts: warm-up, interleaved rounds in a rotating
order, medians, and the A/A twin whose ratio to its original is the noise floor of every other
ratio in the same run.

    ms = interleaved_ms({"ours": f, "theirs": g, "theirs (A/A)": g}, rounds=7)
    ms["theirs (A/A)"] / ms["theirs"]   # the A/A ratio printed beside ours / theirs

A bench that measures something other than the wall time of a call (a time inside the model,
tokens per second, bytes) has each call return its measurement and collects the rounds with
:func:`interleaved_rounds`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

Measurement = TypeVar("Measurement")
Contender = TypeVar("Contender", bound=Hashable)


def interleaved_rounds(
    calls: dict[Contender, Callable[[], Measurement]], rounds: int, warmup: int = 1
) -> dict[Contender, list[Measurement]]:
    """What each contender's call returned in each of ``rounds`` rounds.

    Every contender is called ``warmup`` times first (those results are dropped); each round
    then calls every contender once, in an order that rotates from round to round so no
    contender always runs first (or right after the slowest one).
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds, warmup: expected >= 1 and >= 0, got {rounds}, {warmup}")
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    samples: dict[Contender, list[Measurement]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(calls[name]())
    return samples


def interleaved_ms(
    calls: dict[Contender, Callable[[], object]],
    rounds: int,
    per_round: int = 1,
    warmup: int = 1,
    summary: Callable[[list[float]], float] = statistics.median,
) -> dict[Contender, float]:
    """``summary`` (the median unless told) over ``rounds`` interleaved rounds
    (:func:`interleaved_rounds`) of each contender's milliseconds per call, each round timing
    ``per_round`` calls."""
    if per_round < 1:
        raise ValueError(f"per_round: expected >= 1, got {per_round}")

    def timed(call: Callable[[], object]) -> Callable[[], float]:
        def milliseconds() -> float:
            start = time.perf_counter()
            for _ in range(per_round):
                call()
            return (time.perf_counter() - start) * 1e3 / per_round

        return milliseconds

    samples = interleaved_rounds(
        {name: timed(call) for name, call in calls.items()}, rounds, warmup
    )
    return {name: summary(times) for name, times in samples.items()}
