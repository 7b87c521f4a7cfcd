"""Adapters by ``model``: ``/v1/models`` lists the base and each adapter, and a request's
``model`` picks the adapter that answers, in a batch shared with the other adapters'."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from adapters.random_adapters import generate_with_adapter, random_adapter_set
from conftest import MODEL_NAME, chat_messages, running_server
from PIL import Image

from ascend_vlm.adapters import BASE_ADAPTER
from ascend_vlm.serving.conversion import ServedModels

NEW_TOKENS = 5


def test_the_model_field_picks_the_adapter(model_and_processor, tmp_path):
    base, processor = model_and_processor
    adapters = random_adapter_set(base, tmp_path, {"sketch": 11, "photo": 12})
    image = Image.new("RGB", (64, 64), "purple")
    question = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "what is it?"}]}]  # fmt: skip
    expected = {
        name: processor.tokenizer.decode(
            generate_with_adapter(adapters, processor, question, adapter, NEW_TOKENS),
            skip_special_tokens=True,
        )
        for name, adapter in ((MODEL_NAME, BASE_ADAPTER), ("sketch", "sketch"), ("photo", "photo"))
    }
    assert len(set(expected.values())) == 3
    served = ServedModels(MODEL_NAME, adapters.names, BASE_ADAPTER)
    with running_server(adapters.model, processor, adapters=adapters, served=served) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == [MODEL_NAME, "sketch", "photo"]

        def ask(name: str) -> str:
            answer = client.chat.completions.create(
                model=name, messages=chat_messages("what is it?", (image,)),
                max_tokens=NEW_TOKENS, temperature=0,
            )  # fmt: skip
            return answer.choices[0].message.content

        names = [MODEL_NAME, "sketch", "photo"] * 3
        with ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(ask, names))
    assert answers == [expected[name] for name in names]
