"""Schemathesis over the server's own OpenAPI schema: no generated request (valid or not)
gets a 500, and every error is OpenAI's error object."""

from __future__ import annotations

import pytest
import schemathesis
from conftest import MODEL_NAME, running_server
from hypothesis import HealthCheck, given, settings

from ascend_vlm.serving.limits import ServingLimits

EXAMPLES = 12


@pytest.mark.slow
def test_no_generated_request_gets_a_server_error(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_completion_tokens=2)
    with running_server(model, processor, limits, max_batch_tokens=128) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        checked = 0
        statuses: set[tuple[str, int]] = set()
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(case=operation.as_strategy())
            def call(case) -> None:
                if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                    case.body["model"] = MODEL_NAME  # else nearly every request is a 404
                response = case.call(base_url=server.url, timeout=120)
                statuses.add((case.path, response.status_code))
                assert response.status_code < 500, (case.body, response.text)
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}

            call()
            checked += 1
        assert checked == 4  # chat completions, models, health and metrics
        assert ("/v1/chat/completions", 200) in statuses, statuses
