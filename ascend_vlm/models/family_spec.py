"""The vocabulary family modules use to say *what* to swap; `ascend_vlm.patching` does the *how*.

A model is split into parts: the vision tower (found by attribute path from the base model) and
the text part (everything else). Each part lists, by module class name, which modules go to which
op of `ascend_vlm.ops`, and which are deliberately left alone and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ascend_vlm.ops.moe_experts import ROUTING_WEIGHTS_ON

# Kinds of module a patch swaps or leaves alone; "linear-attention" is a recurrent token mixer
# (Gated DeltaNet), "moe" a sparse mixture-of-experts block.
KINDS = ("attention-text", "attention-vision", "norm", "rope", "mlp", "linear-attention", "moe")


@dataclass(frozen=True)
class RmsNorm:
    """RMSNorm classes -> `ops.rms_norm`; y = x * rsqrt(mean(x^2) + eps) * (offset + weight).

    ``rounds_once``: the module multiplies by the weight in fp32 and rounds once to x's dtype
    whatever the weight's dtype (Gemma 4), so `ops.rms_norm` applies as is; otherwise an
    offset-free norm with a weight of another dtype rounds like Llama's (`rms_norm_promoting`).
    ``scale_switch``: the module attribute that is False on instances without a weight (Gemma
    4's ``with_scale``); those normalise only (weight 1).
    """

    classes: tuple[str, ...]
    offset: float = 0.0
    rounds_once: bool = False
    scale_switch: str | None = None


@dataclass(frozen=True)
class SwigluMlp:
    """Gated MLPs `down(act(gate(x)) * up(x))` with SiLU act -> `ops.swiglu` on cat(gate, up).

    ``fused``: gate and up are one projection, `gate_up_proj(x) = cat(gate(x), up(x))`, with
    the activation in `activation_fn` (GLM); otherwise `gate_proj`, `up_proj` and `act_fn`.
    """

    classes: tuple[str, ...]
    fused: bool = False


@dataclass(frozen=True)
class Rope:
    """Attention classes whose forward calls the module-level `function`, which patching
    resolves to an adapter around `ops.rotary_embedding_pair`.

    style "text": `function(q, k, cos, sin, unsqueeze_dim=1)` with q/k [B, N, S, D], cos/sin
    [B, S, Dr]: NeoX halves rotated on the first Dr <= D dims, the rest passed through.
    style "text-interleaved": the same call with GPT-J pairs (x[2i], x[2i+1]) rotated, each
    pair's angle repeated in cos/sin (GLM-4V's `apply_rotary_pos_emb`).
    (`unsqueeze_dim=0` with cos/sin [S, D]: Pixtral's vision tower calls it so.)
    style "vision": `function(q, k, cos, sin)` with q/k [T, N, D], cos/sin [T, D], math in fp32.
    style "text-single": `function(x, cos, sin, unsqueeze_dim)` on q or k alone, x [B, N, S, D]
    (unsqueeze_dim 1) or [B, S, N, D] (unsqueeze_dim 2), cos/sin [B, S, D] (Gemma 4's text).
    style "axial": `function(x, cos, sin, position_ids, unsqueeze_dim=2)` with x [B, S, N, D],
    cos/sin [B, S, D] and position_ids [B, S, A]: the head dim is cut into A equal chunks, each
    rotated (rotate-half within the chunk) by the same chunk of cos/sin (Gemma 4's 2-D vision
    RoPE, A = 2).
    style "complex" / "complex_vision": Llama 4's `function(xq, xk, freqs_cis)` /
    `function(query, key, freqs_ci)` with q/k [B, S, N, D] and complex freqs [B, S, D/2] /
    [S, 1, D/2] rotating interleaved pairs, math in fp32.
    """

    classes: tuple[str, ...]
    function: str
    style: str = "text"


# How a sparse MoE block hands its router's choices to its routed experts (`SparseMoe.routing`).
#   "experts-call": the block calls ``experts(hidden (T, H), top_k_index (T, K), top_k_weights
#                   (T, K))`` (transformers' ``@use_experts_implementation`` experts), so the
#                   experts module's forward is what changes; router and shared expert stay stock.
#   "dense-scores": the block's ``router`` returns ``(scores (T, E), logits (T, E))``, the scores
#                   the sigmoid of the top-k logits and 0 elsewhere, and the block runs every expert
#                   on every token (Llama 4); the block's forward is what changes, still calling its
#                   router and ``shared_expert`` modules.
MOE_ROUTINGS = ("experts-call", "dense-scores")


@dataclass(frozen=True)
class SparseMoe:
    """Sparse MoE block classes whose routed experts go to `ops.moe_experts`; the router (and
    any shared expert) of each block stays the family's own.

    ``experts`` is the block's attribute holding the experts module (its ``gate_up_proj``
    (E, 2I, H) and ``down_proj`` (E, H, I), or (E, H, 2I) and (E, I, H) when ``transposed``,
    and its SiLU ``act_fn``); ``routing_weights_on`` is the op's ("output": the experts' outputs
    are weighted, "input": Llama 4's router score scales the expert's input); ``routing`` is one
    of :data:`MOE_ROUTINGS`.
    """

    classes: tuple[str, ...]
    experts: str = "experts"
    transposed: bool = False
    routing_weights_on: str = "output"
    routing: str = "experts-call"

    def __post_init__(self) -> None:
        if self.routing not in MOE_ROUTINGS:
            raise ValueError(f"routing: expected one of {MOE_ROUTINGS}, got {self.routing!r}")
        if self.routing_weights_on not in ROUTING_WEIGHTS_ON:
            raise ValueError(
                f"routing_weights_on: expected one of {ROUTING_WEIGHTS_ON}, "
                f"got {self.routing_weights_on!r}"
            )


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet token mixers (Qwen3.5's linear attention) whose forward calls transformers'
    module-level gated delta rule and short-convolution functions, which patching resolves, for
    that forward only, to adapters around ``ops.chunk_gated_delta_rule`` (prefill),
    ``ops.recurrent_gated_delta_rule`` (one token continuing a cached state) and
    ``ops.causal_conv1d``. The recurrent and conv states stay in transformers' cache."""

    classes: tuple[str, ...]


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
    moes: tuple[SparseMoe, ...] = ()
    linear_attention: tuple[GatedDeltaNet, ...] = ()
    left_alone: tuple[LeaveAlone, ...] = ()

    def __add__(self, other: PartSpec) -> PartSpec:
        return PartSpec(
            attention=self.attention + other.attention,
            norms=self.norms + other.norms,
            mlps=self.mlps + other.mlps,
            ropes=self.ropes + other.ropes,
            moes=self.moes + other.moes,
            linear_attention=self.linear_attention + other.linear_attention,
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
