"""`PatchState`: the rebinds `patch` made on one model, recorded so `unpatch` reverts them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from torch import nn

from ascend_vlm._compat.module_internals import forward_attribute
from ascend_vlm.patching.attention import register_attention
from ascend_vlm.patching.report import PatchReport


class Missing(enum.Enum):
    """Marks an instance attribute that did not exist before `patch`; an enum member stays the
    same object through pickling, so `unpatch` still recognises it on an unpickled model."""

    MISSING = "missing"


MISSING = Missing.MISSING


@dataclass
class PatchState:
    """The options `patch` ran with, its report, and every (module, attribute, previous value)
    it rebound, in order. Stored on the base model; pickles with it."""

    options: dict
    report: PatchReport
    rebinds: list[tuple[nn.Module, str, object]] = field(default_factory=list)

    def rebind(self, module: nn.Module, name: str, value: object) -> None:
        """Set instance attribute `name` of `module` to `value`, recording what was there.

        ``"forward"`` goes where the module's calls find it (`forward_attribute`): on a module
        carrying an accelerate hook, the forward the hook wraps, so the hook's device moves and
        offload loads stay around ours.
        """
        if name == "forward":
            name = forward_attribute(module)
        self.rebinds.append((module, name, module.__dict__.get(name, MISSING)))
        module.__dict__[name] = value

    def __setstate__(self, state: dict) -> None:
        # Unpickling a patched model (possibly in a fresh process): its configs name our
        # attention function, so transformers must know it before the first forward.
        register_attention()
        self.__dict__.update(state)

    def revert(self) -> None:
        """Restore every rebound attribute, newest first."""
        for module, name, previous in reversed(self.rebinds):
            if previous is MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = previous
