"""transformers' attention interface as ``patch`` uses it: registering the Ascend attention
under ``ATTENTION_NAME``, switching a config to it, finding the function a module calls, the
packed-segment kwargs, and the output capture that asks for attention weights.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
transformers-names         ``AttentionInterface``, ``PreTrainedConfig``, ``PreTrainedModel`` import
                           from ``transformers`` (patching).
attention-interface        ``AttentionInterface.register`` adds a function that attention modules find
                           through ``ALL_ATTENTION_FUNCTIONS.get_interface`` (patching).
attention-call-convention  the interface calls ``f(module, query, key, value, attention_mask, ...,
                           dropout=, scaling=, is_causal=)`` as ``sdpa_attention_forward`` takes them
                           (``ascend_attention_forward``).
mask-interface             ``masking_utils.AttentionMaskInterface.register`` and ``sdpa_mask`` exist;
                           without a mask function the mask is None and causality is lost
                           (`register_attention_function`).
config-attn-implementation ``config._attn_implementation`` reads ``_attn_implementation_internal``,
                           the attribute patch switches per config (`set_attention_implementation`).
varlen-kwargs              ``FlashAttentionKwargs`` names the packed-segment kwargs ``VARLEN_KWARGS``
                           and their bounds ``VARLEN_BOUND_KWARGS`` (``ascend_attention_forward``).
flash-preload              ``modeling_flash_attention_utils.lazy_import_flash_attention(name)`` loads
                           nothing for the name its ``_loaded_implementation`` holds
                           (`mark_flash_functions_loaded`).
output-collector           ``utils.output_capturing._active_collector`` is the context variable
                           holding the outputs a capture collects (`output_collector`): attention
                           weights are computed only when it asks for "*attentions".
interface-call-detection   a stock attention forward (``LlamaAttention``) reads its function from
                           ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation`` in its
                           own code (`attention_interface_problem`, the generic path).
========================== ==========================================================================

Every one is needed on every supported version: 5.17 and 5.25 both have each detail.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

# Contains "flash": transformers' `is_flash_attention_requested` tests for that substring, and the
# Qwen-VL vision towers then make one packed varlen call instead of a per-image loop.
ATTENTION_NAME = "ascend_flash"
# The packed-segment boundaries `ascend_attention_forward` reads; a tower that passed them under
# other names would reach its padded path with no mask and attend across images.
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
# Optional upper bounds of the segment lengths passed beside them.
VARLEN_BOUND_KWARGS = ("max_length_q", "max_length_k")
# The parameters of an attention function `ascend_attention_forward` honours (the sliding window
# arrives encoded in the mask; soft-capping is refused when its config asks for it).
HONOURED_ATTENTION_PARAMETERS = frozenset(
    {"module", "query", "key", "value", "attention_mask", "scaling", "dropout", "is_causal"}
    | {"sliding_window", "softcap", "output_attentions", "kwargs"}
    | set(VARLEN_KWARGS + VARLEN_BOUND_KWARGS)
)


def register_attention_function(name: str, function: Callable) -> None:
    """Register `function` as transformers attention implementation `name`, with ``sdpa_mask``
    as its mask function (idempotent). Without a mask function transformers hands the attention
    a mask of None and causal masking is silently lost."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def mark_flash_functions_loaded(name: str) -> None:
    """Make transformers' flash-attention preload accept implementation `name` as loaded.

    ``from_pretrained`` and ``set_attn_implementation`` call
    ``lazy_import_flash_attention(name)`` for every name containing "flash" ("to allow compile
    with fullgraph"). Off NPU it asks the kernels hub for a kernel of that name and raises
    ValueError ("Could not find the currently requested flash attention implementation") for a
    function registered through ``AttentionInterface``: transformers offers no public way to
    declare a registered function flash-like, and the name must contain "flash" for the
    Qwen-VL vision towers to make one packed varlen call. The preload skips the name its module
    records as loaded; a function that calls no flash-attention package needs nothing loaded.
    Another flash implementation loaded later (a hub kernel, ``flash_attention_2``) takes the
    record; registering again restores it.
    """
    from transformers import modeling_flash_attention_utils

    modeling_flash_attention_utils._loaded_implementation = name


