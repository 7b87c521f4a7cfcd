"""Held-out evaluation of a VLM: ``python -m ascend_vlm eval``.

One concern per module:

* :mod:`~ascend_vlm.evaluation.datasets`: the samples (ShapesVQA's held-out split, JSONL files);
* :mod:`~ascend_vlm.evaluation.checkpoints`: which checkpoint ``--model`` names, and loading it;
* :mod:`~ascend_vlm.evaluation.options`: the registration point of feature options (flags that
  transform the model), with :mod:`~ascend_vlm.evaluation.features` holding the registrations;
* :mod:`~ascend_vlm.evaluation.stages`: per-stage latency of one generation, from
  :func:`ascend_vlm.trace`; :mod:`~ascend_vlm.evaluation.memory`: peak host memory;
* :mod:`~ascend_vlm.evaluation.runner`: batched greedy answering;
* :mod:`~ascend_vlm.evaluation.metrics` and :mod:`~ascend_vlm.evaluation.statistics`: right or
  wrong per sample, intervals and the paired test;
* :mod:`~ascend_vlm.evaluation.report`: the JSON report, its text form, the comparison;
* :mod:`~ascend_vlm.evaluation.cli`: the command's arguments and run.
"""
