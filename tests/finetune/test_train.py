"""The fine-tune on Trainer: rank-count invariance, exact resume, resume with changed settings,
PEFT reload, model card, learning-rate schedule, the sparse hook's log fields, bad data,
targets."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tiny_finetune import COMMON, finetune_command, run_checked, tiny_config

from ascend_vlm._compat.distributed_loading import load_time_fsdp_problem
from ascend_vlm.data.shapes_vqa import ShapesVQA
from ascend_vlm.data.vqa import BadRecordError, EncodedDataset, collate, pad_token_id_of
from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune.config import FINAL_ADAPTER, LANGUAGE_PROJECTIONS, TrainConfig
from ascend_vlm.finetune.export import save_merged
from ascend_vlm.finetune.held_out import model_inputs
from ascend_vlm.finetune.model_setup import lora_target_modules
from ascend_vlm.finetune.resume import ResumeError
from ascend_vlm.finetune.schedule import scheduled_lr
from ascend_vlm.finetune.train import train


def _completed(output_dir: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    """Run the command (under torchrun when ``nproc`` > 1); a hang fails on the timeout."""
    model = f"--model-path={default_model_path()}"  # the random tiny model, not the reference
    command = [*finetune_command(nproc), f"--output-dir={output_dir}", model, *COMMON, *extra]
    return run_checked(command, timeout=240)


def _run(output_dir: Path, nproc: int, *extra: str) -> str:
    """Run the command (under torchrun when ``nproc`` > 1) and return its stdout."""
    return _completed(output_dir, nproc, *extra).stdout


def _step_records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


def _checkpoints(output_dir: Path) -> list[str]:
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


def _losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _step_records(output_dir)}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("two_ranks")
    stdout = _run(output_dir, 2)
    return output_dir, stdout


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_the_same_global_batch(two_rank_run, tmp_path):
    two_dir, stdout = two_rank_run
    one_dir = tmp_path / "one_rank"
    _run(one_dir, 1, "--grad-accum=2")
    two, one = _losses(two_dir), _losses(one_dir)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    assert stdout.strip().splitlines()[-1].startswith("eval_accuracy: ")
    assert (two_dir / "adapter" / "adapter_model.safetensors").is_file()
    # The sparse hook (the default --comm-hook) runs under Trainer and logs its savings: LoRA
    # and lm_head gradients are dense, so it sends every gradient plus its chunk mask.
    for record in _step_records(two_dir):
        assert -1024 <= record["comm_bytes_saved"] <= 0
        assert 0 < record["comm_density"] <= 1
    assert _checkpoints(two_dir) == ["checkpoint-2", "checkpoint-4", "latest"]


@pytest.mark.slow
@pytest.mark.skipif(load_time_fsdp_problem() is not None, reason=str(load_time_fsdp_problem()))
def test_fsdp_trains_to_the_ddp_losses_with_half_the_parameters_per_rank(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    # 5 eval samples in batches of 2: rank 0 makes 2 generate calls, rank 1 one; the report
    # before training runs before the sharded root's first forward.
    extra = [
        "--modules-to-save=",
        "--eval-size=5",
        "--eval-batch-size=2",
        "--report-question-types=count",
    ]
    ddp_dir, fsdp_dir = tmp_path / "ddp", tmp_path / "fsdp"
    ddp_stdout = _run(ddp_dir, 2, *extra)
    done = _completed(fsdp_dir, 2, *extra, "--fsdp")
    assert done.stdout.strip().splitlines()[-1] == ddp_stdout.strip().splitlines()[-1]
    # Sharded layers reduce their gradients in another order than DDP's buckets.
    ddp = _losses(ddp_dir)
    assert sorted(ddp) == [1, 2, 3, 4]
    assert _losses(fsdp_dir) == pytest.approx(ddp, rel=1e-4)
    held = re.findall(r"fsdp: rank (\d) holds (\d+) of (\d+) parameter elements", done.stderr)
    assert sorted(rank for rank, _, _ in held) == ["0", "1"]
    for _, part, whole in held:
        assert abs(int(part) / int(whole) - 0.5) < 0.1, (part, whole)
    assert _checkpoints(fsdp_dir) == ["checkpoint-2", "checkpoint-4", "latest"]
    for folder in (fsdp_dir / "adapter", fsdp_dir / "checkpoints" / "checkpoint-2"):
        base = AutoModelForImageTextToText.from_pretrained(default_model_path())
        adapted = PeftModel.from_pretrained(base, folder)
        assert not any(hasattr(p, "to_local") for p in adapted.parameters())  # no DTensor
    assert not list(fsdp_dir.glob(".*.staging"))
    sharded, replicated = (
        load_file(folder / "adapter" / "adapter_model.safetensors")
        for folder in (fsdp_dir, ddp_dir)
    )
    assert sorted(sharded) == sorted(replicated)
    for name, tensor in sharded.items():
        torch.testing.assert_close(tensor, replicated[name], atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.slow
def test_resume_after_a_crash_reproduces_the_uninterrupted_losses(two_rank_run, tmp_path):
    uninterrupted, _ = two_rank_run
    crashed = tmp_path / "crashed"
    stdout = _run(crashed, 2, "--stop-after-steps=3")
    assert "eval_accuracy" not in stdout
    assert sorted(_losses(crashed)) == [1, 2, 3]  # step 3 ran after checkpoint 2
    assert (crashed / "checkpoints" / "latest").read_text() == "checkpoint-2"
    _run(crashed, 2, "--resume=latest")
    assert _losses(crashed) == _losses(uninterrupted)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny LoRA run with the per-type report and a merged copy; its stdout."""
    run = tmp_path_factory.mktemp("lora")
    config = tiny_config(
        run,
        report_question_types=("count", "vertical"),
        save_merged=str(run / "merged"),
    )
    with pytest.MonkeyPatch.context() as patch:
        lines = []
        patch.setattr("builtins.print", lambda text, **_: lines.append(str(text)))
        result = train(config)
    return run, result, "\n".join(lines)


