"""Observability: where a VLM's time goes and what its answers looked at.

* :func:`trace` / :class:`Tracer`: per-request stage timeline (vision encode, projector, prefill,
  each decode step, plus events from pruning, the vision cache and batching) with NPU-event
  timing on the NPU; views: :meth:`Trace.summary`, :meth:`Trace.save_chrome_trace` (Perfetto),
  :meth:`Trace.save_heatmap`. Off, nothing is installed on the model. Features report their
  events through :mod:`ascend_vlm.trace_events`, below every feature.
* :mod:`~ascend_vlm.observability.memory`: the peak host memory (RSS) of a block of code, and
  the peak live tensor bytes of one call.
"""

from ascend_vlm.observability.timeline import STAGES, StageSpan, Trace, TracedRequest, TraceMark
from ascend_vlm.observability.tracer import Tracer, trace

__all__ = ["STAGES", "StageSpan", "Trace", "TraceMark", "TracedRequest", "Tracer", "trace"]
