"""Private visual vocabulary: new tokens' ids and rows (from vectors and from example images),
tied and untied output heads, training only the new rows with PEFT's trainable tokens, the
save/load round trip onto a fresh base, and the refusals."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from ascend_vlm.adapters.visual_vocabulary import (
    VISUAL_TOKENS_FILE,
    VisualTokens,
    add_visual_tokens,
    load_visual_tokens,
    save_visual_tokens,
    trainable_token_indices,
)

TOKENS = ("<defect-17>", "<logo>")
TEXT = "a red <defect-17> circle left of the <logo> square"
PLAIN_TEXT = "a red circle left of the blue square"


def _copy(pair):
    """A private copy of a session fixture's (model, processor)."""
    model, processor = pair
    return copy.deepcopy(model), copy.deepcopy(processor)


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tied(model) -> bool:
    head = model.get_output_embeddings()
    return head.weight is model.get_input_embeddings().weight


@pytest.fixture(scope="module")
def tied_model_and_processor(model_and_processor):
    """The default model's architecture with ``tie_word_embeddings=True`` (random weights): in
    transformers 5 the top-level config's flag decides tying, and PEFT reads the same flag."""
    base, processor = model_and_processor
    config = copy.deepcopy(base.config)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = type(base)(config).eval()
    return model, processor


@pytest.fixture(scope="module", params=["untied", "tied"])
def variant(request, model_and_processor, tied_model_and_processor):
    """(model, processor) with an untied output head (the default model's) or a tied one."""
    pair = model_and_processor if request.param == "untied" else tied_model_and_processor
    assert _tied(pair[0]) == (request.param == "tied")
    return pair


def _vectors(hidden: int) -> torch.Tensor:
    return torch.randn(len(TOKENS), hidden, generator=torch.Generator().manual_seed(1))


def test_vectors_become_the_new_rows_and_old_ids_and_rows_stay(variant):
    model, processor = _copy(variant)
    tokenizer = processor.tokenizer
    vocabulary = tokenizer.get_vocab()
    plain_ids = tokenizer(PLAIN_TEXT).input_ids
    embedding = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    old, hidden = embedding.shape
    vectors = _vectors(hidden)

    visual = add_visual_tokens(model, processor, TOKENS, vectors=vectors)

    ids = (old, old + 1)
    assert visual == VisualTokens(TOKENS, ids, old + 2)
    for token, token_id in zip(TOKENS, ids, strict=True):
        assert tokenizer(token).input_ids == [token_id]
        assert tokenizer.decode([token_id]) == token
    assert ids[0] in tokenizer(TEXT).input_ids and ids[1] in tokenizer(TEXT).input_ids
    assert tokenizer(PLAIN_TEXT).input_ids == plain_ids
    assert {t: i for t, i in tokenizer.get_vocab().items() if t not in TOKENS} == vocabulary

    new_embedding = model.get_input_embeddings().weight
    new_head = model.get_output_embeddings().weight
    assert new_embedding.shape == (old + 2, hidden) and new_head.shape == (old + 2, hidden)
    assert model.config.get_text_config().vocab_size == old + 2
    assert torch.equal(new_embedding[:old], embedding)
    assert torch.equal(new_head[:old], head)
    assert torch.equal(new_embedding[old:], vectors)
    if _tied(variant[0]):
        assert _tied(model)
    else:
        assert not _tied(model)
        # Untied: the new logits start at the mean of the old ones.
        assert torch.equal(new_head[old:], head.mean(0).expand(2, -1))


def test_padded_vocabulary_gives_its_unused_rows_to_the_new_tokens(model_and_processor):
    model, processor = _copy(model_and_processor)
    known = len(processor.tokenizer)
    model.resize_token_embeddings(known + 8, mean_resizing=False)
    embedding = model.get_input_embeddings().weight.detach().clone()
    vectors = _vectors(embedding.shape[1])

    visual = add_visual_tokens(model, processor, TOKENS, vectors=vectors)

    assert visual == VisualTokens(TOKENS, (known, known + 1), known + 8)
    weight = model.get_input_embeddings().weight
    assert weight.shape == embedding.shape
    assert torch.equal(weight[known : known + 2], vectors)
    assert torch.equal(weight[:known], embedding[:known])
    assert torch.equal(weight[known + 2 :], embedding[known + 2 :])


