"""Schemathesis over the server's own OpenAPI schema, in its positive and negative generation
modes, and every boundary of the request schema's numbers and lists (at, just inside and just
outside each bound): no request (valid or not) gets a 500, and every error is OpenAI's error
object."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from served_vlm import MODEL_NAME, chat_messages, running_server

from ascend_vlm.serving.limits import ServingLimits

EXAMPLES = 12
ERROR_FIELDS = {"message", "type", "param", "code"}
# A step past a float bound: inside or outside it, and seen as a different number.
FLOAT_STEP = 1e-9


def _checked(response: requests.Response, what: Any) -> None:
    assert response.status_code < 500, (what, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == ERROR_FIELDS, (what, response.text)


def _bound_values(schema: dict[str, Any]) -> Iterator[Any]:
    """Each bound of a number schema, with the values just inside and just outside it."""
    step = 1 if schema.get("type") == "integer" else FLOAT_STEP
    for key, inside in (("minimum", 1), ("maximum", -1)):
        if key in schema:
            yield from (schema[key], schema[key] + inside * step, schema[key] - inside * step)
    if "exclusiveMinimum" in schema:
        bound = schema["exclusiveMinimum"]
        yield from (bound, bound + step)


def _boundary_cases(request_schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(field, value) for every bound of the request's top-level numbers and lists."""
    for field, schema in request_schema["properties"].items():
        for option in schema.get("anyOf", [schema]):
            if option.get("type") in ("integer", "number"):
                yield from ((field, value) for value in _bound_values(option))
            if option.get("type") == "array" and "minItems" in option:
                yield field, []


def _fuzz(operation: Any, mode: GenerationMode, url: str, statuses: set) -> None:
    """Call ``operation`` with EXAMPLES requests schemathesis generates in ``mode``, checking
    each answer and adding (mode, path, status) to ``statuses``."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL_NAME  # else nearly every request is a 404
        response = case.call(base_url=url, timeout=120)
        statuses.add((mode.value, case.path, response.status_code))
        _checked(response, case.body)

    call()


@pytest.mark.slow
def test_no_generated_or_boundary_request_gets_a_server_error(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_completion_tokens=2)
    with running_server(model, processor, limits, max_batch_tokens=128) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        checked = 0
        statuses: set[tuple[str, str, int]] = set()
        for result in schema.get_all_operations():
            operation = result.ok()
            # A GET without parameters has nothing a negative case could break.
            negative = (GenerationMode.NEGATIVE,) if operation.method.upper() == "POST" else ()
            for mode in (GenerationMode.POSITIVE, *negative):
                _fuzz(operation, mode, server.url, statuses)
            checked += 1
        assert checked == 4  # chat completions, models, health and metrics
        assert ("positive", "/v1/chat/completions", 200) in statuses, statuses
        assert ("negative", "/v1/chat/completions", 400) in statuses, statuses

        published = requests.get(f"{server.url}/openapi.json", timeout=30).json()
        request_schema = published["components"]["schemas"]["ChatCompletionRequest"]
        cases = list(_boundary_cases(request_schema))
        # Every bounded field of the request: the token counts, sampling settings, n, penalties
        # and the messages list.
        assert {field for field, _ in cases} >= {
            "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
            "n", "frequency_penalty", "presence_penalty",
        }  # fmt: skip
        answered = set()
        for field, value in cases:
            body = {"model": MODEL_NAME, "messages": chat_messages("hi"), field: value}
            response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
            _checked(response, body)
            answered.add(response.status_code)
        assert answered == {200, 400}
