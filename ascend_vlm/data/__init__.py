"""Shared data: the samples and batches that training, evaluation and features read.

* :mod:`~ascend_vlm.data.vqa`: VQA samples, JSONL / LLaVA record loading, and processor
  encoding and collation;
* :mod:`~ascend_vlm.data.shapes_vqa`: ShapesVQA, the synthetic VQA set rendered from a seed.
"""
