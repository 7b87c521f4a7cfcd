"""What the three Qwen-VL families share beyond their swaps: where their parts are, their
visual tokens and pixel encoders, and every feature supported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ascend_vlm.models.descriptor import (
    SUPPORTED,
    Encoder,
    FamilyDescriptor,
    FeatureSupport,
    Layout,
)
from ascend_vlm.models.family_spec import ModelSpec

LAYOUT = Layout(vision_tower="visual", projector="visual.merger", language_model="language_model")
_VISUAL_TOKEN_IDS = ("image_token_id", "video_token_id")
_ENCODERS = (
    Encoder("get_image_features", grid="image_grid_thw"),
    Encoder("get_video_features", grid="video_grid_thw"),
)
# Every feature runs on Qwen-VL's grids and M-RoPE.
QWEN_VL_FEATURES = FeatureSupport(
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


def qwen_vl_descriptor(
    spec: Callable[[Any], ModelSpec], position_scheme: str, deepstack: str | None = None
) -> FamilyDescriptor:
    """A Qwen-VL family's descriptor: its `spec`, M-RoPE flavour and deepstack config path."""
    return FamilyDescriptor(
        patch=spec,
        layout=LAYOUT,
        visual_token_ids=_VISUAL_TOKEN_IDS,
        position_scheme=position_scheme,
        encoders=_ENCODERS,
        features=QWEN_VL_FEATURES,
        deepstack=deepstack,
    )
