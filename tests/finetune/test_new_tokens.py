"""Fine-tuning with new visual tokens and a named adapter: only the new rows and LoRA train,
the saved adapter carries its tokens and reloads to the trained model, bad settings are
named."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from tiny_finetune import tiny_config

from ascend_vlm.adapters import AdapterSet, load_visual_tokens
from ascend_vlm.adapters.visual_vocabulary import VISUAL_TOKENS_FILE
from ascend_vlm.data.shapes_vqa import KINDS, NEW_SHAPE_KINDS
from ascend_vlm.data.vqa import EncodedDataset, collate, pad_token_id_of
from ascend_vlm.finetune.config import FINAL_ADAPTER
from ascend_vlm.finetune.held_out import model_inputs
from ascend_vlm.finetune.metrics_log import METRICS_FILE
from ascend_vlm.finetune.model_setup import load_base_model
from ascend_vlm.finetune.train import train

TOKENS = ("<star>", "<cross>")
NEW_TOKEN_SETTINGS = {
    "adapter_name": "shapes",
    "new_tokens": TOKENS,
    "shapes_new_kinds": True,
    "modules_to_save": (),
    "question_types": ("shape", "colour"),
    "eval_question_types": ("shape",),
}


@pytest.fixture(scope="module")
def new_token_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("new_tokens")
    config = tiny_config(output_dir, **NEW_TOKEN_SETTINGS)
    result = train(config)
    return SimpleNamespace(config=config, result=result, adapter=output_dir / FINAL_ADAPTER)


def _batch(processor, config) -> dict[str, torch.Tensor]:
    samples = config.shapes_dataset("eval", 4, ("shape", "colour"))
    encoded = EncodedDataset(samples, processor)
    batch = collate([encoded[i] for i in range(len(samples))], pad_token_id_of(processor))
    return model_inputs(batch, torch.device("cpu"))


def test_training_mixes_base_and_new_kinds_and_eval_shows_the_new_ones(new_token_run):
    config = new_token_run.config
    train_kinds, eval_kinds = set(), set()
    for split, kinds in (("train", train_kinds), ("eval", eval_kinds)):
        samples = config.shapes_dataset(split, 40, ("shape",))
        for index in range(len(samples)):
            (shape,) = samples.scene(index)[0]
            kinds.add(shape.kind)
            expected = dict(zip(NEW_SHAPE_KINDS[:2], TOKENS, strict=True)).get(
                shape.kind, shape.kind
            )
            assert samples[index].answer == expected
    assert train_kinds == set(KINDS) | set(NEW_SHAPE_KINDS[:2])
    assert eval_kinds == set(NEW_SHAPE_KINDS[:2])


def test_only_the_new_rows_and_lora_train_and_the_base_stays_bit_identical(new_token_run):
    trained = new_token_run.result.model
    config = new_token_run.config
    fresh, processor = load_base_model(config.model_path, torch.device("cpu"))
    base = dict(trained.base_model.model.named_parameters())
    trainable = {name for name, p in trained.named_parameters() if p.requires_grad}
    assert trainable and all(
        "lora_" in name or "trainable_tokens_delta" in name for name in trainable
    )
    old = len(processor.tokenizer)
    for name, param in fresh.named_parameters():
        # PEFT keeps each wrapped layer's original weight as base_layer / token_adapter's.
        candidates = [
            key
            for key in base
            if key.replace(".base_layer", "").replace(".token_adapter", "") == name
        ]
        assert candidates, name
        kept = base[candidates[0]]
        if kept.shape != param.shape:  # the grown embedding: its old rows are the base's
            kept = kept[:old]
            param = param[:old]
        assert torch.equal(kept, param), name


def test_saved_adapter_reloads_with_its_tokens_onto_a_fresh_base(new_token_run):
    adapter = new_token_run.adapter
    files = {path.name for path in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", VISUAL_TOKENS_FILE} <= files
    saved = json.loads((adapter / VISUAL_TOKENS_FILE).read_text())
    assert saved["tokens"] == list(TOKENS)

    config = new_token_run.config
    trained = new_token_run.result.model.eval()
    inputs = _batch(new_token_run.result.processor, config)
    fresh, processor = load_base_model(config.model_path, torch.device("cpu"))
    load_visual_tokens(fresh, processor, adapter)
    adapters = AdapterSet(fresh)
    adapters.load(config.adapter_name, adapter)
    adapters.activate(config.adapter_name)
    assert torch.equal(_batch(processor, config)["input_ids"], inputs["input_ids"])
    with torch.no_grad():
        expected = trained(**inputs).logits
        got = adapters.model(**inputs).logits
    assert torch.equal(got, expected)


def test_the_model_card_loads_the_named_adapter_with_its_tokens(new_token_run):
    card = (new_token_run.adapter / "README.md").read_text()
    assert "New tokens `<star>`, `<cross>`" in card
    assert "the new kinds: star as `<star>`, cross as `<cross>`" in card
    assert "shape, colour questions about scenes of one shape (count: one to four)" in card
    code = card.split("```python\n")[1].split("```")[0]
    namespace: dict = {}
    exec(code, namespace)  # the card's loading snippet, as a user would run it
    model = namespace["model"].eval()
    assert model.active_adapter == "shapes"
    inputs = _batch(namespace["processor"], new_token_run.config)
    with torch.no_grad():
        expected = new_token_run.result.model.eval()(**inputs).logits
        assert torch.equal(model(**inputs).logits, expected)


def test_metrics_report_the_whole_tables_bytes_a_run_avoids(new_token_run):
    out = new_token_run.adapter.parent
    steps = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    steps = [record for record in steps if "loss" in record]
    assert len(steps) == new_token_run.config.max_steps
    # One process communicates nothing; the field is there for multi-rank runs.
    assert all(record["comm_bytes_whole_tables"] == 0 for record in steps)


def _losses(output_dir) -> dict[int, float]:
    lines = (output_dir / METRICS_FILE).read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_a_stopped_new_token_run_resumes_to_the_same_losses_and_rows(new_token_run, tmp_path):
    import dataclasses

    config = tiny_config(tmp_path, **NEW_TOKEN_SETTINGS, save_every=1, stop_after_steps=2)
    train(config)
    resumed = train(dataclasses.replace(config, stop_after_steps=None, resume="latest"))
    assert _losses(tmp_path) == _losses(new_token_run.adapter.parent)
    expected = dict(new_token_run.result.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"full_finetune": True}, "new_tokens: expected LoRA training"),
        ({"train_data": "x.jsonl"}, "shapes_new_kinds: expected ShapesVQA training data"),
        (
            {"new_tokens": ("<a>", "<b>", "<c>", "<d>", "<e>")},
            "new_tokens: new kind names: expected at most 4",
        ),
        ({"adapter_name": "__base__"}, "adapter_name: expected an adapter name of letters"),
        ({"adapter_name": "v1.2"}, "adapter_name: expected an adapter name of letters"),
        ({"adapter_name": "lora"}, "part of PEFT's 'lora_' prefix"),
        ({"modules_to_save": ("lm_head",)}, "modules_to_save: expected none with new_tokens"),
        ({"modules_to_save": ("language_model.embed_tokens",)}, "expected none with new_tokens"),
        ({"new_tokens": "<star>"}, "new_tokens: expected a sequence of token strings"),
        ({"new_tokens": ("<star>", "<star>")}, "new_tokens: expected distinct non-empty"),
        ({"new_tokens": ("<star>", " ")}, "new_tokens: expected distinct non-empty"),
        ({"new_tokens": ("circle",)}, "kind_names: expected distinct"),
    ],
)
def test_bad_new_token_settings_are_named(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, **{**NEW_TOKEN_SETTINGS, **overrides})


def test_tokens_no_training_record_mentions_are_refused(tmp_path):
    settings = {**NEW_TOKEN_SETTINGS, "shapes_new_kinds": False}
    with pytest.raises(ValueError, match=r"none for \['<star>', '<cross>'\]"):
        train(tiny_config(tmp_path, **settings))


def test_whole_table_bytes_count_the_embedding_and_an_untied_head(new_token_run):
    from ascend_vlm.finetune.model_setup import whole_table_bytes

    model = new_token_run.result.model
    embedding = model.get_input_embeddings().weight
    rows, hidden = embedding.shape
    tied = model.get_output_embeddings().weight is embedding
    assert whole_table_bytes(model, 1) == 0
    assert whole_table_bytes(model, 2) == (1 if tied else 2) * rows * hidden * 4
