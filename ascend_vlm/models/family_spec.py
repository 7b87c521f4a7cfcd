"""The vocabulary family modules use to say *what* to swap; `ascend_vlm.patching` does the *how*.

A model is split into parts: the vision tower (found by attribute path from the base model) and
the text part (everything else). Each part lists, by module class name, which modules go to which
op of `ascend_vlm.ops`, and which are deliberately left alone and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Kinds of module a patch swaps or leaves alone; "linear-attention" is a recurrent token mixer
# (Gated DeltaNet), "moe" a sparse mixture-of-experts block.
KINDS = ("attention-text", "attention-vision", "norm", "rope", "mlp", "linear-attention", "moe")


@dataclass(frozen=True)
class RmsNorm:
    """RMSNorm classes -> `ops.rms_norm`; y = x * rsqrt(mean(x^2) + eps) * (offset + weight)."""

    classes: tuple[str, ...]
    offset: float = 0.0


@dataclass(frozen=True)
class SwigluMlp:
    """Gated MLPs `down(act(gate(x)) * up(x))` with SiLU act -> `ops.swiglu` on cat(gate, up)."""

    classes: tuple[str, ...]


@dataclass(frozen=True)
class Rope:
    """Attention classes whose forward calls the module-level `function`, which patching
    resolves to an adapter around `ops.rotary_embedding_pair`.

    style "text": `function(q, k, cos, sin, unsqueeze_dim=1)` with q/k [B, N, S, D], cos/sin [B, S, D]
    (or `unsqueeze_dim=0` with cos/sin [S, D], as Pixtral's vision tower calls it).
    style "vision": `function(q, k, cos, sin)` with q/k [T, N, D], cos/sin [T, D], math in fp32.
    """

    classes: tuple[str, ...]
    function: str
    style: str = "text"


@dataclass(frozen=True)
class LeaveAlone:
    """Modules of `kind` deliberately not swapped, with the reason shown in the PatchReport."""

    kind: str
    classes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class PartSpec:
    """What to swap in one part (text or vision) of a model."""

    attention: tuple[str, ...] = ()
    norms: tuple[RmsNorm, ...] = ()
    mlps: tuple[SwigluMlp, ...] = ()
    ropes: tuple[Rope, ...] = ()
    left_alone: tuple[LeaveAlone, ...] = ()

    def __add__(self, other: PartSpec) -> PartSpec:
        return PartSpec(
            attention=self.attention + other.attention,
            norms=self.norms + other.norms,
            mlps=self.mlps + other.mlps,
            ropes=self.ropes + other.ropes,
            left_alone=self.left_alone + other.left_alone,
        )


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: its text part, its vision part and where the vision tower lives.

    `vision_towers` are dotted attribute paths from the base model (e.g. "model.visual"); the
    first one that exists is the vision part. Modules outside it belong to the text part.
    """

    text: PartSpec
    vision: PartSpec = field(default_factory=PartSpec)
    vision_towers: tuple[str, ...] = ()
