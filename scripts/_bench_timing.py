"""Side-by-side timing shared by the bench scripts: warm-up, interleaved rounds in a rotating
order, medians, and the A/A twin whose ratio to its original is the noise floor of every other
ratio in the same run.

    ms = interleaved_ms({"ours": f, "theirs": g, "theirs (A/A)": g}, rounds=7)
    ms["theirs (A/A)"] / ms["theirs"]   # the A/A ratio printed beside ours / theirs
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_ms(
    calls: dict[str, Callable[[], object]], rounds: int, per_round: int = 1, warmup: int = 1
) -> dict[str, float]:
    """Median over ``rounds`` of each contender's milliseconds per call.

    Every contender is called ``warmup`` times first; each round then times ``per_round`` calls
    of every contender, in an order that rotates from round to round so no contender always
    runs first (or right after the slowest one).
    """
    if rounds < 1 or per_round < 1 or warmup < 0:
        raise ValueError(
            f"rounds, per_round: expected >= 1 and warmup >= 0, got {rounds}, {per_round}, {warmup}"
        )
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(per_round):
                calls[name]()
            samples[name].append((time.perf_counter() - start) * 1e3 / per_round)
    return {name: statistics.median(times) for name, times in samples.items()}
