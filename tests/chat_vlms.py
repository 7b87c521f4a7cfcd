"""Small VLMs with real processors and chat templates, shared by the tests that compare
multi-request or multi-turn generation with ``generate``: the default tiny Qwen2-VL (with a
processor that loads on every supported transformers, and with its saved one), a tiny LLaVA,
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE of the default model's widths. Session-scoped: nothing may modify
them (take a copy first). ``generate_alone`` is the one-request greedy ``generate`` they are
compared with."""

from __future__ import annotations

import pytest
import torch

from ascend_vlm.default_model import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN,
    ImageTextProcessor,
    default_model_path,
)


@pytest.fixture(scope="session")
def model_and_processor():
    """The default model with a processor that loads on transformers 5.17 and 5.25 alike."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    path = default_model_path()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = ImageTextProcessor(AutoTokenizer.from_pretrained(path), image_processor)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    return model, processor


@pytest.fixture(scope="session")
def saved_model_and_processor():
    """The default model with its saved processor (transformers' own class)."""
    from ascend_vlm.default_model import load_default_model

    try:
        return load_default_model()
    except ImportError as error:  # before 5.25 the saved image processor needs torchvision
        pytest.skip(f"the saved processor does not load here: {error}")


@pytest.fixture(scope="session")
def llava_and_processor():
    """A tiny random LLaVA (CLIP tower, 16 tokens per image) with a real LlavaProcessor over the
    default model's tokenizer, whose image token is <|image_pad|>."""
    from transformers import (
        AutoTokenizer,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    ids = tokenizer.convert_tokens_to_ids
    widths = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = LlavaConfig(
        text_config={
            "model_type": "llama",
            **widths,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 1024,
            "bos_token_id": ids("<|endoftext|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
        },
        vision_config={
            "model_type": "clip_vision_model",
            **widths,
            "num_attention_heads": 4,
            "image_size": 16,
            "patch_size": 4,
            "projection_dim": 32,
        },
        image_token_id=ids(IMAGE_TOKEN),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config).eval()
    return model, processor


@pytest.fixture(scope="session")
def qwen2_5_vl_and_processor(model_and_processor):
    """A random Qwen2.5-VL of the default model's widths, on the same processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ascend_vlm.default_model import token_ids

    base, processor = model_and_processor
    reference = base.config
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "out_hidden_size": reference.text_config.hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    text = reference.text_config.to_dict()
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        **token_ids(reference),
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval(), processor


def _vision_of_14_pixel_patches(out_hidden_size: int, **family) -> dict:
    """A 2-layer Qwen-VL-style vision sub-config the default model's processor serves (14-pixel
    patches, 2x2 merge, 2 frames a patch), its output `out_hidden_size` wide."""
    return {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "out_hidden_size": out_hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **family,
    }


def _mrope_text_config(reference, **rope) -> dict:
    """A 2-layer decoder sub-config of the default model's width and vocabulary (4 heads of
    hidden / 4, GQA 2) with M-RoPE over [8, 4, 4] rotary pairs and the `rope` options."""
    hidden = reference.text_config.hidden_size
    return {
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "vocab_size": reference.text_config.vocab_size,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [8, 4, 4],
            **rope,
        },
    }


def _qwen3_vl_sub_configs(reference) -> tuple[dict, dict]:
    """Qwen3-VL's text and vision sub-configs (interleaved M-RoPE, one deepstack layer) at the
    default model's widths, with 14-pixel patches so the default processor serves them."""
    text = _mrope_text_config(reference, mrope_interleaved=True)
    vision = _vision_of_14_pixel_patches(
        reference.text_config.hidden_size, num_position_embeddings=64, deepstack_visual_indexes=[0]
    )
    return text, vision


@pytest.fixture(scope="session")
def qwen3_vl_and_processor(model_and_processor):
    """A random Qwen3-VL (interleaved M-RoPE, one deepstack layer) of the default model's
    widths, with 14-pixel patches so the same processor serves it."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from ascend_vlm.default_model import token_ids

    base, processor = model_and_processor
    text, vision = _qwen3_vl_sub_configs(base.config)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **token_ids(base.config))
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval(), processor


@pytest.fixture(scope="session")
def qwen3_vl_moe_and_processor(model_and_processor):
    """The Qwen3-VL above with its second decoder layer a sparse MoE block (8 experts, top-2),
    on the same processor."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from ascend_vlm.default_model import token_ids
    from ascend_vlm.models.tiny.qwen import tiny_moe
    from ascend_vlm.models.tiny.sizes import TINY

    base, processor = model_and_processor
    text, vision = _qwen3_vl_sub_configs(base.config)
    text = {**text, **tiny_moe(TINY), "mlp_only_layers": [0]}
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **token_ids(base.config))
    torch.manual_seed(0)
    return Qwen3VLMoeForConditionalGeneration(config).eval(), processor


