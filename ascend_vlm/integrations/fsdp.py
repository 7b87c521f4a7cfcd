"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a VLM that does not fit one card, with LoRA:
one shard unit per decoder layer and vision-tower layer, on HCCL or gloo.

Three routes, the same units (`sharded_layer_classes`):

* Trainer anywhere (NPU with HCCL, CPU with gloo), transformers 5.25: `fsdp_distributed_config`
  gives the ``distributed_config`` of ``from_pretrained``, which shards the model while loading
  it (transformers' own FSDP2, `fsdp_plan`); Trainer then trains it without DDP and keeps the
  LoRA parameters added after loading (replicated) in step across ranks. 5.17 lacks it.
* Trainer on accelerators (NPU, GPU): `fsdp_training_arguments` gives the ``TrainingArguments``
  (``fsdp=True``, ``fsdp_config={"version": 2, ...}``, transformers 5.17 to 5.25 with
  accelerate 1.16) under which accelerate's ``fsdp2_prepare_model`` calls ``fully_shard`` on
  every module of those classes, the input embeddings, the final norm with the LM head, and
  the root.
* CPU processes (gloo) and loops of one's own: `shard_model`. accelerate 1.16 turns FSDP on
  only for accelerator devices: on CPU ranks its state stays ``MULTI_CPU``, Trainer's
  ``fsdp=True`` trains with DDP and full parameters on every rank, and a model sharded
  beforehand is wrapped in DDP all the same.

Both work on a patched, PEFT-wrapped (LoRA) model: ``patch`` changes instance forwards, not the
parameters FSDP2 turns into ``DTensor`` shards, and LoRA's frozen base weights are sharded with
the trainable ones (FSDP2 keeps ``requires_grad`` per parameter).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._compat.distributed_loading import load_time_fsdp_problem
from ascend_vlm._compat.fsdp_state import FSDP_STATE_PROBES, init_fsdp_root
from ascend_vlm._compat.probe import require_probes
from ascend_vlm.models import descriptor_for
from ascend_vlm.models.descriptor import attribute_at


def _element_classes(module: nn.Module) -> list[str]:
    """Class names of the elements of every ``nn.ModuleList`` inside `module`, in order."""
    names = [
        type(element).__name__
        for child in module.modules()
        if isinstance(child, nn.ModuleList)
        for element in child
    ]
    return list(dict.fromkeys(names))


def sharded_layer_classes(model: nn.Module) -> list[str]:
    """The class names FSDP2 shards one unit per instance of in `model` (a transformers VLM,
    optionally PEFT-wrapped): its family's decoder layer class (the descriptor's
    ``layout.decoder_layers``), then the layer classes of its vision tower (the elements of the
    tower's module lists). A model no family describes gets transformers' own
    ``_no_split_modules``. ValueError when neither names any class."""
    base = base_model(model)
    descriptor = descriptor_for(getattr(base, "config", None))
    if descriptor is None:
        names = sorted(getattr(base, "_no_split_modules", None) or ())
    else:
        multimodal = descriptor.layout.multimodal_model(base)
        layers = attribute_at(multimodal, descriptor.layout.decoder_layers)
        names = [type(layer).__name__ for layer in layers or ()]
        for path in descriptor.layout.tower_paths():
            tower = attribute_at(base, path)
            if isinstance(tower, nn.Module):
                names += _element_classes(tower)
                break
    names = list(dict.fromkeys(names))
    if not names:
        raise ValueError(
            f"model: expected a transformers model whose family descriptor or "
            f"_no_split_modules names its layer classes, got {type(base).__name__} with none"
        )
    return names


def fsdp_plan(model_class: type, config: Any) -> dict[str, str]:
    """transformers' ``fsdp_plan`` for ``model_class(config)``: a "free_full_weight" rule (one
    ``fully_shard`` unit per module, resharded after its forward) per module of a class
    `sharded_layer_classes` names, as its path from the model with the layer number as "*"
    ("model.language_model.layers.*"). The model is built on the meta device to read them."""
    with torch.device("meta"):
        model = model_class(config)
    classes = set(sharded_layer_classes(model))
    rules = {}
    for name, module in model.named_modules():
        if type(module).__name__ in classes:
            parent, _, index = name.rpartition(".")
            rules[f"{parent}.*" if index.isdigit() else name] = "free_full_weight"
    return rules


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_distributed_config(
    config: Any,
    *,
    model_class: type | None = None,
    fsdp_size: int | None = None,
    cpu_offload: bool = False,
) -> Any:
    """The ``transformers.distributed.DistributedConfig`` that makes ``from_pretrained`` shard a
    model with FSDP2 while loading it: ``fsdp_size`` ranks (default: the world size, from the
    process group or torchrun's ``WORLD_SIZE``), the rules of `fsdp_plan`, parameters offloaded
    to host memory with ``cpu_offload``.

    config: the checkpoint's config (``AutoConfig.from_pretrained(path)``); model_class: the
    class to load (default: the config's first ``architectures`` entry). Pass the result as
    ``from_pretrained(path, distributed_config=...)`` on every rank, then apply ``patch`` and
    PEFT as usual. RuntimeError on a transformers without load-time FSDP for Trainer (5.17:
    use `shard_model` in a loop of one's own); ValueError for fewer than 2 ranks or a config
    naming no architecture.
    """
    problem = load_time_fsdp_problem()
    if problem is not None:
        raise RuntimeError(f"fsdp_distributed_config: {problem}")
    from transformers.distributed import DistributedConfig

    size = _world_size() if fsdp_size is None else fsdp_size
    if size < 2:
        raise ValueError(f"fsdp_size: expected at least 2 ranks to shard over, got {size}")
    if model_class is None:
        import transformers

        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            raise ValueError(
                f"config: expected an architectures entry naming a transformers class "
                f"(or pass model_class=), got {architectures!r}"
            )
    return DistributedConfig(
        fsdp_size=size, fsdp_plan=fsdp_plan(model_class, config), fsdp_cpu_offload=cpu_offload
    )


def fsdp_training_arguments(
    model: nn.Module, *, reshard_after_forward: bool = True, cpu_offload: bool = False
) -> dict[str, Any]:
    """Keyword arguments of ``transformers.TrainingArguments`` that shard `model` with FSDP2
    under Trainer on accelerator devices: ``{"fsdp": True, "fsdp_config": {...}}`` naming
    `sharded_layer_classes` (on CPU ranks accelerate trains with DDP instead: `shard_model`).

    reshard_after_forward: free each unit's gathered parameters after its forward (True: least
    memory, one more all-gather in backward); cpu_offload: keep the shards in host memory. The
    checkpoint Trainer saves is a full state dict, as without FSDP. Launch one process per card
    (``torchrun``); on one process Trainer refuses FSDP.
    """
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "transformer_layer_cls_to_wrap": sharded_layer_classes(model),
            "reshard_after_forward": reshard_after_forward,
            "cpu_offload": cpu_offload,
            "state_dict_type": "FULL_STATE_DICT",
        },
    }


