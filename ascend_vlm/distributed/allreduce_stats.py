"""The running counters of a sparse all-reduce state (:class:`SparseAllReduceStats`)."""

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SparseAllReduceStats:
    """Running counters of one :class:`SparseAllReduceState`, cheap enough to keep on.

    ``bytes_*`` count the payload one rank hands to its collectives: ``bytes_dense`` what the
    default hook all-reduces, ``bytes_sent`` what this hook all-reduces or all-gathers (the
    chunk mask or the row exchange's sizes included). ``chunks_nonzero`` counts the union of
    the ranks' non-zero chunks; when row chunks fall back to dense it is the sum of the
    ranks' counts (capped at the chunks probed), an upper bound of the union.
    """

    steps: int = 0
    buckets: int = 0
    dense_fallbacks: int = 0
    warmup_buckets: int = 0
    chunks_probed: int = 0
    chunks_nonzero: int = 0
    bytes_dense: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    @property
    def chunk_density(self) -> float:
        """Fraction of probed chunks that were non-zero on at least one rank."""
        return self.chunks_nonzero / self.chunks_probed if self.chunks_probed else 0.0

    @property
    def bytes_ratio(self) -> float:
        """``bytes_dense / bytes_sent``: how many times fewer bytes than the default hook."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else math.inf

    @property
    def seconds_per_bucket(self) -> float:
        """Mean wall time from hook entry to the bucket's all-reduce completing."""
        return self.seconds / self.buckets if self.buckets else 0.0

    def summary(self) -> str:
        return (
            f"steps={self.steps} buckets={self.buckets} dense_fallbacks={self.dense_fallbacks} "
            f"warmup_buckets={self.warmup_buckets} chunk_density={self.chunk_density:.3f} "
            f"bytes_ratio={self.bytes_ratio:.2f}x "
            f"ms_per_bucket={1e3 * self.seconds_per_bucket:.2f}"
        )