def _eval_inputs(processor) -> dict[str, torch.Tensor]:
    eval_set = EncodedDataset(ShapesVQA("eval", 4, image_size=56), processor)
    batch = collate([eval_set[i] for i in range(4)], pad_token_id_of(processor))
    return model_inputs(batch, torch.device("cpu"))


@pytest.mark.slow
def test_saved_adapter_and_merged_copy_reload_with_plain_libraries(lora_run, processor):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration

    from ascend_vlm.default_model import load_processor

    run, result, _ = lora_run
    inputs = _eval_inputs(processor)
    base = Qwen2VLForConditionalGeneration.from_pretrained(default_model_path())
    with torch.no_grad():
        base_logits = base(**inputs).logits
        adapted = PeftModel.from_pretrained(base, run / "adapter").eval()
        expected = result.model.eval()(**inputs).logits
        actual = adapted(**inputs).logits
        merged = AutoModelForImageTextToText.from_pretrained(run / "merged").eval()
        merged_logits = merged(**inputs).logits
        merged_in_memory = adapted.merge_and_unload()(**inputs).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert not torch.allclose(actual, base_logits, atol=1e-3)
    # Saving and reloading the merge loses nothing: bit-identical to PEFT's own merge.
    assert torch.equal(merged_logits, merged_in_memory)
    # The adapter computes x W^T + s (x A^T) B^T, the merge x (W + s B A)^T: the same sum
    # rounded in another order in fp32, so most logits differ in their last bits; the bound is
    # 8 fp32 epsilons of the largest logit (a few units in the last place).
    bound = 8 * torch.finfo(torch.float32).eps * actual.abs().max()
    assert 0 < (merged_logits - actual).abs().max() <= bound
    assert load_processor(run / "merged").image_processor.size.longest_edge == 112 * 112
    assert (run / "merged" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_merged_copy_is_saved_in_the_requested_dtype(lora_run, tmp_path):
    from safetensors.torch import load_file

    run, _, _ = lora_run
    save_merged(default_model_path(), run / "adapter", tmp_path / "bf16", torch.bfloat16)
    fp32 = load_file(run / "merged" / "model.safetensors")
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    assert sorted(bf16) == sorted(fp32)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)


