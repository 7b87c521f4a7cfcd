"""``python -m ascend_vlm explain``: answer a question about images and explain the answer.

Writes into ``--out`` the attention overlay of one answer token on each image
(``attention_image{k}.png``), the stage heat map (``stages.png``), the Chrome trace
(``trace.json``, opens in https://ui.perfetto.dev) and the anomalous-token report
(``report.json``); prints the answer, the stage table and the outlier tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices such as 0,1, got {text!r}"
        ) from None


def add_command(commands: Any) -> None:
    """Register ``explain`` on the ``python -m ascend_vlm`` sub-command parser."""
    parser = commands.add_parser(
        "explain", help="answer a question about images; write attention maps and a trace"
    )
    parser.add_argument(
        "--model",
        required=True,
        help="local checkpoint folder, Hugging Face Hub id, or 'reference'",
    )
    parser.add_argument(
        "--image",
        required=True,
        action="append",
        help="image file, http(s) URL or data: URL (repeatable)",
    )
    parser.add_argument("--question", required=True, help="the question about the images")
    parser.add_argument("--out", required=True, type=Path, help="folder for the outputs")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--token", type=int, default=0, help="answer token to map")
    parser.add_argument("--layers", type=_layers, help="decoder layers to average (default all)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help="answer tokens to generate at most"
    )
    parser.add_argument("--no-patch", dest="patch", action="store_false", help="skip patch")
    parser.set_defaults(handler=run_command, parser=parser)


def run_command(args: argparse.Namespace) -> int:
    """Run ``explain``; argparse errors (status 2) name the bad option."""
    from ascend_vlm.commands.checkpoints import (
        checkpoint_folder,
        load_model_and_processor,
    )
    from ascend_vlm.data.images import load_image
    from ascend_vlm.observability.explain import explain, save_explanation

    parser = args.parser
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.token < 0 or args.token >= args.max_new_tokens:
        parser.error(f"--token: expected 0 <= token < --max-new-tokens, got {args.token}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.force:
        parser.error(f"--out: {args.out} exists and is not an empty folder; pass --force")
    try:
        images = [load_image(source, name="--image") for source in args.image]
    except ValueError as error:
        parser.error(str(error))
    try:
        model_path = checkpoint_folder(args.model, "--model")
    except FileNotFoundError as error:
        parser.error(str(error))
    model, processor = load_model_and_processor(model_path, "--model")
    if args.patch:
        from ascend_vlm.patching import patch

        patch(model)
    try:
        explanation = explain(
            model,
            processor,
            images,
            args.question,
            max_new_tokens=args.max_new_tokens,
            layers=args.layers,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.token >= len(explanation.answer_ids):
        parser.error(
            f"--token: the answer has {len(explanation.answer_ids)} tokens, got {args.token}"
        )
    paths = save_explanation(explanation, images, args.out, token=args.token)
    print(f"question: {explanation.question}")
    print(f"answer:   {explanation.answer!r}")
    print()
    print(explanation.trace.summary())
    outliers = explanation.report["outliers"]
    print(f"\nanomalous tokens (|robust z| > {explanation.report['threshold']}): {len(outliers)}")
    for entry in outliers:
        print(f"  #{entry['index']} {entry['text']!r}: {', '.join(entry['outlier_on'])}")
    print()
    for name, path in paths.items():
        print(f"wrote {name:<18} {path}")
    return 0
