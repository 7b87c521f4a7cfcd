"""The "prune" feature option of eval: ``--prune`` / ``--kv`` spec parsing, argparse errors,
the ``--compare`` form, and pruning actually enabled on the model."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest
import torch

from ascend_vlm import pruning
from ascend_vlm.__main__ import main
from ascend_vlm.commands.pruning_option import apply_pruning, kv_spec, prune_spec
from ascend_vlm.pruning import PruneConfig, SnapKVConfig

EVAL_ERROR = "python -m ascend_vlm eval: error: "


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fastv", PruneConfig()),
        ("divprune:keep=0.25", PruneConfig(method="divprune", keep=0.25)),
        ("random:keep=0.5,seed=3", PruneConfig(method="random", keep=0.5, seed=3)),
        ("uniform", PruneConfig(method="uniform")),
        ("fastv:layer=3,keep=1", PruneConfig(layer=3, keep=1.0)),
        ("fastv:layer=1;keep=0.5", PruneConfig(layer=1, keep=0.5)),
        ("random:seed=7+layer=4+keep=0.1", PruneConfig(method="random", layer=4, keep=0.1, seed=7)),
    ],
)
def test_prune_spec_gives_the_config_with_defaults_for_missing_keys(spec, expected):
    config = prune_spec(spec)
    assert config == expected
    assert type(config.layer) is int and type(config.keep) is float and type(config.seed) is int


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("snapkv", SnapKVConfig()),
        ("snapkv:compression_ratio=0.75", SnapKVConfig(compression_ratio=0.75)),
        (
            "snapkv:compression_ratio=0,window=8,kernel_size=3,pooling=max,per_head=false",
            SnapKVConfig(0.0, window=8, kernel_size=3, pooling="max", per_head=False),
        ),
        ("snapkv:per_head=TRUE;window=1", SnapKVConfig(window=1, per_head=True)),
        ("snapkv:per_head=False+pooling=avg", SnapKVConfig(per_head=False)),
    ],
)
def test_kv_spec_gives_the_config_with_defaults_for_missing_keys(spec, expected):
    config = kv_spec(spec)
    assert config == expected
    assert type(config.compression_ratio) is float and type(config.per_head) is bool


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prune", "bogus"], "argument --prune: method: expected one of fastv, divprune, random, uniform, got 'bogus'"),
        (["--prune", "fastv:depth=2"], "argument --prune: unknown key 'depth': expected one of layer, keep, seed"),
        (["--prune", "fastv:method=random"], "argument --prune: unknown key 'method': expected one of layer, keep, seed"),
        (["--prune", "fastv:keep=half"], "argument --prune: keep: expected a number, got 'half'"),
        (["--prune", "fastv:layer=1.5"], "argument --prune: layer: expected an int, got '1.5'"),
        (["--prune", "fastv:keep=0"], "argument --prune: keep: expected a number with 0 < x <= 1, got 0.0"),
        (["--prune", "fastv:layer=0"], "argument --prune: layer: expected an int >= 1, got 0"),
        (["--prune", "random:seed=-1"], "argument --prune: seed: expected an int >= 0, got -1"),
        (["--prune", "fastv:layer"], "argument --prune: expected METHOD[:key=value,...] (items separated by ',', ';' or '+'), got item 'layer' in 'fastv:layer'"),
        (["--prune", "fastv:"], "argument --prune: expected METHOD[:key=value,...] (items separated by ',', ';' or '+'), got item '' in 'fastv:'"),
        (["--prune", "fastv:keep=0.5,keep=1"], "argument --prune: keep: given twice in 'fastv:keep=0.5,keep=1'"),
        (["--kv", "h2o"], "argument --kv: method: expected snapkv, got 'h2o'"),
        (["--kv", "snapkv:ratio=0.5"], "argument --kv: unknown key 'ratio': expected one of compression_ratio, window, kernel_size, pooling, per_head"),
        (["--kv", "snapkv:per_head=yes"], "argument --kv: per_head: expected true or false, got 'yes'"),
        (["--kv", "snapkv:compression_ratio=1"], "argument --kv: compression_ratio: expected a number with 0 <= x < 1, got 1.0"),
        (["--kv", "snapkv:kernel_size=4"], "argument --kv: kernel_size: expected an odd int, got 4"),
        (["--kv", "snapkv:pooling=min"], "argument --kv: pooling: expected one of avg, max, got 'min'"),
        (["--kv", "snapkv:window"], "argument --kv: expected METHOD[:key=value,...] (items separated by ',', ';' or '+'), got item 'window' in 'snapkv:window'"),
        (["--compare", "patched", "prune=fastv:layer=1;keep=0"], "--compare: configuration 'prune=fastv:layer=1;keep=0': argument --prune: keep: expected a number with 0 < x <= 1, got 0.0"),
    ],
)  # fmt: skip
def test_bad_spec_exits_2_naming_the_flag(command_error, argv, message):
    # Rejected while parsing: no model is resolved or loaded.
    assert command_error(["eval", *argv]) == EVAL_ERROR + message


def test_compare_configurations_take_specs_with_the_alternative_separators(
    tiny_model_path, tmp_path
):
    out = tmp_path / "report.json"
    argv = ["eval", "--model", str(tiny_model_path), "--limit", "1", "--max-new-tokens", "1"]
    first, second = "prune=fastv:layer=1;keep=0.5", "prune=uniform:layer=1+keep=0.25,unpatched"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--compare", first, second, "--json", str(out)]) == 0
    a, b = json.loads(out.read_text())["configurations"]
    assert a["options"]["prune"]["prune"] == {
        "method": "fastv", "layer": 1, "keep": 0.5, "seed": 0,
    }  # fmt: skip
    assert a["options"]["prune"]["summary"] == "pruned: fastv layer=1 keep=0.5"
    assert b["options"]["prune"]["summary"] == "pruned: uniform layer=1 keep=0.25"
    assert b["options"]["patch"]["patched"] is False


@pytest.fixture
def tiny_qwen2_vl():
    from ascend_vlm.models import tiny

    model = tiny.build_model("qwen2_vl", layers=4, attn_implementation="sdpa")
    return model, tiny.make_inputs("qwen2_vl", model, n_images=2)


def test_apply_enables_pruning_and_compression(tiny_qwen2_vl):
    model, inputs = tiny_qwen2_vl
    args = argparse.Namespace(
        prune=prune_spec("fastv:layer=2,keep=0.5"), kv=kv_spec("snapkv:window=4")
    )
    applied = apply_pruning(model, args)
    assert applied == {
        "summary": "pruned: fastv layer=2 keep=0.5; kv: snapkv ratio=0.5 window=4",
        "prune": {"method": "fastv", "layer": 2, "keep": 0.5, "seed": 0},
        "kv": {
            "compression_ratio": 0.5, "window": 4, "kernel_size": 7, "pooling": "avg",
            "per_head": True,
        },
    }  # fmt: skip
    assert json.loads(json.dumps(applied)) == applied
    with torch.no_grad():
        model(**inputs)
    stats = pruning.pruning_stats(model)
    assert stats is not None
    (visual,) = stats.visual_tokens
    assert visual > 0
    assert stats.kept_visual_tokens == (math.ceil(0.5 * visual),)
    assert stats.kv_ratio < 1.0


def test_apply_without_flags_leaves_the_model_alone(tiny_qwen2_vl):
    model, inputs = tiny_qwen2_vl
    applied = apply_pruning(model, argparse.Namespace(prune=None, kv=None))
    assert applied == {"summary": "not pruned", "prune": None, "kv": None}
    with torch.no_grad():
        model(**inputs)
    assert pruning.pruning_stats(model) is None


def test_apply_names_the_flag_when_the_model_refuses_the_config(tiny_qwen2_vl):
    model, _ = tiny_qwen2_vl
    args = argparse.Namespace(prune=prune_spec("random:layer=4"), kv=None)
    with pytest.raises(ValueError, match=r"^--prune: layer: expected 1 <= layer < 4 "):
        apply_pruning(model, args)
