"""GLM-4.6V builds whatever model types its sub-configs name; patch takes each part's spec from
that sub-config, so a GLM-4.6V on GLM-4.5V's MoE decoder and ViT is patched as those."""

from __future__ import annotations

import torch
import transformers

import ascend_vlm
from ascend_vlm.models import tiny


def test_glm46v_on_moe_sub_configs_swaps_their_classes_and_matches_stock():
    moe_config = tiny.FAMILIES["glm4v_moe"].config()
    config = transformers.Glm46VConfig(
        text_config=moe_config.text_config.to_dict(),
        vision_config=moe_config.vision_config.to_dict(),
        image_token_id=moe_config.image_token_id,
        video_token_id=moe_config.video_token_id,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Glm46VForConditionalGeneration(config).eval()
    inputs = tiny.make_inputs("glm46v", model, n_images=2)
    with torch.no_grad():
        expected = model(**inputs).logits
    report = ascend_vlm.patch(model)
    with torch.no_grad():
        got = model(**inputs).logits
    ascend_vlm.unpatch(model)
    swapped = {(kind, name) for kind, name, _ in report.swapped}
    assert ("attention-text", "Glm4vMoeTextAttention") in swapped
    assert ("mlp", "Glm4vMoeisionMlp") in swapped
    assert ("moe", "Glm4vMoeTextMoE") in swapped
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
