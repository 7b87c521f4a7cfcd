"""Tiny (and small) random configs and matching inputs for every supported family.

Used by the tests (patched vs unpatched equivalence) and by `scripts/bench_patch.py`. The "tiny"
size is the smallest that still exercises every code path: 2 decoder layers of width 32 with GQA,
a 2-layer vision tower, 4-16 image tokens per image. The "small" size (benchmarks only) makes
compute matter: 4 decoder layers of width 512, a 2-layer vision tower of width 512 and one
224x224 image (16x16-pixel patches) per image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

VOCAB = 128
IMAGE_TOKEN = 120  # the special ids sit above the ids used for random text (< TEXT_VOCAB)
VISION_START, VISION_END, VIDEO_TOKEN, BOS, PAD = 121, 122, 123, 1, 0
TEXT_VOCAB = 100


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of one model size; `image` and `patch` are edge lengths in pixels."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    image: int
    patch: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patches_per_side(self) -> int:
        return self.image // self.patch


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(32, 64, 2, 4, 2, 32, 64, 2, 4, 16, 4),
    "small": ModelSize(512, 1408, 4, 8, 2, 512, 2048, 2, 8, 224, 16),
}
TINY = SIZES["tiny"]


def _widths(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    """The four size keys text and vision configs share."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
    }


def _text(size: ModelSize) -> dict:
    return {
        **_widths(size.hidden, size.intermediate, size.layers, size.heads),
        "num_key_value_heads": size.kv_heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": 2,
    }


def _clip(size: ModelSize) -> dict:
    return {
        "model_type": "clip_vision_model",
        **_vit(size),
        "image_size": size.image,
        "patch_size": size.patch,
        "projection_dim": size.hidden,
    }


def _siglip(size: ModelSize) -> dict:
    return {**_clip(size), "model_type": "siglip_vision_model"}


def _vit(size: ModelSize) -> dict:
    return _widths(
        size.vision_hidden, size.vision_intermediate, size.vision_layers, size.vision_heads
    )


def _mrope(size: ModelSize, **extra) -> dict:
    """Multimodal RoPE over the head dim: half of the rotary pairs temporal, a quarter each
    height and width (tiny: [2, 1, 1])."""
    quarter = size.head_dim // 8
    return {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [2 * quarter, quarter, quarter],
        **extra,
    }


_TEXT = _text(TINY)


@dataclass(frozen=True)
class TinyFamily:
    """A tiny model of one family: how to build it and how to feed it images.

    config(size) -> the model config at that `ModelSize` (tiny by default). images(model, n) ->
    (model kwargs for n images, image tokens per image), one image per [3, H, W] entry; the
    kwargs are batch-agnostic pixel tensors, so `make_inputs` can lay the image tokens out in
    any batch.
    """

    name: str
    model_class: str
    config: Callable[..., object]
    images: Callable[[torch.nn.Module, int], tuple[dict, list[int]]]
    image_batch_axis: bool = False  # pixel_values grouped per sample: [B, n_images, 3, H, W]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qwen_images(model, count: int) -> tuple[dict, list[int]]:
    vision = model.config.vision_config
    side = vision.image_side_in_patches  # set by _qwen_vision: one image of that many patches
    grid = torch.tensor([[1, side, side]] * count)  # t, h, w in patches
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
    """One image at the first grid pinpoint: the base view plus one crop per tile."""
    size = model.config.vision_config.image_size
    height, width = model.config.image_grid_pinpoints[0]
    crops = 1 + (height // size) * (width // size)
    pixels = torch.randn(count, crops, 3, size, size, generator=_generator(count))
    kwargs = {"pixel_values": pixels, "image_sizes": torch.tensor([[height, width]] * count)}
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


def _qwen_vision(size: ModelSize, **family) -> dict:
    """Qwen-VL vision tower: patch edge size.patch, 2x2 merge, `out_hidden_size` = text width."""
    return {
        "depth": size.vision_layers,
        "hidden_size": size.vision_hidden,
        "num_heads": size.vision_heads,
        "patch_size": size.patch,
        "in_channels": 3,
        "image_side_in_patches": size.patches_per_side,
        **family,
    }


def _qwen_ids() -> dict:
    return {
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": VIDEO_TOKEN,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }


def _qwen2_vl(size: ModelSize = TINY):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={**_text(size), "rope_parameters": _mrope(size)},
        vision_config=_qwen_vision(
            size,
            embed_dim=size.vision_hidden,
            hidden_size=size.hidden,
            mlp_ratio=size.vision_intermediate // size.vision_hidden,
            # tiny: the single vision block the patching tests count modules of
            depth=1 if size is TINY else size.vision_layers,
        ),
        **_qwen_ids(),
    )


def _qwen2_5_vl(size: ModelSize = TINY):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={**_text(size), "rope_parameters": _mrope(size)},
        vision_config=_qwen_vision(
            size,
            intermediate_size=size.vision_intermediate,
            out_hidden_size=size.hidden,
            window_size=size.image,  # one window per image: window attention on the varlen path
            fullatt_block_indexes=[size.vision_layers - 1],
        ),
        **_qwen_ids(),
    )