def shard_model(
    model: nn.Module, *, reshard_after_forward: bool = True, mesh: Any = None
) -> nn.Module:
    """Apply ``fully_shard`` to `model` in place, as accelerate's FSDP2 does, and return it: one
    unit per module of a class `sharded_layer_classes` names (innermost first), then the root
    (`model` itself, a PEFT wrapper included) for the remaining parameters.

    Needs the default process group (gloo on CPU, HCCL on NPU) or a 1-D ``mesh``; every rank
    then holds about 1/world_size of every parameter (dim-0 shards) and gathers each unit only
    around its forward and backward. reshard_after_forward: as in ``fully_shard``. Build the
    optimizer after sharding (it must see the ``DTensor`` parameters); a full state dict for
    saving comes from ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
    ``full_state_dict=True``.
    """
    from torch.distributed.fsdp import fully_shard

    classes = set(sharded_layer_classes(model))
    for module in reversed(list(model.modules())):
        if module is not model and type(module).__name__ in classes:
            fully_shard(module, reshard_after_forward=reshard_after_forward, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def held_parameter_elements(model: nn.Module) -> tuple[int, int]:
    """``(held, whole)``: the parameter elements this rank holds (its local shard of each
    ``DTensor``, all of a plain tensor) and the elements of the whole parameters."""
    held = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    return held, sum(p.numel() for p in model.parameters())


def _outermost_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units in `module` (itself included) that no other unit contains."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return [module]
    return [unit for child in module.children() for unit in _outermost_units(child)]


@contextlib.contextmanager
def roots_unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Gather the parameters of `model`'s outermost FSDP2 units for the duration (a no-op for
    a model without any), resharding them after.

    An outermost unit gathers its own parameters (embeddings, a vision tower's patch embedding,
    the head) only around its forward; ``generate`` encodes images through the vision tower
    before that forward runs, so without this its first call meets sharded weights. Every
    rank must enter it together (gathering is a collective); the inner units still gather
    around their own forwards. RuntimeError naming the probe when the installed torch lacks
    the internal that makes a unit the root (:mod:`ascend_vlm._compat.fsdp_state`)."""
    roots = _outermost_units(model)
    if roots:
        require_probes(
            FSDP_STATE_PROBES, "roots_unsharded", f"torch {torch.__version__}", RuntimeError
        )
    for root in roots:
        # A unit becomes the root at its first forward; before any (a report ahead of training)
        # the inner units met first would each claim it.
        init_fsdp_root(root)
        root.unshard()
    try:
        yield model
    finally:
        for root in roots:
            root.reshard()
