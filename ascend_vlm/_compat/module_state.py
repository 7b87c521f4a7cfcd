"""What a replay repro reads of a module to rebuild it without its constructor: an
``nn.Module``'s own parameters, buffers and children (``None`` entries included, which torch's
public iterators skip) and the attention and experts implementations a transformers config
names (which ``to_dict`` leaves out).

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
module-state               ``nn.Module`` keeps its own tensors and children in ``_parameters``,
                           ``_buffers``, ``_non_persistent_buffers_set`` and ``_modules``, and a
                           config its implementations in ``CONFIG_IMPLEMENTATIONS``.
========================== ==========================================================================

Needed on every supported version; used by :mod:`ascend_vlm.verification.repro_codec` only,
so ``patch``'s version gate does not run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

# Instance attributes every nn.Module has from nn.Module.__init__ (its machinery, not state).
MODULE_MACHINERY = frozenset(vars(nn.Module()))
# The config attributes naming the attention and experts implementations.
CONFIG_IMPLEMENTATIONS = ("_attn_implementation_internal", "_experts_implementation_internal")


@dataclass
class OwnState:
    """A module's own (not its children's) parameters and buffers, the names of the buffers
    ``state_dict`` leaves out, and its direct children, each None where registered as None."""

    parameters: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor | None]
    non_persistent: set[str]
    children: dict[str, nn.Module | None]


def own_state(module: nn.Module) -> OwnState:
    """``module``'s :class:`OwnState` (the live objects, not copies)."""
    return OwnState(
        dict(module._parameters),
        dict(module._buffers),
        set(module._non_persistent_buffers_set),
        dict(module._modules),
    )


def restore_own_state(module: nn.Module, state: OwnState) -> None:
    """Register ``state`` on ``module``, a module fresh from ``nn.Module.__init__``."""
    module._parameters.update(state.parameters)
    module._buffers.update(state.buffers)
    module._non_persistent_buffers_set.update(state.non_persistent)
    module._modules.update(state.children)


def config_implementations(config: object) -> dict[str, str]:
    """The implementations ``config`` names, by attribute of ``CONFIG_IMPLEMENTATIONS``."""
    found = {name: getattr(config, name, None) for name in CONFIG_IMPLEMENTATIONS}
    return {name: value for name, value in found.items() if isinstance(value, str)}


def set_config_implementations(config: object, implementations: dict[str, str]) -> None:
    """Make ``config`` name ``implementations`` (attribute -> name), without the checks and
    sub-config propagation of transformers' public setters: each sub-config keeps its own."""
    for name, value in implementations.items():
        if name not in CONFIG_IMPLEMENTATIONS:
            raise ValueError(
                f"implementations: expected keys of {CONFIG_IMPLEMENTATIONS}, got {name!r}"
            )
        setattr(config, name, value)


def _module_state() -> str | None:
    from transformers import PreTrainedConfig

    linear = nn.Linear(2, 2, bias=False)
    linear.register_buffer("scratch", torch.zeros(1), persistent=False)
    state = own_state(linear)
    if set(state.parameters) != {"weight", "bias"} or state.parameters["bias"] is not None:
        return "nn.Module._parameters does not hold a parameter registered as None"
    if state.non_persistent != {"scratch"}:
        return "nn.Module._non_persistent_buffers_set does not name a non-persistent buffer"
    config = PreTrainedConfig()
    config._attn_implementation = "sdpa"
    missing = [name for name in CONFIG_IMPLEMENTATIONS if not hasattr(config, name)]
    if missing or config_implementations(config).get(CONFIG_IMPLEMENTATIONS[0]) != "sdpa":
        return f"PreTrainedConfig keeps its implementations elsewhere than {CONFIG_IMPLEMENTATIONS}"
    return None


MODULE_STATE_PROBES = (Probe("module-state", _module_state, NEEDED_ON_EVERY_SUPPORTED_VERSION),)
