"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server.

The names are a contract (the Kubernetes autoscaler of ``deploy/kubernetes`` scales on them):

* ``ascend_vlm_requests_total{status}``: chat-completion requests by outcome (:data:`STATUSES`);
* histograms ``ascend_vlm_time_to_first_token_seconds`` (request received to its first token),
  ``ascend_vlm_time_per_output_token_seconds`` (mean gap between a request's later tokens) and
  ``ascend_vlm_request_duration_seconds`` (received to its last byte);
* counters ``ascend_vlm_prompt_tokens_total``, ``ascend_vlm_visual_tokens_total`` (the image
  tokens among the prompt tokens) and ``ascend_vlm_generated_tokens_total``;
* gauges ``ascend_vlm_queue_depth`` (requests accepted and not yet running),
  ``ascend_vlm_running_rows`` (sequences in the running batch), ``ascend_vlm_kv_bytes`` (KV
  bytes the running sequences hold now) and ``ascend_vlm_kv_tokens`` (tokens whose KV they
  hold: bytes over tokens shows what the blocks cost beyond the tokens' need), read from the
  engine at scrape;
* counters ``ascend_vlm_vision_cache_hits_total`` / ``ascend_vlm_vision_cache_misses_total``,
  read from the model's vision cache at scrape (0 without one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# Outcomes of a chat-completion request (the ``status`` label).
STATUSES = (
    "ok",  # answered (stream or not)
    "invalid",  # 400 / 404 / 413: the request's fault, including a budget it exceeds
    "unauthorized",  # 401
    "queue_full",  # 429
    "unavailable",  # 503: draining at shutdown
    "cancelled",  # the client left before the answer ended
    "error",  # 500: the model failed
)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _VisionCacheCounters(Collector):
    """Hits and misses of the vision cache ``cache()`` returns (None: no cache), at scrape."""

    def __init__(self, cache: Callable[[], Any]) -> None:
        self._cache = cache

    def collect(self) -> Iterator[CounterMetricFamily]:
        cache = self._cache()
        stats = cache.stats() if cache is not None else None
        for name, value in (("hits", stats.hits if stats else 0),
                            ("misses", stats.misses if stats else 0)):  # fmt: skip
            yield CounterMetricFamily(
                f"ascend_vlm_vision_cache_{name}", f"Vision-cache {name} per image", value=value
            )


class ServingMetrics:
    """The metrics of one server. ``queue_depth``, ``running_rows``, ``kv_bytes`` and
    ``kv_tokens`` are read at scrape from the callables given; ``vision_cache()`` returns the model's
    :class:`~ascend_vlm.reuse.VisionCache` or None."""

    def __init__(
        self,
        queue_depth: Callable[[], float],
        running_rows: Callable[[], float],
        kv_bytes: Callable[[], float],
        kv_tokens: Callable[[], float],
        vision_cache: Callable[[], Any],
    ) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "ascend_vlm_requests", "Chat-completion requests by outcome", ["status"],
            registry=registry,
        )  # fmt: skip
        for status in STATUSES:
            self.requests.labels(status=status)
        self.time_to_first_token = Histogram(
            "ascend_vlm_time_to_first_token_seconds", "Request received to its first token",
            buckets=TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "ascend_vlm_time_per_output_token_seconds", "Mean time between a request's tokens "
            "after the first", buckets=TPOT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.request_duration = Histogram(
            "ascend_vlm_request_duration_seconds", "Request received to its answer's end",
            buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "ascend_vlm_prompt_tokens", "Prompt tokens admitted", registry=registry
        )
        self.visual_tokens = Counter(
            "ascend_vlm_visual_tokens", "Image tokens among the prompt tokens", registry=registry
        )
        self.generated_tokens = Counter(
            "ascend_vlm_generated_tokens", "Tokens generated", registry=registry
        )
        for name, what, read in (
            ("ascend_vlm_queue_depth", "Requests accepted and not running yet", queue_depth),
            ("ascend_vlm_running_rows", "Sequences in the running batch", running_rows),
            ("ascend_vlm_kv_bytes", "KV bytes the running sequences hold", kv_bytes),
            ("ascend_vlm_kv_tokens", "Tokens whose KV the running sequences hold", kv_tokens),
        ):
            Gauge(name, what, registry=registry).set_function(read)
        registry.register(_VisionCacheCounters(vision_cache))

    def count(self, status: str) -> None:
        """One more request ended with ``status`` (one of :data:`STATUSES`)."""
        if status not in STATUSES:
            raise ValueError(f"status: expected one of {', '.join(STATUSES)}, got {status!r}")
        self.requests.labels(status=status).inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
