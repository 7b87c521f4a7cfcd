"""Replay repros: a module (or a fused op) saved from a patched bf16 model on the mock NPU, read
back with ``weights_only=True`` and re-run against the float64 reference, for every module
kind the library patches (norm, rope application, text and vision attention, MLP, MoE, linear
attention) and a stock module, with the errors checked against a direct computation."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import ascend_vlm
from ascend_vlm import ops
from ascend_vlm.kernel_backend import using_backend
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.verification.replay import (
    FORMAT,
    OpRecorder,
    load_repro,
    replay,
    replay_command,
    save_repro,
)

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

# (family, module name, kind, whether patch swaps something inside it)
MODULES = [
    *[
        (family, name, kind, True)
        for family in ("qwen2_vl", "qwen3_5", "qwen3_vl_moe")
        for name, kind in [
            ("model.language_model.layers.0.input_layernorm", "norm"),
            ("model.language_model.layers.0.mlp", "mlp"),
            ("model.visual.blocks.0.attn", "vision-attention"),
            ("model.visual.blocks.0", "vision-block"),
        ]
    ],
    ("qwen2_vl", "model.language_model.layers.0.self_attn", "attention", True),
    ("qwen2_vl", "model.language_model.layers.1", "decoder-layer", True),
    ("qwen2_vl", "model.visual.merger", "projector", False),
    ("qwen3_5", "model.language_model.layers.0.linear_attn", "linear-attention", True),
    ("qwen3_5", "model.language_model.layers.2.self_attn", "attention", True),
    ("qwen3_5", "model.language_model.layers.2", "decoder-layer", True),
    ("qwen3_vl_moe", "model.language_model.layers.0.self_attn", "attention", True),
    ("qwen3_vl_moe", "model.language_model.layers.0.self_attn.q_norm", "norm", True),
    ("qwen3_vl_moe", "model.language_model.layers.1.mlp", "moe", True),
    ("qwen3_vl_moe", "model.language_model.layers.1.mlp.gate", "router", False),
]


def _floating(output) -> torch.Tensor:
    """Every floating tensor of a (nested tuple) output, flattened into one float64 vector."""
    if isinstance(output, tuple | list):
        return torch.cat([_floating(item) for item in output])
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output.double().flatten()
    return torch.zeros(0, dtype=torch.float64)


def _float64(value):
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_float64(v) for v in value)
    return value


def _patched_call(family: str, name: str):
    """The patched bf16 model's module ``name`` and the (args, kwargs) of its first call on
    text with one image, made on the mock NPU."""
    model = build_model(family)
    ascend_vlm.patch(model)
    model.to(torch.bfloat16)
    module = model.get_submodule(name)
    calls = []
    handle = module.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append((args, kwargs)) if not calls else None,
        with_kwargs=True,
    )
    with torch.no_grad():
        model(**make_inputs(family, model, n_images=1), use_cache=False)
    handle.remove()
    return module, *calls[0]


def _direct_rel_l2(family: str, name: str, module, args, kwargs) -> float:
    """The module's bf16 output on the mock against the stock fp64 module of the same (bf16)
    weights, with sdpa attention (which takes the masks the patched model makes) and eager
    experts, computed here."""
    stock = build_model(family, attn_implementation="sdpa").to(torch.bfloat16)
    if hasattr(stock.config, "_experts_implementation"):
        stock.set_experts_implementation("eager")  # grouped_mm takes no float64
    reference = stock.get_submodule(name).double()
    with torch.no_grad():
        got = _floating(module(*args, **kwargs))
        with using_backend("cpu"):
            expected = _floating(
                reference(*_float64(args), **{k: _float64(v) for k, v in kwargs.items()})
            )
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize(("family", "name", "kind", "patched"), MODULES)
def test_a_module_repro_round_trips_with_the_direct_error(
    mock_npu, tmp_path, family, name, kind, patched
):
    module, args, kwargs = _patched_call(family, name)
    path = save_repro(
        module, args, kwargs, tmp_path / "repro.pt",
        kind=kind, dtype=torch.bfloat16, device=mock_npu.device, module_name=name,
    )  # fmt: skip
    saved = torch.load(path, weights_only=True)
    assert saved["format"] == FORMAT and saved["kind"] == kind and saved["dtype"] == "bfloat16"
    assert saved["command"] == "python -m ascend_vlm verify --replay repro.pt"

    result = replay(path)

    assert result.errors.rel_l2 == pytest.approx(
        _direct_rel_l2(family, name, module, args, kwargs), rel=1e-6
    )
    assert 0 < result.errors.rel_l2 < 2e-2  # bf16 rounding, no fault
    assert result.errors.cosine > 0.999
    assert bool(result.op_errors) == patched
    assert all(e.op.startswith("ascend_vlm::") and e.errors.rel_l2 < 1e-2 for e in result.op_errors)
    assert result.module_name == name and result.backend == "mock"
    assert result.target == f"module {type(module).__name__}" and name in result.table()
    # each op call is put down to the submodule that made it
    assert {e.module for e in result.op_errors} <= {n for n, _ in module.named_modules()}
    if kind == "decoder-layer":
        assert {"input_layernorm", "mlp"} <= {e.module for e in result.op_errors}


def test_a_faulty_norm_kernel_shows_in_the_module_and_in_its_op(mock_npu, tmp_path, monkeypatch):
    name = "model.language_model.layers.0.input_layernorm"
    module, args, kwargs = _patched_call("qwen2_vl", name)
    path = save_repro(
        module, args, kwargs, tmp_path / "norm.pt",
        kind="norm", dtype="bfloat16", device="cpu", module_name=name,
    )  # fmt: skip
    healthy = replay(path)
    kernel = mock_npu.torch_npu.npu_rms_norm

    def scaled_gamma(input, gamma, epsilon=1e-6):
        return kernel(input, gamma * 1.25, epsilon)

    monkeypatch.setattr(mock_npu.torch_npu, "npu_rms_norm", scaled_gamma)
    faulty = replay(path)

    assert healthy.errors.rel_l2 < 1e-2
    # y * 1.25 against y: relative error 0.25, up to bf16 rounding
    assert faulty.errors.rel_l2 == pytest.approx(0.25, abs=1e-2)
    (op_error,) = faulty.op_errors
    assert op_error.op == "ascend_vlm::rms_norm"
    assert op_error.errors.rel_l2 == pytest.approx(0.25, abs=1e-2)
    assert "rms_norm" in faulty.table() and "0.25" not in healthy.table()


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("qwen2_vl", "model.language_model.layers.0.self_attn"),
        ("qwen3_5", "model.language_model.layers.2.self_attn"),
        ("qwen3_vl_moe", "model.language_model.layers.0.self_attn"),
        ("qwen3_vl_moe", "model.visual.blocks.0.attn"),
    ],
)
def test_a_rope_application_replays_as_its_op(mock_npu, tmp_path, monkeypatch, family, name):
    module, args, kwargs = _patched_call(family, name)
    with torch.no_grad(), OpRecorder() as recorder:
        module(*args, **kwargs)
    rope, *_ = [call for call in recorder.calls if "rotary" in call.op.name()]
    op_args, op_kwargs = rope.args, rope.kwargs
    path = save_repro(
        rope.op.name(), op_args, op_kwargs, tmp_path / "rope.pt",
        kind="rope", dtype=torch.bfloat16, device="cpu", module_name=f"{name}.rope",
    )  # fmt: skip

    result = replay(path)

    with torch.no_grad():
        q, k = ops.rotary_embedding_pair(*op_args, **op_kwargs)
        with using_backend("cpu"):
            q64, k64 = ops.rotary_embedding_pair(*_float64(op_args), **op_kwargs)
    got = torch.cat([q.flatten(), k.flatten()]).double()
    expected = torch.cat([q64.flatten(), k64.flatten()])
    direct = float((got - expected).norm() / expected.norm())
    assert result.target == "op ascend_vlm::rotary_embedding_pair"
    assert result.errors.rel_l2 == pytest.approx(direct, rel=1e-6)
    assert [e.op for e in result.op_errors] == ["ascend_vlm::rotary_embedding_pair"]

    kernel = mock_npu.torch_npu.npu_rotary_mul
    monkeypatch.setattr(
        mock_npu.torch_npu,
        "npu_rotary_mul",
        lambda x, r1, r2, *a, **kw: kernel(x, r1, -r2, *a, **kw),
    )
    assert replay(path).errors.rel_l2 > 0.1  # sin's sign flipped


def test_replay_names_a_corrupt_or_foreign_file(tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a torch file")
    foreign = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(2)}, foreign)
    pickled = tmp_path / "pickled.pt"
    torch.save(torch.nn.Linear(2, 2), pickled)

    for path, says in [
        (corrupt, "unreadable"),
        (foreign, "a dict without that format"),
        (pickled, "unreadable"),
    ]:
        with pytest.raises(ValueError, match=str(path)) as error:
            replay(path)
        assert says in str(error.value)
        with pytest.raises(ValueError, match=str(path)):
            load_repro(path)


def test_save_repro_refuses_a_call_continuing_a_cached_sequence(tmp_path):
    norm = build_model("qwen2_vl").model.language_model.norm
    hidden = torch.randn(1, 1, norm.weight.shape[0])
    with pytest.raises(ValueError, match="cache_position"):
        save_repro(
            norm, (hidden,), {"cache_position": torch.tensor([7])}, tmp_path / "x.pt",
            kind="norm", dtype="float32", device="cpu", module_name="norm",
        )  # fmt: skip
    with pytest.raises(ValueError, match="kind"):
        save_repro(norm, (hidden,), {}, tmp_path / "x.pt", kind="", dtype="float32",
                   device="cpu", module_name="norm")  # fmt: skip
    assert replay_command(tmp_path / "x.pt") == "python -m ascend_vlm verify --replay x.pt"


def test_the_module_state_probe_holds():
    from ascend_vlm._compat.module_state import MODULE_STATE_PROBES

    assert [(probe.name, probe.check()) for probe in MODULE_STATE_PROBES] == [
        ("module-state", None)
    ]


def test_a_fault_in_a_patched_forward_travels_in_the_repro(mock_npu, tmp_path):
    """RMSNorm with eps times 1e4 in its rebound forward: the module is far off, while the op
    it calls computes exactly what it is asked (so the fault is not the kernel's)."""
    from ascend_vlm.patching.adapters import rms_norm_forward

    name = "model.language_model.layers.0.input_layernorm"
    module, args, kwargs = _patched_call("qwen2_vl", name)
    stock = module.forward
    eps = stock.args[1]
    module.forward = functools.partial(rms_norm_forward, module, eps * 1e4, *stock.args[2:])
    path = save_repro(
        module, args, kwargs, tmp_path / "eps.pt",
        kind="norm", dtype="bfloat16", device="cpu", module_name=name,
    )  # fmt: skip
    about = torch.load(path, weights_only=True)["about"]
    assert "Qwen2VLRMSNorm" in about and "--replay eps.pt" in about

    result = replay(path)

    direct = _direct_rel_l2("qwen2_vl", name, module, args, kwargs)
    assert result.errors.rel_l2 == pytest.approx(direct, rel=1e-6)
    assert result.errors.rel_l2 > 0.05
    (op_error,) = result.op_errors
    assert op_error.errors.rel_l2 < 1e-2 and op_error.module == ""


def test_a_repro_saved_on_an_npu_replays_on_the_cpu_under_the_mock(mock_npu, tmp_path):
    norm = build_model("qwen2_vl").model.language_model.norm
    hidden = torch.randn(1, 3, norm.weight.shape[0])
    path = save_repro(
        norm, (hidden,), {}, tmp_path / "npu.pt",
        kind="norm", dtype="float32", device="npu:0", module_name="model.norm",
    )  # fmt: skip

    result = replay(path)

    assert result.device == "cpu" and result.backend == "mock"
    assert "saved on npu:0, replayed on the CPU under the 'mock' backend" in result.notes
    assert result.errors.rel_l2 < 1e-6  # a stock fp32 norm against float64
    assert json.loads(json.dumps(result.to_json()))["errors"] == vars(result.errors)
    with pytest.raises(ValueError, match=f"{path}: device 'npu:0' is not usable here"):
        replay(path, device="npu:0")


def test_a_rope_drop_in_replays_as_a_function(mock_npu, tmp_path):
    """The function ``patch`` resolves a Qwen2-VL attention's ``apply_rotary_pos_emb`` to, saved
    with its arguments: it runs the op on the mock in bf16, against transformers' own function
    in float64 here."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from ascend_vlm.patching.adapters import rope_adapter

    drop_in = rope_adapter("text")
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 5, 8, generator=generator).bfloat16() for _ in range(2))
    angles = torch.randn(1, 5, 4, generator=generator).repeat(1, 1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    path = save_repro(
        drop_in, (q, k, cos, sin), {}, tmp_path / "rope.pt",
        kind="rope", dtype="bfloat16", device="cpu", module_name="layers.0.self_attn.rope",
    )  # fmt: skip

    result = replay(path)

    with torch.no_grad():
        got = _floating(drop_in(q, k, cos, sin))
        expected = _floating(apply_rotary_pos_emb(*_float64((q, k, cos, sin))))
    assert result.target == "function _rope_text" and result.errors.rel_l2 > 0
    assert result.errors.rel_l2 == pytest.approx(
        float((got - expected).norm() / expected.norm()), rel=1e-6
    )
    assert [e.op for e in result.op_errors] == ["ascend_vlm::rotary_embedding_pair"]


def test_what_has_no_plain_data_form_is_noted_or_refused(tmp_path):
    norm = build_model("qwen2_vl").model.language_model.norm
    norm.callback = lambda hidden: hidden  # a function with no import path
    hidden = torch.randn(1, 3, norm.weight.shape[0])
    path = save_repro(
        norm, (hidden,), {}, tmp_path / "norm.pt",
        kind="norm", dtype="float32", device="cpu", module_name="model.norm",
    )  # fmt: skip

    assert "attribute callback is not saved (no plain-data form)" in replay(path).notes
    with pytest.raises(ValueError, match=r"inputs\.kwargs\.extra: no plain-data form for object"):
        save_repro(
            norm, (hidden,), {"extra": object()}, tmp_path / "bad.pt",
            kind="norm", dtype="float32", device="cpu", module_name="model.norm",
        )  # fmt: skip


def _hostile_repro(tmp_path, target: dict, args: tuple) -> object:
    """A repro file written as ``save_repro`` writes one, with ``target`` and ``args`` put in
    by hand (what a hostile sender controls)."""
    norm = build_model("qwen2_vl").model.language_model.norm
    path = save_repro(
        norm, (torch.randn(1, 3, norm.weight.shape[0]),), {}, tmp_path / "hostile.pt",
        kind="norm", dtype="float32", device="cpu", module_name="model.norm",
    )  # fmt: skip
    repro = torch.load(path, weights_only=True)
    repro["target"] = target
    repro["inputs"] = {"t": "dict", "items": [["args", {"t": "tuple", "items": list(args)}],
                                              ["kwargs", {"t": "dict", "items": []}]]}  # fmt: skip
    torch.save(repro, path)
    return path


@pytest.mark.parametrize(
    "function",
    [
        {"t": "callable", "path": "torch.serialization:os.system"},
        {"t": "callable", "path": "torch.hub:load"},
        {"t": "partial", "id": 0, "func": {"t": "callable", "path": "torch.hub:load"},
         "args": {"t": "tuple", "items": []}, "keywords": {"t": "dict", "items": []}},
        {"t": "module", "id": 0, "class_of": "torch.serialization:os"},
    ],
)  # fmt: skip
def test_a_hostile_function_target_is_refused_before_it_runs(tmp_path, function):
    marker = tmp_path / "marker"
    path = _hostile_repro(tmp_path, {"function": function}, (f"touch {marker}",))
    refused = function.get("path") or function.get("class_of") or function["func"]["path"]

    with pytest.raises(ValueError, match=str(path)) as error:
        replay(path)

    assert refused in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("encoded", "refused"),
    [
        ({"t": "module", "class": "collections:OrderedDict"}, "collections:OrderedDict"),
        ({"t": "module", "class": "torch.utils.data:DataLoader"}, "DataLoader"),
        ({"t": "module", "class": "torch.optim:SGD"}, "torch.optim:SGD"),
        ({"t": "module", "class": "ascend_vlm.verification.replay:Errors"}, "Errors"),
        ({"t": "config", "class": "torch.nn:Linear"}, "torch.nn:Linear"),
        ({"t": "dataclass", "class": "ascend_vlm.verification.replay:Errors"}, "Errors"),
        ({"t": "callable", "path": "torch.hub:load"}, "torch.hub:load"),
        ({"t": "callable", "path": "torch:load"}, "torch:load"),
        ({"t": "callable", "path": "ascend_vlm.verification.replay:save_repro"}, "save_repro"),
        ({"t": "dtype", "name": "load"}, "dtype"),
    ],
)
def test_a_class_or_function_outside_the_allow_list_is_refused(tmp_path, encoded, refused):
    """Whatever the tag, a class or function a repro may not name is refused by path, here as
    an argument of an allowed function target."""
    body = {"id": 0, "training": False, "attributes": {}, "rebound": {}, "parameters": {},
            "buffers": {}, "non_persistent": [], "children": {}, "values": {}, "fields": {},
            "implementations": {}}  # fmt: skip
    target = {"function": {"t": "callable", "path": "ascend_vlm.ops.rms_norm:rms_norm"}}
    path = _hostile_repro(tmp_path, target, ({**body, **encoded},))

    with pytest.raises(ValueError, match=str(path)) as error:
        replay(path)

    assert refused in str(error.value)


def test_a_method_a_repro_binds_is_one_of_its_object(tmp_path):
    from ascend_vlm.verification.repro_names import bound_method

    norm = torch.nn.LayerNorm(2)
    assert bound_method(norm, "extra_repr")() == norm.extra_repr()
    for name in ("__reduce_ex__", "weight", "missing"):
        with pytest.raises(ValueError, match=f"method LayerNorm.{name}"):
            bound_method(norm, name)
