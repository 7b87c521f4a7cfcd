"""Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE, and Qwen-VL
prompts with images."""

from __future__ import annotations

import torch

from ascend_vlm.models.tiny.family import TinyFamily
from ascend_vlm.models.tiny.sizes import (
    BOS,
    IMAGE_TOKEN,
    PAD,
    TEXT_VOCAB,
    TINY,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    ModelSize,
    generator,
    mrope_parameters,
    text_config,
)


def qwen_images(model, count: int) -> tuple[dict, list[int]]:
    """`count` images of ``image_side_in_patches`` squared patches each, with their grids."""
    vision = model.config.vision_config
    side = vision.image_side_in_patches  # set by qwen_vision_config: one image of that many patches
    grid = torch.tensor([[1, side, side]] * count)  # t, h, w in patches
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, generator=generator(count))
    tokens = int(grid[0].prod()) // vision.spatial_merge_size**2
    return {"pixel_values": pixels, "image_grid_thw": grid}, [tokens] * count


def qwen_token_inputs(input_ids: torch.Tensor, n_images: int) -> dict:
    """Qwen-VL's multimodal token types (1 on image tokens), passed when images are."""
    return {"mm_token_type_ids": (input_ids == IMAGE_TOKEN).int()} if n_images else {}


def qwen_vision_config(size: ModelSize, **family) -> dict:
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


def qwen_token_ids() -> dict:
    return {
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": VIDEO_TOKEN,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }


def _qwen2_vl(size: ModelSize = TINY):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={**text_config(size), "rope_parameters": mrope_parameters(size)},
        vision_config=qwen_vision_config(
            size,
            embed_dim=size.vision_hidden,
            hidden_size=size.hidden,
            mlp_ratio=size.vision_intermediate // size.vision_hidden,
            # tiny: the single vision block the patching tests count modules of
            depth=1 if size is TINY else size.vision_layers,
        ),
        **qwen_token_ids(),
    )


def _qwen2_5_vl(size: ModelSize = TINY):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={**text_config(size), "rope_parameters": mrope_parameters(size)},
        vision_config=qwen_vision_config(
            size,
            intermediate_size=size.vision_intermediate,
            out_hidden_size=size.hidden,
            window_size=size.image,  # one window per image: window attention on the varlen path
            fullatt_block_indexes=[size.vision_layers - 1],
        ),
        **qwen_token_ids(),
    )


def qwen3_vl_vision_config(size: ModelSize) -> dict:
    """Qwen3-VL's vision tower (also Qwen3-VL-MoE's and Qwen3.5's): learned position
    embeddings for one image, deepstack from its first layer."""
    return qwen_vision_config(
        size,
        intermediate_size=size.vision_intermediate,
        out_hidden_size=size.hidden,
        num_position_embeddings=size.patches_per_side**2,
        deepstack_visual_indexes=[0],
    )


def qwen3_vl_text_config(size: ModelSize) -> dict:
    """Qwen3-VL's decoder (also Qwen3-VL-MoE's): interleaved M-RoPE, explicit head_dim."""
    return {
        **text_config(size),
        "head_dim": size.head_dim,
        "rope_parameters": mrope_parameters(size, mrope_interleaved=True),
    }


def _qwen3_vl(size: ModelSize = TINY):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=qwen3_vl_text_config(size),
        vision_config=qwen3_vl_vision_config(size),
        **qwen_token_ids(),
    )


def tiny_moe(size: ModelSize) -> dict:
    """Sparse MoE sizes: 8 experts, top-2, each expert a quarter of the dense MLP's width."""
    return {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": size.intermediate // 4,
    }


def _qwen3_vl_moe(size: ModelSize = TINY):
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(
        # the first decoder layer dense (a gated MLP), every other one sparse
        text_config={**qwen3_vl_text_config(size), **tiny_moe(size), "mlp_only_layers": [0]},
        vision_config=qwen3_vl_vision_config(size),
        **qwen_token_ids(),
    )


def qwen3_5_text_config(size: ModelSize) -> dict:
    """Qwen3.5's decoder: the size's layers as Gated DeltaNet layers (two key heads shared by
    four value heads) then one gated full-attention layer, whose heads are twice the size's
    head dim with half of it rotary (the size's M-RoPE sections)."""
    return {
        **text_config(size),
        "num_hidden_layers": size.layers + 1,
        "layer_types": ["linear_attention"] * size.layers + ["full_attention"],
        "head_dim": 2 * size.head_dim,
        "rope_parameters": mrope_parameters(
            size, partial_rotary_factor=0.5, mrope_interleaved=True
        ),
        "linear_num_key_heads": size.kv_heads,
        "linear_num_value_heads": 2 * size.kv_heads,
        "linear_key_head_dim": size.head_dim,
        "linear_value_head_dim": size.head_dim,
    }


def _qwen3_5(size: ModelSize = TINY):
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=qwen3_5_text_config(size),
        vision_config=qwen3_vl_vision_config(size),
        **qwen_token_ids(),
    )


def _qwen3_5_moe(size: ModelSize = TINY):
    """Qwen3.5's decoder with 4 routed experts (top 2) and a shared expert in every layer."""
    from transformers import Qwen3_5MoeConfig

    experts = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": size.intermediate // 2,
        "shared_expert_intermediate_size": size.intermediate // 2,
    }
    return Qwen3_5MoeConfig(
        text_config={**qwen3_5_text_config(size), **experts},
        vision_config=qwen3_vl_vision_config(size),
        **qwen_token_ids(),
    )


def _qwen_family(name: str, model_class: str, config) -> TinyFamily:
    return TinyFamily(name, model_class, config, qwen_images, token_inputs=qwen_token_inputs)


TINY_FAMILIES = (
    _qwen_family("qwen2_vl", "Qwen2VLForConditionalGeneration", _qwen2_vl),
    _qwen_family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl),
    _qwen_family("qwen3_vl", "Qwen3VLForConditionalGeneration", _qwen3_vl),
    _qwen_family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", _qwen3_vl_moe),
    _qwen_family("qwen3_5", "Qwen3_5ForConditionalGeneration", _qwen3_5),
    _qwen_family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", _qwen3_5_moe),
)


def qwen_prompt(model, images: int, text_len: int, seed: int) -> tuple[list[int], dict]:
    """One Qwen-VL prompt row: BOS, ``images`` images (vision start + image tokens each), then
    ``text_len`` random text ids (seeded); returns ``(ids, image kwargs)``."""
    pixels, per_image = qwen_images(model, images)
    words = torch.randint(3, TEXT_VOCAB, (text_len,), generator=generator(seed)).tolist()
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
