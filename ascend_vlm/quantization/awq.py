"""Activation-aware weight quantization (AWQ, Lin et al. 2023): the per-input-channel scale
search, applied to a model's float weights in place before they are rounded to nearest.

A *scaling group* is a set of linears that read the same input ``x`` together with the op that
produces ``x`` (its *producer*): a norm whose output channels scale with its weight (and bias),
or a linear whose output rows can be divided. For a scale vector ``s`` over ``x``'s channels,

    W x = (W diag(s)) (x / s),

so multiplying every consumer's columns by ``s`` and dividing the producer's output channels by
``s`` leaves the float model's function unchanged, while the rounding error of ``Q(W diag(s))``
shrinks on the channels ``s`` enlarges. AWQ enlarges the channels that carry large activations:

    s(alpha) = m^alpha / sqrt(max(m^alpha) * min(m^alpha)),   m = mean over tokens of |x|
    (m^alpha clamped to >= 1e-4),
    loss(alpha) = sum over the group's linears W of mean((W x - Q(W diag(s)) (x / s))^2),

over ``alpha`` in {0, 1/20, ..., 19/20}, keeping the smallest loss (ties keep the smaller
alpha). ``Q`` is :func:`~ascend_vlm.quantization.rtn.quantize_rtn` at the requested bits, group
size and symmetry, dequantized. ``alpha = 0`` gives ``s = 1``, plain RTN, so the chosen loss
never exceeds RTN's on the calibration inputs, and an alpha-0 group's weights are left as they
are.

Groups, per block, by module path (AutoAWQ's table for LLaMA-style decoders):

* decoder layers of the language model (a module with ``self_attn`` and ``mlp`` children):
  ``input_layernorm -> self_attn.{q,k,v}_proj``, ``post_attention_layernorm ->
  mlp.{gate,up}_proj``, ``mlp.up_proj -> mlp.down_proj`` (gated MLP: ``down(act(gate) * up)``,
  so dividing ``up``'s rows divides ``down``'s input), ``self_attn.v_proj -> self_attn.o_proj``
  only when ``v_proj``'s outputs are ``o_proj``'s inputs channel for channel (no grouped-query
  sharing: ``v_proj.out_features == o_proj.in_features``);
* when ``layers`` names vision linears, blocks of the vision tower: ``norm1 -> attn.qkv``, ``norm2 ->
  mlp.{fc1 | linear_fc1 | gate_proj, up_proj}`` (Qwen-VL towers), ``layer_norm1 ->
  self_attn.{q,k,v}_proj``, ``layer_norm2 -> mlp.fc1`` (CLIP / SigLIP towers), and the same
  ``up -> down`` and ``v -> o`` (``out_proj``) folds.

A group is scaled only when every module is where the table says (consumers plain
``nn.Linear``), a norm producer folds (checked on a copy: scaling its weight and bias by ``s``
scales its output by ``s``, which rejects Gemma's ``(1 + weight)`` norms), and during
calibration each consumer of a norm received exactly that norm's output. Everything else keeps
its weights: plain RTN.

Inputs are recorded once, in one pass over the calibration batches before any scaling: scaling
preserves the function, and a consumer's input changes only with its own group's scale, so the
recorded inputs stay the ones each group sees. Per group: a uniform random sample of at most
:data:`SAMPLE_ROWS` input rows (seeded; kept in the activations' dtype and device) and the mean
``|x|`` over all rows; in the language model rows at padded positions (``attention_mask`` 0)
are left out. The search runs in float32; the scales are then applied to the weights in their
own dtype (``s`` rounded to it first, so a producer and its consumers use the same ``s``).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm.models.parts import model_part
from ascend_vlm.quantization.rtn import check_scheme, quantize_rtn

GRID = 20
SAMPLE_ROWS = 512
MIN_SCALE = 1e-4


@dataclass(frozen=True)
class AWQGroupResult:
    """One scaling group: ``name`` is the producer's module name, ``consumers`` the linears it
    feeds; ``alpha`` the chosen exponent; ``rtn_loss`` and ``awq_loss`` the loss above at
    ``alpha = 0`` and at ``alpha``, summed over the consumers; ``rows`` the sampled input rows
    the losses were measured on."""

    name: str
    consumers: tuple[str, ...]
    alpha: float
    rtn_loss: float
    awq_loss: float
    rows: int


@dataclass(frozen=True)
class AWQReport:
    """What :func:`apply_awq_scales` did: the searched ``groups`` in model order, and the names
    of the producers of groups that matched the table but were left unscaled (``skipped``:
    calibration never reached them, or a consumer did not read the producer's output)."""

    bits: int
    group_size: int
    groups: tuple[AWQGroupResult, ...]
    skipped: tuple[str, ...] = ()

    @property
    def rtn_loss(self) -> float:
        return sum(group.rtn_loss for group in self.groups)

    @property
    def awq_loss(self) -> float:
        return sum(group.awq_loss for group in self.groups)


@dataclass(frozen=True)
class _Rule:
    """Producer path -> consumer paths inside a block; ``requires`` must exist too."""

    producer: str
    consumers: tuple[str, ...]
    requires: tuple[str, ...] = ()


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATED = _Rule("mlp.up_proj", ("mlp.down_proj",), requires=("mlp.gate_proj",))
TEXT_RULES = (
    _Rule("input_layernorm", _QKV),
    _Rule("self_attn.v_proj", ("self_attn.o_proj",)),
    _Rule("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    _GATED,
)
VISION_RULES = (
    _Rule("norm1", ("attn.qkv",)),
    _Rule("layer_norm1", _QKV),
    _Rule("self_attn.v_proj", ("self_attn.out_proj",)),
    _Rule("norm2", ("mlp.fc1",)),
    _Rule("norm2", ("mlp.linear_fc1",)),
    _Rule("norm2", ("mlp.gate_proj", "mlp.up_proj")),
    _Rule("layer_norm2", ("mlp.fc1",)),
    _GATED,
)


@dataclass(eq=False)
class _Group:
    """A matched group and what calibration recorded for it."""

    name: str
    producer: nn.Module
    consumer_names: tuple[str, ...]
    consumers: tuple[nn.Linear, ...]
    language: bool
    rows: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    count: int = 0
    connected: bool = True
    produced: torch.Tensor | None = field(default=None, repr=False)
    seen: int = 0


def _submodule(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _norm_folds(norm: nn.Module, width: int) -> bool:
    """Whether ``norm(x)`` with weight and bias multiplied by ``s`` equals ``norm(x) * s``."""
    own = dict(norm.named_parameters(recurse=False))
    weight = own.get("weight")
    if (
        weight is None
        or set(own) - {"weight", "bias"}
        or any(True for _ in norm.children())
        or tuple(weight.shape) != (width,)
    ):
        return False
    probe = copy.deepcopy(norm).float()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, width, generator=generator).to(weight.device)
    s = (torch.rand(width, generator=generator) + 0.5).to(weight.device)
    try:
        with torch.no_grad():
            before = probe(x)
            for parameter in probe.parameters(recurse=False):
                parameter.mul_(s)
            after = probe(x)
    except Exception:  # a norm that is not a plain x -> y module does not fold
        return False
    return isinstance(before, torch.Tensor) and torch.allclose(
        after, before * s, rtol=1e-4, atol=1e-5
    )


def _match(block_name: str, block: nn.Module, rule: _Rule, language: bool) -> _Group | None:
    producer = _submodule(block, rule.producer)
    consumers = [_submodule(block, path) for path in rule.consumers]
    if producer is None or any(type(c) is not nn.Linear for c in consumers):
        return None
    if any(_submodule(block, path) is None for path in rule.requires):
        return None
    width = consumers[0].in_features
    if any(c.in_features != width for c in consumers):
        return None
    if type(producer) is nn.Linear:
        if producer.out_features != width:
            return None
    elif not _norm_folds(producer, width):
        return None
    return _Group(
        name=f"{block_name}.{rule.producer}",
        producer=producer,
        consumer_names=tuple(f"{block_name}.{path}" for path in rule.consumers),
        consumers=tuple(consumers),
        language=language,
    )


def _find_groups(root: nn.Module, layers: Collection[str] | None) -> list[_Group]:
    """The groups of every block in model order (of the language model, and of the vision
    tower when ``layers`` names a vision linear), only those whose consumers are all in
    ``layers`` when given. ValueError when the language model has no decoder layer."""
    include_vision = layers is not None and any(model_part(name) == "vision" for name in layers)
    groups: list[_Group] = []
    decoder_layers = 0
    for name, block in root.named_modules():
        children = dict(block.named_children())
        if "mlp" not in children or not ({"self_attn", "attn"} & set(children)):
            continue
        part = model_part(name)
        if part == "language":
            decoder_layers += 1
            rules = TEXT_RULES
        elif part == "vision" and include_vision:
            rules = VISION_RULES
        else:
            continue
        for rule in rules:
            group = _match(name, block, rule, language=part == "language")
            if group is not None and (
                layers is None or all(consumer in layers for consumer in group.consumer_names)
            ):
                groups.append(group)
    if not decoder_layers:
        model_type = getattr(getattr(root, "config", None), "model_type", None)
        raise ValueError(
            f"model: expected a language model with decoder layers (modules with self_attn and "
            f"mlp children), found none in {type(root).__name__} (model_type {model_type!r})"
        )
    return groups


class _Recorder:
    """Forward hooks sampling each group's consumer inputs."""

    def __init__(self, groups: list[_Group]) -> None:
        self.mask: torch.Tensor | None = None
        self.generator = torch.Generator().manual_seed(0)
        self.handles = []
        for group in groups:
            if type(group.producer) is not nn.Linear:
                self.handles.append(group.producer.register_forward_hook(self._produced(group)))
            for index, consumer in enumerate(group.consumers):
                self.handles.append(consumer.register_forward_hook(self._consumed(group, index)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _produced(self, group: _Group):
        def hook(module, args, output):
            group.produced, group.seen = output, 0

        return hook

    def _consumed(self, group: _Group, index: int):
        def hook(module, args, output):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                group.connected = False
                return
            if type(group.producer) is not nn.Linear:
                produced = group.produced
                same = produced is x or (
                    isinstance(produced, torch.Tensor)
                    and produced.shape == x.shape
                    and torch.equal(produced, x)
                )
                group.connected &= same
                group.seen += 1
                if group.seen == len(group.consumers):
                    group.produced = None
            if index == 0:
                self._sample(group, x)

        return hook

    def _sample(self, group: _Group, x: torch.Tensor) -> None:
        """Bottom-k by uniform random keys: a uniform sample of all rows seen so far."""
        x = x.detach()
        if group.language and self.mask is not None and x.shape[:-1] == self.mask.shape:
            rows = x[self.mask.to(x.device)]
        else:
            rows = x.reshape(-1, x.shape[-1])
        if not rows.shape[0]:
            return
        total = rows.float().abs().sum(0)
        group.abs_sum = total if group.abs_sum is None else group.abs_sum + total
        group.count += rows.shape[0]
        keys = torch.rand(rows.shape[0], generator=self.generator)
        if group.rows is not None:
            rows = torch.cat((group.rows, rows))
            keys = torch.cat((group.keys, keys))
        if rows.shape[0] > SAMPLE_ROWS:
            keys, kept = torch.topk(keys, SAMPLE_ROWS, largest=False)
            rows = rows[kept.to(rows.device)]
        group.rows, group.keys = rows, keys


def _scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    s = mean_abs.pow(alpha).clamp(min=MIN_SCALE)
    return s / (s.max() * s.min()).sqrt()


def _search(
    group: _Group, bits: int, group_size: int, symmetric: bool | None
) -> tuple[float, float, float, torch.Tensor]:
    """(alpha, RTN loss, best loss, s) for ``group``, in float32."""
    x = group.rows.float()
    mean_abs = (group.abs_sum / group.count).to(x.device)
    weights = [consumer.weight.detach().float().to(x.device) for consumer in group.consumers]
    references = [x @ w.t() for w in weights]
    best = (0.0, float("inf"), torch.ones_like(mean_abs))
    rtn_loss = None
    for step in range(GRID):
        alpha = step / GRID
        s = _scales(mean_abs, alpha)
        loss = 0.0
        for weight, reference in zip(weights, references, strict=True):
            quantized = quantize_rtn(weight * s, bits, group_size, symmetric=symmetric)
            loss += torch.mean((reference - (x / s) @ quantized.dequantize().t()) ** 2).item()
        if rtn_loss is None:
            rtn_loss = loss
        if loss < best[1]:
            best = (alpha, loss, s)
    alpha, loss, s = best
    return alpha, rtn_loss, loss, s


@torch.no_grad()
def _apply(group: _Group, s: torch.Tensor) -> None:
    """Consumers' columns times ``s``, the producer's output channels divided by ``s``."""
    for consumer in group.consumers:
        consumer.weight.mul_(s.to(consumer.weight.device, consumer.weight.dtype))
    producer = group.producer
    if type(producer) is nn.Linear:
        rows = s.to(producer.weight.device, producer.weight.dtype)
        producer.weight.div_(rows[:, None])
        if producer.bias is not None:
            producer.bias.div_(rows.to(producer.bias.dtype))
        return
    for parameter in producer.parameters(recurse=False):
        parameter.div_(s.to(parameter.device, parameter.dtype))


def _progress(iterable, description: str, unit: str, enabled: bool):
    from tqdm.auto import tqdm  # a transformers dependency

    return tqdm(iterable, desc=description, unit=unit, disable=not enabled)


def _calibrate(root: nn.Module, groups, calibration, progress: bool) -> None:
    recorder = _Recorder(groups)
    device = next(root.parameters()).device
    training = root.training
    root.eval()
    batches = 0
    try:
        with torch.no_grad():
            for batch in _progress(calibration, "awq: calibrate", "batch", progress):
                if not isinstance(batch, Mapping):
                    raise TypeError(
                        f"calibration: expected model-input mappings (dicts of tensors), got "
                        f"{type(batch).__name__} at batch {batches}"
                    )
                inputs = {
                    key: value.to(device) if isinstance(value, torch.Tensor) else value
                    for key, value in batch.items()
                }
                mask = inputs.get("attention_mask")
                recorder.mask = mask.bool() if isinstance(mask, torch.Tensor) else None
                root(**inputs)
                batches += 1
    finally:
        recorder.remove()
        root.train(training)
    if not batches:
        raise ValueError("calibration: expected at least one batch of model inputs, got none")


def apply_awq_scales(
    model: nn.Module,
    calibration: Iterable[Mapping[str, torch.Tensor]],
    bits: int,
    group_size: int,
    *,
    symmetric: bool | None = None,
    layers: Collection[str] | None = None,
    progress: bool = True,
) -> AWQReport:
    """Search and apply AWQ scales to ``model``'s float weights in place (see the module
    docstring); the float model computes the same function afterwards, up to rounding.

    ``model``: a transformers VLM, optionally PEFT-wrapped. ``calibration``: model-input
    mappings (e.g. processor outputs), each run as ``model(**batch)`` once. ``bits``,
    ``group_size``, ``symmetric``: the RTN grid the weights will be rounded to (``symmetric``
    None: :func:`~ascend_vlm.quantization.rtn.quantize_rtn`'s default for ``bits``).
    ``layers``: the names of the linears that will be quantized; a group is scaled only when
    all its consumers are among them (rescaling a layer kept in float would re-round it for
    nothing), and vision blocks only when some are. None: every language-model group.
    ``progress``: tqdm bars.

    Raises TypeError / ValueError naming the argument for a bad scheme, a non-module model,
    an empty calibration, a batch that is not a mapping, and a model whose language model has
    no decoder layers.
    """
    check_scheme(bits, group_size)
    root = base_model(model)
    groups = _find_groups(root, None if layers is None else frozenset(layers))
    _calibrate(root, groups, calibration, progress)
    results, skipped = [], []
    for group in _progress(groups, "awq: search", "group", progress):
        if group.rows is None or not group.connected:
            skipped.append(group.name)
            continue
        alpha, rtn_loss, loss, s = _search(group, bits, group_size, symmetric)
        if alpha > 0:
            _apply(group, s)
        results.append(
            AWQGroupResult(
                name=group.name,
                consumers=group.consumer_names,
                alpha=alpha,
                rtn_loss=rtn_loss,
                awq_loss=loss,
                rows=group.rows.shape[0],
            )
        )
        group.rows = group.keys = group.abs_sum = None
    return AWQReport(
        bits=bits, group_size=group_size, groups=tuple(results), skipped=tuple(skipped)
    )
