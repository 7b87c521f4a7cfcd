"""ascend_vlm.testing.transformers_suite (auto-patching every top-level model a test builds), its
tiny-model testers, and scripts/run_transformers_tests.py (the stock/patched diff)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlavaForConditionalGeneration, LlavaModel, PreTrainedModel

from ascend_vlm.models import tiny
from ascend_vlm.patching import is_patched
from ascend_vlm.testing.transformers_suite import AutoPatcher
from ascend_vlm.testing.transformers_tiny_tester import family_test_case

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_transformers_tests.py"


@pytest.fixture
def spied():
    """An installed AutoPatcher whose patch only records the models it is given."""
    seen: list[torch.nn.Module] = []
    patcher = AutoPatcher(patch=seen.append)
    patcher.install()
    try:
        yield patcher, seen
    finally:
        patcher.uninstall()


def test_a_composite_model_is_patched_once_and_its_sub_models_never(spied) -> None:
    patcher, seen = spied
    model = tiny.build_model("qwen2_vl")
    sub_models = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m is not model]
    assert len(sub_models) == 3  # the base model, its vision tower and its language model
    assert seen == [model]
    assert patcher.patched == 1


def test_a_model_built_in_a_plain_objects_init_is_top_level(spied) -> None:
    class Holder:
        def __init__(self) -> None:
            self.model = tiny.build_model("llava_clip")

    _, seen = spied
    holder = Holder()
    assert seen == [holder.model]


def test_suspended_builds_stock_and_reset_clears_the_count(spied) -> None:
    patcher, seen = spied
    with patcher.suspended():
        tiny.build_model("paligemma")
    assert seen == []
    tiny.build_model("paligemma")
    assert patcher.patched == 1
    patcher.reset()
    assert patcher.patched == 0


def test_uninstall_restores_post_init_and_a_second_install_is_refused() -> None:
    original = PreTrainedModel.__dict__["post_init"]
    patcher = AutoPatcher(patch=lambda model: None)
    patcher.install()
    assert PreTrainedModel.__dict__["post_init"] is not original
    with pytest.raises(RuntimeError, match="already installed"):
        patcher.install()
    patcher.uninstall()
    assert PreTrainedModel.__dict__["post_init"] is original


def test_the_default_patch_is_ascend_vlm_patch() -> None:
    patcher = AutoPatcher()
    patcher.install()
    try:
        model = tiny.build_model("qwen2_vl")
    finally:
        patcher.uninstall()
    assert is_patched(model)
    assert not is_patched(model.model)


def test_family_test_case_feeds_its_tiny_model_one_image_and_labels() -> None:
    class NoTests:
        pass

    case = family_test_case("llava", NoTests)
    assert case.all_model_classes == (LlavaForConditionalGeneration, LlavaModel)
    test = case("setUp")
    test.setUp()
    config, inputs = test.model_tester.prepare_config_and_inputs_for_common()
    image_tokens = int((inputs["input_ids"] == tiny.IMAGE_TOKEN).sum())
    assert image_tokens > 0
    assert int((inputs["labels"] == -100).sum()) == image_tokens
    assert test.model_tester.seq_length == inputs["input_ids"].shape[1]
    with torch.no_grad():
        loss = LlavaForConditionalGeneration(config)(**inputs).loss
    assert torch.isfinite(loss)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("run_transformers_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_diff_lists_stock_passes_that_fail_patched_and_keeps_attention_name_tests_apart(
    script,
) -> None:
    o = script.Outcome
    stock = {
        "f::T::test_a": o("passed"),
        "f::T::test_b": o("passed"),
        "f::T::test_sdpa_can_dispatch_non_composite_models": o("passed"),
        "f::T::test_c": o("failed", "stock bug"),
        "f::T::test_d": o("passed"),
        "f::T::test_e": o("passed"),
    }
    patched = {
        "f::T::test_a": o("passed", patched_models=1),
        "f::T::test_b": o("error", "KeyError: 'ascend_flash'", patched_models=2),
        "f::T::test_sdpa_can_dispatch_non_composite_models": o("failed", "name", patched_models=1),
        "f::T::test_c": o("passed", patched_models=1),
        "f::T::test_d": o("skipped", "needs a GPU"),
    }
    result = script.diff("qwen2_vl", "generated", stock, patched)
    assert result.patched_only_failures == {
        "f::T::test_b": "error: KeyError: 'ascend_flash'",
        "f::T::test_e": "missing: ",
    }
    assert result.attention_name_failures == {
        "f::T::test_sdpa_can_dispatch_non_composite_models": "failed: name"
    }
    assert result.patched_only_passes == ["f::T::test_c"]
    assert result.counts["stock"] == {"passed": 5, "failed": 1}
    assert result.counts["patched"] == {
        "passed": 2,
        "error": 1,
        "failed": 1,
        "skipped": 1,
        "tests_that_patched_a_model": 4,
    }


def test_read_junit_takes_outcome_message_and_patched_count(script, tmp_path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.models.x.test_m.T" name="test_a"'
        ' file="tests/models/x/test_m.py"><properties><property name="ascend_vlm_patched"'
        ' value="2"/></properties><failure message="AssertionError: 1 != 2&#10;more">'
        '</failure></testcase><testcase classname="tests.models.x.test_m.T" name="test_b"'
        ' file="tests/models/x/test_m.py"><skipped message="no GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert script.read_junit(xml) == {
        "tests/models/x/test_m.py::T::test_a": script.Outcome(
            "failed", "AssertionError: 1 != 2", 2
        ),
        "tests/models/x/test_m.py::T::test_b": script.Outcome("skipped", "no GPU", 0),
    }


def test_prepare_tests_refuses_a_directory_without_transformers_tests(script, tmp_path) -> None:
    with pytest.raises(ValueError, match="transformers_dir: expected a checkout"):
        script.prepare_tests(tmp_path, tmp_path / "work", ["qwen2_vl"])


def test_read_subtest_failures_takes_the_short_summary_lines(script, tmp_path) -> None:
    log = tmp_path / "r.log"
    log.write_text(
        "FAILED t.py::T::test_a - boom\n"
        "SUBFAILED[model.x.bias] t.py::T::test_b\n"
        "..SUBFAILED is only read at a line start\n"
    )
    assert script.read_subtest_failures(log) == {"SUBFAILED[model.x.bias] t.py::T::test_b"}
    assert script.read_subtest_failures(tmp_path / "absent.log") == set()
