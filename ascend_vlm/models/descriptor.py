"""The vocabulary a family uses to declare what every feature needs to know about it.

A :class:`FamilyDescriptor` holds, for one ``config.model_type``: what `patch` swaps (its
``spec(config)``), where the parts of the multimodal model are (:class:`Layout`), which config
attributes hold the visual token ids, its position scheme, its deepstack layers, the methods
that encode pixels, and for every feature of :class:`FeatureSupport` whether it runs on the
family and, when it does not, why. Features read it through `ascend_vlm.models`; none keeps a
family list of its own.

Adding a feature means adding a field to :class:`FeatureSupport`: every family that does not
answer it then fails to build (the fields have no defaults).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ascend_vlm.models.family_spec import ModelSpec

# 1-D RoPE over the token index; Qwen2-VL's M-RoPE (text, t, h, w sections of the rotary
# dimension); Qwen3-VL's M-RoPE with the t/h/w frequencies interleaved; GLM-4V's M-RoPE
# (Qwen2-VL's sections, each frequency rotating a GPT-J pair of adjacent dims).
POSITION_SCHEMES = ("rope", "mrope", "interleaved_mrope", "pairwise_mrope")


@dataclass(frozen=True)
class Supported:
    """A feature that runs on the family."""


SUPPORTED = Supported()


@dataclass(frozen=True)
class Refused:
    """A feature that does not run on the family; ``reason`` is the sentence its error shows."""

    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"reason: expected a non-empty sentence, got {self.reason!r}")


Support = Supported | Refused


@dataclass(frozen=True)
class FeatureSupport:
    """Whether each feature runs on a family. Every field is required; its ``label`` metadata
    names the feature in errors."""

    token_pruning: Support = field(metadata={"label": "token pruning"})
    kv_compression: Support = field(metadata={"label": "SnapKV prompt-cache compression"})
    vision_cache: Support = field(metadata={"label": "the vision cache"})
    chat_sessions: Support = field(metadata={"label": "ChatSession"})
    batching: Support = field(metadata={"label": "BatchGenerator"})
    quantization: Support = field(metadata={"label": "quantization"})
    adapters: Support = field(metadata={"label": "adapters"})
    tracing: Support = field(metadata={"label": "tracing"})
    attention_overlay: Support = field(metadata={"label": "the attention overlay"})
    vision_input: Support = field(metadata={"label": "the fast vision input"})

    def __post_init__(self) -> None:
        for name, answer in self.answers().items():
            if not isinstance(answer, (Supported, Refused)):
                raise TypeError(
                    f"{name}: expected SUPPORTED or Refused(reason), got {type(answer).__name__}"
                )

    def answers(self) -> dict[str, Support]:
        """Feature name -> its answer, in :data:`FEATURES` order."""
        return {name: getattr(self, name) for name in FEATURES}


FEATURES: tuple[str, ...] = tuple(f.name for f in fields(FeatureSupport))
FEATURE_LABELS: dict[str, str] = {f.name: f.metadata["label"] for f in fields(FeatureSupport)}


@dataclass(frozen=True)
class Layout:
    """Dotted attribute paths from the multimodal model to its vision tower, its projector
    (vision features -> language embeddings) and its language model, whose ``layers`` are the
    decoder layers. ``multimodal`` is the path from a transformers ``...ForConditionalGeneration``
    to the multimodal model: ``"model"``, or ``""`` when the generation model holds the parts
    itself (Llama 4)."""

    vision_tower: str
    projector: str
    language_model: str
    multimodal: str = "model"

    def multimodal_model(self, generation_model: Any) -> Any:
        """The multimodal model of ``generation_model``, or None when it has none there."""
        if not self.multimodal:
            return generation_model
        return attribute_at(generation_model, self.multimodal)

    @property
    def decoder_layers(self) -> str:
        return f"{self.language_model}.layers"

    @property
    def encoder_modules(self) -> tuple[str, ...]:
        """The multimodal model's children whose weights turn pixels into features."""
        return tuple(
            dict.fromkeys(path.split(".")[0] for path in (self.vision_tower, self.projector))
        )

    def tower_paths(self) -> tuple[str, ...]:
        """The vision tower's paths from the generation model, then from the multimodal one
        (`patch` takes either)."""
        if not self.multimodal:
            return (self.vision_tower,)
        return (f"{self.multimodal}.{self.vision_tower}", self.vision_tower)


@dataclass(frozen=True)
class Encoder:
    """A method of the multimodal model that encodes pixels, and the argument carrying the
    per-item grids (items are rows of ``pixel_values`` counted by the grid's product) or None
    (items are the first axis of ``pixel_values``)."""

    method: str
    grid: str | None = None


@dataclass(frozen=True)
class FamilyDescriptor:
    """Everything a feature needs to know about one model_type.

    ``patch(config)`` gives the :class:`ModelSpec` `patch` applies; ``visual_token_ids`` are
    config attributes holding the ids of the tokens visual features replace (image first);
    ``position_scheme`` is one of :data:`POSITION_SCHEMES`; ``deepstack`` is the dotted config
    path of the vision layers whose features are added to the first decoder layers (None when
    the family has none); ``encoders`` are the pixel-encoding methods, image first.
    """

    patch: Callable[[Any], ModelSpec]
    layout: Layout
    visual_token_ids: tuple[str, ...]
    position_scheme: str
    encoders: tuple[Encoder, ...]
    features: FeatureSupport
    deepstack: str | None = None

    def __post_init__(self) -> None:
        if self.position_scheme not in POSITION_SCHEMES:
            raise ValueError(
                f"position_scheme: expected one of {', '.join(POSITION_SCHEMES)}, "
                f"got {self.position_scheme!r}"
            )
        if not self.visual_token_ids:
            raise ValueError("visual_token_ids: expected at least one config attribute, got none")
        if not self.encoders:
            raise ValueError("encoders: expected at least one pixel-encoding method, got none")

    def token_ids(self, config: Any) -> tuple[int, ...]:
        """The distinct visual token ids ``config`` sets, in ``visual_token_ids`` order."""
        values = (getattr(config, name, None) for name in self.visual_token_ids)
        return tuple(value for value in dict.fromkeys(values) if isinstance(value, int))

    def rope_index(self, base: Any) -> Callable[..., Any] | None:
        """The inner model's ``get_rope_index`` of ``base`` (a family's model with its head) when
        its positions are multi-axis, None for plain RoPE (positions are the token indices)."""
        return None if self.position_scheme == "rope" else base.model.get_rope_index

    def deepstack_layers(self, config: Any) -> int:
        """How many first decoder layers get vision features added (0 without deepstack)."""
        return 0 if self.deepstack is None else len(attribute_at(config, self.deepstack) or ())


def attribute_at(owner: Any, path: str) -> Any:
    """The value at dotted attribute ``path`` of ``owner`` (a config or a module), or None when
    a step is missing."""
    value = owner
    for name in path.split("."):
        value = getattr(value, name, None)
    return value