@pytest.mark.slow
def test_held_out_accuracy_per_type_is_reported_before_and_after(lora_run):
    run, result, stdout = lora_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    before = next(r for r in records if "accuracy_before" in r)
    after = next(r for r in records if "accuracy_after" in r)
    assert (before["step"], after["step"]) == (0, 3)
    assert list(before["accuracy_before"]) == list(after["accuracy_after"]) == ["count", "vertical"]
    lines = stdout.splitlines()
    assert lines[0] == "held-out accuracy   before    after"
    assert lines[1].split() == [
        "count",
        f"{before['accuracy_before']['count']:.4f}",
        f"{after['accuracy_after']['count']:.4f}",
    ]
    assert lines[2].split()[0] == "vertical"
    assert lines[-1] == f"eval_accuracy: {result.eval_accuracy:.4f}"
    # The final eval asks the taught skill only (vertical by default): top or bottom.
    assert after["accuracy_after"]["vertical"] == result.eval_accuracy


def test_bad_training_record_fails_fast_with_its_number_and_leaves_no_run(tmp_path):
    (tmp_path / "data.jsonl").write_text(
        json.dumps({"image": "missing.png", "question": "q?", "answer": "a"}) + "\n"
    )
    config = tiny_config(
        tmp_path / "out", train_data=str(tmp_path / "data.jsonl"), on_bad_record="fail"
    )
    with pytest.raises(BadRecordError, match=r"record 1: image .*missing\.png.* does not exist"):
        train(config)
    assert not (tmp_path / "out" / "train_config.json").exists()


