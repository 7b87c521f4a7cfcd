"""``attn_implementation="ascend_flash"``: registered by ``import ascend_vlm`` (when transformers'
modeling code loads), accepted by ``from_pretrained`` and ``set_attn_implementation``, and equal
to eager attention (logits with and without padding, greedy generate, loss and gradients) on
CPU and on the mock NPU; the Qwen-VL vision towers take their packed varlen path; whole-model
``patch`` works on top of it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

import ascend_vlm
from ascend_vlm import ops
from ascend_vlm.models.tiny import FAMILIES, build_model, make_inputs

ATOL = 1e-4
# A Qwen-VL tower (packed varlen vision attention), a CLIP-tower LLaVA, a hybrid linear-attention
# decoder with a Qwen3-VL-style tower, and a Gemma (sliding windows through the mask function).
LOADED_FAMILIES = ("qwen2_5_vl", "llava_clip", "qwen3_5", "gemma3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family name -> folder of its tiny checkpoint (saved on first use)."""
    folders = {}

    def get(name: str):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(name)
            build_model(name).save_pretrained(folders[name])
        return folders[name]

    return get


def _load(checkpoints, name: str, attn_implementation: str) -> torch.nn.Module:
    model_class = getattr(transformers, FAMILIES[name].model_class)
    return model_class.from_pretrained(
        checkpoints(name), attn_implementation=attn_implementation
    ).eval()


@pytest.fixture(params=["cpu", "mock_npu"])
def backend(request) -> str:
    """The kernel backend the test runs on: the reference on CPU, or the mock NPU."""
    if request.param == "mock_npu":
        request.getfixturevalue("mock_npu")
    return request.param


def _real_logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**inputs).logits
    # Pad positions attend to nothing; eager softmaxes garbage there, the fused op returns 0.
    return logits[inputs["attention_mask"].bool()]


def _attention_configs(model) -> set[str]:
    return {
        module.config._attn_implementation
        for module in model.modules()
        if isinstance(getattr(module, "config", None), transformers.PreTrainedConfig)
    }


REGISTERED = (
    "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
    "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS\n"
    "assert 'ascend_flash' in ALL_ATTENTION_FUNCTIONS.valid_keys()\n"
    "assert 'ascend_flash' in ALL_MASK_ATTENTION_FUNCTIONS\n"
    "assert not [m for m in sys.modules if m.startswith('torch_npu')]\n"
)


@pytest.mark.parametrize(
    "code",
    [
        "import sys, ascend_vlm\n"
        "assert 'transformers.modeling_utils' not in sys.modules, 'transformers imported'\n",
        "import sys, transformers.modeling_utils, ascend_vlm\n",
    ],
    ids=["ascend_vlm_first", "transformers_first"],
)
def test_import_registers_without_importing_transformers_models_or_torch_npu(code):
    result = subprocess.run(
        [sys.executable, "-c", code + REGISTERED], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("name", LOADED_FAMILIES)
@pytest.mark.parametrize("case", [{"n_images": 2}, {"batch": 3, "padding": "left"}])
def test_from_pretrained_ascend_flash_logits_equal_eager(checkpoints, backend, name, case):
    eager = _load(checkpoints, name, "eager")
    model = _load(checkpoints, name, "ascend_flash")
    assert _attention_configs(model) == {"ascend_flash"}
    inputs = make_inputs(name, eager, **case)
    torch.testing.assert_close(
        _real_logits(model, inputs), _real_logits(eager, inputs), atol=ATOL, rtol=0
    )


def test_the_qwen_vl_vision_tower_makes_packed_varlen_calls(checkpoints, backend, monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3])  # cu_seqlens_q
        return packed_attention(*args, **kwargs)

    packed_attention = ops.packed_attention
    monkeypatch.setattr(ops, "packed_attention", counted)
    model = _load(checkpoints, "qwen2_5_vl", "ascend_flash")
    with torch.no_grad():
        model(**make_inputs("qwen2_5_vl", model, n_images=2))
    assert calls, "the vision tower never reached ops.packed_attention"
    assert all(offsets.numel() >= 3 for offsets in calls)  # two images or more per call


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava_clip"])
def test_generate_equals_eager(checkpoints, name):
    eager = _load(checkpoints, name, "eager")
    model = _load(checkpoints, name, "ascend_flash")
    inputs = make_inputs(name, eager, n_images=1)
    expected = eager.generate(**inputs, max_new_tokens=16, do_sample=False)
    produced = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(produced, expected)


def _loss_and_gradients(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_5"])
def test_loss_and_every_gradient_equal_eager(checkpoints, backend, name):
    eager = _load(checkpoints, name, "eager")
    model = _load(checkpoints, name, "ascend_flash")
    inputs = make_inputs(name, eager, n_images=1)
    loss, gradients = _loss_and_gradients(model, inputs)
    eager_loss, eager_gradients = _loss_and_gradients(eager, inputs)
    torch.testing.assert_close(loss, eager_loss, atol=ATOL, rtol=0)
    assert gradients.keys() == eager_gradients.keys()
    for name_, gradient in eager_gradients.items():
        torch.testing.assert_close(gradients[name_], gradient, atol=ATOL, rtol=1e-4, msg=name_)


def test_set_attn_implementation_on_a_loaded_model(checkpoints):
    eager = _load(checkpoints, "qwen2_5_vl", "eager")
    model = _load(checkpoints, "qwen2_5_vl", "eager")
    model.set_attn_implementation("ascend_flash")
    assert _attention_configs(model) == {"ascend_flash"}
    inputs = make_inputs("qwen2_5_vl", eager, n_images=1)
    torch.testing.assert_close(
        _real_logits(model, inputs), _real_logits(eager, inputs), atol=ATOL, rtol=0
    )


def test_the_mask_function_masks_padding(checkpoints):
    model = _load(checkpoints, "llava_clip", "ascend_flash")
    inputs = make_inputs("llava_clip", model, batch=2, padding="right")
    shorter = {k: v[1:] for k, v in inputs.items()}
    kept = int(shorter["attention_mask"].sum())
    shorter = {k: v[:, :kept] for k, v in shorter.items()}
    with torch.no_grad():
        padded_row = model(**inputs).logits[1, :kept]
        alone = model(**shorter).logits[0]
    torch.testing.assert_close(padded_row, alone, atol=ATOL, rtol=0)


def test_whole_model_patch_on_top_and_unpatch_keep_ascend_flash(checkpoints):
    eager = _load(checkpoints, "qwen2_5_vl", "eager")
    model = _load(checkpoints, "qwen2_5_vl", "ascend_flash")
    inputs = make_inputs("qwen2_5_vl", eager, n_images=1)
    report = ascend_vlm.patch(model)
    assert report.swapped_count("norm") > 0 and report.swapped_count("mlp") > 0
    torch.testing.assert_close(
        _real_logits(model, inputs), _real_logits(eager, inputs), atol=ATOL, rtol=0
    )
    ascend_vlm.unpatch(model)
    assert _attention_configs(model) == {"ascend_flash"}


def test_a_failed_registration_warns_instead_of_breaking_transformers(monkeypatch):
    from transformers import modeling_utils

    from ascend_vlm.patching import attention

    def moved() -> None:
        raise AttributeError("AttentionInterface has no register")

    monkeypatch.setattr(attention, "register_attention", moved)
    with pytest.warns(UserWarning, match="could not register attn_implementation='ascend_flash'"):
        ascend_vlm._register_ascend_flash(modeling_utils)
