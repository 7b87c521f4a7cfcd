"""FSDP2's per-unit state, as `ascend_vlm.integrations.fsdp.roots_unsharded` uses it: making an
outermost unit the root of the units inside it before its first forward.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
fsdp-lazy-init             ``FSDPModule._get_fsdp_state()`` returns the unit's ``FSDPState``, whose
                           ``_lazy_init()`` makes the unit the root of the units inside it, as its
                           first forward does, and is a no-op once one ran (`init_fsdp_root`).
========================== ==========================================================================

This probes torch (2.13 has no public call for it), not transformers: no transformers version
makes it removable. ``patch``'s version gate does not run it (a model never sharded does not rely
on it): `roots_unsharded` runs it before sharded roots are gathered and raises naming it.
"""

from __future__ import annotations

import typing

from torch import nn

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe


def init_fsdp_root(unit: nn.Module) -> None:
    """Make FSDP2 unit ``unit`` (a ``FSDPModule``) the root of the units inside it now, as its
    first forward would; a no-op once a forward ran. Before any forward, the inner units a call
    meets first would each claim to be a root. Valid while the probe "fsdp-lazy-init" passes."""
    unit._get_fsdp_state()._lazy_init()


def _fsdp_lazy_init() -> str | None:
    from torch.distributed.fsdp import FSDPModule

    get_state = getattr(FSDPModule, "_get_fsdp_state", None)
    if not callable(get_state):
        return "FSDPModule has no _get_fsdp_state"
    try:
        state_class = typing.get_type_hints(get_state).get("return")
    except Exception as error:  # an annotation naming what torch no longer defines
        return f"FSDPModule._get_fsdp_state's return type: {error}"
    if not callable(getattr(state_class, "_lazy_init", None)):
        name = getattr(state_class, "__name__", state_class)
        return f"{name}, the FSDP2 unit state, has no _lazy_init"
    return None


FSDP_STATE_PROBES = (Probe("fsdp-lazy-init", _fsdp_lazy_init, NEEDED_ON_EVERY_SUPPORTED_VERSION),)
