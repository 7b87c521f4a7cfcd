"""LLaVA, LLaVA-NeXT, LLaVA-OneVision, InternVL, Gemma 3, PaliGemma: a known vision
tower (CLIP, SigLIP, InternViT) + a projector + a known decoder, each taken from the
sub-config's own model_type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ascend_vlm.models._backbones import composite_spec
from ascend_vlm.models.descriptor import (
    SUPPORTED,
    Encoder,
    FamilyDescriptor,
    FeatureSupport,
    Layout,
    Refused,
)
from ascend_vlm.models.family_spec import ModelSpec

LAYOUT = Layout(
    vision_tower="vision_tower", projector="multi_modal_projector", language_model="language_model"
)


def spec(config) -> ModelSpec:
    return composite_spec(config, LAYOUT)


def llava_descriptor(
    features: FeatureSupport, *, videos: bool = False, patch: Callable[[Any], ModelSpec] = spec
) -> FamilyDescriptor:
    """The descriptor of a family laid out as LLaVA (:data:`LAYOUT`, one image token, 1-D
    RoPE, `get_image_features` and with `videos` `get_video_features`), patched by `patch`."""
    return FamilyDescriptor(
        patch=patch,
        layout=LAYOUT,
        visual_token_ids=("image_token_id", "video_token_id") if videos else ("image_token_id",),
        position_scheme="rope",
        encoders=(Encoder("get_image_features"),)
        + ((Encoder("get_video_features"),) if videos else ()),
        features=features,
    )


_ANYRES = "its processor cuts each image into a varying number of anyres tiles plus a base image"
_TILES = "its processor crops each image into a varying number of tiles"
_CACHE_UNVERIFIED = (
    "the cache splits only Qwen-VL's grid rows and LLaVA's one pixel entry per image, and is "
    "not verified on this family's get_image_features"
)


def sized_image_features(layout: str) -> FeatureSupport:
    """The features of a family whose processor passes ``image_sizes`` with the pixels;
    `layout` says how the processor lays an image out (the refusals' reason)."""
    return FeatureSupport(
        token_pruning=SUPPORTED,
        kv_compression=SUPPORTED,
        vision_cache=Refused(f"{layout}, passed with image_sizes, which the cache does not split"),
        chat_sessions=Refused(
            "its processor returns image_sizes, which ChatSession cannot split per image"
        ),
        batching=SUPPORTED,
        quantization=SUPPORTED,
        adapters=SUPPORTED,
        tracing=SUPPORTED,
        attention_overlay=Refused(f"{layout}, a geometry the overlay does not invert"),
        vision_input=Refused(f"{layout}, which neither fast preprocessor reproduces"),
    )


_ANYRES_FEATURES = sized_image_features(_ANYRES)
# Gemma 3 and Gemma 4 refuse batching for this reason.
SLIDING_CACHES_UNBATCHED = (
    "its layers alternate sliding-window caches, which BatchGenerator's KV blocks do not hold; "
    "its per-sequence fallback for such layers is not yet tested on this family"
)
_BIDIRECTIONAL_PREFIX = "its image and prefix tokens attend bidirectionally"
_GEMMA3_PRUNING = (
    "its image tokens attend to each other bidirectionally and its layers alternate "
    "sliding-window caches"
)
DESCRIPTORS = {
    "llava": llava_descriptor(
        FeatureSupport(
            token_pruning=SUPPORTED,
            kv_compression=SUPPORTED,
            vision_cache=SUPPORTED,
            chat_sessions=SUPPORTED,
            batching=SUPPORTED,
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=SUPPORTED,
            vision_input=SUPPORTED,
        )
    ),
    "llava_next": llava_descriptor(_ANYRES_FEATURES),
    "llava_onevision": llava_descriptor(_ANYRES_FEATURES, videos=True),
    "internvl": llava_descriptor(
        FeatureSupport(
            token_pruning=SUPPORTED,
            kv_compression=SUPPORTED,
            vision_cache=Refused(_CACHE_UNVERIFIED),
            chat_sessions=Refused(
                f"{_TILES}, so pixel_values has no fixed number of entries per image"
            ),
            batching=SUPPORTED,
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                f"{_TILES} and its projector pixel-shuffles the patches, a geometry the overlay "
                f"does not invert"
            ),
            vision_input=Refused(f"{_TILES}, which neither fast preprocessor reproduces"),
        )
    ),
    "gemma3": llava_descriptor(
        FeatureSupport(
            token_pruning=Refused(_GEMMA3_PRUNING),
            kv_compression=Refused(_GEMMA3_PRUNING),
            vision_cache=Refused(_CACHE_UNVERIFIED),
            chat_sessions=Refused(
                "its sliding-window cache layers cannot be cropped back once their window is full"
            ),
            batching=Refused(SLIDING_CACHES_UNBATCHED),
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                "its projector average-pools the patch grid to mm_tokens_per_image tokens, a "
                "geometry the overlay does not invert"
            ),
            vision_input=Refused(
                "its image processor has its own pipeline (pan and scan), which neither fast "
                "preprocessor reproduces"
            ),
        )
    ),
    "paligemma": llava_descriptor(
        FeatureSupport(
            token_pruning=Refused(_BIDIRECTIONAL_PREFIX),
            kv_compression=Refused(_BIDIRECTIONAL_PREFIX),
            vision_cache=Refused(_CACHE_UNVERIFIED),
            chat_sessions=Refused(
                f"{_BIDIRECTIONAL_PREFIX}, so an earlier turn's cached prefix is not what the "
                f"whole conversation computes"
            ),
            batching=SUPPORTED,
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                "the overlay's geometry covers Qwen-VL's merged grids and LLaVA's patch raster; "
                "PaliGemma's is not wired in"
            ),
            vision_input=SUPPORTED,
        )
    ),
}
