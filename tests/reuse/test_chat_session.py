"""`ChatSession` on the tiny default Qwen2-VL: every turn's greedy answer equals a from-scratch
``generate`` over the full conversation, only the new tokens are prefilled, and forks, reset,
the cache limit and bad inputs behave as documented."""

from __future__ import annotations

import contextvars
import copy

import pytest
import torch
from PIL import Image

from ascend_vlm.default_model import (
    ImageTextProcessor,
)
from ascend_vlm.reuse.chat_session import ChatSession

MAX_NEW = 8


def _image(colour: str, size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, colour)


def _encode(processor, messages: list[dict]):
    """The processor's inputs for the chat-template prompt of ``messages`` with all images."""
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [part["image"] for m in messages for part in m["content"] if part["type"] == "image"]
    return processor(text=[prompt], images=images or None, return_tensors="pt")


def _generate(model, processor, messages: list[dict]) -> tuple[torch.Tensor, int]:
    """Greedy ``model.generate`` from scratch over ``messages`` (ending with a user turn):
    the sequence and the prompt length."""
    inputs = _encode(processor, messages)
    output = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return output[0], inputs["input_ids"].shape[1]


def _assert_exact(model, processor, session: ChatSession, answer: str) -> None:
    sequence, prompt_length = _generate(model, processor, session.messages[:-1])
    expected = processor.tokenizer.decode(sequence[prompt_length:], skip_special_tokens=True)
    assert answer == expected
    assert session.messages[-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": answer}],
    }


TURNS_IMAGES_1_3 = [
    ("describe this image", [_image("red", (64, 64))]),
    ("which colour is it", []),
    ("how many shapes are there", [_image("blue", (100, 80))]),
]
TURNS_IMAGE_2 = [
    ("hello", []),
    ("what is in this picture", [_image("green", (80, 112))]),
    ("is it left or right", []),
]


MODELS = {
    "qwen2_vl": "model_and_processor",
    "qwen2_vl-saved-processor": "saved_model_and_processor",
    "llava": "llava_and_processor",
    "glm4v": "glm4v_and_processor",
    "glm46v": "glm46v_and_processor",
    "glm4v_moe": "glm4v_moe_and_processor",
    "paddleocr_vl": "paddleocr_vl_and_processor",
}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("turns", [TURNS_IMAGES_1_3, TURNS_IMAGE_2], ids=["images-1-3", "image-2"])
def test_each_turn_matches_generate_over_the_full_conversation(request, family, turns):
    model, processor = request.getfixturevalue(MODELS[family])
    session = ChatSession(model, processor)
    for text, images in turns:
        answer = session.ask(text, images, max_new_tokens=MAX_NEW)
        _assert_exact(model, processor, session, answer)
    assert len(session.messages) == 2 * len(turns)


