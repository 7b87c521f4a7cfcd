"""Answer attention rows equal eager attention's weights, on any attention implementation, and
the anomalous-token statistics follow their definitions."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

import ascend_vlm
from ascend_vlm._compat.attention import set_attention_implementation
from ascend_vlm.observability.attention_maps import answer_attention
from ascend_vlm.observability.token_report import (
    OUTLIER_THRESHOLD,
    anomalous_token_report,
    robust_z_scores,
    token_statistics,
)


def _sequence(model, processor, images, answer_tokens=4):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Which colour?"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = dict(processor(text=prompt, images=images, return_tensors="pt"))
    length = inputs["input_ids"].shape[1]
    answer = torch.arange(40, 40 + answer_tokens)[None]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], answer], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "mm_token_type_ids" in inputs:
        tail = torch.zeros((1, answer_tokens), dtype=inputs["mm_token_type_ids"].dtype)
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], tail], dim=1)
    return inputs, length


def _eager_rows(model, inputs, length):
    """Head-mean eager attention rows of positions length-1 ... S-2, per layer."""
    eager = copy.deepcopy(model)
    set_attention_implementation(eager.config, "eager")
    for config in (eager.config.text_config, getattr(eager.config, "vision_config", None)):
        if config is not None:
            set_attention_implementation(config, "eager")
    with torch.no_grad():
        output = eager(**inputs, output_attentions=True, use_cache=False)
    return torch.stack([a[0, :, length - 1 : -1].float().mean(dim=0) for a in output.attentions])


@pytest.mark.parametrize("patched", [False, True], ids=["sdpa", "patched"])
@pytest.mark.parametrize(
    "fixture",
    [
        "model_and_processor",
        "llava_and_processor",
        "qwen3_vl_moe_and_processor",
        "glm4v_and_processor",
        "paddleocr_vl_and_processor",
    ],
)
def test_rows_equal_eager_weights(request, fixture, patched):
    model, processor = request.getfixturevalue(fixture)
    images = [Image.new("RGB", (84, 56), (200, 30, 30)), Image.new("RGB", (56, 56), (9, 9, 200))]
    inputs, length = _sequence(model, processor, images)
    expected = _eager_rows(model, inputs, length)
    model = copy.deepcopy(model)
    if patched:
        ascend_vlm.patch(model)
    attention = answer_attention(model, inputs, length)
    assert attention.weights.shape == expected.shape
    torch.testing.assert_close(attention.weights, expected, atol=2e-5, rtol=1e-4)
    assert attention.query_positions == tuple(range(length - 1, inputs["input_ids"].shape[1] - 1))
    image_token = model.config.image_token_id
    assert torch.equal(attention.visual, inputs["input_ids"][0] == image_token)
    chosen = answer_attention(model, inputs, length, layers=[1])
    torch.testing.assert_close(chosen.weights[0], expected[1], atol=2e-5, rtol=1e-4)


def test_hidden_norms_are_the_last_layer_outputs(model_and_processor):
    model, processor = model_and_processor
    inputs, length = _sequence(model, processor, [Image.new("RGB", (56, 56))])
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True, use_cache=False).hidden_states
    attention = answer_attention(model, inputs, length)
    # transformers' last hidden state is after the final norm: undo nothing, recompute instead
    layers = model.model.language_model.layers
    captured = []
    handle = layers[-1].register_forward_hook(
        lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o)
    )
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        handle.remove()
    expected = captured[0][0, length - 1 : -1].float().norm(dim=-1)
    torch.testing.assert_close(attention.hidden_norms, expected)
    assert len(hidden) == len(layers) + 1


def test_bad_arguments_are_named(model_and_processor):
    from ascend_vlm.pruning import PruneConfig, enable_token_pruning

    model, processor = model_and_processor
    inputs, length = _sequence(model, processor, [Image.new("RGB", (56, 56))])
    pruned = copy.deepcopy(model)
    enable_token_pruning(pruned, PruneConfig(layer=1, keep=0.5))
    with pytest.raises(ValueError, match=r"model: attention maps .* disable token pruning first"):
        answer_attention(pruned, inputs, length)
    with pytest.raises(ValueError, match=r"prompt_length: expected 1 <= prompt_length <"):
        answer_attention(model, inputs, inputs["input_ids"].shape[1])
    with pytest.raises(ValueError, match=r"layers: expected indices in \[0, 2\), got \[2\]"):
        answer_attention(model, inputs, length, layers=[2])
    batch = {**inputs, "input_ids": inputs["input_ids"].expand(2, -1)}
    with pytest.raises(ValueError, match=r"expected one row \[1, S\]"):
        answer_attention(model, batch, length)


def test_robust_z_scores_follow_the_modified_z_definition():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    # median 3, absolute deviations 2 1 0 1 97 -> MAD 1
    expected = (values - 3.0) / 1.4826
    torch.testing.assert_close(robust_z_scores(values), expected.double())
    # a tight cluster: the scale is 1% of the median, not the tiny MAD
    tight = torch.tensor([0.99995, 0.99996, 0.99994, 0.99995, 0.9999])
    assert robust_z_scores(tight).abs().max() < 0.01
    tied = torch.tensor([5.0, 5.0, 5.0, 9.0])  # MAD 0: mean absolute deviation (1.0) instead
    torch.testing.assert_close(
        robust_z_scores(tied), torch.tensor([0.0, 0.0, 0.0, 4.0 / 1.253314]).double()
    )
    assert torch.equal(robust_z_scores(torch.full((3,), 2.0)), torch.zeros(3).double())


def _synthetic_attention(rows, visual, norms):
    from ascend_vlm.observability.attention_maps import AnswerAttention

    rows = torch.tensor(rows, dtype=torch.float32)
    return AnswerAttention(
        layers=(0,),
        query_positions=tuple(range(10, 10 + rows.shape[0])),
        weights=rows[None],
        hidden_norms=torch.tensor(norms),
        visual=torch.tensor(visual),
    )


def test_statistics_and_outliers_on_a_synthetic_answer():
    import numpy as np

    from ascend_vlm.observability.visual_grid import ImageCells

    visual = [True, True, True, True, False, False]
    calm = [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]
    peaked = [0.7, 0.0, 0.0, 0.0, 0.15, 0.15]
    rows = [calm] * 6 + [peaked]
    attention = _synthetic_attention(rows, visual, [10.0] * 6 + [10.5])
    stats = token_statistics(attention)
    torch.testing.assert_close(stats["visual_share"], torch.tensor([0.4] * 6 + [0.7]).double())
    torch.testing.assert_close(stats["visual_entropy"][:6], torch.ones(6).double())
    assert stats["visual_entropy"][6] == pytest.approx(0.0, abs=1e-9)
    boxes = np.array([[0, 0, 5, 5], [5, 0, 10, 5], [0, 5, 5, 10], [5, 5, 10, 10]], dtype=float)
    cells = [ImageCells(image_index=0, rows=2, cols=2, boxes=boxes, image_size=(10, 10))]
    texts = [f"t{i}" for i in range(7)]
    report = anomalous_token_report(attention, list(range(7)), texts, cells)
    assert report["threshold"] == OUTLIER_THRESHOLD
    assert [entry["index"] for entry in report["outliers"]] == [6]
    assert set(report["outliers"][0]["outlier_on"]) == {
        "visual_share",
        "visual_entropy",
        "hidden_norm",
    }
    attended = report["outliers"][0]["attended"]
    assert attended == {"image": 0, "box": [0, 0, 5, 5], "weight": pytest.approx(0.7)}
    assert report["tokens"][6]["position"] == 17 and report["tokens"][6]["text"] == "t6"
    with pytest.raises(ValueError, match="token_ids, token_texts: expected 7 entries"):
        anomalous_token_report(attention, [1], ["x"], cells)
