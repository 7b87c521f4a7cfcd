"""The transformers version gate and the probes of the internals `ascend_vlm.patch` relies on."""

from __future__ import annotations

import functools
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._subclasses.fake_tensor
import transformers
from transformers import (
    activations,
    cache_utils,
    masking_utils,
    modeling_flash_attention_utils,
    modeling_utils,
)
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.qwen2_vl import configuration_qwen2_vl, modeling_qwen2_vl
from transformers.utils import output_capturing
from transformers.utils.deprecation import deprecate_kwarg

import ascend_vlm
from ascend_vlm import PatchError
from ascend_vlm._compat.decorators import rewrap, rope_problem
from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION
from ascend_vlm._compat.versions import LOWEST_SUPPORTED, NEWEST_TESTED, major_minor
from ascend_vlm.models import REGISTRY
from ascend_vlm.patching import version_gate
from ascend_vlm.patching.version_gate import check_transformers_version, failed_probes

NEWER = f"{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}.0"
GLOBAL_PROBES = {
    "transformers-names",
    "attention-interface",
    "attention-call-convention",
    "mask-interface",
    "config-attn-implementation",
    "config-sub-configs",
    "varlen-kwargs",
    "flash-preload",
    "output-collector",
    "silu-activation",
    "accelerate-hooks",
    "deprecate-kwarg-wrapper",
    "kernels-wrappers",
    "experts-implementation",
    "torch-mode-stacks",
    "torch-fake-tensors",
    "cache-layers",
    "tensor-versions",
}


@pytest.fixture()
def fresh_probes(monkeypatch):
    """Probe results and the one-time warning recomputed for this test, and after it."""
    failed_probes.cache_clear()
    monkeypatch.setattr(version_gate, "_warned", set())
    yield
    failed_probes.cache_clear()


def test_every_probe_passes_on_the_installed_transformers():
    names = {probe.name for probe in version_gate.probes()}
    assert names >= GLOBAL_PROBES | {f"vision-tower:{t}" for t in REGISTRY}
    assert {"rope:llama", "classes:qwen2_vl_vision", "varlen-vision:qwen2_vl_vision"} <= names
    assert failed_probes() == {}


def test_every_probe_says_from_which_version_it_can_go():
    removable_once = re.compile(r"removable once \d+\.\d+ is the lowest supported")
    for probe in version_gate.probes():
        removable = probe.removable
        assert removable == NEEDED_ON_EVERY_SUPPORTED_VERSION or removable_once.fullmatch(
            removable
        ), (probe.name, removable)


@pytest.mark.parametrize("version", ["5.16.1", "5.0.0", "4.57.1"])
def test_a_version_older_than_the_lowest_supported_is_refused(version):
    lowest = f"{LOWEST_SUPPORTED[0]}.{LOWEST_SUPPORTED[1]}"
    with pytest.raises(PatchError, match=rf"transformers {version} is older .*>={lowest},<="):
        check_transformers_version(version)


def _low_end() -> str:
    return f"{LOWEST_SUPPORTED[0]}.{LOWEST_SUPPORTED[1]}.0"


