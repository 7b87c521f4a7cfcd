"""Tiny random configs and matching inputs for every supported family.

Used by the tests (patched vs unpatched equivalence) and by `scripts/bench_patch.py`. Sizes are
the smallest that still exercise every code path: 2 decoder layers of width 32 with GQA, a 1-2
layer vision tower, 4-16 image tokens per image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB = 128
IMAGE_TOKEN = 120  # the special ids sit above the ids used for random text (< TEXT_VOCAB)
VISION_START, VISION_END, VIDEO_TOKEN, BOS, PAD = 121, 122, 123, 1, 0
TEXT_VOCAB = 100

_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "pad_token_id": PAD,
    "bos_token_id": BOS,
    "eos_token_id": 2,
}
_CLIP = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 16,
    "patch_size": 4,
    "projection_dim": 32,
}
_SIGLIP = {**_CLIP, "model_type": "siglip_vision_model"}


@dataclass(frozen=True)
class TinyFamily:
    """A tiny model of one family: how to build it and how to feed it images.

    images(model, n) -> (model kwargs for n images, image tokens per image), one image per
    [3, H, W] entry; the kwargs are batch-agnostic pixel tensors, so `make_inputs` can lay the
    image tokens out in any batch.
    """

    name: str
    model_class: str
    config: Callable[[], object]
    images: Callable[[torch.nn.Module, int], tuple[dict, list[int]]]
    image_batch_axis: bool = False  # pixel_values grouped per sample: [B, n_images, 3, H, W]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qwen_images(model, count: int) -> tuple[dict, list[int]]:
    vision = model.config.vision_config
    grid = torch.tensor([[1, 4, 4]] * count)  # t, h, w in patches -> 16 patches, 4 tokens
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, generator=_generator(count))
    tokens = int(grid[0].prod()) // vision.spatial_merge_size**2
    return {"pixel_values": pixels, "image_grid_thw": grid}, [tokens] * count


def _feature_counted_images(model, count: int, extra: Callable[[int], dict] | None = None):
    """Images for models whose tokens-per-image is whatever `get_image_features` returns."""
    vision = model.config.vision_config
    pixels = torch.randn(
        count, 3, vision.image_size, vision.image_size, generator=_generator(count)
    )
    kwargs = {"pixel_values": pixels, **(extra(count) if extra else {})}
    with torch.no_grad():
        features = model.model.get_image_features(**kwargs)
    features = getattr(features, "pooler_output", features)
    return kwargs, [f.reshape(-1, f.shape[-1]).shape[0] for f in features]


def _anyres_images(model, count: int) -> tuple[dict, list[int]]:
    size = model.config.vision_config.image_size
    pixels = torch.randn(count, 5, 3, size, size, generator=_generator(count))  # base + 2x2 tiles
    kwargs = {"pixel_values": pixels, "image_sizes": torch.tensor([[2 * size, 2 * size]] * count)}
    with torch.no_grad():
        features = model.model.get_image_features(**kwargs)
    features = getattr(features, "pooler_output", features)
    return kwargs, [f.shape[0] for f in features]


def _fixed_count_images(tokens: Callable[[object], int]):
    def images(model, count: int) -> tuple[dict, list[int]]:
        size = model.config.vision_config.image_size
        size = size[0] if isinstance(size, (list, tuple)) else size
        pixels = torch.randn(count, 3, size, size, generator=_generator(count))
        return {"pixel_values": pixels}, [tokens(model.config)] * count

    return images


def _qwen2_vl():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={
            **_TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 1, 1],
            },
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 4,
            "in_channels": 3,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={
            **_TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 1, 1],
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 4,
            "window_size": 16,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def _qwen3_vl():
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={
            **_TEXT,
            "head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 4,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
            "in_channels": 3,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def _llava():
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={**_TEXT, "model_type": "llama"},
        vision_config=_CLIP,
        image_token_id=IMAGE_TOKEN,
        projector_hidden_act="gelu",
    )


def _llava_siglip():
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={**_TEXT, "model_type": "qwen2"},
        vision_config=_SIGLIP,
        image_token_id=IMAGE_TOKEN,
        vision_feature_select_strategy="full",
    )


def _llava_next():
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        text_config={**_TEXT, "model_type": "mistral"},
        vision_config=_CLIP,
        image_token_id=IMAGE_TOKEN,
        image_grid_pinpoints=[[32, 32]],
    )


def _llava_onevision():
    from transformers import LlavaOnevisionConfig

    return LlavaOnevisionConfig(
        text_config={**_TEXT, "model_type": "qwen2"},
        vision_config=_SIGLIP,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        image_grid_pinpoints=[[32, 32]],
        vision_feature_layer=-1,
    )


def _idefics3(model_type: str):
    def build():
        from transformers import AutoConfig

        return AutoConfig.for_model(
            model_type,
            text_config={**_TEXT, "model_type": "llama"},
            vision_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "image_size": 16,
                "patch_size": 4,
            },
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        )

    return build


def _paligemma():
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig(
        text_config={**_TEXT, "model_type": "gemma", "head_dim": 8},
        vision_config={**_SIGLIP, "projection_dim": 32},
        image_token_id=IMAGE_TOKEN,
        projection_dim=32,
    )


def _gemma3():
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config={
            **_TEXT,
            "model_type": "gemma3_text",
            "head_dim": 8,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        vision_config=_SIGLIP,
        image_token_id=IMAGE_TOKEN,
        boi_token_index=VISION_START,
        eoi_token_index=VISION_END,
        mm_tokens_per_image=4,
    )


def _internvl():
    from transformers import InternVLConfig

    return InternVLConfig(
        text_config={**_TEXT, "model_type": "qwen2"},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": [16, 16],
            "patch_size": [4, 4],
            "norm_type": "rms_norm",
        },
        image_token_id=IMAGE_TOKEN,
        downsample_ratio=0.5,
    )


def _idefics3_tokens(config) -> int:
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2


def _idefics3_images(model, count: int) -> tuple[dict, list[int]]:
    kwargs, tokens = _fixed_count_images(_idefics3_tokens)(model, count)
    return {"pixel_values": kwargs["pixel_values"]}, tokens


def _internvl_tokens(config) -> int:
    vision = config.vision_config
    side = vision.image_size[0] // vision.patch_size[0]
    return int(side * side * config.downsample_ratio**2)


FAMILIES: dict[str, TinyFamily] = {
    family.name: family
    for family in (
        TinyFamily("qwen2_vl", "Qwen2VLForConditionalGeneration", _qwen2_vl, _qwen_images),
        TinyFamily("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl, _qwen_images),
        TinyFamily("qwen3_vl", "Qwen3VLForConditionalGeneration", _qwen3_vl, _qwen_images),
        TinyFamily("llava_clip", "LlavaForConditionalGeneration", _llava, _feature_counted_images),
        TinyFamily(
            "llava_siglip", "LlavaForConditionalGeneration", _llava_siglip, _feature_counted_images
        ),
        TinyFamily("llava_next", "LlavaNextForConditionalGeneration", _llava_next, _anyres_images),
        TinyFamily(
            "llava_onevision",
            "LlavaOnevisionForConditionalGeneration",
            _llava_onevision,
            _anyres_images,
        ),
        TinyFamily(
            "idefics3",
            "Idefics3ForConditionalGeneration",
            _idefics3("idefics3"),
            _idefics3_images,
            image_batch_axis=True,
        ),
        TinyFamily(
            "smolvlm",
            "SmolVLMForConditionalGeneration",
            _idefics3("smolvlm"),
            _idefics3_images,
            image_batch_axis=True,
        ),
        TinyFamily(
            "paligemma",
            "PaliGemmaForConditionalGeneration",
            _paligemma,
            _fixed_count_images(lambda c: c.text_config.num_image_tokens),
        ),
        TinyFamily(
            "gemma3",
            "Gemma3ForConditionalGeneration",
            _gemma3,
            _fixed_count_images(lambda c: c.mm_tokens_per_image),
        ),
        TinyFamily(
            "internvl",
            "InternVLForConditionalGeneration",
            _internvl,
            _fixed_count_images(_internvl_tokens),
        ),
    )
}


def build_model(name: str, *, seed: int = 0, attn_implementation: str = "eager"):
    """A freshly initialised tiny model of family `name` (fp32, eval mode)."""
    import transformers

    family = FAMILIES[name]
    torch.manual_seed(seed)
    config = family.config()
    config._attn_implementation = attn_implementation
    model = getattr(transformers, family.model_class)(config)
    return model.eval()


def make_inputs(
    name: str, model, *, n_images: int = 0, batch: int = 1, text_len: int = 6, padding: str = "none"
) -> dict:
    """Model kwargs: `batch` rows of random text, row 0 carrying `n_images` images.

    padding "left"/"right": row 1 onwards is shortened by 3 tokens and padded on that side (the
    attention_mask marks the pads). Token ids of text stay below TEXT_VOCAB.
    """
    if padding not in ("none", "left", "right"):
        raise ValueError(f"padding: expected 'none', 'left' or 'right', got {padding!r}")
    family = FAMILIES[name]
    generator = _generator(batch * 10 + n_images)
    image_kwargs, tokens_per_image = family.images(model, n_images) if n_images else ({}, [])
    rows = []
    for row in range(batch):
        text = torch.randint(3, TEXT_VOCAB, (text_len,), generator=generator).tolist()
        images = tokens_per_image if row == 0 else []
        ids = [BOS] + [t for count in images for t in [VISION_START] + [IMAGE_TOKEN] * count] + text
        rows.append(ids)
    if n_images and batch > 1:
        # every row needs its own images for models that group pixels per sample
        raise ValueError("make_inputs: images are only placed in row 0; use batch=1 with images")
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch, width), PAD)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for index, ids in enumerate(rows):
        ids = ids[:-3] if index > 0 and padding != "none" else ids
        start = width - len(ids) if padding == "left" else 0
        input_ids[index, start : start + len(ids)] = torch.tensor(ids)
        attention_mask[index, start : start + len(ids)] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **image_kwargs}
    if family.image_batch_axis and n_images:
        inputs["pixel_values"] = inputs["pixel_values"].unsqueeze(0)
    if name in ("gemma3", "paligemma"):
        inputs["token_type_ids"] = (input_ids == IMAGE_TOKEN).long()
    if name.startswith("qwen") and n_images:
        inputs["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN).int()
    return inputs
