"""The command line of ``python -m ascend_vlm``: what its sub-commands share, and the
sub-commands that drive one feature on a checkpoint.

The command line sits above every application: each sub-command (``eval``, ``serve``,
``verify``, ``finetune`` in their apps' ``cli`` modules, and the ones here) loads a checkpoint
(or builds the reference one), applies the feature options and hands the model to its app.
What they share lives here, so that no app imports another:

* :mod:`~ascend_vlm.commands.checkpoints`: which checkpoint ``--model`` names, and loading it;
* :mod:`~ascend_vlm.commands.options`: the registration point of feature options (flags that
  transform the model), with :mod:`~ascend_vlm.commands.features` holding the registrations
  (:mod:`~ascend_vlm.commands.pruning_option`, :mod:`~ascend_vlm.commands.quantization_option`,
  :mod:`~ascend_vlm.commands.vision_cache_option`, :mod:`~ascend_vlm.commands.adapter_option`);
* :mod:`~ascend_vlm.commands.generate_batch`: ``generate-batch``, continuous batching over a
  JSONL file of requests;
* :mod:`~ascend_vlm.commands.explain`: ``explain``, attention overlays, the stage trace and the
  anomalous-token report of one answer.
"""