@pytest.mark.parametrize("version", [_low_end(), "5.23.0.dev0", "5.25.3"])
def test_a_supported_version_is_accepted_without_probing_or_warning(monkeypatch, version):
    monkeypatch.setattr(version_gate, "failed_probes", lambda: pytest.fail("probes ran"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_transformers_version(version) == version


def test_a_newer_version_warns_once_when_every_probe_passes(fresh_probes):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_transformers_version(NEWER) == NEWER
        assert check_transformers_version(NEWER) == NEWER
        assert check_transformers_version("6.0.0") == "6.0.0"
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # one per newer version, not one per call
    assert messages[0].startswith(f"transformers {NEWER} is newer than the newest version")
    assert f"({NEWEST_TESTED[0]}.{NEWEST_TESTED[1]})" in messages[0]
    assert {w.category for w in caught} == {UserWarning}


def _remove_register_from_mask_interface(monkeypatch):
    monkeypatch.setattr(masking_utils, "AttentionMaskInterface", object)


def _no_longer_flash(monkeypatch):
    monkeypatch.setattr(modeling_qwen2_vl, "is_flash_attention_requested", lambda config: False)


def _preload_loads_every_name(monkeypatch):
    def lazy_import_flash_attention(implementation, *args, **kwargs):
        raise ValueError(f"Could not find {implementation}")

    monkeypatch.setattr(
        modeling_flash_attention_utils, "lazy_import_flash_attention", lazy_import_flash_attention
    )


def _config_reads_elsewhere(monkeypatch):
    monkeypatch.setattr(
        transformers.PreTrainedConfig,
        "_attn_implementation",
        property(lambda self: "sdpa", lambda self, value: None),
    )


def _silu_is_gelu(monkeypatch):
    monkeypatch.setitem(activations.ACT2FN, "silu", activations.GELUActivation)


def _tower_stored_elsewhere(monkeypatch):
    monkeypatch.setattr(modeling_qwen2_vl.Qwen2VLModel, "__init__", lambda self, config: None)


def _hooks_without_old_forward(monkeypatch):
    hooks = pytest.importorskip("accelerate.hooks")
    monkeypatch.setattr(hooks, "add_hook_to_module", lambda module, hook: module)


def _deprecate_kwarg_without_cell(monkeypatch):
    def decorator(*args, **kwargs):
        def wrap(function):
            table = {"function": function}
            return functools.wraps(function)(lambda *a, **k: table["function"](*a, **k))

        return wrap

    monkeypatch.setattr("transformers.utils.deprecation.deprecate_kwarg", decorator)


def _experts_dispatch_swapping_index_and_weights(monkeypatch):
    from transformers.integrations import moe

    def get_interface(self, implementation, default):
        return lambda module, hidden, index, weights: default(module, hidden, weights, index)

    monkeypatch.setattr(moe.ExpertsInterface, "get_interface", get_interface)


FAILURES = {
    "transformers-names": (
        lambda mp: mp.setattr(sys.modules["transformers"], "PreTrainedModel", None),
        "PreTrainedModel",
    ),
    "attention-interface": (
        lambda mp: mp.setattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", {}),
        "ALL_ATTENTION_FUNCTIONS is a dict",
    ),
    "attention-call-convention": (
        lambda mp: mp.delattr("transformers.integrations.sdpa_attention.sdpa_attention_forward"),
        "has no sdpa_attention_forward",
    ),
    "mask-interface": (_remove_register_from_mask_interface, "has no register"),
    "config-attn-implementation": (_config_reads_elsewhere, "reads 'sdpa'"),
    "config-sub-configs": (
        lambda mp: mp.setattr(configuration_qwen2_vl.Qwen2VLConfig, "sub_configs", {}),
        "Qwen2VLConfig.sub_configs names no vision sub-config: {}",
    ),
    "varlen-kwargs": (
        lambda mp: mp.delitem(
            modeling_flash_attention_utils.FlashAttentionKwargs.__annotations__, "max_length_q"
        ),
        "FlashAttentionKwargs has no max_length_q",
    ),
    "flash-preload": (_preload_loads_every_name, "loads a name marked as loaded"),
    "output-collector": (
        lambda mp: mp.delattr(output_capturing, "_active_collector"),
        "has no _active_collector",
    ),
    "attributes:gemma3_text": (
        lambda mp: mp.setattr(modeling_gemma3.Gemma3RMSNorm, "__init__", lambda self: None),
        "Gemma3RMSNorm.__init__ stores no weight, variance_epsilon or eps",
    ),
    "silu-activation": (_silu_is_gelu, 'ACT2FN["silu"] is a GELUActivation'),
    "accelerate-hooks": (_hooks_without_old_forward, "no _hf_hook / instance _old_forward"),
    "deprecate-kwarg-wrapper": (_deprecate_kwarg_without_cell, "ValueError: wrapper: expected one"),
    "torch-mode-stacks": (
        lambda mp: mp.setattr(torch._C, "_len_torch_dispatch_stack", lambda: 0),
        "(function, dispatch) mode depths outside, in a function mode, in a dispatch mode: "
        "((0, 0), (1, 0), (0, 0))",
    ),
    "cache-layers": (
        lambda mp: mp.setattr(cache_utils.DynamicLayer, "get_seq_length", lambda self: 3),
        "after keeping 1 of 3 slots, (get_seq_length, get_mask_sizes(2)) gives (3, 5)",
    ),
    "torch-fake-tensors": (
        lambda mp: mp.setattr(torch._subclasses.fake_tensor, "is_fake", lambda tensor: False),
        "is_fake (fake, real) gives (False, False)",
    ),
    "experts-implementation": (
        _experts_dispatch_swapping_index_and_weights,
        "the dispatching forward passed [('hidden', 'weights', 'index')]",
    ),
    "rope:llama": (
        lambda mp: mp.delattr(modeling_llama, "apply_rotary_pos_emb"),
        "modeling_llama has no apply_rotary_pos_emb",
    ),
    "classes:qwen2_vl_text": (
        lambda mp: mp.delattr(modeling_qwen2_vl, "Qwen2VLRMSNorm"),
        "has no Qwen2VLRMSNorm",
    ),
    "varlen-vision:qwen2_vl_vision": (_no_longer_flash, "is False for 'ascend_flash'"),
    "vision-tower:qwen2_vl": (
        _tower_stored_elsewhere,
        "stores the vision tower under model.visual",
    ),
}


@pytest.mark.parametrize("probe", list(FAILURES))
def test_a_newer_version_is_refused_naming_the_failing_probe(monkeypatch, fresh_probes, probe):
    break_it, found = FAILURES[probe]
    break_it(monkeypatch)
    with pytest.raises(PatchError) as raised:
        check_transformers_version(NEWER)
    message = str(raised.value)
    assert message.startswith(f"transformers {NEWER} is newer than the newest version")
    assert f"probe {probe!r}: " in message and found in message, message


def test_a_probe_that_raises_fails_with_the_exception(monkeypatch, fresh_probes):
    def is_flash_attention_requested():
        return True

    monkeypatch.setattr(
        modeling_qwen2_vl, "is_flash_attention_requested", is_flash_attention_requested
    )
    assert failed_probes() == {
        "varlen-vision:qwen2_vl_vision": "TypeError: test_a_probe_that_raises_fails_with_the_"
        "exception.<locals>.is_flash_attention_requested() takes 0 positional arguments but 1 "
        "was given"
    }


def test_patch_refuses_a_newer_version_whose_probe_fails(monkeypatch, fresh_probes):
    from ascend_vlm.models.tiny import build_model

    model = build_model("llava_clip")
    # (building a model can replace transformers' lazy module in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", NEWER)
    monkeypatch.delattr(modeling_llama, "apply_rotary_pos_emb")
    with pytest.raises(PatchError, match="probe 'rope:llama'"):
        ascend_vlm.patch(model)
    assert not any("forward" in vars(module) for module in model.modules())


def _rotate(q, k, cos, sin, unsqueeze_dim=1):
    return q, k


def test_rewrap_keeps_what_the_decorator_does_around_the_new_function():
    calls = []

    def forward(self, cache=None):
        return ("stock", cache)

    wrapper = deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")(forward)
    rebuilt = rewrap(wrapper, lambda self, cache=None: calls.append(cache) or ("new", cache))
    with pytest.warns(FutureWarning, match="past_key_values"):
        assert rebuilt(None, past_key_values=3) == ("new", 3)
    assert calls == [3]
    assert wrapper(None, cache=4) == ("stock", 4)  # the decorated original is untouched
    assert rebuilt.__wrapped__ is not forward and rebuilt.__name__ == "forward"


class _Attention:
    def forward(self, q, k, cos, sin):
        return _rotate(q, k, cos, sin)


def _decorated(decorator):
    return type("Decorated", (_Attention,), {"forward": decorator(_Attention.forward)})


def _function_in_a_dict(function):
    table = {"function": function}
    return functools.wraps(function)(lambda *args: table["function"](*args))


def test_rope_problem_accepts_rebuildable_decorators_and_names_others():
    kwarg_renamed = _decorated(deprecate_kwarg("past_key_values", "99.0.0", new_name="cache"))
    assert rope_problem(_Attention, "_rotate", "text") is None
    assert rope_problem(kwarg_renamed, "_rotate", "text") is None
    assert rope_problem(_decorated(_function_in_a_dict), "_rotate", "text") == (
        f"Decorated.forward is decorated by <lambda> ({__file__}), which rebinding cannot rebuild"
    )
    assert rope_problem(_Attention, "apply_rotary_pos_emb", "text") == (
        "_Attention.forward does not call apply_rotary_pos_emb"
    )
    assert rope_problem(_Attention, "_rotate", "vision") == (
        "_rotate('q', 'k', 'cos', 'sin', 'unsqueeze_dim') does not have the expected signature "
        "('q', 'k', 'cos', 'sin')"
    )


ROOT = Path(__file__).resolve().parents[1]


def _pinned(requirements: str) -> tuple[int, int]:
    for line in (ROOT / requirements).read_text(encoding="utf-8").splitlines():
        if line.startswith("transformers=="):
            return major_minor(line.removeprefix("transformers=="))
    raise AssertionError(f"{requirements} pins no transformers")


def test_the_range_ends_are_the_pinned_test_environments():
    # CI runs the suite on requirements-dev.txt and the family tests on requirements-lowest.txt.
    assert _pinned("requirements-dev.txt") == NEWEST_TESTED
    assert _pinned("requirements-lowest.txt") == LOWEST_SUPPORTED
    lowest = f"{LOWEST_SUPPORTED[0]}.{LOWEST_SUPPORTED[1]}"
    assert f'"transformers>={lowest},<{NEWEST_TESTED[0] + 1}",' in (ROOT / "setup.py").read_text()


def test_the_installed_transformers_is_in_the_supported_range():
    assert LOWEST_SUPPORTED <= major_minor(transformers.__version__) <= NEWEST_TESTED