@pytest.mark.parametrize(
    ("fixture", "sizes"),
    [
        ("model_and_processor", [(56, 56), (84, 56), (56, 112)]),
        ("llava_and_processor", [(16, 16)] * 3),
    ],
)
def test_examples_give_the_mean_projected_visual_feature(request, fixture, sizes):
    model, processor = _copy(request.getfixturevalue(fixture))
    images = [_image(seed, *size) for seed, size in enumerate(sizes)]
    examples = {TOKENS[0]: images[:2], TOKENS[1]: images[2:]}
    expected = []
    with torch.no_grad():
        for token in TOKENS:
            features = []
            for image in examples[token]:  # one image at a time, unlike the function
                pixels = processor.image_processor(images=[image], return_tensors="pt")
                output = model.model.get_image_features(**pixels).pooler_output
                features += [f.reshape(-1, f.shape[-1]) for f in output]
            expected.append(torch.cat(features).mean(0))
    assert not torch.allclose(expected[0], expected[1])
    model.train()

    visual = add_visual_tokens(model, processor, TOKENS, examples=examples)

    rows = model.get_input_embeddings().weight[list(visual.token_ids)]
    torch.testing.assert_close(rows, torch.stack(expected))
    assert model.training  # the caller's mode comes back


@pytest.fixture(scope="module")
def trained(variant):
    """The variant with TOKENS added from vectors, a LoRA adapter with trainable token rows,
    and three AdamW steps (lr 1e-2) of language-model loss on a text using the tokens."""
    from peft import LoraConfig, get_peft_model

    model, processor = _copy(variant)
    vectors = _vectors(model.get_input_embeddings().weight.shape[1])
    visual = add_visual_tokens(model, processor, TOKENS, vectors=vectors)
    head_init = model.get_output_embeddings().weight[list(visual.token_ids)].detach().clone()
    indices = trainable_token_indices(model, visual)
    params = dict(model.named_parameters())
    before = {name: param.detach().clone() for name, param in params.items()}

    config = LoraConfig(target_modules=["q_proj", "v_proj"], trainable_token_indices=indices)
    peft_model = get_peft_model(model, config)
    ids = processor.tokenizer([TEXT], return_tensors="pt").input_ids
    trainable = [param for param in peft_model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    for _ in range(3):
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return SimpleNamespace(
        processor=processor,
        vectors=vectors,
        visual=visual,
        head_init=head_init,
        indices=indices,
        params=params,
        before=before,
        peft_model=peft_model,
        ids=ids,
        tied=_tied(variant[0]),
        old=len(variant[1].tokenizer),
    )


def test_trainable_token_indices_name_the_embedding_and_an_untied_head(trained):
    ids = list(trained.visual.token_ids)
    expected = {"model.language_model.embed_tokens": ids}
    if not trained.tied:
        expected["lm_head"] = ids
    assert trained.indices == expected


def test_training_changes_only_the_new_rows(trained):
    old, ids = trained.old, list(trained.visual.token_ids)
    # Every base parameter, the full embedding and head included, is bit-identical.
    for name, param in trained.params.items():
        assert torch.equal(param, trained.before[name]), name

    # The wrappers' weight is the base weight with the trained rows written in.
    embedding = trained.peft_model.get_input_embeddings().weight
    head = trained.peft_model.get_output_embeddings().weight
    embedding_before = trained.before["model.language_model.embed_tokens.weight"]
    assert torch.equal(embedding[:old], embedding_before[:old])
    assert not torch.equal(embedding[ids], trained.vectors)
    if trained.tied:
        assert torch.equal(head, embedding)
    else:
        assert torch.equal(head[:old], trained.before["lm_head.weight"][:old])
        assert not torch.equal(head[ids], trained.head_init)

    merged = copy.deepcopy(trained.peft_model).merge_and_unload()
    assert torch.equal(merged.get_input_embeddings().weight, embedding)
    assert torch.equal(merged.get_output_embeddings().weight, head)
    assert _tied(merged) == trained.tied


def test_saved_adapter_and_tokens_restore_the_trained_model_on_a_fresh_base(
    trained, variant, tmp_path
):
    from peft import PeftModel
    from safetensors.torch import load_file

    trained.peft_model.save_pretrained(tmp_path)
    save_visual_tokens(trained.visual, trained.processor, tmp_path)
    files = sorted(path.name for path in tmp_path.iterdir())
    assert "adapter_model.safetensors" in files and VISUAL_TOKENS_FILE in files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth", ".pkl"))]
    # Only the K trained rows of the embedding (and an untied head) are stored, not the tables.
    rows = {
        key: tuple(tensor.shape)
        for key, tensor in load_file(tmp_path / "adapter_model.safetensors").items()
        if "lora_" not in key
    }
    hidden = trained.vectors.shape[1]
    assert sorted(rows.values()) == [(len(TOKENS), hidden)] * (1 if trained.tied else 2)

    fresh, processor = _copy(variant)
    assert load_visual_tokens(fresh, processor, tmp_path) == trained.visual
    ids = processor.tokenizer([TEXT], return_tensors="pt").input_ids
    assert torch.equal(ids, trained.ids)
    restored = PeftModel.from_pretrained(fresh, tmp_path).eval()
    trained.peft_model.eval()
    with torch.no_grad():
        expected = trained.peft_model(input_ids=ids).logits
        got = restored(input_ids=ids).logits
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def error_pair(model_and_processor):
    """A copy the refusals must leave unchanged."""
    return _copy(model_and_processor)


@pytest.mark.parametrize(
    ("tokens", "kwargs", "message"),
    [
        ([], {"vectors": 1}, "tokens: expected at least one token, got an empty sequence"),
        (
            "<logo>",
            {"vectors": 1},
            "tokens: expected a sequence of token strings, got str '<logo>'",
        ),
        (["<logo>", ""], {"vectors": 1}, "tokens: expected non-empty strings, got ['']"),
        (
            ["<logo>", "<a>", "<logo>"],
            {"vectors": 1},
            "tokens: expected distinct tokens, got duplicates ['<logo>']",
        ),
        (
            ["<logo>", "<|image_pad|>"],
            {"vectors": 1},
            "tokens: expected tokens not yet in the tokenizer's vocabulary, got ['<|image_pad|>']",
        ),
        (TOKENS, {}, "vectors, examples: expected exactly one of them, got neither"),
        (
            TOKENS,
            {"vectors": 1, "examples": {}},
            "vectors, examples: expected exactly one of them, got both",
        ),
        (
            TOKENS,
            {"vectors": torch.zeros(3, 128)},
            "vectors: expected a tensor of shape (2, 128) (tokens, hidden), got (3, 128)",
        ),
        (
            TOKENS,
            {"vectors": torch.zeros(2, 128, dtype=torch.float64)},
            "vectors: expected the embedding's dtype torch.float32, got torch.float64",
        ),
        (
            TOKENS,
            {"examples": {TOKENS[0]: [_image(0, 56, 56)]}},
            "examples: expected exactly the tokens ['<defect-17>', '<logo>'] as keys, got "
            "['<defect-17>'] (missing ['<logo>'], unknown [])",
        ),
        (
            TOKENS[:1],
            {"examples": {TOKENS[0]: [_image(0, 56, 56)], "<other>": [_image(1, 56, 56)]}},
            "unknown ['<other>']",
        ),
        (
            TOKENS,
            {"examples": [_image(0, 56, 56)]},
            "examples: expected a mapping token -> images, got list",
        ),
        (
            TOKENS,
            {"examples": {TOKENS[0]: [_image(0, 56, 56)], TOKENS[1]: []}},
            "examples: expected at least one image per token, got none for ['<logo>']",
        ),
    ],
)
def test_add_refuses_bad_input_before_changing_anything(error_pair, tokens, kwargs, message):
    model, processor = error_pair
    with pytest.raises(ValueError, match=re.escape(message)):
        add_visual_tokens(model, processor, tokens, **kwargs)
    assert len(processor.tokenizer) == 512
    assert model.get_input_embeddings().weight.shape[0] == 512


def test_load_refuses_another_base_a_repeat_and_a_folder_without_tokens(
    model_and_processor, tmp_path
):
    model, processor = _copy(model_and_processor)
    visual = add_visual_tokens(model, processor, TOKENS, vectors=_vectors(128))
    save_visual_tokens(visual, processor, tmp_path)

    with pytest.raises(ValueError, match=re.escape("tokens: expected tokens not yet in")):
        load_visual_tokens(model, processor, tmp_path)

    other, other_processor = _copy(model_and_processor)
    other.resize_token_embeddings(520, mean_resizing=False)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "model, processor: expected a base whose tokenizer puts ['<defect-17>', '<logo>'] "
            "at ids [512, 513] and whose embedding then has 514 rows, got ids [512, 513] and "
            "520 rows (a tokenizer of 512 tokens, an embedding of 520 rows); the tokens were "
            "saved for another base model"
        ),
    ):
        load_visual_tokens(other, other_processor, tmp_path)
    assert len(other_processor.tokenizer) == 512

    other_processor.tokenizer.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=re.escape("got ids [513, 514] and 520 rows")):
        load_visual_tokens(other, other_processor, tmp_path)

    with pytest.raises(
        FileNotFoundError, match=re.escape(f"folder: expected a folder with {VISUAL_TOKENS_FILE}")
    ):
        load_visual_tokens(other, other_processor, tmp_path / "missing")


