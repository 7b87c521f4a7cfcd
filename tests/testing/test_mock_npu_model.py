"""End to end: a patched tiny Qwen2-VL runs its NPU code path under the mock (every fused kernel
called) and matches the unpatched eager model, with an image and with left padding."""

from __future__ import annotations

import pytest
import torch

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs

KERNELS = ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu")


pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def test_patched_qwen2_vl_on_the_npu_path_matches_eager(mock_npu, monkeypatch) -> None:
    model = build_model("qwen2_vl")
    with_image = make_inputs("qwen2_vl", model, n_images=1)
    padded = make_inputs("qwen2_vl", model, batch=2, padding="left")
    inputs = [
        {k: v.to(mock_npu.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for batch in (with_image, padded)
    ]
    model.to(mock_npu.device)
    calls = dict.fromkeys(KERNELS, 0)
    for name in KERNELS:
        original = getattr(mock_npu.torch_npu, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mock_npu.torch_npu, name, counting)
    with torch.no_grad():
        expected = [model(**batch).logits for batch in inputs]
        ascend_vlm.patch(model)
        got = [model(**batch).logits for batch in inputs]
    assert all(count > 0 for count in calls.values()), calls
    real_tokens = inputs[1]["attention_mask"].bool()[..., None]
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        got[1] * real_tokens, expected[1] * real_tokens, atol=1e-5, rtol=1e-5
    )
