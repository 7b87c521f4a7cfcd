"""``python -m ascend_vlm generate-batch``: answer a JSONL file of requests with continuous
batching (:class:`~ascend_vlm.batching.BatchGenerator`) and write one JSONL result per request,
in input order.

A request line: ``{"id": "a", "prompt": "...", "images": ["cat.png"], "max_new_tokens": 32,
"do_sample": false, "temperature": 1.0, "top_k": null, "top_p": null, "seed": 0, "stop": []}``
(only ``prompt`` is required; image paths are relative to the JSONL file; http(s) and
data: URLs are fetched), or ``"messages"``
in the chat format with ``{"type": "image", "image": "cat.png"}`` parts instead of
``prompt`` / ``images``. A result line: ``id``, ``text``, ``tokens``, ``finish_reason``,
``prompt_tokens``, ``time_to_first_token``, ``latency``, ``tokens_per_second`` (seconds from
submission).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ascend_vlm._files import atomic_write_text
from ascend_vlm.batching.command_line import (
    add_budget_arguments,
    add_kv_cache_arguments,
    budget_message,
    budget_settings,
    kv_cache_settings,
)
from ascend_vlm.batching.request import GenerationRequest

_SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop")


class RequestFileError(ValueError):
    """A request line that cannot be read; the message names the line."""


def _image(folder: Path, value: object, where: str) -> Any:
    """The image a request names: a path relative to the JSONL file's folder, an http(s) URL or
    a data: URL."""
    from ascend_vlm.data.images import is_remote, load_image

    if not isinstance(value, str):
        raise RequestFileError(f"{where}: expected an image path or URL string, got {value!r}")
    try:
        return load_image(value if is_remote(value) else str(folder / value), name=where)
    except ValueError as error:
        raise RequestFileError(str(error)) from None


def _messages(folder: Path, record: dict, where: str) -> list[dict]:
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise RequestFileError(f"{where}: messages: expected a list, got {messages!r}")
        loaded = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = [
                    {**part, "image": _image(folder, part.get("image"), where)}
                    if isinstance(part, dict) and part.get("type") == "image"
                    else part
                    for part in content
                ]
                message = {**message, "content": content}
            loaded.append(message)
        return loaded
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        raise RequestFileError(f'{where}: expected a "prompt" string or "messages", got {record!r}')
    images = [_image(folder, value, where) for value in record.get("images", [])]
    content = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]


def read_requests(path: Path) -> list[GenerationRequest]:
    """The requests of a JSONL file (see the module docstring). RequestFileError names the
    line of any malformed record."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise RequestFileError(f"{where}: {error}") from None
        if not isinstance(record, dict):
            raise RequestFileError(f"{where}: expected a JSON object, got {record!r}")
        unknown = set(record) - {"id", "prompt", "images", "messages", *_SETTINGS}
        if unknown:
            raise RequestFileError(f"{where}: unknown fields {sorted(unknown)}")
        settings = {key: record[key] for key in _SETTINGS if key in record}
        if "stop" in settings and isinstance(settings["stop"], list):
            settings["stop"] = tuple(settings["stop"])
        messages = _messages(path.parent, record, where)
        try:
            requests.append(
                GenerationRequest(
                    messages=messages,
                    request_id=str(record.get("id", f"line-{number}")),
                    **settings,
                )
            )
        except (TypeError, ValueError) as error:
            raise RequestFileError(f"{where}: {error}") from None
    if not requests:
        raise RequestFileError(f"{path}: expected at least one request line, got none")
    return requests


def add_command(commands: Any) -> None:
    """Register ``generate-batch`` on the ``python -m ascend_vlm`` sub-command parser."""
    parser = commands.add_parser(
        "generate-batch", help="answer a JSONL file of requests with continuous batching"
    )
    parser.add_argument(
        "--model", required=True, help="local checkpoint folder or Hugging Face Hub id"
    )
    parser.add_argument("--requests", required=True, type=Path, help="requests, JSONL")
    parser.add_argument("--out", required=True, type=Path, help="results, JSONL")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    add_budget_arguments(parser)
    add_kv_cache_arguments(parser)
    parser.add_argument(
        "--no-patch", dest="patch", action="store_false", help="run the stock model, unpatched"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    parser.set_defaults(handler=run_command, parser=parser)


def run_command(args: argparse.Namespace) -> int:
    """Run ``generate-batch``; argparse errors (status 2) name the bad option or line."""
    from ascend_vlm.batching.budgets import BudgetError
    from ascend_vlm.batching.generator import BatchGenerator
    from ascend_vlm.commands.checkpoints import (
        checkpoint_folder,
        load_model_and_processor,
    )
    from ascend_vlm.vision_input.fast_processor import with_fast_pixels

    parser = args.parser
    budgets = {**budget_settings(args, parser), **kv_cache_settings(args, parser)}
    if args.out.exists() and not args.force:
        parser.error(f"--out: {args.out} exists; pass --force to replace it")
    if not args.requests.is_file():
        parser.error(f"--requests: expected a JSONL file, got {args.requests} (no such file)")
    try:
        model_path = checkpoint_folder(args.model, "--model")
        requests = read_requests(args.requests)
    except (FileNotFoundError, RequestFileError) as error:
        parser.error(str(error))
    model, processor = load_model_and_processor(model_path, "--model")
    # Every request is encoded at submission; the fast image part gives the same tensors.
    processor = with_fast_pixels(processor, workers=2)
    if args.patch:
        from ascend_vlm.patching import patch

        patch(model)
    try:
        generator = BatchGenerator(model, processor, **budgets)
        results = generator.generate_many(requests, progress=args.progress)
    except BudgetError as error:
        parser.error(budget_message(error))
    lines = [
        json.dumps(
            {
                "id": result.request_id,
                "text": result.text,
                "tokens": list(result.tokens),
                "finish_reason": result.finish_reason,
                "prompt_tokens": result.prompt_tokens,
                "time_to_first_token": result.time_to_first_token,
                "latency": result.latency,
                "tokens_per_second": result.tokens_per_second,
            }
        )
        for result in results
    ]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    stats = generator.stats()
    used = ", ".join(f"{name} {share:.0%}" for name, share in stats.utilisation.items())
    print(
        f"[ascend_vlm] {stats.requests} requests, {stats.output_tokens} tokens in "
        f"{stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s), {stats.steps} steps; "
        f"mean budget use: {used}; wrote {args.out}",
        flush=True,
    )
    return 0