def test_later_turns_prefill_only_the_new_tokens(model_and_processor):
    model, processor = model_and_processor
    seen: list[int] = []

    def count(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append(hidden.shape[1])

    session = ChatSession(model, processor)
    session.ask(*TURNS_IMAGES_1_3[0], max_new_tokens=MAX_NEW)
    # The cache holds the first prompt and the answer as generated (the last token is never fed).
    generated, first_prompt_length = _generate(model, processor, session.messages[:1])
    assert session.cached_tokens == generated.numel() - 1
    first_layer = model.model.language_model.layers[0]
    handle = first_layer.register_forward_pre_hook(count, with_kwargs=True)
    try:
        session.ask(*TURNS_IMAGES_1_3[2], max_new_tokens=MAX_NEW)
    finally:
        handle.remove()
    prompt = _encode(processor, session.messages[:-1])["input_ids"][0]
    held = generated[:-1]
    n = min(prompt.numel(), held.numel())
    differ = (prompt[:n] != held[:n]).nonzero()
    reused = int(differ[0, 0]) if differ.numel() else n
    assert reused > first_prompt_length
    assert seen[0] == prompt.numel() - reused  # the prefill: only what the cache lacks
    assert all(length == 1 for length in seen[1:])


def test_ask_stream_yields_the_answer_and_records_the_turn(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    session.ask(*TURNS_IMAGES_1_3[0], max_new_tokens=MAX_NEW)
    expected = session.fork().ask(*TURNS_IMAGES_1_3[2], max_new_tokens=MAX_NEW)
    pieces = list(session.ask_stream(*TURNS_IMAGES_1_3[2], max_new_tokens=MAX_NEW))
    assert "".join(pieces) == expected
    assert session.messages[-1]["content"][0]["text"] == expected
    assert len(session.messages) == 4


def test_ask_stream_closed_early_records_nothing(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    session.ask(*TURNS_IMAGES_1_3[0], max_new_tokens=MAX_NEW)
    before = session.messages
    held, _ = _generate(model, processor, before[:1])
    held = held[:-1]  # the cached ids: the last generated token is never fed
    assert session.cached_tokens == held.numel()
    stream = session.ask_stream("which colour", max_new_tokens=MAX_NEW)
    next(stream)
    stream.close()
    assert session.messages == before
    # The cache is back to what the turn started from: the prefix of the held ids that the
    # turn's prompt shares (the answer re-tokenized from its text may differ at its end).
    user = {"role": "user", "content": [{"type": "text", "text": "which colour"}]}
    prompt = _encode(processor, [*before, user])["input_ids"][0]
    n = min(prompt.numel(), held.numel())
    differ = (prompt[:n] != held[:n]).nonzero()
    reused = int(differ[0, 0]) if differ.numel() else n
    assert session.cached_tokens == reused
    assert all(layer.get_seq_length() == reused for layer in session._cache.layers)
    answer = session.ask(*TURNS_IMAGES_1_3[2], max_new_tokens=MAX_NEW)
    _assert_exact(model, processor, session, answer)


def test_fork_branches_independently(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    session.ask(*TURNS_IMAGES_1_3[0], max_new_tokens=MAX_NEW)
    branch = session.fork()
    assert branch.messages == session.messages
    assert branch.cached_tokens == session.cached_tokens

    answer = branch.ask(
        "what is in this picture", [_image("green", (80, 112))], max_new_tokens=MAX_NEW
    )
    assert len(branch.messages) == 4 and len(session.messages) == 2
    other = session.ask("is it left or right", max_new_tokens=MAX_NEW)
    _assert_exact(model, processor, session, other)
    assert session.messages[2]["content"][-1]["text"] == "is it left or right"
    # The branch's answer was computed from the cache copied before the original went on.
    _assert_exact(model, processor, branch, answer)
    assert branch.messages[2]["content"][-1]["text"] == "what is in this picture"
    answer = branch.ask("and the first one", max_new_tokens=MAX_NEW)
    _assert_exact(model, processor, branch, answer)


def test_reset_forgets_everything(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    session.ask(*TURNS_IMAGES_1_3[0], max_new_tokens=MAX_NEW)
    session.reset()
    assert session.messages == [] and session.cached_tokens == 0
    answer = session.ask(*TURNS_IMAGE_2[1], max_new_tokens=MAX_NEW)
    assert len(session.messages) == 2
    _assert_exact(model, processor, session, answer)


def test_max_cached_tokens_refuses_the_turn_without_changing_anything(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor, max_cached_tokens=60)
    session.ask("hello", max_new_tokens=MAX_NEW)
    before, held = session.messages, session.cached_tokens
    with pytest.raises(ValueError, match=r"max_cached_tokens.*needs \d+ .*limit of 60.*reset\(\)"):
        session.ask("what is in this picture", [_image("green", (80, 112))], max_new_tokens=20)
    assert session.messages == before and session.cached_tokens == held


def _generation_config(**settings):
    from transformers import GenerationConfig

    return GenerationConfig(**settings)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s: s.ask(3), TypeError, "text: expected a str"),
        (lambda s: s.ask("hi", images="x.png"), TypeError, "images: expected None"),
        (lambda s: s.ask("hi", images=[torch.zeros(3, 8, 8)]), TypeError, r"images\[0\]"),
        (lambda s: s.ask("hi", max_new_tokens=0), ValueError, "max_new_tokens: expected an int"),
        (lambda s: s.ask("hi", max_new_tokens=2.0), TypeError, "max_new_tokens"),
        (lambda s: s.ask("hi", streamer=object()), TypeError, "streamer are set by ChatSession"),
        (lambda s: s.ask("hi", num_beams=2), ValueError, "num_beams"),
        (lambda s: s.ask("hi", use_cache=False), TypeError, "use_cache are set by ChatSession"),
        (
            lambda s: s.ask("hi", generation_config=_generation_config(num_beams=2)),
            ValueError,
            r"num_beams: .*got 2 \(from generation_config\)",
        ),
        (
            lambda s: s.ask(
                "hi", generation_config=_generation_config(do_sample=True, num_return_sequences=2)
            ),
            ValueError,
            r"num_return_sequences: .*got 2 \(from generation_config\)",
        ),
        (lambda s: next(s.ask_stream(None)), TypeError, "text: expected a str"),
    ],
    ids=[
        "text",
        "images-str",
        "images-tensor",
        "max-new-0",
        "max-new-float",
        "managed",
        "beams",
        "use-cache",
        "config-beams",
        "config-sequences",
        "stream",
    ],
)
def test_bad_arguments_are_named(model_and_processor, call, error, message):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    with pytest.raises(error, match=message):
        call(session)
    assert session.messages == [] and session.cached_tokens == 0


def test_constructor_checks(model_and_processor):
    model, processor = model_and_processor
    without_template = copy.copy(processor)
    without_template.chat_template = None
    without_template.tokenizer = copy.copy(processor.tokenizer)
    without_template.tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"processor: .*chat template"):
        ChatSession(model, without_template)
    with pytest.raises(ValueError, match="max_cached_tokens: expected None or an int"):
        ChatSession(model, processor, max_cached_tokens=0)
    with pytest.raises(TypeError, match="model: expected a Hugging Face model"):
        ChatSession(object(), processor)


def test_model_generation_config_beams_are_refused(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    saved = model.generation_config.num_beams
    model.generation_config.num_beams = 2
    try:
        with pytest.raises(ValueError, match=r"num_beams: .*\(from model.generation_config\)"):
            session.ask("hi", max_new_tokens=MAX_NEW)
        # An explicit value wins over the model's, as in generate.
        answer = session.ask("hi", max_new_tokens=MAX_NEW, num_beams=1)
    finally:
        model.generation_config.num_beams = saved
    _assert_exact(model, processor, session, answer)


def test_generation_config_use_cache_false_is_overridden(model_and_processor):
    model, processor = model_and_processor
    session = ChatSession(model, processor)
    config = _generation_config(use_cache=False, do_sample=False)
    for text, images in TURNS_IMAGES_1_3:
        answer = session.ask(text, images, max_new_tokens=MAX_NEW, generation_config=config)
        _assert_exact(model, processor, session, answer)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_error_inside_the_model_leaves_the_session_usable(model_and_processor, error):
    """An error in the last decoder layer during the prefill leaves the earlier layers holding
    part of the turn; the session crops every layer back and the next turn is still exact."""
    model, processor = model_and_processor
    layers = model.model.language_model.layers
    session = ChatSession(model, processor)
    session.ask(*TURNS_IMAGES_1_3[0], max_new_tokens=MAX_NEW)
    before = session.messages
    first_prompt = _encode(processor, before[:1])["input_ids"].shape[1]

    def fail(module, args):
        raise error("inside the model")

    handle = layers[-1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(error, match="inside the model"):
            session.ask(*TURNS_IMAGES_1_3[2], max_new_tokens=MAX_NEW)
    finally:
        handle.remove()
    assert session.messages == before
    # Every layer holds the same prefix of the earlier turn (the last layer was never reached
    # in the failed prefill; cropping each layer by the first's excess emptied it).
    held = session.cached_tokens
    assert held >= first_prompt
    assert [layer.get_seq_length() for layer in session._cache.layers] == [held] * len(layers)
    for text, images in TURNS_IMAGES_1_3[1:]:
        answer = session.ask(text, images, max_new_tokens=MAX_NEW)
        _assert_exact(model, processor, session, answer)


def test_ask_stream_runs_generate_in_the_callers_context(model_and_processor):
    model, processor = model_and_processor
    variable = contextvars.ContextVar("request", default="unset")
    seen: list[str] = []

    def record(module, args):
        seen.append(variable.get())

    session = ChatSession(model, processor)
    token = variable.set("request-1")
    handle = model.model.language_model.layers[0].register_forward_pre_hook(record)
    try:
        answer = "".join(session.ask_stream("hello", max_new_tokens=MAX_NEW))
    finally:
        handle.remove()
        variable.reset(token)
    assert seen and set(seen) == {"request-1"}
    _assert_exact(model, processor, session, answer)


def test_peft_wrapped_model_matches_generate(model_and_processor):
    peft = pytest.importorskip("peft")
    model, processor = model_and_processor
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapped = peft.get_peft_model(copy.deepcopy(model), config).eval()
    session = ChatSession(wrapped, processor)
    assert session._rope_index is not None  # the M-RoPE path, through get_base_model()
    turns = [TURNS_IMAGES_1_3[0], TURNS_IMAGES_1_3[2]]
    for text, images in turns:
        answer = session.ask(text, images, max_new_tokens=MAX_NEW)
        _assert_exact(wrapped, processor, session, answer)


class _BudgetProcessor(ImageTextProcessor):
    """Gives each image a pixel budget that depends on how many images the prompt has, as
    processors that share a budget across images do: an earlier image's token count changes
    when a later turn adds an image."""

    def __init__(self, tokenizer, one, several) -> None:
        super().__init__(tokenizer, one)
        self._one, self._several = one, several

    def __call__(self, text, images=None, **kwargs):
        self.image_processor = self._one if len(images or []) <= 1 else self._several
        return super().__call__(text, images, **kwargs)


@pytest.mark.parametrize("change", ["shrinks", "grows"])
def test_earlier_image_whose_tokens_change_is_prefilled_again(model_and_processor, change):
    """Turn 2 adds an image, and the first image's token count changes (16 <-> 4 tokens): the
    cached ids match the new prompt up to (shrinks) or into (grows) the first image's tokens,
    and the session prefills again from the first image's start, passing its pixels."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    model, processor = model_and_processor
    small = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    large = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    one, several = (large, small) if change == "shrinks" else (small, large)
    budget = _BudgetProcessor(processor.tokenizer, one, several)
    seen: list[int] = []

    def count(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append(hidden.shape[1])

    session = ChatSession(model, budget)
    answer = session.ask("describe this image", [_image("red", (112, 112))], max_new_tokens=MAX_NEW)
    _assert_exact(model, budget, session, answer)
    handle = model.model.language_model.layers[0].register_forward_pre_hook(count, with_kwargs=True)
    try:
        answer = session.ask("and this one", [_image("blue", (112, 112))], max_new_tokens=MAX_NEW)
    finally:
        handle.remove()
    _assert_exact(model, budget, session, answer)
    prompt = _encode(budget, session.messages[:-1])["input_ids"][0]
    first_image = int((prompt == processor.image_token_id).nonzero()[0, 0])
    assert seen[0] == prompt.numel() - first_image


def test_images_changed_in_place_after_a_turn_do_not_reach_the_session(model_and_processor):
    model, processor = model_and_processor
    image = _image("red", (112, 112))
    session = ChatSession(model, processor)
    session.ask("describe this image", [image], max_new_tokens=MAX_NEW)
    image.thumbnail((56, 56))  # in place: 4 image tokens instead of 16 if it were re-read
    assert session.messages[0]["content"][0]["image"].size == (112, 112)
    answer = session.ask("which colour is it", max_new_tokens=MAX_NEW)
    _assert_exact(model, processor, session, answer)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_later_qwen_generations_match_generate(request, family):
    model, processor = request.getfixturevalue(f"{family}_and_processor")
    session = ChatSession(model, processor)
    for text, images in TURNS_IMAGES_1_3:
        answer = session.ask(text, images, max_new_tokens=MAX_NEW)
        _assert_exact(model, processor, session, answer)


def test_a_patched_model_on_the_mock_npu_matches_generate(model_and_processor, mock_npu):
    import copy

    import ascend_vlm

    base, processor = model_and_processor
    model = copy.deepcopy(base)
    ascend_vlm.patch(model)
    session = ChatSession(model, processor)
    for text, images in TURNS_IMAGES_1_3:
        answer = session.ask(text, images, max_new_tokens=MAX_NEW)
        _assert_exact(model, processor, session, answer)