def test_lora_targets_split_language_vision_and_projector(processor):
    from ascend_vlm.default_model import load_default_model

    model, _ = load_default_model()
    language = lora_target_modules(model)
    assert language and all(".language_model." in name for name in language)
    assert {name.rsplit(".", 1)[1] for name in language} == set(LANGUAGE_PROJECTIONS)
    with_vision = lora_target_modules(model, vision=True)
    vision = set(with_vision) - set(language)
    assert vision and all(".visual.blocks." in name for name in vision)
    projector = set(lora_target_modules(model, projector=True)) - set(language)
    assert projector and all(".visual.merger." in name for name in projector)
    with pytest.raises(ValueError, match="lora_targets: expected names of linear layers"):
        lora_target_modules(model, ("no_such_proj",))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_steps", 0, "max_steps: expected a positive int"),
        ("comm_hook", "dense", "comm_hook: expected one of"),
        ("warmup_steps", -1, "warmup_steps: expected an int >= 0"),
        ("dtype", "fp16", "dtype: expected one of \\('fp32', 'bf16'\\), got 'fp16'"),
        ("eval_question_types", ("up",), "eval_question_types: expected distinct names"),
        ("report_question_types", ("up",), "report_question_types: expected distinct names"),
        ("quantize", 3, r"quantize: expected one of \(8, 4\) bits, got 3"),
    ],
)
def test_bad_config_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_a_quantized_base_trains_lora_and_its_card_loads_it_onto_the_same(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.quantization import QuantizationConfig, QuantLinear, quantize

    config = tiny_config(tmp_path / "qlora", quantize=4, patch=True, max_steps=2)
    result = train(config)
    assert [record["step"] for record in _step_records(tmp_path / "qlora")] == [1, 2]
    assert math.isfinite(result.last_loss)
    adapter = tmp_path / "qlora" / FINAL_ADAPTER
    card = (adapter / "README.md").read_text()
    assert "weight-only quantized (W4 g128, RTN) and frozen" in card
    assert "quantize(base, QuantizationConfig(bits=4, group_size=128))" in card
    base = AutoModelForImageTextToText.from_pretrained(default_model_path())
    quantize(base, QuantizationConfig(bits=4, group_size=128), progress=False)
    model = PeftModel.from_pretrained(base, adapter)
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert adapted and all(isinstance(m.base_layer, QuantLinear) for m in adapted)
    with pytest.raises(ValueError, match="quantize: expected LoRA without save_merged"):
        TrainConfig(quantize=4, full_finetune=True)


def test_a_merged_copy_needs_lora():
    with pytest.raises(ValueError, match="save_merged: expected only with LoRA"):
        TrainConfig(full_finetune=True, save_merged="merged")


def test_without_a_model_path_a_torchrun_job_needs_the_built_reference(tmp_path, monkeypatch):
    from ascend_vlm.finetune.reference_model import base_model_path

    monkeypatch.setenv("ASCEND_VLM_CACHE", str(tmp_path))
    assert base_model_path("/models/mine", world_size=2) == "/models/mine"
    with pytest.raises(FileNotFoundError, match="python -m ascend_vlm reference-model"):
        base_model_path(None, world_size=2)


def test_learning_rate_warms_up_from_a_nonzero_first_step_and_decays_past_the_last():
    peak = 0.01
    assert [scheduled_lr(s, peak, 1, 4) for s in (1, 2, 3, 4)] == pytest.approx(
        [
            peak,
            peak * (1 + math.cos(math.pi / 4)) / 2,
            peak / 2,
            peak * (1 - math.cos(math.pi / 4)) / 2,
        ]
    )
    assert [scheduled_lr(s, peak, 4, 6) for s in (1, 2, 3, 4)] == pytest.approx(
        [peak / 4, peak / 2, 3 * peak / 4, peak]
    )
    assert scheduled_lr(6, peak, 4, 6) == pytest.approx(peak / 4)  # cos(2 pi / 3) = -1/2
    assert scheduled_lr(1, peak, 0, 3) == pytest.approx(peak * (1 + math.cos(math.pi / 4)) / 2)
    assert scheduled_lr(2, peak, 50, 2) == pytest.approx(peak)  # warm-up capped at max_steps


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run of 3 steps stopped after 2 (checkpoint every step), launched from its own folder
    with a relative --model-path (a link to the default model)."""
    root = tmp_path_factory.mktemp("stopped")
    (root / "base").symlink_to(default_model_path(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        config = tiny_config(
            root / "run",
            model_path="base",
            train_size=8,
            max_steps=3,
            save_every=1,
            stop_after_steps=2,
        )
        train(config)
    return root


def _resumable_copy(stopped_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(stopped_run / "run", run)
    return run


def _resume_config(run: Path, stopped_run: Path, **overrides) -> TrainConfig:
    settings = {"model_path": str(stopped_run / "base"), "train_size": 8, "max_steps": 3}
    settings.update(save_every=1, resume="latest")
    return tiny_config(run, **{**settings, **overrides})


@pytest.mark.slow
def test_first_step_runs_at_the_warmed_up_learning_rate(stopped_run):
    records = _step_records(stopped_run / "run")
    assert [r["lr"] for r in records] == pytest.approx(
        [5e-3, 5e-3 * (1 + math.cos(math.pi / 3)) / 2]
    )
    assert not any("comm_bytes_saved" in r for r in records)  # one process: no all-reduce


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ({"lora_r": 8}, ["--lora-r: saved 16, got 8; it defines which weights are trained"]),
        (
            {"batch_size": 2, "lora_targets": ("q_proj", "v_proj")},
            [
                "--batch-size: saved 4, got 2; the saved data position and batches follow it",
                "--lora-targets: saved ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', "
                "'up_proj', 'down_proj'], got ['q_proj', 'v_proj']; it defines which weights",
            ],
        ),
        (
            {"learning_rate": 1e-3},
            ["--learning-rate: saved 0.005, got 0.001; the saved optimizer state and"],
        ),
        (
            {"max_steps": 1},
            [
                "--max-steps: saved 3, got 1; expected at least 2, the steps the LoRA phase has "
                "already trained (a larger count continues training)"
            ],
        ),
    ],
)
def test_resume_refuses_incompatible_changes_and_keeps_the_saved_run(
    stopped_run, tmp_path, overrides, refused
):
    run = _resumable_copy(stopped_run, tmp_path)
    saved = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ResumeError) as error:
        train(_resume_config(run, stopped_run, **overrides))
    message = str(error.value)
    assert message.startswith("resume: the saved run cannot continue with changed settings:\n")
    assert message.endswith(
        f"Resume with the saved values ({run / 'train_config.json'}), or start a new run in "
        "another --output-dir."
    )
    lines = message.splitlines()[1:-1]
    assert len(lines) == len(refused)
    for line, expected in zip(lines, refused, strict=True):
        assert line.startswith(f"  {expected}")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == saved


@pytest.mark.slow
def test_a_new_run_into_a_saved_run_folder_is_refused(stopped_run, tmp_path):
    run = _resumable_copy(stopped_run, tmp_path)
    saved = (run / "train_config.json").read_bytes()
    with pytest.raises(ResumeError, match=r"output_dir: expected a folder without a saved run"):
        train(_resume_config(run, stopped_run, resume=None))
    assert (run / "train_config.json").read_bytes() == saved


@pytest.mark.slow
def test_resume_with_more_steps_continues_logs_it_and_writes_the_model_card(
    stopped_run, tmp_path, caplog
):
    run = _resumable_copy(stopped_run, tmp_path)
    with caplog.at_level(logging.INFO, logger="ascend_vlm.finetune.run_settings"):
        result = train(_resume_config(run, stopped_run, max_steps=4, stop_after_steps=None))
    assert (
        "resume: --max-steps 3 -> 4: the LoRA phase continues from step 2 to step 4; its "
        "learning-rate schedule is recomputed to end at 4"
    ) in caplog.messages
    records = _step_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records[2:]] == pytest.approx(
        [scheduled_lr(3, 5e-3, 1, 4), scheduled_lr(4, 5e-3, 1, 4)]
    )
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["max_steps"] == 4 and saved["lora_r"] == 16 and saved["resume"] == "latest"

    base = str(stopped_run / "base")  # the relative --model-path, made absolute
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == base
    card = (run / "adapter" / "README.md").read_text()
    for expected in (
        f"---\nlibrary_name: peft\nbase_model: {base}\n---\n\n"
        "# LoRA adapter trained with ascend_vlm's `python -m ascend_vlm finetune`\n",
        "LoRA (r=16, alpha=32, dropout=0.0) on the language model's q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj linears. Trained in full and saved with the "
        "adapter: lm_head.",
        "- Train: ShapesVQA train split (ascend_vlm.data.shapes_vqa): 8 generated samples, "
        "data seed 0, 56 px images,",
        "- Eval: ShapesVQA eval split (ascend_vlm.data.shapes_vqa): 4 generated samples,",
        "- 4 optimizer steps of AdamW, seed 0.\n"
        "- Learning rate: peak 0.005, linear warm-up over 1 step, then cosine decay.\n"
        "- Weight decay 0, gradient clipping at 1.\n"
        "- Global batch 4 = 4 per rank x 1 accumulated x 1 rank.\n"
        f"- Loss of the last step: {records[-1]['loss']:.4g}.\n",
        f"on the 4 eval samples: {result.eval_accuracy:.4f}.",
        f'base = AutoModelForImageTextToText.from_pretrained("{base}")\n'
        f'model = PeftModel.from_pretrained(base, "{run / "adapter"}")',
    ):
        assert expected in card
