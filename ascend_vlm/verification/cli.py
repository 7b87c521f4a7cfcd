"""``python -m ascend_vlm verify``: where a checkpoint drifts from its stock fp32 reference.

Loads ``--model`` twice: the reference (stock, fp32 on the CPU, or fp64 with
``--reference-dtype fp64``) and the model under test in ``--dtype``, patched unless
``--no-patch``, on ``--device``; encodes the first ``--limit`` questions of ``--data`` (a
JSONL/LLaVA file whose records all have images, or ShapesVQA's held-out split) as the
evaluation does; runs :func:`ascend_vlm.verify` on them and prints the report (module by
module, then end to end: top-1 agreement, KL, the first differing greedy token among
``--max-new-tokens`` and the paired accuracy), the verdict and the host's peak memory rise.
``--json`` writes the report, ``--plot`` the error-vs-depth PNG, ``--replay DIR`` the repro of
the first flagged module's call (a ``.pt`` file to send to a kernel team).

``--replay FILE.pt`` (without ``--model``) re-runs one repro on ``--device`` (default: where it
was saved) against float64 and prints its table.

Exit status: 0 when no module is flagged, 1 when one is, 2 (argparse's ``error:`` line naming
the option) on a user's mistake.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ascend_vlm._byte_units import MIB
from ascend_vlm.verification.end_to_end import DEFAULT_MAX_NEW_TOKENS

SHAPES_VQA = "shapes-vqa"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REFERENCE_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
DEFAULT_LIMIT = 4


def add_command(commands: Any) -> None:
    """Register ``verify`` on the ``python -m ascend_vlm`` sub-command parser."""
    parser = commands.add_parser(
        "verify",
        help="find where a model drifts from its stock reference, module by module",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--model", help="local checkpoint folder, Hugging Face Hub id, or 'reference'"
    )
    parser.add_argument(
        "--data",
        default=SHAPES_VQA,
        metavar=f"JSONL|{SHAPES_VQA}",
        help="questions about images: a JSONL/LLaVA file or ShapesVQA's held-out split",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="test dtype")
    parser.add_argument(
        "--reference-dtype", choices=tuple(REFERENCE_DTYPES), default="fp32", help="reference"
    )
    parser.add_argument(
        "--patch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="patch the model under test with ascend_vlm.patch (default: patched)",
    )
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="questions to run")
    parser.add_argument(
        "--device", choices=("cpu", "npu"), help="model's device (default: cpu; a repro's own)"
    )
    parser.add_argument("--k", type=float, default=4.0, help="flag errors over k x the floor")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the report as JSON")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="draw error vs depth")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="greedy tokens compared end to end",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="DIR|FILE.pt",
        help="write the first flagged module's repro into DIR; or re-run the repro FILE.pt",
    )
    parser.add_argument("--force", action="store_true", help="let --json/--plot replace OUT")
    parser.set_defaults(handler=run_command, parser=parser)


def _check_outputs(args: argparse.Namespace) -> None:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        if not path.parent.is_dir():
            args.parser.error(f"{flag}: expected a file in an existing folder, got {path}")
        if path.exists() and not args.force:
            args.parser.error(f"{flag}: {path} exists; pass --force to replace it")


def _check_device(args: argparse.Namespace) -> torch.device:
    from ascend_vlm.kernel_backend import active_backend

    if args.device == "npu" and active_backend() != "npu":
        args.parser.error(
            f"--device: expected an NPU (torch_npu with a device) for npu, got the "
            f"{active_backend()!r} kernel backend; use --device cpu"
        )
    return torch.device("npu:0" if args.device == "npu" else "cpu")


def _replay(args: argparse.Namespace) -> int:
    """Re-run the repro ``--replay FILE.pt`` and print (and with ``--json`` write) its table."""
    from ascend_vlm.verification.replay import replay

    device = None if args.device is None else _check_device(args)
    try:
        result = replay(args.replay, device=device)
    except (ValueError, FileNotFoundError) as error:
        # One error line: torch's reasons for an unreadable file run over several.
        args.parser.error(f"--replay: {' '.join(str(error).split())}")
    print(result.table(), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _dataset(args: argparse.Namespace) -> Any:
    from ascend_vlm.commands.checkpoints import REFERENCE
    from ascend_vlm.data import datasets
    from ascend_vlm.data.vqa import BadRecordError

    if args.data == SHAPES_VQA:
        if args.model != REFERENCE:
            return datasets.shapes_vqa(args.limit)
        # The reference checkpoint is trained (and held out) at its recipe's image size.
        from ascend_vlm.finetune.reference_model import RECIPE

        return datasets.shapes_vqa(args.limit, image_size=RECIPE.image_size)
    if not Path(args.data).is_file():
        args.parser.error(f"--data: expected a JSONL file or {SHAPES_VQA}, got {args.data}")
    try:
        dataset = datasets.jsonl(args.data)
    except BadRecordError as error:
        args.parser.error(f"--data: {error}")
    dataset = dataset.head(min(args.limit, len(dataset)))
    for index in range(len(dataset)):
        if dataset[index].image is None:
            args.parser.error(
                f"--data: sample {index + 1} of {args.data} has no image; verify compares the "
                "vision tower and projector too, so every sample needs one"
            )
    return dataset


def _inputs(processor: Any, dataset: Any) -> list[dict[str, torch.Tensor]]:
    """One batch of one prompt per sample, as the evaluation encodes it (chat template over the
    question and image)."""
    from ascend_vlm.data.vqa import collate, encode_sample, pad_token_id_of

    pad_id = pad_token_id_of(processor)
    batches = []
    for index in range(len(dataset)):
        encoded = encode_sample(processor, dataset[index], with_answer=False)
        batch = collate([encoded], pad_id)
        del batch["labels"]
        batches.append(batch)
    return batches


def run_command(args: argparse.Namespace) -> int:
    """Run ``verify`` (module docstring); returns the exit status."""
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.commands.checkpoints import checkpoint_folder, load_model_and_processor
    from ascend_vlm.verification.verifier import verify

    parser = args.parser
    _check_outputs(args)
    if args.replay is not None and args.replay.suffix == ".pt":
        if args.model is not None:
            parser.error("--replay: a FILE.pt re-runs one repro; give it without --model")
        return _replay(args)
    if args.model is None:
        parser.error("--model: expected a checkpoint folder, Hub id or 'reference', got none")
    for flag, value in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            parser.error(f"{flag}: expected an int >= 1, got {value}")
    if not args.k > 0:
        parser.error(f"--k: expected a number > 0, got {args.k}")
    if args.replay is not None and args.replay.exists() and not args.replay.is_dir():
        parser.error(f"--replay: expected a folder for the repro or a FILE.pt, got {args.replay}")
    device = _check_device(args)
    try:
        path = checkpoint_folder(args.model, "--model")
    except FileNotFoundError as error:
        parser.error(str(error))
    dataset = _dataset(args)
    print(f"[ascend_vlm] loading {path} (reference and model under test) ...", flush=True)
    reference, processor = load_model_and_processor(path, "--model")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=DTYPES[args.dtype]).eval()
    if args.patch:
        from ascend_vlm.patching import patch

        patch(model)
    model.to(device)
    try:
        report = verify(
            model,
            _inputs(processor, dataset),
            reference=reference,
            reference_dtype=REFERENCE_DTYPES[args.reference_dtype],
            k=args.k,
            processor=processor,
            samples=[dataset[index] for index in range(len(dataset))],
            max_new_tokens=args.max_new_tokens,
            replay_dir=args.replay,
        )
    except ValueError as error:
        parser.error(str(error))
    print(report, flush=True)
    peak = report.peak_host_bytes
    print(
        f"peak host memory rise during verify: {'n/a' if peak is None else f'{peak / MIB:.1f} MiB'}"
    )
    if args.json is not None:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    if args.plot is not None:
        from ascend_vlm.verification.plot import save_error_plot

        print(f"wrote {save_error_plot(report, args.plot)}")
    if report.repro is not None:
        from ascend_vlm.verification.replay import replay_command

        print(f"replay it with: {replay_command(report.repro)} (from {Path(report.repro).parent})")
    return 1 if report.first_flagged is not None else 0
