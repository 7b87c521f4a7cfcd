"""``python -m ascend_vlm eval``: arguments, their validation, and the run.

Every bad input is found before the first model is loaded and reported through argparse
(``error:`` line naming the option, exit status 2).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_vlm.commands import features  # noqa: F401  (registers the built-in options)
from ascend_vlm.commands.checkpoints import REFERENCE, checkpoint_folder
from ascend_vlm.commands.options import REGISTRY, OptionRegistry
from ascend_vlm.data.datasets import DEFAULT_SHAPES_SAMPLES, EvalDataset

HELP = "accuracy, latency and memory of a VLM on held-out questions"
DESCRIPTION = f"""\
Answer held-out questions with greedy generation and report accuracy per question type (exact
and normalised match, 95% Wilson intervals), latency per stage (vision encode, prefill, decode
per token: mean and 95th percentile over batches) and the host's peak memory rise.

Data: ShapesVQA's held-out "eval" split ({DEFAULT_SHAPES_SAMPLES} samples unless --limit), or
--data FILE.jsonl (flat or LLaVA records, as the fine-tune script reads; a record's "type" field
is its question type, "all" without one). Feature options (below, one group per feature)
transform the loaded model before it answers."""
EPILOG = """\
--compare A B: answer the same samples with two configurations and report both accuracies,
the difference B - A with a 95% interval (Newcombe's paired method) and McNemar's exact
p-value. A configuration is a comma-separated list of items, each one of
  a preset        {presets} (the presets of the feature options);
  key=value       a flag of this command without its dashes: model=PATH, or a feature's flag;
  a model         'reference' or a checkpoint folder (anything that is neither of the above).
Items override the rest of the command line for that configuration only; the data, --limit,
--batch-size and --max-new-tokens are shared. Examples:
  python -m ascend_vlm eval --model reference --compare unpatched patched
  python -m ascend_vlm eval --compare ckpt/a ckpt/b,unpatched --limit 200 --json out.json

--json OUT writes the full report (every sample's prediction included) atomically; an
existing OUT is replaced only with --force."""


class _ConfigurationError(Exception):
    """A --compare configuration that does not parse (argparse's message)."""


class _ConfigurationParser(argparse.ArgumentParser):
    """The per-configuration flags (``--model`` and the feature options), raising instead of
    exiting so the main parser reports the error against ``--compare``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ConfigurationError(message)


@dataclass(frozen=True)
class _Configuration:
    label: str
    args: argparse.Namespace
    model: Path


def _say(message: str) -> None:
    print(f"[ascend_vlm] {message}", flush=True)


def _positive(value: int | None, flag: str, parser: argparse.ArgumentParser) -> None:
    if value is not None and value < 1:
        parser.error(f"{flag}: expected an int >= 1, got {value}")


class EvalCommand:
    """The ``eval`` subcommand over the feature options of ``registry``."""

    def __init__(self, registry: OptionRegistry = REGISTRY) -> None:
        self.registry = registry
        self.parser: argparse.ArgumentParser | None = None

    def _add_configuration_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model",
            help=f"local checkpoint folder, Hugging Face Hub id, or '{REFERENCE}' for the trained "
            "reference checkpoint (built on first use)",
        )
        self.registry.add_arguments(parser)

    def add_parser(self, commands: Any) -> argparse.ArgumentParser:
        """Add the ``eval`` parser to ``commands`` (an ``add_subparsers`` result); returns it."""
        parser = commands.add_parser(
            "eval",
            help=HELP,
            description=DESCRIPTION,
            epilog=EPILOG.format(presets=", ".join(self.registry.presets()) or "none"),
        )
        self._add_configuration_arguments(parser)
        parser.add_argument("--data", metavar="JSONL", help="evaluate a JSONL/LLaVA file")
        parser.add_argument("--limit", type=int, help="evaluate the first N samples")
        parser.add_argument("--seed", type=int, help="ShapesVQA seed (default 0); not with --data")
        parser.add_argument(
            "--image-size",
            type=int,
            help=f"ShapesVQA image side in pixels (default: the reference recipe's with --model "
            f"{REFERENCE}, else ShapesVQA's); not with --data",
        )
        parser.add_argument(
            "--new-kinds",
            metavar="NAMES",
            help="ShapesVQA scenes of the kinds the reference never saw: K comma-separated names "
            "select the first K of star, cross, hexagon, ring and call them so (e.g. a fine-tune "
            "run's --new-tokens; 'star,cross,hexagon,ring' for their own names); not with --data",
        )
        parser.add_argument("--batch-size", type=int, default=8, help="samples per generate")
        parser.add_argument("--max-new-tokens", type=int, default=8, help="answer token limit")
        parser.add_argument(
            "--no-prefetch",
            dest="prefetch",
            action="store_false",
            help="prepare each batch only when it is due (by default the next batch is read, "
            "encoded and uploaded in a thread while one generates, which on a CPU shares cores "
            "with the timed generation)",
        )
        parser.add_argument(
            "--compare", nargs=2, metavar=("A", "B"), help="two configurations (see below)"
        )
        parser.add_argument("--json", metavar="OUT", help="write the full report to OUT")
        parser.add_argument("--force", action="store_true", help="let --json replace OUT")
        self.parser = parser
        return parser

    def _configuration_parser(self) -> _ConfigurationParser:
        parser = _ConfigurationParser(prog="--compare", add_help=False, allow_abbrev=False)
        self._add_configuration_arguments(parser)
        return parser

    def _configuration_tokens(self, spec: str) -> list[str]:
        presets = self.registry.presets()
        tokens = []
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                raise _ConfigurationError("expected comma-separated items, got an empty item")
            if "=" in item:
                key, value = item.split("=", 1)
                tokens += [f"--{key}", value]
            elif item in presets:
                tokens += presets[item]
            elif item == REFERENCE or Path(item).is_dir():
                tokens += ["--model", item]
            else:
                raise _ConfigurationError(
                    f"expected a preset ({', '.join(sorted(presets))}), key=value, "
                    f"'{REFERENCE}' or a checkpoint folder, got {item!r}"
                )
        return tokens

    def _configurations(self, args: argparse.Namespace) -> list[_Configuration]:
        parser = self.parser
        if args.compare is None:
            named = [(args.model, args, "--model")]
        else:
            named = []
            config_parser = self._configuration_parser()
            for spec in args.compare:
                where = f"--compare: configuration {spec!r}"
                try:
                    tokens = self._configuration_tokens(spec)
                    config = config_parser.parse_args(tokens, namespace=copy.copy(args))
                except _ConfigurationError as error:
                    parser.error(f"{where}: {error}")
                named.append((spec, config, f"{where}: --model"))
        hint = " (give it once, or as model=PATH in each configuration)" if args.compare else ""
        configurations = []
        for label, config, argument in named:
            if config.model is None:
                parser.error(
                    f"--model: expected a checkpoint folder or '{REFERENCE}', got none{hint}"
                )
            try:
                path = checkpoint_folder(config.model, argument)
            except FileNotFoundError as error:
                parser.error(str(error))
            configurations.append(_Configuration(label, config, path))
        return configurations

    def _dataset(self, args: argparse.Namespace) -> EvalDataset:
        from ascend_vlm.data import datasets
        from ascend_vlm.data.shapes_vqa import MIN_IMAGE_SIZE
        from ascend_vlm.data.vqa import BadRecordError

        parser = self.parser
        if args.data is None:
            if args.image_size is not None and args.image_size < MIN_IMAGE_SIZE:
                parser.error(
                    f"--image-size: expected an int >= {MIN_IMAGE_SIZE} pixels, got {args.image_size}"
                )
            seed = 0 if args.seed is None else args.seed
            image_size = args.image_size
            if image_size is None and args.model == REFERENCE:
                # The reference checkpoint is trained (and held out) at its recipe's size.
                from ascend_vlm.finetune.reference_model import RECIPE

                image_size = RECIPE.image_size
            names = [name.strip() for name in (args.new_kinds or "").split(",") if name.strip()]
            if args.new_kinds is not None and not names:
                parser.error(f"--new-kinds: expected comma-separated names, got {args.new_kinds!r}")
            try:
                return datasets.shapes_vqa(args.limit, seed, image_size, names)
            except ValueError as error:
                parser.error(f"--new-kinds: {error}")
        for flag, value in (
            ("--seed", args.seed),
            ("--image-size", args.image_size),
            ("--new-kinds", args.new_kinds),
        ):
            if value is not None:
                parser.error(f"{flag}: applies to ShapesVQA only, not to --data {args.data}")
        if not Path(args.data).is_file():
            parser.error(f"--data: expected a JSONL file, got {args.data} (no such file)")
        try:
            dataset = datasets.jsonl(args.data)
        except BadRecordError as error:
            parser.error(f"--data: {error}")
        if args.limit is None:
            return dataset
        if args.limit > len(dataset):
            parser.error(
                f"--limit: expected at most the {len(dataset)} samples of --data, got {args.limit}"
            )
        return dataset.head(args.limit)

    def _check_json(self, args: argparse.Namespace) -> None:
        if args.json is None:
            return
        out = Path(args.json)
        if not out.parent.is_dir():
            self.parser.error(f"--json: expected a file in an existing folder, got {out}")
        if out.exists() and not args.force:
            self.parser.error(f"--json: {out} exists; pass --force to replace it")

    def run(self, args: argparse.Namespace) -> int:
        """Validate ``args`` (errors exit through argparse, status 2), evaluate every
        configuration, print the report and write it to ``--json``; returns 0."""
        from ascend_vlm.commands.checkpoints import load_model_and_processor
        from ascend_vlm.evaluation.report import (
            build_report,
            configuration_entry,
            format_report,
            write_json,
        )
        from ascend_vlm.evaluation.runner import generate_answers

        if self.parser is None:
            raise RuntimeError("run: call add_parser first")
        for flag in ("--limit", "--batch-size", "--max-new-tokens"):
            _positive(getattr(args, flag[2:].replace("-", "_")), flag, self.parser)
        self._check_json(args)
        dataset = self._dataset(args)
        configurations = self._configurations(args)

        entries = []
        for configuration in configurations:
            _say(f"loading {configuration.model} ...")
            model, processor = load_model_and_processor(configuration.model)
            try:
                options = self.registry.apply(model, configuration.args, processor)
            except ValueError as error:  # the loaded model refuses a feature's flags
                self.parser.error(f"{configuration.label}: {error}")
            for name, applied in options.items():
                _say(f"{name}: {applied['summary']}")
            result = generate_answers(
                model,
                processor,
                dataset,
                batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens,
                description=configuration.label,
                prefetch=args.prefetch,
            )
            options = self.registry.finish(model, configuration.args, options)
            entries.append(
                configuration_entry(configuration.label, str(configuration.model), options, result)
            )
            del model, processor  # release A before B loads
        settings = {
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "prefetch": args.prefetch,
        }
        report = build_report(dataset.description, settings, entries)
        if args.json is not None:
            write_json(report, args.json)
        print(format_report(report), flush=True)
        if args.json is not None:
            _say(f"wrote the full report to {args.json}")
        return 0
