"""``python -m ascend_vlm serve``: load a model, apply the feature options, and serve it with
the OpenAI API (:mod:`ascend_vlm.serving.app`) until SIGTERM drains it.

The feature options are the command line's, as ``eval`` has them
(:mod:`ascend_vlm.commands.features`: ``--quantize``, ``--patch`` / ``--no-patch``,
``--prune`` / ``--kv``, ``--vision-cache``), applied in the same order, except that
``--adapter NAME=PATH`` loads every adapter side by side for requests to choose by ``model``
(``eval``'s ``--use-adapter`` has no meaning here). The budget flags are the batch generator's,
as ``generate-batch`` has them (:mod:`ascend_vlm.batching.command_line`). A user's mistake (a bad flag, a model or adapter that does not load, an
address it cannot listen on) prints one ``error:`` line and exits 2, before anything listens.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path
from typing import Any

from ascend_vlm._byte_units import MIB
from ascend_vlm.batching.command_line import (
    add_budget_arguments,
    add_kv_cache_arguments,
    budget_settings,
    kv_cache_settings,
)
from ascend_vlm.commands import features  # noqa: F401  (registers the feature options)
from ascend_vlm.commands.adapter_option import named_path
from ascend_vlm.commands.options import REGISTRY
from ascend_vlm.serving.limits import LIMIT_FLAGS, ServingLimits

ADAPTER_OPTION = "adapter"
API_KEY_VARIABLE = "ASCEND_VLM_API_KEY"
DEFAULTS = ServingLimits()


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def _add_server_arguments(parser: Any) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    group.add_argument(
        "--served-model-name", metavar="NAME", help="the base model's name in the API "
        "(default: the --model value)",
    )  # fmt: skip
    group.add_argument(
        "--api-key", metavar="KEY", default=os.environ.get(API_KEY_VARIABLE),
        help=f"require 'Authorization: Bearer KEY' on every request but /health (default: "
        f"${API_KEY_VARIABLE}, else none)",
    )  # fmt: skip
    group.add_argument(
        "--allow-local-images", metavar="DIR", type=Path,
        help="let requests name image files under DIR (default: data: URLs only)",
    )  # fmt: skip
    group.add_argument(
        "--allow-image-urls", action="store_true",
        help="let requests name http(s) image URLs, fetched with --image-url-timeout and "
        "--image-url-max-mib",
    )  # fmt: skip
    group.add_argument(
        "--image-cache", metavar="MIB", type=int, default=0,
        help="keep up to MIB MiB of decoded request images and MIB MiB of their preprocessed "
        "pixels (least recently used evicted), so a conversation's repeated images are neither "
        "decoded nor preprocessed again (default 0: off)",
    )  # fmt: skip
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning"],
                       help="uvicorn's log level")  # fmt: skip
    limits = parser.add_argument_group("limits")
    numbers = {
        "max_queue": (int, "N", DEFAULTS.max_queue, "requests waiting or running (429 beyond)"),
        "max_body_bytes": (int, "MIB", DEFAULTS.max_body_bytes // MIB,
                           "request body in MiB (413 beyond)"),
        "max_images": (int, "N", DEFAULTS.max_images, "images per request"),
        "max_image_pixels": (int, "N", DEFAULTS.max_image_pixels, "width x height per image"),
        "max_completion_tokens": (int, "N", DEFAULTS.max_completion_tokens,
                                  "tokens a request may ask for, and gets when it names none"),
        "url_timeout": (float, "SECONDS", DEFAULTS.url_timeout, "per image URL fetch"),
        "url_max_bytes": (int, "MIB", DEFAULTS.url_max_bytes // MIB, "MiB per fetched image"),
        "drain_seconds": (float, "SECONDS", DEFAULTS.drain_seconds,
                          "SIGTERM lets running requests finish in"),
    }  # fmt: skip
    for field, (kind, metavar, default, text) in numbers.items():
        limits.add_argument(
            LIMIT_FLAGS[field], type=_positive(kind), default=default, metavar=metavar, help=text
        )


def add_command(commands: Any) -> None:
    """Register ``serve`` on the ``python -m ascend_vlm`` sub-command parser."""
    parser = commands.add_parser("serve", help="serve a VLM with the OpenAI API")
    parser.add_argument(
        "--model", required=True, help="local checkpoint folder or Hugging Face Hub id"
    )
    for option in REGISTRY.options():
        group = parser.add_argument_group(f"{option.name} option")
        if option.name != ADAPTER_OPTION:
            option.add_arguments(group)
            continue
        group.add_argument(
            "--adapter", type=named_path, action="append", default=[], metavar="NAME=PATH",
            help="load the LoRA adapter saved in folder PATH as NAME (a request picks it with "
            "\"model\": NAME); repeat for several",
        )  # fmt: skip
    add_budget_arguments(parser.add_argument_group("budgets of the running batch"))
    add_kv_cache_arguments(parser.add_argument_group("KV cache of the running batch"))
    _add_server_arguments(parser)
    parser.set_defaults(handler=run_command, parser=parser)


def _limits(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServingLimits:
    local = args.allow_local_images
    if local is not None and not local.is_dir():
        parser.error(f"--allow-local-images: expected a directory, got {local}")
    if args.image_cache < 0:
        parser.error(f"--image-cache: expected MiB >= 0, got {args.image_cache}")
    return ServingLimits(
        max_body_bytes=args.max_body_mib * MIB,
        max_images=args.max_images,
        max_image_pixels=args.max_image_pixels,
        max_completion_tokens=args.max_completion_tokens,
        max_queue=args.max_queue,
        url_timeout=args.image_url_timeout,
        url_max_bytes=args.image_url_max_mib * MIB,
        drain_seconds=args.drain_seconds,
        allow_image_urls=args.allow_image_urls,
        local_images=local,
    )


def _prepared_model(args: argparse.Namespace, path: Path) -> tuple[Any, Any, Any]:
    """``(model, processor, adapter set or None)``: the checkpoint with every feature option
    applied in the registry's order. ValueError naming the flag a model refuses."""
    from ascend_vlm.commands.adapter_option import load_adapter_set
    from ascend_vlm.commands.checkpoints import load_model_and_processor
    from ascend_vlm.vision_input.fast_processor import with_fast_pixels

    model, processor = load_model_and_processor(path, "--model")
    adapters = None
    for option in REGISTRY.options():
        if option.name == ADAPTER_OPTION:
            if args.adapter:
                adapters, _ = load_adapter_set(model, processor, args.adapter)
            continue
        extra = (processor,) if option.needs_processor else ()
        print(f"[ascend_vlm] {option.apply(model, args, *extra)['summary']}", flush=True)
    # Every request is encoded on the engine thread; the fast image part gives the same tensors.
    fast = with_fast_pixels(processor, workers=2, cache_bytes=args.image_cache * MIB)
    return model, fast, adapters


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_command(args: argparse.Namespace) -> int:
    """Run ``serve`` until a signal drains it; 0 then."""
    from ascend_vlm.adapters import BASE_ADAPTER
    from ascend_vlm.batching import BatchGenerator
    from ascend_vlm.commands.checkpoints import checkpoint_folder
    from ascend_vlm.reuse import vision_cache_of
    from ascend_vlm.serving.app import build_app
    from ascend_vlm.serving.conversion import ServedModels
    from ascend_vlm.serving.engine import Engine
    from ascend_vlm.serving.images import decoded_image_cache
    from ascend_vlm.serving.server import DrainingServer, bind_socket

    parser = args.parser
    budgets = {**budget_settings(args, parser), **kv_cache_settings(args, parser)}
    limits = _limits(args, parser)
    try:
        path = checkpoint_folder(args.model, "--model")
        listener = bind_socket(args.host, args.port)
    except (FileNotFoundError, OSError) as error:
        parser.error(str(error))
    try:
        model, processor, adapters = _prepared_model(args, path)
        generator = BatchGenerator(
            model if adapters is None else adapters.model,
            processor,
            adapters=adapters,
            **budgets,
        )
    except ValueError as error:
        parser.error(str(error))
    served = ServedModels(
        name=args.served_model_name or args.model,
        adapters=() if adapters is None else adapters.names,
        base_adapter=None if adapters is None else BASE_ADAPTER,
    )
    engine = Engine(generator, limits.max_queue)
    engine.start()
    decoded = decoded_image_cache(args.image_cache * MIB) if args.image_cache else None
    app = build_app(engine, served, limits, args.api_key, vision_cache_of(model), decoded)
    host, port = listener.getsockname()[:2]
    print(f"[ascend_vlm] serving {', '.join([served.name, *served.adapters])} on "
          f"http://{args.host}:{port}/v1", flush=True)  # fmt: skip
    if not args.api_key and not _loopback(host):
        print(f"[ascend_vlm] warning: listening on {host} without --api-key", flush=True)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    server = DrainingServer(app, engine, limits.drain_seconds, log_level=args.log_level)
    try:
        server.run(sockets=[listener])
    finally:
        engine.stop()
    return 0
