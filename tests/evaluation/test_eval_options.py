"""The feature-option registry: registration rules, and a new feature flowing through eval."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import torch

from ascend_vlm.commands.options import REGISTRY, OptionRegistry
from ascend_vlm.evaluation.cli import EvalCommand


def _no_arguments(group) -> None:
    return None


def _summary(model, args) -> dict:
    return {"summary": "nothing"}


@pytest.mark.parametrize(
    ("name", "presets", "message"),
    [
        ("Bad_Name", None, "name: expected lowercase words joined by '-', got 'Bad_Name'"),
        ("first", None, "name: option 'first' is already registered"),
        ("second", {"on": ["--x"]}, r"presets: \['on'\] already registered by another option"),
    ],
)
def test_register_rejects_bad_names_and_clashes(name, presets, message):
    registry = OptionRegistry()
    registry.register("first", _no_arguments, _summary, presets={"on": ["--first"]})
    with pytest.raises(ValueError, match=message):
        registry.register(name, _no_arguments, _summary, presets=presets)
    assert [option.name for option in registry.options()] == ["first"]


def test_apply_requires_a_summary():
    registry = OptionRegistry()
    registry.register("silent", _no_arguments, lambda model, args: None)
    with pytest.raises(
        TypeError, match="option 'silent': apply must return a dict with a 'summary'"
    ):
        registry.apply(object(), argparse.Namespace())


def test_options_that_need_the_processor_receive_it():
    registry = OptionRegistry()
    seen = []
    registry.register(
        "plain", _no_arguments, lambda model, args: seen.append("plain") or _summary(model, args)
    )
    registry.register(
        "calibrated",
        _no_arguments,
        lambda model, args, processor: seen.append(processor) or _summary(model, args),
        needs_processor=True,
    )
    registry.apply(object(), argparse.Namespace(), "the processor")
    assert seen == ["plain", "the processor"]


def test_the_built_in_options_are_registered_in_order():
    assert [option.name for option in REGISTRY.options()] == [
        "quantize",
        "patch",
        "adapter",
        "prune",
        "vision-cache",
    ]
    assert REGISTRY.presets() == {"patched": ("--patch",), "unpatched": ("--no-patch",)}


def _scale_registry(calls: list) -> OptionRegistry:
    """A stand-in feature: ``--logit-scale S`` multiplies the output embedding by S."""

    def add_arguments(group) -> None:
        group.add_argument("--logit-scale", type=float, default=1.0, help="scale the logits")

    def apply(model, args) -> dict:
        with torch.no_grad():
            model.lm_head.weight.mul_(args.logit_scale)
            calls.append((args.logit_scale, float(model.lm_head.weight.abs().sum())))
        return {"summary": f"logits x {args.logit_scale}", "scale": args.logit_scale}

    registry = OptionRegistry()
    registry.register(
        "logit-scale", add_arguments, apply, presets={"doubled": ["--logit-scale", "2"]}
    )
    return registry


def test_a_registered_feature_becomes_a_flag_a_preset_and_a_report_field(tiny_model_path, tmp_path):
    calls: list = []
    command = EvalCommand(_scale_registry(calls))
    parser = argparse.ArgumentParser(prog="python -m ascend_vlm")
    command.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "report.json"
    argv = ["eval", "--model", str(tiny_model_path), "--limit", "2", "--max-new-tokens", "1"]
    argv += ["--logit-scale", "0.5", "--compare", "logit-scale=1", "doubled", "--json", str(out)]
    with contextlib.redirect_stdout(io.StringIO()) as text:
        assert command.run(parser.parse_args(argv)) == 0
    report = json.loads(out.read_text())
    first, second = report["configurations"]
    assert first["options"] == {"logit-scale": {"summary": "logits x 1.0", "scale": 1.0}}
    assert second["options"] == {"logit-scale": {"summary": "logits x 2.0", "scale": 2.0}}
    assert [scale for scale, _ in calls] == [1.0, 2.0]
    assert calls[1][1] == pytest.approx(2 * calls[0][1], rel=1e-6)  # applied to the model
    assert "option   logit-scale: logits x 2.0" in text.getvalue().splitlines()
    assert report["comparison"]["samples"] == 2