def set_attention_implementation(config: object, name: str) -> None:
    """Make `config` (a ``PreTrainedConfig``) name attention implementation `name`, without the
    checks and sub-config propagation of transformers' public setter."""
    config._attn_implementation_internal = name


def attention_function(module: object, name: str) -> Callable:
    """The function transformers' attention `module` calls under implementation `name`: the
    registered one, or for "eager" its modeling module's ``eager_attention_forward``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


@functools.cache
def output_collector() -> Callable[[], dict | None]:
    """The getter of transformers' active output collector: None, or the dict of the outputs the
    running capture collects (output name -> list).

    transformers 5 asks for attention weights through its output capture: the ``capture_outputs``
    decorator of a model's forward (reading ``output_attentions`` from the call or the config)
    sets this per-context dict, and forward hooks on the attention modules append element 1 of
    their result, the weights, to its "attentions" list.
    """
    from transformers.utils.output_capturing import _active_collector

    return _active_collector.get


def keyword_names(code: types.CodeType) -> set[str]:
    """Keyword-argument names the function's calls pass (they sit in tuple constants)."""
    return {n for c in code.co_consts if isinstance(c, tuple) for n in c if isinstance(n, str)}


def _names_read(code: types.CodeType) -> set[str]:
    """Global and attribute names `code` and the code nested in it (comprehensions) read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_read(constant)
    return names


def attention_interface_problem(cls: type) -> str | None:
    """Why attention class `cls` cannot be routed to our function by its config, or None.

    It can when its (undecorated) forward looks its function up in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation`` in its own code, passes no
    attention sinks (``s_aux``) nor any other argument its modeling module's
    ``eager_attention_forward`` names beyond ``HONOURED_ATTENTION_PARAMETERS`` (a position
    bias, sinks: math ours would drop), and, when it asks ``is_flash_attention_requested`` (it then makes
    one packed call for all its sequences), passes the segment boundaries as ``VARLEN_KWARGS``:
    without them the packed call would attend across sequences.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    forward = inspect.unwrap(cls.forward)
    if not isinstance(forward, types.FunctionType):
        return f"{cls.__name__}.forward is not a Python function: {forward!r}"
    names = _names_read(forward.__code__)
    looked_up = forward.__globals__.get("ALL_ATTENTION_FUNCTIONS") is ALL_ATTENTION_FUNCTIONS
    if not looked_up or not {"ALL_ATTENTION_FUNCTIONS", "_attn_implementation"} <= names:
        return (
            f"{cls.__name__}.forward does not look its function up in transformers' "
            f"ALL_ATTENTION_FUNCTIONS by config._attn_implementation"
        )
    keywords = keyword_names(forward.__code__)
    eager = forward.__globals__.get("eager_attention_forward")
    extra = set(inspect.signature(eager).parameters) if callable(eager) else set()
    unhonoured = sorted((extra - HONOURED_ATTENTION_PARAMETERS) & keywords | {"s_aux"} & keywords)
    if unhonoured:
        return (
            f"{cls.__name__}.forward passes {', '.join(unhonoured)} to its attention function, "
            f"which ascend_attention_forward does not honour"
        )
    if "is_flash_attention_requested" in names and not set(VARLEN_KWARGS) <= keywords:
        return (
            f"{cls.__name__}.forward makes a packed flash-attention call without "
            f"{'/'.join(VARLEN_KWARGS)}: its sequences would attend to each other"
        )
    return None


def _missing(owner: object, names: tuple[str, ...]) -> str | None:
    absent = [name for name in names if getattr(owner, name, None) is None]
    label = getattr(owner, "__name__", type(owner).__name__)
    return f"{label} has no {', '.join(absent)}" if absent else None


def _transformers_names() -> str | None:
    import transformers

    return _missing(transformers, ("AttentionInterface", "PreTrainedConfig", "PreTrainedModel"))


