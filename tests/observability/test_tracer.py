"""ascend_vlm.trace: stages per request, Chrome trace export, feature events, exact removal,
profiler ranges and the NPU-event clock under the mock NPU."""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
import torch
from PIL import Image

import ascend_vlm
from ascend_vlm import trace_events
from ascend_vlm.observability import Tracer, trace


def _inputs(processor, images, question="What colour is the circle?"):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=prompt, images=images, return_tensors="pt")


def _image(colour=(200, 30, 30), size=(84, 56)):
    return Image.new("RGB", size, colour)


def _hook_state(model):
    """Every module's hook dictionaries (keys) and the model's instance attributes."""
    hooks = {
        name: (
            tuple(module._forward_hooks),
            tuple(module._forward_pre_hooks),
            tuple(module._forward_hooks_with_kwargs),
            tuple(module._forward_hooks_always_called),
        )
        for name, module in model.named_modules()
    }
    return hooks, set(model.__dict__)


def _check_request_stages(timeline, request, new_tokens, vision=True):
    spans = timeline.stages_of(request)
    names = [span.label for span in spans]
    expected = (["vision_encode", "projector"] if vision else []) + ["prefill"]
    expected += [f"decode {step}" for step in range(1, new_tokens)]
    assert names == expected
    bounds = timeline.requests[request]
    assert bounds.start <= spans[0].start and spans[-1].end <= bounds.end
    for span in spans:
        assert span.end > span.start
    for first, second in itertools.pairwise(spans):
        assert first.end <= second.start  # ordered, never overlapping


@pytest.mark.parametrize(
    "fixture",
    [
        "model_and_processor",
        "llava_and_processor",
        "qwen3_vl_moe_and_processor",
        "glm4v_and_processor",
    ],
)
def test_generate_stages_are_ordered_and_disjoint(request, fixture):
    model, processor = request.getfixturevalue(fixture)
    model = copy.deepcopy(model)
    ascend_vlm.patch(model)
    inputs = _inputs(processor, [_image()])
    with torch.no_grad(), trace(model) as timeline:
        output = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        model(**inputs)  # a forward outside generate is a request of its own
    assert output.shape[1] - inputs["input_ids"].shape[1] == 5
    assert [(r.index, r.kind) for r in timeline.requests] == [(0, "generate"), (1, "forward")]
    _check_request_stages(timeline, 0, 5)
    _check_request_stages(timeline, 1, 1)
    assert timeline.requests[0].end <= timeline.requests[1].start
    assert timeline.clock == "host"
    assert timeline.decode_steps(0) == 4


def test_several_images_and_a_generate_per_request(model_and_processor):
    model, processor = model_and_processor
    images = [_image(), _image((20, 200, 20), (56, 112))]
    with torch.no_grad(), trace(model) as timeline:
        for _ in range(2):
            model.generate(**_inputs(processor, images), max_new_tokens=2, min_new_tokens=2)
    assert len(timeline.requests) == 2
    for request in range(2):
        _check_request_stages(timeline, request, 2)  # one tower call encodes both images
    rows, columns, cells = timeline.stage_matrix()
    assert rows == ["0: generate", "1: generate"]
    assert columns == ["vision_encode", "projector", "prefill", "decode 1"]
    assert all(value > 0 for row in cells for value in row)


def test_a_one_token_prompt_is_still_a_prefill(model_and_processor):
    model, _ = model_and_processor
    with torch.no_grad(), trace(model) as timeline:
        model.generate(input_ids=torch.tensor([[40]]), max_new_tokens=3, min_new_tokens=3)
    _check_request_stages(timeline, 0, 3, vision=False)


def test_tracing_leaves_nothing_behind_and_changes_no_output(model_and_processor):
    model, processor = model_and_processor
    inputs = _inputs(processor, [_image()])
    before = _hook_state(model)
    with torch.no_grad():
        expected = model(**inputs).logits
        with trace(model):
            assert _hook_state(model) != before
            traced = model(**inputs).logits
        after = model(**inputs).logits
    assert _hook_state(model) == before
    assert "generate" not in model.__dict__
    assert torch.equal(traced, expected) and torch.equal(after, expected)
    assert not trace_events._LISTENERS


def test_an_error_inside_the_block_still_removes_everything(model_and_processor):
    model, processor = model_and_processor
    before = _hook_state(model)
    with pytest.raises(ValueError, match="boom"), trace(model) as timeline:
        with torch.no_grad():
            model(**_inputs(processor, [_image()]))
        raise ValueError("boom")
    assert _hook_state(model) == before
    assert timeline.complete and len(timeline.requests) == 1