def _random_glm(model_and_processor, vlm_type: str, **text_family):
    """A random GLM-4V-style model of model_type ``vlm_type`` (M-RoPE on half the head dim,
    RMSNorm ViT) of the default model's widths, with 14-pixel patches so the same processor
    serves it; ``text_family`` adds to its text sub-config."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    base, processor = model_and_processor
    reference = base.config
    hidden = reference.text_config.hidden_size
    pairs = hidden // 2 // 4  # two heads; the rotary half of each head dim, two dims a pair
    text = {
        "hidden_size": hidden,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "vocab_size": reference.text_config.vocab_size,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
            "mrope_section": [pairs // 2, pairs // 4, pairs - pairs // 2 - pairs // 4],
        },
        **text_family,
    }
    config = AutoConfig.for_model(
        vlm_type,
        text_config=text,
        vision_config=_vision_of_14_pixel_patches(hidden, image_size=112),
        image_token_id=reference.image_token_id,
        video_token_id=reference.video_token_id,
        image_start_token_id=reference.vision_start_token_id,
        image_end_token_id=reference.vision_end_token_id,
    )
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).eval(), processor


@pytest.fixture(scope="session")
def glm4v_and_processor(model_and_processor):
    """A random GLM-4.1V (adjacent rotary pairs) on the default model's processor."""
    return _random_glm(model_and_processor, "glm4v")


@pytest.fixture(scope="session")
def glm46v_and_processor(model_and_processor):
    """A random GLM-4.6V (GLM-4.1V's parts built from its sub-configs' model types) on the
    default model's processor."""
    return _random_glm(model_and_processor, "glm46v", model_type="glm4v_text")


@pytest.fixture(scope="session")
def glm4v_moe_and_processor(model_and_processor):
    """A random GLM-4.5V (MoE: a dense first layer, then 4 experts, top-2, and a shared expert)
    on the default model's processor."""
    moe = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return _random_glm(model_and_processor, "glm4v_moe", **moe)


@pytest.fixture(scope="session")
def paddleocr_vl_and_processor(model_and_processor):
    """A random PaddleOCR-VL of the default model's widths with its own image processor (14-pixel
    patches, 2x2 merge) inside the default model's processor (the same tokenizer and image
    token)."""
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration
    from transformers.models.paddleocr_vl import PaddleOCRVLImageProcessorPil

    from ascend_vlm.default_model import token_ids

    base, processor = model_and_processor
    reference = base.config
    ids = token_ids(reference)
    text = {
        **_mrope_text_config(reference),
        **{k: v for k, v in ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 56,
        "patch_size": 14,
        "spatial_merge_size": 2,
    }
    config = PaddleOCRVLConfig(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    model = PaddleOCRVLForConditionalGeneration(config).eval()
    image_processor = PaddleOCRVLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    return model, ImageTextProcessor(processor.tokenizer, image_processor)


def generate_alone(model, processor, request, **settings) -> list[int]:
    """The new tokens of a one-request greedy ``generate`` for a ``GenerationRequest``."""
    prompt = processor.apply_chat_template(
        list(request.messages), tokenize=False, add_generation_prompt=True
    )
    images = request.images()
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=request.max_new_tokens, do_sample=False, **settings
        )
    return output[0, inputs["input_ids"].shape[1] :].tolist()
