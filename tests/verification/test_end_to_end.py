"""End-to-end comparison of a model with its reference on ShapesVQA samples: an identical
model agrees everywhere, a perturbed one diverges where an independent computation says, the
patched bf16 model on the mock NPU stays close, and the paired accuracies are the evaluation's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import ascend_vlm
from ascend_vlm.data.datasets import shapes_vqa
from ascend_vlm.data.statistics import paired_accuracies
from ascend_vlm.data.vqa import VQASample, collate, encode_sample, pad_token_id_of
from ascend_vlm.verification.end_to_end import compare_end_to_end

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def samples():
    dataset = shapes_vqa(limit=3, image_size=56)
    return [dataset[i] for i in range(len(dataset))]


def _perturbed(model):
    """A copy of ``model`` with one weight perturbed: its last layer's MLP output projection."""
    perturbed = copy.deepcopy(model)
    weight = perturbed.model.language_model.layers[-1].mlp.down_proj.weight
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    return perturbed


def _independent(model, reference, processor, sample):
    """(KL(reference || model) per prompt position, first differing greedy index) of one
    sample, computed here with torch's kl_div and plain generate calls."""
    pad = pad_token_id_of(processor)
    batch = collate([encode_sample(processor, sample, with_answer=False)], pad)
    del batch["labels"]
    with torch.no_grad():
        log_q = torch.log_softmax(model(**batch).logits[0].double(), -1)
        log_p = torch.log_softmax(reference(**batch).logits[0].double(), -1)
        kl = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
        prompt = batch["input_ids"].shape[1]
        generate = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": pad}
        got = model.generate(**batch, **generate)[0, prompt:].tolist()
        expected = reference.generate(**batch, **generate)[0, prompt:].tolist()
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if first is None and len(got) != len(expected):
        first = min(len(got), len(expected))
    return kl, first


def test_an_unperturbed_model_agrees_everywhere(model_and_processor, samples):
    reference, processor = model_and_processor
    report = compare_end_to_end(
        copy.deepcopy(reference), reference, processor, samples, max_new_tokens=NEW_TOKENS
    )

    assert report.top1_agreement == 1.0
    assert report.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert report.max_kl == pytest.approx(0.0, abs=1e-12)
    assert report.first_divergence is None
    assert all(s.model_answer == s.reference_answer for s in report.samples)
    assert report.accuracy["difference"] == 0.0
    low, high = report.accuracy["ci95"]
    assert low <= 0.0 <= high
    json.dumps(report.to_json())
    assert "top-1 agreement 1.0000" in report.table()


def test_a_perturbed_weight_shows_in_kl_and_the_first_differing_token(model_and_processor, samples):
    reference, processor = model_and_processor
    model = _perturbed(reference)
    report = compare_end_to_end(model, reference, processor, samples, max_new_tokens=NEW_TOKENS)

    per_sample = [_independent(model, reference, processor, sample) for sample in samples]
    all_kl = torch.cat([kl for kl, _ in per_sample])
    assert report.mean_kl == pytest.approx(float(all_kl.mean()), rel=1e-6)
    assert report.max_kl == pytest.approx(float(all_kl.max()), rel=1e-6)
    assert report.mean_kl > 1e-3
    for comparison, (kl, first) in zip(report.samples, per_sample, strict=True):
        assert comparison.positions == len(kl)
        assert comparison.first_divergence == first
    assert report.first_divergence is not None
    diverged = next(s for s in report.samples if s.first_divergence is not None)
    assert diverged.model_token != diverged.reference_token
    assert report.top1_agreement < 1.0


def test_a_perturbed_embedding_row_diverges_after_the_token_is_read(model_and_processor, samples):
    reference, processor = model_and_processor
    batch = collate([encode_sample(processor, samples[0], with_answer=False)], 0)
    with torch.no_grad():
        generated = reference.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
            max_new_tokens=NEW_TOKENS, do_sample=False,
        )[0, batch["input_ids"].shape[1]:].tolist()  # fmt: skip
    # The second generated token, read first as the input of the third step: the prompt's
    # logits and the first two tokens cannot change, the third can.
    read = generated[1]
    assert read not in batch["input_ids"][0].tolist() and read != generated[0]
    model = copy.deepcopy(reference)
    with torch.no_grad():
        row = model.get_input_embeddings().weight[read]
        row.add_(torch.randn(row.shape, generator=torch.Generator().manual_seed(2)))

    report = compare_end_to_end(model, reference, processor, samples[:1], max_new_tokens=NEW_TOKENS)

    kl, first = _independent(model, reference, processor, samples[0])
    assert report.samples[0].first_divergence == first == 2
    assert report.max_kl == float(kl.max()) == 0.0
    assert report.top1_agreement == 1.0


def test_the_patched_bf16_model_on_the_mock_npu_stays_close(mock_npu, model_and_processor, samples):
    reference, processor = model_and_processor
    model = copy.deepcopy(reference).to(torch.bfloat16)
    ascend_vlm.patch(model)
    report = compare_end_to_end(model, reference, processor, samples[:1], max_new_tokens=2)

    assert 0.0 < report.mean_kl < 1e-2
    assert report.top1_agreement > 0.8


def test_accuracy_is_the_paired_comparison_of_the_evaluation(model_and_processor, samples):
    reference, processor = model_and_processor
    model = _perturbed(reference)
    first = compare_end_to_end(model, reference, processor, samples, max_new_tokens=NEW_TOKENS)
    # Gold answers the reference gives itself: it scores 1.0, the perturbed model less.
    graded = [
        VQASample(s.image, s.question, c.reference_answer or "x")
        for s, c in zip(samples, first.samples, strict=True)
    ]
    report = compare_end_to_end(model, reference, processor, graded, max_new_tokens=NEW_TOKENS)

    outcomes = [
        (c.reference_answer.strip().lower() == c.answer.lower(),
         c.model_answer.strip().lower() == c.answer.lower())
        for c in report.samples
    ]  # fmt: skip
    expected = paired_accuracies([r for r, _ in outcomes], [m for _, m in outcomes])
    assert report.accuracy == expected
    assert "paired interval" in report.table()


def test_inputs_without_answers_have_no_accuracy_and_bad_arguments_are_named(
    model_and_processor, samples
):
    reference, processor = model_and_processor
    batch = collate([encode_sample(processor, samples[0], with_answer=False)], 0)
    del batch["labels"]
    report = compare_end_to_end(reference, reference, processor, [batch], max_new_tokens=1)
    assert report.accuracy is None and report.top1_agreement == 1.0

    with pytest.raises(ValueError, match="samples"):
        compare_end_to_end(reference, reference, processor, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        compare_end_to_end(reference, reference, processor, samples, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"samples\[0\]"):
        compare_end_to_end(reference, reference, processor, [{"pixel_values": torch.ones(1)}])
