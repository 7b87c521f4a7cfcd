"""Sub-commands of ``python -m ascend_vlm`` that drive one feature on a checkpoint.

They are applications, above the features they drive: each loads a checkpoint (or builds the
reference one) and patches the model before handing it to its feature.

* :mod:`~ascend_vlm.commands.generate_batch`: ``generate-batch``, continuous batching over a
  JSONL file of requests;
* :mod:`~ascend_vlm.commands.explain`: ``explain``, attention overlays, the stage trace and the
  anomalous-token report of one answer.
"""
