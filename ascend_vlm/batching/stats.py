"""`RunStats`: what a batch generator has done since it was made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunStats:
    """Counters since the generator was made: finished ``requests``, ``output_tokens``,
    ``steps``, ``seconds`` spent in :meth:`BatchGenerator.submit` (encoding prompts and images)
    and :meth:`BatchGenerator.run`, the mean share of each bounded budget used per step
    (``utilisation``, name -> fraction), the prompt tokens prefilled (``prefilled_tokens``)
    and those the prefix cache supplied instead (``reused_tokens``, over ``prefix_hits``
    requests), and ``kv_bytes``, the KV the running sequences hold now."""

    requests: int
    output_tokens: int
    steps: int
    seconds: float
    utilisation: dict[str, float]
    prefilled_tokens: int
    prefix_hits: int
    reused_tokens: int
    kv_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0