def test_chrome_trace_follows_the_trace_event_format(model_and_processor, tmp_path):
    model, processor = model_and_processor
    with torch.no_grad(), trace(model) as timeline:
        model.generate(**_inputs(processor, [_image()]), max_new_tokens=3, min_new_tokens=3)
        trace_events.emit("custom", model, note="between stages")
        trace_events.emit("custom", torch.nn.Linear(1, 1), note="another model's")
    data = json.loads(timeline.save_chrome_trace(tmp_path / "trace.json").read_text())
    assert set(data) >= {"traceEvents", "displayTimeUnit"}
    assert data["displayTimeUnit"] in ("ms", "ns")
    phases = {}
    for event in data["traceEvents"]:
        assert isinstance(event["name"], str) and event["ph"] in ("X", "i", "M")
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        phases.setdefault(event["ph"], []).append(event)
        if event["ph"] == "X":
            assert isinstance(event["ts"], float) and event["ts"] >= 0
            assert isinstance(event["dur"], float) and event["dur"] >= 0
        elif event["ph"] == "i":
            assert isinstance(event["ts"], float) and event["s"] in ("g", "p", "t")
        else:
            assert event["name"] in ("process_name", "thread_name")
            assert isinstance(event["args"]["name"], str)
    stages = [e["name"] for e in phases["X"] if e["cat"] == "stage"]
    assert stages == ["vision_encode", "projector", "prefill", "decode 1", "decode 2"]
    request = next(e for e in phases["X"] if e["cat"] == "request")
    for event in phases["X"]:  # every stage lies inside its request, on its thread
        assert event["tid"] == request["tid"]
        assert request["ts"] <= event["ts"]
        assert event["ts"] + event["dur"] <= request["ts"] + request["dur"] + 1e-3
    assert [e["args"] for e in phases["i"]] == [{"note": "between stages"}]


def test_summary_lists_each_stage_and_the_rest(model_and_processor):
    model, processor = model_and_processor
    with torch.no_grad(), trace(model) as timeline:
        model.generate(**_inputs(processor, [_image()]), max_new_tokens=3, min_new_tokens=3)
    lines = timeline.summary().splitlines()
    assert lines[0].split() == [
        "stage",
        "calls",
        "total",
        "ms",
        "mean",
        "ms",
        "p50",
        "ms",
        "max",
        "ms",
        "share",
    ]
    calls = {line.split()[0]: line.split()[1] for line in lines[1:5]}
    assert calls == {"vision_encode": "1", "projector": "1", "prefill": "1", "decode": "2"}
    shares = [float(line.split()[-1].rstrip("%")) for line in lines[1:6]]
    assert math.isclose(sum(shares), 100.0, abs_tol=0.3)
    assert lines[-1].startswith("1 request(s)")


def test_feature_events_are_marked_on_their_request(model_and_processor):
    from ascend_vlm.pruning import PruneConfig, enable_token_pruning
    from ascend_vlm.reuse import VisionCache, enable_vision_cache

    model, processor = model_and_processor
    model = copy.deepcopy(model)
    enable_token_pruning(model, PruneConfig(layer=1, keep=0.5))
    enable_vision_cache(model, VisionCache(max_bytes=1 << 20))
    inputs = _inputs(processor, [_image()])
    with torch.no_grad(), trace(model) as timeline:
        for _ in range(2):
            model.generate(**inputs, max_new_tokens=2, min_new_tokens=2)
    marks = [(m.name, m.request, m.fields) for m in timeline.marks]
    caches = [(request, fields) for name, request, fields in marks if name == "vision_cache"]
    assert caches == [(0, {"hits": 0, "misses": 1}), (1, {"hits": 1, "misses": 0})]
    pruned = [fields for name, _, fields in marks if name == "pruning"]
    assert len(pruned) == 2 and pruned[0]["kept_visual_tokens"][0] < pruned[0]["visual_tokens"][0]
    # the second request found its features in the cache: no vision stages
    assert [s.name for s in timeline.stages_of(1)] == ["prefill", "decode"]


def test_batch_generator_events(model_and_processor):
    from ascend_vlm.batching import BatchGenerator, GenerationRequest

    model, processor = model_and_processor
    generator = BatchGenerator(model, processor, max_batch_size=2)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    requests = [
        GenerationRequest(messages=messages, max_new_tokens=2, request_id=name)
        for name in ("a", "b")
    ]
    with trace(model) as timeline:
        generator.generate_many(requests, progress=False)
    names = [m.name for m in timeline.marks]
    assert names.count("batching_admit") == 2 and names.count("batching_finish") == 2
    assert "batching_step" in names
    # batching events happen between the model calls: on the timeline, outside any request
    assert all(m.request is None for m in timeline.marks)
    assert {m.fields["request_id"] for m in timeline.marks if m.name == "batching_finish"} == {
        "a",
        "b",
    }
    assert all(r.kind == "forward" for r in timeline.requests)  # each model call one request


