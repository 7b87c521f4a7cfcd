"""generate_answers with and without its prefetch thread: same predictions, the thread gone
afterwards, a failing sample named."""

from __future__ import annotations

import threading

import pytest

from ascend_vlm.data.datasets import shapes_vqa
from ascend_vlm.default_model import load_default_model
from ascend_vlm.evaluation.runner import generate_answers


def _run(model, processor, dataset, prefetch):
    return generate_answers(
        model,
        processor,
        dataset,
        batch_size=3,
        max_new_tokens=3,
        progress=False,
        prefetch=prefetch,
    )


def test_prefetched_batches_give_the_same_predictions():
    model, processor = load_default_model()
    dataset = shapes_vqa(7, image_size=64)
    with_thread = _run(model, processor, dataset, prefetch=True)
    without = _run(model, processor, dataset, prefetch=False)
    assert [p.prediction for p in with_thread.predictions] == [
        p.prediction for p in without.predictions
    ]
    assert len(with_thread.stage_times) == 3
    assert not [t for t in threading.enumerate() if t.name == "ascend-vlm-prefetch"]


def test_a_failing_sample_is_named(monkeypatch):
    model, processor = load_default_model()
    dataset = shapes_vqa(7, image_size=64)
    real = type(dataset).__getitem__

    def broken(self, index):
        if index == 4:
            raise OSError("unreadable image")
        return real(self, index)

    monkeypatch.setattr(type(dataset), "__getitem__", broken)
    with pytest.raises(OSError, match="unreadable") as caught:
        _run(model, processor, dataset, prefetch=True)
    assert "while preparing batch 1 (samples 3-5) ahead" in caught.value.__notes__