def _attention_interface() -> str | None:
    from transformers import modeling_utils

    problem = _missing(modeling_utils, ("AttentionInterface", "ALL_ATTENTION_FUNCTIONS"))
    if problem:
        return problem
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    if not isinstance(interface, modeling_utils.AttentionInterface):
        return f"ALL_ATTENTION_FUNCTIONS is a {type(interface).__name__}, not an AttentionInterface"
    return _missing(modeling_utils.AttentionInterface, ("register", "get_interface"))


def _attention_call_convention() -> str | None:
    from transformers.integrations import sdpa_attention

    if not callable(getattr(sdpa_attention, "sdpa_attention_forward", None)):
        return "transformers.integrations.sdpa_attention has no sdpa_attention_forward"
    parameters = tuple(inspect.signature(sdpa_attention.sdpa_attention_forward).parameters)
    positional = ("module", "query", "key", "value", "attention_mask")
    absent = {"dropout", "scaling", "is_causal"} - set(parameters)
    if parameters[:5] != positional or absent:
        return (
            f"sdpa_attention_forward{parameters} is not ({', '.join(positional)}, ...) with "
            f"dropout, scaling and is_causal"
        )
    return None


def _mask_interface() -> str | None:
    from transformers import masking_utils

    problem = _missing(masking_utils, ("AttentionMaskInterface", "sdpa_mask"))
    return problem or _missing(masking_utils.AttentionMaskInterface, ("register",))


def _config_attn_implementation() -> str | None:
    from transformers import PreTrainedConfig

    config = PreTrainedConfig()
    set_attention_implementation(config, ATTENTION_NAME)
    found = getattr(config, "_attn_implementation", None)
    if found != ATTENTION_NAME:
        return (
            f"config._attn_implementation reads {found!r} after _attn_implementation_internal "
            f"was set to {ATTENTION_NAME!r}"
        )
    return None


def _varlen_kwargs() -> str | None:
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs

    absent = set(VARLEN_KWARGS + VARLEN_BOUND_KWARGS) - set(FlashAttentionKwargs.__annotations__)
    return f"FlashAttentionKwargs has no {', '.join(sorted(absent))}" if absent else None


def _flash_preload() -> str | None:
    from transformers import modeling_flash_attention_utils as flash_utils

    problem = _missing(flash_utils, ("lazy_import_flash_attention",))
    if problem or not hasattr(flash_utils, "_loaded_implementation"):
        return problem or f"{flash_utils.__name__} has no _loaded_implementation"
    loaded = flash_utils._loaded_implementation
    probe_name = "ascend_vlm_flash_probe"
    try:
        mark_flash_functions_loaded(probe_name)
        flash_utils.lazy_import_flash_attention(probe_name)
    except Exception as error:  # what the preload raises for a name it then loads is its own
        return f"lazy_import_flash_attention loads a name marked as loaded: {error!r}"
    finally:
        flash_utils._loaded_implementation = loaded
    return None


def _output_collector() -> str | None:
    from transformers.utils import output_capturing

    problem = _missing(output_capturing, ("_active_collector",))
    return problem or _missing(output_capturing._active_collector, ("get", "set", "reset"))


def _interface_call_detection() -> str | None:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return attention_interface_problem(LlamaAttention)


ATTENTION_PROBES = (
    Probe("transformers-names", _transformers_names, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("attention-interface", _attention_interface, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe(
        "attention-call-convention", _attention_call_convention, NEEDED_ON_EVERY_SUPPORTED_VERSION
    ),
    Probe("mask-interface", _mask_interface, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe(
        "config-attn-implementation", _config_attn_implementation, NEEDED_ON_EVERY_SUPPORTED_VERSION
    ),
    Probe("varlen-kwargs", _varlen_kwargs, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("flash-preload", _flash_preload, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("output-collector", _output_collector, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("interface-call-detection", _interface_call_detection, NEEDED_ON_EVERY_SUPPORTED_VERSION),
)
