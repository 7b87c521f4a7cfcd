"""A whole patched model under torch.compile and strict torch.export gives the stock logits.

Dynamo used to guard on transformers' own ``apply_rotary_pos_emb`` while tracing our adapter
(``AttributeError: 'function' object has no attribute 'args'``). ``fullgraph=True`` wherever the
stock model compiles in one graph (Qwen2-VL's vision grid sizes are data-dependent, so with an
image only the graph-break mode applies, patched or not). aot_eager runs Dynamo and AOTAutograd
on the fake kernels without inductor's C++ code generation, which takes minutes on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

COMPILE_CASES = [  # family, images, fullgraph
    ("qwen2_vl", 0, True),
    pytest.param("qwen2_vl", 1, False, marks=pytest.mark.slow),
    ("llava_clip", 1, True),
]


def _stock_and_patched(family: str, n_images: int):
    model = build_model(family, attn_implementation="sdpa")
    inputs = make_inputs(family, model, n_images=n_images)
    with torch.no_grad():
        stock = model(**inputs).logits
    ascend_vlm.patch(model)
    return model, inputs, stock


@pytest.mark.parametrize(
    ("family", "n_images", "fullgraph"),
    COMPILE_CASES,
    ids=["qwen2_vl-text-fullgraph", "qwen2_vl-image-breaks", "llava_clip-image-fullgraph"],
)
def test_compiled_patched_model_gives_stock_logits(family, n_images, fullgraph) -> None:
    model, inputs, stock = _stock_and_patched(family, n_images)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    with torch.no_grad():
        logits = compiled(**inputs).logits
    torch.testing.assert_close(logits, stock, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_clip"])
def test_strict_export_of_patched_model_gives_stock_logits(family) -> None:
    model, inputs, stock = _stock_and_patched(family, 0)
    kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    # use_cache=False: transformers' DynamicCache is not an exportable output (stock as well)
    exported = torch.export.export(model, (), {**kwargs, "use_cache": False}, strict=True)
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert "ascend_vlm.rotary_embedding_pair.default" in targets
    logits = exported.module()(**kwargs, use_cache=False).logits
    torch.testing.assert_close(logits, stock, atol=1e-5, rtol=1e-5)
