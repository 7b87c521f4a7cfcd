"""Several LoRA adapters resident over one base VLM: loaded from disk, switched per request,
mixed per batch row, hot-swapped, unloaded.

PEFT holds and computes the adapters (``PeftModel.load_adapter``, ``set_adapter``,
``hotswap_adapter``); :class:`AdapterSet` adds what serving needs around it: safetensors-only
loading checked against the base before anything is touched (an adapter trained on another
base is refused naming the first module that does not fit), a base "adapter"
(:data:`BASE_ADAPTER`), per-request activation that does not grow with the adapters resident,
mixed-adapter rows in one pass (:mod:`~ascend_vlm.adapters.mixed_rows`; PEFT's
``adapter_names=`` path where the stacks cannot serve), and the rules PEFT leaves implicit
(mixed rows only while every resident adapter stays in the language model, because the vision
tower's layers see all images' patches, not rows).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._compat.peft_layers import peft_active_adapter_problem, set_lora_active_adapter
from ascend_vlm.adapters.mixed_rows import StackedAdapters, plain_lora_layers, rows_through_stacks
from ascend_vlm.models.parts import model_part

# PEFT's name for "no adapter" in per-row adapter names; here also an activatable adapter.
BASE_ADAPTER = "__base__"
# PEFT's name for an adapter created without one.
DEFAULT_ADAPTER_NAME = "default"
_WEIGHTS = "adapter_model.safetensors"
_CONFIG = "adapter_config.json"


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_adapter_name(name: object, argument: str = "name") -> str:
    """``name`` when it can name a PEFT adapter next to others; ``ValueError`` naming
    ``argument`` otherwise.

    Accepted: letters, digits, ``_`` and ``-``. PEFT keys modules by the name (no ``.``) and
    saves a named adapter into a folder of that name (no ``/``); it finds an adapter's tensors
    by names containing ``"lora_"``, so a name inside that prefix ("a", "lora") would match
    other adapters' tensors; and :data:`BASE_ADAPTER` means "no adapter" in per-row names."""
    if (
        not isinstance(name, str)
        or not _ADAPTER_NAME.fullmatch(name)
        or name == BASE_ADAPTER
        or name in "lora_"
    ):
        raise ValueError(
            f"{argument}: expected an adapter name of letters, digits, '_' and '-', not "
            f"{BASE_ADAPTER!r} nor part of PEFT's 'lora_' prefix, got {name!r}"
        )
    return name