def test_disabling_inside_generate_ends_the_trace_there(model_and_processor):
    from transformers import LogitsProcessorList

    model, processor = model_and_processor
    tracer = Tracer(model)
    tracer.enable()

    def stop_tracing(input_ids, scores):
        tracer.disable()
        return scores

    with torch.no_grad():
        model.generate(
            **_inputs(processor, [_image()]),
            max_new_tokens=3,
            min_new_tokens=3,
            logits_processor=LogitsProcessorList([stop_tracing]),
        )
    timeline = tracer.trace
    assert timeline.complete and len(timeline.requests) == 1
    assert [s.name for s in timeline.stages_of(0)] == ["vision_encode", "projector", "prefill"]
    assert "generate" not in model.__dict__


def test_a_compiled_model_records_its_generate_calls(model_and_processor):
    model, processor = model_and_processor
    compiled = torch.compile(model, backend="eager")
    inputs = _inputs(processor, [_image()])
    with torch.no_grad():
        expected = model(**inputs).logits
        with trace(compiled) as timeline:
            logits = compiled(**inputs).logits
            compiled.generate(**inputs, max_new_tokens=2, min_new_tokens=2)
    torch.testing.assert_close(logits, expected)
    # the compiled forward runs the hooks inside its graph, where they stand aside: no request;
    # generate calls the wrapped module itself, eagerly: one request with every stage
    assert [r.kind for r in timeline.requests] == ["generate"]
    _check_request_stages(timeline, 0, 2)
    assert "generate" not in model.__dict__


def test_named_ranges_reach_torch_profiler(model_and_processor):
    model, processor = model_and_processor
    inputs = _inputs(processor, [_image()])
    with torch.no_grad(), torch.profiler.profile() as profiler, trace(model):
        model.generate(**inputs, max_new_tokens=2, min_new_tokens=2)
    names = {event.key for event in profiler.key_averages()}
    assert {"ascend_vlm::vision_encode", "ascend_vlm::prefill", "ascend_vlm::decode 1"} <= names


@pytest.mark.mock_npu
def test_mock_npu_times_stages_with_npu_events(model_and_processor, monkeypatch):
    model, processor = model_and_processor
    recorded = []
    event_class = torch.npu.Event
    original = event_class.record

    def counting_record(self, stream=None):
        recorded.append(self)
        return original(self, stream)

    monkeypatch.setattr(event_class, "record", counting_record)
    synchronized = []
    original_synchronize = torch.npu.synchronize
    monkeypatch.setattr(
        torch.npu, "synchronize", lambda *a: synchronized.append(1) or original_synchronize(*a)
    )
    with torch.no_grad(), trace(model) as timeline:
        model.generate(**_inputs(processor, [_image()]), max_new_tokens=3, min_new_tokens=3)
        assert not synchronized  # no host synchronisation while the model runs
    assert timeline.clock == "device"
    assert synchronized == [1]
    # origin + request start/end + 5 stages x start/end
    assert len(recorded) == 1 + 2 + 2 * 5 and all(e.enable_timing for e in recorded)
    _check_request_stages(timeline, 0, 3)
    # each stage is an mstx range on the current stream, every one ended
    ranges = torch.npu.mstx.ranges
    assert [message for message, _, _ in ranges] == [
        f"ascend_vlm::{span.label}" for span in timeline.stages_of(0)
    ]
    assert all(ended and stream is not None for _, stream, ended in ranges)


def test_bad_use_is_refused(model_and_processor):
    model, _processor = model_and_processor
    with pytest.raises(ValueError, match="clock: expected one of auto, device, host"):
        Tracer(model, clock="wall")
    with pytest.raises(ValueError, match=r"model: expected a transformers VLM.*Linear"):
        Tracer(torch.nn.Linear(2, 2))
    tracer = Tracer(model)
    tracer.enable()
    try:
        with pytest.raises(RuntimeError, match="trace: still recording"):
            tracer.trace.summary()
        with pytest.raises(RuntimeError, match="model: already traced"):
            Tracer(model).enable()
        with pytest.raises(RuntimeError, match="model: already traced"), trace(model):
            pass
    finally:
        tracer.disable()
    assert tracer.trace.complete and tracer.disable() is tracer.trace


def test_unknown_requests_are_refused(model_and_processor):
    model, processor = model_and_processor
    with torch.no_grad(), trace(model) as timeline:
        model(**_inputs(processor, [_image()]))
    with pytest.raises(ValueError, match=r"request: expected an index in \[0, 1\), got 1"):
        timeline.stages_of(1)
    with pytest.raises(ValueError, match="name: expected one of vision_encode"):
        timeline.stage_seconds(0, "decoding")
