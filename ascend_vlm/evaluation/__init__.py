"""Held-out evaluation of a VLM: ``python -m ascend_vlm eval``.

One concern per module:

* :mod:`~ascend_vlm.evaluation.stages`: per-stage latency of one generation, from
  :func:`ascend_vlm.trace`;
* :mod:`~ascend_vlm.evaluation.runner`: batched greedy answering;
* :mod:`~ascend_vlm.evaluation.report`: the JSON report, its text form, the comparison;
* :mod:`~ascend_vlm.evaluation.cli`: the command's arguments and run.

What it shares with ``verify`` lies below both apps: the samples
(:mod:`ascend_vlm.data.datasets`), the answer metrics and the paired statistics
(:mod:`ascend_vlm.data.answer_metrics`, :mod:`ascend_vlm.data.statistics`) and the peak host
memory (:mod:`ascend_vlm.observability.memory`). What it shares with the other commands lies
in the command line (:mod:`ascend_vlm.commands`): which checkpoint ``--model`` names, and the
feature options.
"""
