"""The server through the official ``openai`` client and raw HTTP on 127.0.0.1: answers equal
``generate``, streams end with a usage chunk and ``[DONE]``, images as data URLs, the models
list, OpenAI error objects naming the field or limit (400, 404, 413), and the metrics."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from chat_vlms import generate_alone
from PIL import Image
from served_vlm import MODEL_NAME, chat_messages, data_url

from ascend_vlm.batching import GenerationRequest

METRIC_NAMES = (
    "ascend_vlm_requests_total",
    "ascend_vlm_time_to_first_token_seconds",
    "ascend_vlm_time_per_output_token_seconds",
    "ascend_vlm_request_duration_seconds",
    "ascend_vlm_prompt_tokens_total",
    "ascend_vlm_visual_tokens_total",
    "ascend_vlm_generated_tokens_total",
    "ascend_vlm_queue_depth",
    "ascend_vlm_running_rows",
    "ascend_vlm_kv_bytes",
    "ascend_vlm_kv_tokens",
    "ascend_vlm_vision_cache_hits_total",
    "ascend_vlm_vision_cache_misses_total",
)

# A data URL whose payload is base64 of b"not-an-image".
BAD_IMAGE = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90LWFuLWltYWdl"}}
]}]  # fmt: skip


def _post(server, body: dict, **options) -> requests.Response:
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120, **options)


def test_a_greedy_answer_equals_generate_with_its_usage(tiny_server, model_and_processor):
    model, processor = model_and_processor
    expected = generate_alone(
        model, processor, GenerationRequest.from_prompt("hello there", max_new_tokens=6)
    )
    answer = tiny_server.client().chat.completions.create(
        model=MODEL_NAME, messages=chat_messages("hello there"), max_tokens=6, temperature=0
    )
    text = processor.tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.completion_tokens == len(expected)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert answer.usage.prompt_tokens == len(processor.tokenizer(prompt)["input_ids"])
    assert answer.usage.prompt_tokens_details.image_tokens == 0
    assert answer.model == MODEL_NAME and answer.object == "chat.completion"


def test_an_image_as_a_data_url_counts_its_visual_tokens(tiny_server, model_and_processor):
    model, processor = model_and_processor
    image = Image.new("RGB", (64, 64), "red")
    expected = generate_alone(
        model, processor, GenerationRequest.from_prompt("what colour?", [image], max_new_tokens=5)
    )
    answer = tiny_server.client().chat.completions.create(
        model=MODEL_NAME, messages=chat_messages("what colour?", (image,)), max_tokens=5,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.content == processor.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    image_tokens = answer.usage.prompt_tokens_details.image_tokens
    assert 0 < image_tokens < answer.usage.prompt_tokens


def test_a_stream_sends_deltas_a_usage_chunk_and_done(tiny_server, model_and_processor):
    model, processor = model_and_processor
    expected = generate_alone(
        model, processor, GenerationRequest.from_prompt("count", max_new_tokens=7)
    )
    stream = tiny_server.client().chat.completions.create(
        model=MODEL_NAME, messages=chat_messages("count"), max_tokens=7, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == processor.tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    # Raw: every event is "data: <json>", the last "data: [DONE]"; without include_usage the
    # finish chunk carries the usage.
    body = {"model": MODEL_NAME, "messages": chat_messages("count"), "max_tokens": 7,
            "temperature": 0, "stream": True}  # fmt: skip
    with _post(tiny_server, body, stream=True) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    assert last["usage"]["completion_tokens"] == len(expected)


def test_sampling_with_a_seed_repeats_and_stop_cuts_the_text(tiny_server):
    client = tiny_server.client()
    settings = {"model": MODEL_NAME, "messages": chat_messages("tell me"), "max_tokens": 12,
                "temperature": 0.9, "top_p": 0.95, "seed": 7}  # fmt: skip
    first = client.chat.completions.create(**settings).choices[0].message.content
    assert client.chat.completions.create(**settings).choices[0].message.content == first
    assert len(first) >= 4, first  # the seed fixes the answer: long enough to cut
    stop = first[2:4]
    cut = client.chat.completions.create(**settings, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == first[: first.index(stop)]


def test_models_lists_the_base(tiny_server):
    models = tiny_server.client().models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "valid string"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"n": 2}, "n", "less than or equal to 1"),
        ({"stop": [""]}, "stop", "non-empty strings"),
        ({"tools": []}, "tools", "Extra inputs"),
        ({"max_tokens": 65}, "max_tokens", "--max-completion-tokens"),
        ({"max_completion_tokens": 1000}, "max_completion_tokens", "at most 64"),
        ({"messages": BAD_IMAGE}, "messages.0.content.0.image_url.url", "cannot read an image"),
        # Fields named as the client spelled them, camelCase too, and a field left out.
        ({"maxTokens": 5}, "maxTokens", "Extra inputs"),
        ({"messages": [{"role": "user", "content": "hi", "toolCallId": "x"}]},
         "messages.0.toolCallId", "Extra inputs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages.0.content.0.image_url.url", "Field required"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x", "detail": "medium"}}]}]},
         "messages.0.content.0.image_url.detail", "'auto', 'low' or 'high'"),
    ],
)  # fmt: skip
def test_invalid_requests_answer_400_naming_the_field(tiny_server, change, param, words):
    body = {"model": MODEL_NAME, "messages": chat_messages("hi"), **change}
    response = _post(tiny_server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param) or error["message"].startswith("--")
    assert words in error["message"], error["message"]


def test_the_client_raises_openais_errors(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.NotFoundError, match="expected one of the served models"):
        client.chat.completions.create(model="other", messages=chat_messages("hi"))
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL_NAME, messages=chat_messages("hi"),
                                       max_tokens=10_000)  # fmt: skip


def test_limits_answer_400_or_413_naming_the_limit(model_and_processor):
    from served_vlm import running_server

    from ascend_vlm.serving.limits import ServingLimits

    model, processor = model_and_processor
    limits = ServingLimits(max_body_bytes=20_000, max_images=1, max_image_pixels=64 * 64,
                           max_completion_tokens=8)  # fmt: skip
    with running_server(model, processor, limits, max_batch_tokens=40) as server:
        small, big = Image.new("RGB", (32, 32)), Image.new("RGB", (65, 64))
        cases = [
            (chat_messages("x", (small, small)), 400, "--max-images (1)"),
            (chat_messages("x", (big,)), 400, "65x64 pixels, more than --max-image-pixels"),
            (chat_messages("x" * 30_000), 413, "larger than --max-body-mib (20000 bytes)"),
            (chat_messages("word " * 60), 400, "--max-batch-tokens: the request needs"),
        ]
        for messages, status, words in cases:
            response = _post(server, {"model": MODEL_NAME, "messages": messages})
            assert response.status_code == status, response.text
            assert words in response.json()["error"]["message"]
        chunked = requests.post(
            f"{server.url}/v1/chat/completions", data=iter([b"{" + b" " * 15_000] * 2),
            headers={"content-type": "application/json"}, timeout=60,
        )  # fmt: skip
        assert chunked.status_code == 413
        assert server.metric('ascend_vlm_requests_total{status="invalid"}') == 5


def test_an_api_key_guards_everything_but_health(model_and_processor):
    from served_vlm import API_KEY, running_server

    model, processor = model_and_processor
    with running_server(model, processor, api_key=API_KEY) as server:
        assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            refused = requests.get(f"{server.url}{path}", timeout=30)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
        wrong = requests.get(f"{server.url}/v1/models", timeout=30,
                             headers={"authorization": "Bearer not-it"})  # fmt: skip
        assert wrong.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").chat.completions.create(
                model=MODEL_NAME, messages=chat_messages("hi")
            )
        answer = server.client().chat.completions.create(
            model=MODEL_NAME, messages=chat_messages("hi"), max_tokens=2
        )
        assert answer.usage.completion_tokens <= 2
        assert server.metric('ascend_vlm_requests_total{status="unauthorized"}') == 1


def test_metrics_carry_the_contracted_names(tiny_server):
    image = Image.new("RGB", (64, 64), "red")
    generated = tiny_server.metric("ascend_vlm_generated_tokens_total")
    visual = tiny_server.metric("ascend_vlm_visual_tokens_total")
    tiny_server.client().chat.completions.create(
        model=MODEL_NAME, messages=chat_messages("colour?", (image,)), max_tokens=2
    )
    body = requests.get(f"{tiny_server.url}/metrics", timeout=30).text
    declared = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")}
    for name in METRIC_NAMES:
        base = name.removesuffix("_total")
        assert name in declared or base in declared, name
    assert tiny_server.metric("ascend_vlm_generated_tokens_total") > generated
    assert tiny_server.metric("ascend_vlm_visual_tokens_total") > visual
    assert tiny_server.metric("ascend_vlm_queue_depth") == 0
    assert requests.get(f"{tiny_server.url}/health", timeout=30).json() == {"status": "ok"}


def test_an_unknown_route_answers_openais_error(tiny_server):
    response = requests.get(f"{tiny_server.url}/v1/nothing", timeout=30)
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert data_url(Image.new("RGB", (2, 2))).startswith("data:image/png;base64,")
