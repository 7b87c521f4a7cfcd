"""32 concurrent streaming clients with greedy decoding: each gets exactly the answer
``model.generate`` gives its request alone, while they share the running batch."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from chat_vlms import generate_alone
from PIL import Image
from served_vlm import MODEL_NAME, chat_messages

from ascend_vlm.batching import GenerationRequest

CLIENTS = 32
NEW_TOKENS = 6


def _questions() -> list[tuple[str, tuple[Image.Image, ...]]]:
    red, blue = Image.new("RGB", (64, 64), "red"), Image.new("RGB", (100, 80), "blue")
    green = Image.new("RGB", (80, 112), "green")
    return [
        ("hello there", ()),
        ("describe this", (red,)),
        ("compare them", (red, blue)),
        ("what is it", (green,)),
        ("a longer question about shapes and colours", ()),
        ("and this one", (blue,)),
        ("short", ()),
        ("which is bigger", (green, red)),
    ]


def test_concurrent_streams_each_equal_generate_alone(tiny_server, model_and_processor):
    model, processor = model_and_processor
    questions = _questions()
    expected = [
        processor.tokenizer.decode(
            generate_alone(
                model,
                processor,
                GenerationRequest.from_prompt(text, list(images), max_new_tokens=NEW_TOKENS),
            ),
            skip_special_tokens=True,
        )
        for text, images in questions
    ]
    client = tiny_server.client()

    def ask(index: int) -> tuple[str, list]:
        text, images = questions[index % len(questions)]
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=chat_messages(text, images), max_tokens=NEW_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    rows_seen, kv_seen = [], []
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(ask, index) for index in range(CLIENTS)]
        while not all(future.done() for future in futures):
            engine = tiny_server.engine
            rows_seen.append(engine.running_rows)
            kv_seen.append(engine.kv_tokens)
            time.sleep(0.01)  # a sample per step or so, leaving the cores to the server
        answers = [future.result() for future in futures]
    for index, (text, chunks) in enumerate(answers):
        assert text == expected[index % len(questions)], index
        assert chunks[-1].usage.completion_tokens <= NEW_TOKENS
    assert max(rows_seen) > 1  # the clients shared the running batch
    assert max(kv_seen) > 0  # the running rows held their tokens
