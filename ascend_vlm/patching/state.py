"""`PatchState`: what the adapters of one installation of `patch` work with."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from ascend_vlm.patching.ledger import Edits
from ascend_vlm.patching.report import PatchReport


class PartOptions(Protocol):
    """What an adapter asks of the part it patches (``adapters.Part``)."""

    def enabled(self, kind: str) -> bool:
        """Whether `patch`'s options ask for modules of `kind` in this part."""


def disabled_by(kind: str) -> str:
    """The left-alone reason of a module of `kind` that `patch`'s options turn off."""
    return f"disabled by patch({kind}=False) or patch(vision=False)"


def _tagged_extra_repr(original: Callable[[], str], op_name: str) -> str:
    text = original()
    return f"{text}, fused=ascend_vlm.ops.{op_name}" if text else f"fused=ascend_vlm.ops.{op_name}"


@dataclass
class PatchState:
    """The options `patch` runs with, the report being written, and the ledger's edits every
    change goes through (so removing the patch feature reverts it)."""

    options: dict
    report: PatchReport
    edits: Edits

    def rebind(self, module: nn.Module, name: str, value: object) -> None:
        """Set instance attribute `name` of `module` to `value` (`Edits.set_attribute`)."""
        self.edits.set_attribute(module, name, value)

    def tag(self, module: nn.Module, op_name: str) -> None:
        """Make the module's ``extra_repr`` name the op its forward now runs."""
        self.rebind(
            module, "extra_repr", functools.partial(_tagged_extra_repr, module.extra_repr, op_name)
        )