def _qwen3_vl(size: ModelSize = TINY):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={
            **_text(size),
            "head_dim": size.head_dim,
            "rope_parameters": _mrope(size, mrope_interleaved=True),
        },
        vision_config=_qwen_vision(
            size,
            intermediate_size=size.vision_intermediate,
            out_hidden_size=size.hidden,
            num_position_embeddings=size.patches_per_side**2,
            deepstack_visual_indexes=[0],
        ),
        **_qwen_ids(),
    )


def _llava(size: ModelSize = TINY):
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={**_text(size), "model_type": "llama"},
        vision_config=_clip(size),
        image_token_id=IMAGE_TOKEN,
        projector_hidden_act="gelu",
    )


def _llava_siglip(size: ModelSize = TINY):
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={**_text(size), "model_type": "qwen2"},
        vision_config=_siglip(size),
        image_token_id=IMAGE_TOKEN,
        vision_feature_select_strategy="full",
    )


def _anyres_pinpoints(size: ModelSize) -> list[list[int]]:
    # tiny: a 2x2 grid of tiles (5 crops); small: one tile (2 crops of 224x224) to bound compute
    tiles_per_side = 2 if size is TINY else 1
    return [[tiles_per_side * size.image, tiles_per_side * size.image]]


def _llava_next(size: ModelSize = TINY):
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        text_config={**_text(size), "model_type": "mistral"},
        vision_config=_clip(size),
        image_token_id=IMAGE_TOKEN,
        image_grid_pinpoints=_anyres_pinpoints(size),
    )


def _llava_onevision(size: ModelSize = TINY):
    from transformers import LlavaOnevisionConfig

    return LlavaOnevisionConfig(
        text_config={**_text(size), "model_type": "qwen2"},
        vision_config=_siglip(size),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        image_grid_pinpoints=_anyres_pinpoints(size),
        vision_feature_layer=-1,
    )


def _idefics3(model_type: str):
    def build(size: ModelSize = TINY):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            model_type,
            text_config={**_text(size), "model_type": "llama"},
            vision_config={**_vit(size), "image_size": size.image, "patch_size": size.patch},
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        )

    return build


def _paligemma(size: ModelSize = TINY):
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig(
        text_config={**_text(size), "model_type": "gemma", "head_dim": size.head_dim},
        vision_config=_siglip(size),
        image_token_id=IMAGE_TOKEN,
        projection_dim=size.hidden,
    )


def _gemma3(size: ModelSize = TINY):
    from transformers import Gemma3Config

    sliding = ["sliding_attention"] * (size.layers - 1)
    return Gemma3Config(
        text_config={
            **_text(size),
            "model_type": "gemma3_text",
            "head_dim": size.head_dim,
            "sliding_window": 8 if size is TINY else 128,
            "layer_types": [*sliding, "full_attention"],
        },
        vision_config=_siglip(size),
        image_token_id=IMAGE_TOKEN,
        boi_token_index=VISION_START,
        eoi_token_index=VISION_END,
        mm_tokens_per_image=(size.patches_per_side // 2) ** 2,
    )


def _internvl(size: ModelSize = TINY):
    from transformers import InternVLConfig

    return InternVLConfig(
        text_config={**_text(size), "model_type": "qwen2"},
        vision_config={
            **_vit(size),
            "image_size": [size.image, size.image],
            "patch_size": [size.patch, size.patch],
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


def build_model(
    name: str,
    *,
    seed: int = 0,
    attn_implementation: str = "eager",
    size: str = "tiny",
    layers: int | None = None,
):
    """A freshly initialised model of family `name` at `size` (a key of SIZES; fp32, eval), with
    `layers` decoder layers instead of the size's when given."""
    import transformers

    if size not in SIZES:
        raise ValueError(f"size: expected one of {tuple(SIZES)}, got {size!r}")
    family = FAMILIES[name]
    torch.manual_seed(seed)
    shape = SIZES[size] if layers is None else replace(SIZES[size], layers=layers)
    config = family.config(shape)
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


def qwen_prompt(model, images: int, text_len: int, seed: int) -> tuple[list[int], dict]:
    """One Qwen-VL prompt row: BOS, ``images`` images (vision start + image tokens each), then
    ``text_len`` random text ids (seeded); returns ``(ids, image kwargs)``."""
    pixels, per_image = _qwen_images(model, images)
    words = torch.randint(3, TEXT_VOCAB, (text_len,), generator=_generator(seed)).tolist()
    ids = [BOS]
    for count in per_image:
        ids += [VISION_START] + [IMAGE_TOKEN] * count
    return ids + words, pixels


def left_padded_qwen_batch(rows: list[tuple[list[int], dict]]) -> dict:
    """Model kwargs of `qwen_prompt` rows, left-padded to the longest (rows may carry different
    image counts)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (ids, _) in enumerate(rows):
        input_ids[index, width - len(ids) :] = torch.tensor(ids)
        attention_mask[index, width - len(ids) :] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN).int(),
        "pixel_values": torch.cat([pixels["pixel_values"] for _, pixels in rows]),
        "image_grid_thw": torch.cat([pixels["image_grid_thw"] for _, pixels in rows]),
    }
