"""From a chat request to the generator's request: an image part's ``detail`` "low" shrinks the
image to OpenAI's low resolution (aspect kept), "high" / "auto" / none keep it as sent, and a
message's ``name`` is accepted and not shown to the model."""

from __future__ import annotations

import pytest
from PIL import Image
from served_vlm import data_url

from ascend_vlm.serving.conversion import LOW_DETAIL_SIDE, generation_request
from ascend_vlm.serving.images import decoded_image_cache
from ascend_vlm.serving.limits import ServingLimits
from ascend_vlm.serving.protocol import ChatCompletionRequest


def _request(size: tuple[int, int], detail: str | None) -> ChatCompletionRequest:
    image_url = {"url": data_url(Image.new("RGB", size, "red"))}
    if detail is not None:
        image_url["detail"] = detail
    content = [{"type": "image_url", "image_url": image_url}, {"type": "text", "text": "what?"}]
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": content, "name": "alice"}]
    )


@pytest.mark.parametrize(
    ("size", "detail", "seen"),
    [
        ((1024, 768), "low", (LOW_DETAIL_SIDE, 384)),
        ((300, 2048), "low", (75, LOW_DETAIL_SIDE)),
        ((200, 100), "low", (200, 100)),  # already small: never enlarged
        ((1024, 768), "high", (1024, 768)),
        ((1024, 768), "auto", (1024, 768)),
        ((1024, 768), None, (1024, 768)),
    ],
)
def test_detail_low_shrinks_the_image_to_openais_low_resolution(size, detail, seen):
    request = generation_request(_request(size, detail), None, ServingLimits(), "chatcmpl-1")
    [message] = request.messages
    assert message["content"][0]["image"].size == seen
    assert message == {"role": "user", "content": [message["content"][0],
                                                   {"type": "text", "text": "what?"}]}  # fmt: skip


def test_detail_low_leaves_the_decoded_image_as_it_was():
    # The decoded cache hands every request the same image: "low" must shrink a copy of it.
    decoded = decoded_image_cache(1 << 26)
    for detail, seen in (("low", (LOW_DETAIL_SIDE, 384)), ("high", (1024, 768))):
        request = generation_request(
            _request((1024, 768), detail), None, ServingLimits(), "chatcmpl-1", decoded
        )
        assert request.messages[0]["content"][0]["image"].size == seen
    assert decoded.hits == 1
