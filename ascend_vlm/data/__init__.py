"""Shared data: the samples and batches that training, evaluation and features read.

* :mod:`~ascend_vlm.data.vqa`: VQA samples, JSONL / LLaVA record loading, and processor
  encoding and collation;
* :mod:`~ascend_vlm.data.shapes_vqa`: ShapesVQA, the synthetic VQA set rendered from a seed;
* :mod:`~ascend_vlm.data.datasets`: the samples an evaluation answers (ShapesVQA's held-out
  split, JSONL / LLaVA files);
* :mod:`~ascend_vlm.data.content_keys`: content keys vouched for images where they come in,
  which the caches downstream key them by instead of hashing their pixels again;
* :mod:`~ascend_vlm.data.answer_metrics`: right or wrong per answer;
  :mod:`~ascend_vlm.data.statistics`: intervals and the paired test of accuracies.
"""