def test_add_refuses_a_processor_larger_than_the_model(model_and_processor):
    model, processor = _copy(model_and_processor)
    processor.tokenizer.add_tokens(["<extra>"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "processor: expected a tokenizer no larger than the model's 512 embedding rows, "
            "got 513 tokens"
        ),
    ):
        add_visual_tokens(model, processor, TOKENS, vectors=_vectors(128))
    assert len(processor.tokenizer) == 513


def test_save_and_trainable_indices_refuse_tokens_of_another_model(model_and_processor, tmp_path):
    model, processor = model_and_processor
    visual = VisualTokens(TOKENS, (512, 513), 514)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "processor: expected a tokenizer mapping ['<defect-17>', '<logo>'] to [512, 513], "
            "got [None, None]"
        ),
    ):
        save_visual_tokens(visual, processor, tmp_path)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "visual: expected token ids below the model's 512 embedding rows, got [512, 513]"
        ),
    ):
        trainable_token_indices(model, visual)


def test_tying_that_peft_would_misread_or_a_resize_would_break_is_refused(
    model_and_processor, tied_model_and_processor, monkeypatch
):
    model, processor = _copy(model_and_processor)
    visual = add_visual_tokens(model, processor, TOKENS, vectors=_vectors(128))
    model.config.tie_word_embeddings = True
    with pytest.raises(
        ValueError,
        match=re.escape(
            "model: expected config.tie_word_embeddings to say whether the output head shares "
            "the embedding's weight (False), got True"
        ),
    ):
        trainable_token_indices(model, visual)

    # transformers 5.25 grows a tied weight in place, so the head cannot come apart; a resize
    # that unties it (as a custom or future one could) stands in here.
    model, processor = _copy(tied_model_and_processor)
    resize = model.resize_token_embeddings

    def untying_resize(*args, **kwargs):
        resize(*args, **kwargs)
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())

    monkeypatch.setattr(model, "resize_token_embeddings", untying_resize)
    with pytest.raises(RuntimeError, match="did not re-tie them"):
        add_visual_tokens(model, processor, TOKENS, vectors=_vectors(128))