def _adapter_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the adapter's safetensors file, read from its header only."""
    from safetensors import safe_open

    with safe_open(str(folder / _WEIGHTS), framework="pt") as weights:
        return {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118


def _module_of(key: str) -> tuple[str, str] | None:
    """(module path in the base model, "A" or "B") of a saved LoRA tensor name, else None."""
    for kind in ("A", "B"):
        marker = f".lora_{kind}.weight"
        if key.endswith(marker):
            path = key[: -len(marker)]
            return path.removeprefix("base_model.model."), kind
    return None


class AdapterSet:
    """LoRA adapters resident over ``model`` (a transformers VLM, patched or not, or a
    PEFT-wrapped one), one active at a time, or one per batch row.

    The first :meth:`load` wraps the model in a ``peft.PeftModel`` (:attr:`model`: call it
    and its ``generate`` for the active adapter; :meth:`forward` / :meth:`generate` of this set
    for one adapter per row). Before any load, or after :meth:`activate` of
    :data:`BASE_ADAPTER`, the base answers. Adapters load in inference mode (frozen).
    """

    def __init__(self, model: nn.Module) -> None:
        from peft import PeftModel

        self._peft: Any = model if isinstance(model, PeftModel) else None
        self._base = base_model(model)
        self._vision_adapters: set[str] = set()
        self._hotswap_rank: int | None = None
        self._layers: list | None = None
        self._tuner_layers: list = []
        # Resident adapters stacked for mixed rows; None: not built yet, False: not stackable.
        self._stacks: StackedAdapters | bool | None = None
        if self._peft is not None:
            self._refresh_layers()
        self._active = BASE_ADAPTER if self._peft is None else self._peft.active_adapter

    @property
    def model(self) -> nn.Module:
        """The model to call: the PEFT model once an adapter is loaded, else the base."""
        return self._peft if self._peft is not None else self._base

    @property
    def names(self) -> tuple[str, ...]:
        """Resident adapters, in load order (without :data:`BASE_ADAPTER`)."""
        return () if self._peft is None else tuple(self._peft.peft_config)

    @property
    def active(self) -> str:
        """The adapter calls without ``adapter_names`` use (:data:`BASE_ADAPTER`: none)."""
        return self._active

    # ------------------------------------------------------------------ loading

    def _check_folder(self, name: str, path: Path) -> None:
        check_adapter_name(name)
        if name in self.names:
            raise ValueError(f"name: adapter {name!r} is already loaded; unload it first")
        if not (path / _CONFIG).is_file():
            raise ValueError(f"path: expected a PEFT adapter folder with {_CONFIG}, got {path}")
        if not (path / _WEIGHTS).is_file():
            found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            raise ValueError(
                f"path: expected the adapter's weights in {_WEIGHTS} (safetensors only), got "
                f"{', '.join(found) or 'no weights file'} in {path}"
            )
        config = json.loads((path / _CONFIG).read_text())
        if config.get("peft_type") != "LORA":
            raise ValueError(
                f"path: expected a LoRA adapter, got peft_type {config.get('peft_type')!r}"
            )
        self._check_shapes(_adapter_shapes(path))

    def _check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """ValueError naming the first LoRA tensor that does not fit a linear of the base."""
        modules = dict(self._base.named_modules())
        for key, shape in shapes.items():
            located = _module_of(key)
            if located is None:
                continue
            module_path, kind = located
            layer = getattr(modules.get(module_path), "base_layer", modules.get(module_path))
            # Sizes from the layer, not its weight: a quantized base's QuantLinear (an
            # nn.Linear) keeps only an empty placeholder weight.
            if not isinstance(layer, nn.Linear):
                raise ValueError(
                    f"path: adapter for another base: it adapts {module_path!r}, which this "
                    f"{type(self._base).__name__} has no linear layer at"
                )
            out_features, in_features = layer.out_features, layer.in_features
            fits = len(shape) == 2 and (
                shape[1] == in_features if kind == "A" else shape[0] == out_features
            )
            if not fits:
                expected = f"[r, {in_features}]" if kind == "A" else f"[{out_features}, r]"
                raise ValueError(
                    f"path: adapter for another base: {key} has shape {list(shape)}, "
                    f"{module_path} here needs lora_{kind} {expected}"
                )

    def load(self, name: str, path: str | Path) -> None:
        """Load the adapter saved in folder ``path`` (``save_pretrained`` output: its config
        and ``adapter_model.safetensors``) as ``name``; the active adapter does not change.
        ValueError naming what is wrong (name taken or reserved, not a LoRA folder, no
        safetensors, an adapter trained for another base)."""
        from peft import PeftModel

        path = Path(path)
        self._check_folder(name, path)
        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self._base, path, adapter_name=name)
                self._peft.eval()
            else:
                self._peft.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception:
            # A load PEFT gave up on half way leaves no trace of the adapter behind.
            if self._peft is not None and name in self._peft.peft_config:
                self._remove(name)
            raise
        finally:
            # PEFT activates what it loads: the active adapter stays what it was.
            self._stacks = None
            self._refresh_layers()
            self._apply(self._active)
        if any(model_part(module) in ("vision", "projector") for module in self._targets(name)):
            self._vision_adapters.add(name)

    def _targets(self, name: str) -> list[str]:
        """Module paths (in the base) that adapter ``name`` adapts."""
        return [
            module_name
            for module_name, module in self._base.named_modules()
            if name in getattr(module, "lora_A", {})
        ]

    # ------------------------------------------------------------------ switching

    def _check_name(self, name: object, argument: str = "name") -> None:
        if name != BASE_ADAPTER and name not in self.names:
            accepted = ", ".join([BASE_ADAPTER, *self.names])
            raise ValueError(f"{argument}: expected one of {accepted}, got {name!r}")

    def _refresh_layers(self) -> None:
        """Choose how switching works for the resident adapters: by naming the active adapter
        on each tuner layer (cost independent of how many adapters are resident) when the
        installed PEFT keeps it where ``_compat`` expects and no auxiliary module (modules to
        save, trainable tokens) needs PEFT's own switching; else through ``set_adapter``."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        modules = list(self._peft.modules()) if self._peft is not None else []
        fast = peft_active_adapter_problem() is None and not any(
            isinstance(module, AuxiliaryTrainingWrapper) for module in modules
        )
        self._tuner_layers = [m for m in modules if isinstance(m, BaseTunerLayer)]
        self._layers = self._tuner_layers if fast else None

    def _apply(self, name: str) -> None:
        """Make the tuner layers compute adapter ``name`` (:data:`BASE_ADAPTER`: none)."""
        if self._peft is None:
            return
        if self._layers is not None:
            # A layer skips active names it does not hold: BASE_ADAPTER computes the base.
            for layer in self._layers:
                set_lora_active_adapter(layer, name)
        elif name == BASE_ADAPTER:
            self._peft.base_model.disable_adapter_layers()
        else:
            self._peft.base_model.enable_adapter_layers()
            self._peft.set_adapter(name, inference_mode=True)

    def activate(self, name: str) -> None:
        """Make ``name`` (a resident adapter, or :data:`BASE_ADAPTER`) the active one."""
        self._check_name(name)
        self._apply(name)
        self._active = name

    def _check_rows(self, adapter_names: Sequence[str]) -> list[str]:
        names = list(adapter_names)
        if not names:
            raise ValueError("adapter_names: expected one adapter name per batch row, got none")
        for name in names:
            self._check_name(name, "adapter_names")
        if self._vision_adapters:
            raise ValueError(
                f"adapter_names: resident adapters {', '.join(sorted(self._vision_adapters))} "
                f"adapt the vision tower or projector, whose layers see every row's image patches "
                f"at once, not rows; mixed batches need language-model adapters only (activate "
                f"an adapter for the whole batch instead)"
            )
        if self._peft is None:
            return names
        dora = sorted({n for n in names if n in self.names and self._peft.peft_config[n].use_dora})
        if dora:
            # PEFT refuses per-row names for DoRA rows, and leaves its forward hooks behind.
            raise ValueError(
                f"adapter_names: rows name {', '.join(dora)}, which use DoRA, which mixed "
                f"batches cannot serve; activate an adapter for the whole batch instead"
            )
        if self._peft.training:
            raise ValueError(
                "adapter_names: expected the model in eval mode (mixed rows serve inference; "
                "PEFT refuses them in training), got it in training mode"
            )
        if any(layer.merged for layer in self._tuner_layers):
            raise ValueError(
                "adapter_names: expected unmerged adapters (a merged one is in every row's "
                "weights), got merged LoRA layers; unmerge them first"
            )
        return names

    def _row_stacks(self) -> StackedAdapters | None:
        """The resident adapters stacked for one-pass mixed rows, or None when PEFT's own
        mixed-batch forward has to serve them (an adapter with a variant such as DoRA or a LoRA
        bias, or switching through ``set_adapter``). Built once per resident set, and again
        when the LoRA weights they copy changed (moved, cast or written in place)."""
        if self._stacks is None:
            stackable = self._layers is not None and plain_lora_layers(self._layers, self.names)
            self._stacks = StackedAdapters(self._layers, self.names) if stackable else False
        elif self._stacks and self._stacks.stale():
            self._stacks = StackedAdapters(self._layers, self.names)
        return self._stacks or None

    def _run_rows(self, method: str, adapter_names: Sequence[str], inputs: dict) -> Any:
        names = self._check_rows(adapter_names)
        if self._peft is None:  # nothing resident: every row is the base
            return getattr(self._base, method)(**inputs)
        stacks = self._row_stacks()
        if stacks is not None:
            self._apply(BASE_ADAPTER)  # the layers compute the base; the stacks add each row's
            try:
                rows = [None if name == BASE_ADAPTER else name for name in names]
                with rows_through_stacks(self._peft, stacks, rows):
                    return getattr(self._peft, method)(**inputs)
            finally:
                self._apply(self._active)
        base_active = self._active == BASE_ADAPTER and self._layers is None
        if base_active:  # disabled LoRA layers ignore per-row names
            self._peft.base_model.enable_adapter_layers()
        try:
            return getattr(self._peft, method)(**inputs, adapter_names=names)
        finally:
            if base_active:
                self._peft.base_model.disable_adapter_layers()

    def forward(self, adapter_names: Sequence[str], **inputs: Any) -> Any:
        """The model's forward with row ``i`` of the batch through adapter ``adapter_names[i]``
        (:data:`BASE_ADAPTER` allowed). ValueError for an unknown name; when a resident
        adapter adapts the vision tower or projector (mixed rows need language-model adapters
        only); for a row naming a DoRA adapter; for a model in training mode or with merged
        adapters."""
        return self._run_rows("forward", adapter_names, inputs)

    def generate(self, adapter_names: Sequence[str], **inputs: Any) -> torch.Tensor:
        """``generate`` with row ``i`` through adapter ``adapter_names[i]`` (see
        :meth:`forward` for the rules)."""
        return self._run_rows("generate", adapter_names, inputs)

    # ------------------------------------------------------------------ unloading, hot swap

    def unload(self, name: str) -> None:
        """Remove adapter ``name``; unloading the last one gives the base model back exactly
        (its own modules, no LoRA layer left). The active adapter becomes the base when it
        was ``name``."""
        if name == BASE_ADAPTER or name not in self.names:
            raise ValueError(
                f"name: expected a resident adapter ({', '.join(self.names) or 'none'}), got {name!r}"
            )
        self._remove(name)
        if self._active == name:
            self._active = BASE_ADAPTER
        self._stacks = None
        self._refresh_layers()
        self._apply(self._active)
        self._vision_adapters.discard(name)

    def _remove(self, name: str) -> None:
        """Take adapter ``name`` out of PEFT; the last one out gives the base model back."""
        if len(self._peft.peft_config) == 1:
            self._base, self._peft = self._peft.unload(), None
            return
        self._peft.delete_adapter(name)
        # PEFT takes its new model-level active adapter from a layer's, which is BASE_ADAPTER
        # while the base is active here: name a resident one instead.
        resident = self._active if self._active in self.names else self.names[0]
        self._peft.set_adapter(resident, inference_mode=True)

    def prepare_for_hotswap(self, target_rank: int) -> None:
        """Pad every resident adapter to rank ``target_rank`` and make its scalings tensors
        (``peft.utils.hotswap.prepare_model_for_compiled_hotswap``), so :meth:`hotswap` of
        adapters up to that rank never recompiles a ``torch.compile``d model. Call before
        compiling."""
        from peft.utils.hotswap import prepare_model_for_compiled_hotswap

        if self._peft is None:
            raise ValueError("prepare_for_hotswap: expected a loaded adapter to prepare, got none")
        if not isinstance(target_rank, int) or target_rank < 1:
            raise ValueError(f"target_rank: expected an int >= 1, got {target_rank!r}")
        prepare_model_for_compiled_hotswap(
            self._peft, target_rank=target_rank, check_compiled="warn"
        )
        self._hotswap_rank = target_rank

    def hotswap(self, name: str, path: str | Path) -> None:
        """Replace the weights of resident adapter ``name`` in place with those saved in
        ``path`` (same target modules; a rank above the prepared one is refused), keeping its
        name and the model's compiled code."""
        from peft.utils.hotswap import hotswap_adapter

        path = Path(path)
        if name not in self.names:
            self._check_name(name)
            raise ValueError(f"name: {BASE_ADAPTER!r} has no weights to swap")
        if not (path / _WEIGHTS).is_file():
            raise ValueError(f"path: expected the adapter's weights in {_WEIGHTS}, got {path}")
        shapes = _adapter_shapes(path)
        self._check_shapes(shapes)
        targets = {located[0] for key in shapes if (located := _module_of(key)) is not None}
        slot = set(self._targets(name))
        if targets != slot:
            different = sorted(targets ^ slot)
            raise ValueError(
                f"path: cannot hot-swap {path} into adapter {name!r}: it adapts other modules "
                f"({len(different)} differ, e.g. {different[0]}); load it as a new adapter"
            )
        ranks = [shape[0] for key, shape in shapes.items() if key.endswith(".lora_A.weight")]
        rank = max(ranks, default=0)
        if self._hotswap_rank is not None and rank > self._hotswap_rank:
            raise ValueError(
                f"path: adapter of rank {rank} cannot be hot-swapped into slots prepared for rank "
                f"{self._hotswap_rank} (a compiled model would recompile); prepare_for_hotswap with "
                f"a target_rank >= {rank} before compiling"
            )
        device = str(next(self._base.parameters()).device)
        active = self._peft.active_adapter
        self._peft.set_adapter(name, inference_mode=True)
        try:
            hotswap_adapter(self._peft, str(path), adapter_name=name, torch_device=device)
        except (ValueError, RuntimeError) as error:
            raise ValueError(
                f"path: cannot hot-swap {path} into adapter {name!r}: {error}"
            ) from None
        finally:
            self._stacks = None  # the stacks hold copies of the swapped weights
            self._peft.set_adapter(active, inference_mode=True)
            self._apply(self._active)
