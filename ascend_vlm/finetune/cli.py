"""``python -m ascend_vlm finetune``: LoRA fine-tuning of a Hugging Face VLM on transformers'
Trainer, one process per device.

    torchrun --nproc_per_node=2 -m ascend_vlm finetune               # ShapesVQA, reference
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 -m ascend_vlm finetune --model-path /models/Qwen2-VL-2B
    python -m ascend_vlm finetune --max-steps 20                     # single process

The last line printed (rank 0) is ``eval_accuracy: <fraction>``. A user's mistake (a bad flag or
value, a missing model or data file, a refused resume) prints one ``error:`` line on rank 0 and
exits with status 2 on every rank; SIGINT or SIGTERM saves a checkpoint of the last finished
step and exits with 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from typing import IO, Any, NoReturn

from ascend_vlm.data.vqa import BAD_RECORD_POLICIES
from ascend_vlm.finetune.config import COMM_HOOKS, DTYPES, TrainConfig
from ascend_vlm.finetune.reference_model import HELD_OUT_SKILL, base_model_path

PROGRAM = "python -m ascend_vlm"
DESCRIPTION = (
    "LoRA fine-tuning of a Hugging Face VLM on transformers' Trainer, one process per device."
)
EPILOG = f"""\
Launch with torchrun: torchrun --nproc_per_node=N -m ascend_vlm finetune [options].
Without --model-path the base is the reference checkpoint (python -m ascend_vlm reference-model,
built on first use by a single-process run), trained without ShapesVQA's {HELD_OUT_SKILL!r}
questions; the default run teaches them in {TrainConfig.max_steps} LoRA steps and prints the
held-out accuracy per question type before and after. --resume latest continues a run; it
refuses changed settings other than run control and the step count.
"""
HELP = "fine-tune a VLM with LoRA on transformers' Trainer (launched by torchrun)"
# A user's mistake found while parsing or starting: a bad value, a missing file or folder, a
# bad data record, a refused resume (all ValueError or FileNotFoundError).
USER_ERRORS = (ValueError, FileNotFoundError)


class RankZeroParser(argparse.ArgumentParser):
    """An argument parser that prints help, usage and errors on rank 0 only.

    Under torchrun every rank parses the same command line; the other ranks exit with the
    same status, silently, so ``--help`` or a bad flag shows once.
    """

    def __init__(self, *args, rank: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank

    def print_help(self, file: IO[str] | None = None) -> None:
        if self.rank == 0:
            super().print_help(file)

    def print_usage(self, file: IO[str] | None = None) -> None:
        if self.rank == 0:
            super().print_usage(file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        super().exit(status, message if self.rank == 0 else None)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def parse_args(argv: list[str], program: str = PROGRAM) -> TrainConfig:
    """The run's settings from the command line ``argv`` (``SystemExit`` 2 naming a bad flag,
    ``ValueError`` naming a bad value, ``FileNotFoundError`` naming a ``--model-path`` that is
    neither a folder nor a Hub id that can be fetched)."""
    from ascend_vlm.commands.checkpoints import REFERENCE, resolve_model

    defaults = TrainConfig()
    parser = RankZeroParser(
        prog=f"{program} finetune",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        rank=_rank(),
    )

    def add(*flags: str, help: str, **kwargs) -> None:
        """Add an option for the ``TrainConfig`` field it names, defaulting to that field's
        default; its help ends with the default when there is one worth showing (an empty
        one says so in words, if at all)."""
        if kwargs.get("action") is None and "default" not in kwargs:
            default = getattr(defaults, flags[0][2:].replace("-", "_"))
            is_list = isinstance(default, (tuple, list))
            kwargs["default"] = ",".join(default) if is_list else default
        if kwargs.get("default") not in (None, "") and kwargs.get("action") is None:
            help += " (default: %(default)s)"
        parser.add_argument(*flags, help=help, **kwargs)

    add("--output-dir", help="checkpoints, metrics, final adapter")
    add(
        "--model-path",
        help="local from_pretrained folder, Hugging Face Hub id, or 'reference' (default: the "
        "reference checkpoint)",
    )
    add("--train-data", help="JSONL of VQA / LLaVA records (default: ShapesVQA)")
    add("--eval-data", help="JSONL for the final eval (default: ShapesVQA eval)")
    add("--train-size", type=int, help="ShapesVQA train records")
    add("--eval-size", type=int, help="ShapesVQA eval records")
    add("--data-seed", type=int, help="ShapesVQA generator seed")
    add("--image-size", type=int, help="ShapesVQA image side (px)")
    add(
        "--shapes-binding",
        action="store_true",
        help="ShapesVQA: ask colour/shape/position about 1-4-shape scenes (harder)",
    )
    add("--question-types", help="comma-separated ShapesVQA question types trained on")
    add("--eval-question-types", help="ShapesVQA question types of the final eval_accuracy")
    add(
        "--report-question-types",
        help="ShapesVQA types whose held-out accuracy is printed before and after ('' for none)",
    )
    add(
        "--on-bad-record",
        choices=BAD_RECORD_POLICIES,
        help="skip a bad JSONL record with a warning, or stop with its number",
    )
    add("--max-steps", type=int, help="optimizer steps of LoRA")
    add("--batch-size", type=int, help="samples per rank per micro")
    add("--grad-accum", type=int, help="micro-batches per step")
    add("--learning-rate", "--lr", type=float, help="peak learning rate")
    add("--weight-decay", type=float, help="AdamW weight decay")
    add(
        "--warmup-steps",
        type=int,
        help="linear warm-up steps (step 1 runs at lr / warmup) before the cosine decay",
    )
    add("--max-grad-norm", type=float, help="gradient clipping")
    add("--seed", type=int, help="init, sampler order and dropout seed")
    add("--lora-r", type=int, help="LoRA rank")
    add("--lora-alpha", type=int, help="LoRA scaling numerator")
    add("--lora-dropout", type=float, help="LoRA input dropout")
    add("--lora-targets", help="comma-separated language-model linear names")
    add("--lora-vision", action="store_true", help="also adapt every vision-tower linear")
    add("--lora-projector", action="store_true", help="also adapt the projector's linears")
    add(
        "--modules-to-save",
        help="comma-separated modules trained in full and saved with the adapter ('' for none)",
    )
    add("--full-finetune", action="store_true", help="train every weight instead of LoRA")
    add(
        "--adapter-name",
        help="PEFT name of the trained LoRA adapter, used by the model card's loading code (the "
        "folder does not record it)",
    )
    add(
        "--new-tokens",
        help="comma-separated new tokens (e.g. '<star>,<ring>') added to the tokenizer, "
        "embedding and head; only their rows train beside LoRA (PEFT trainable tokens), "
        "initialised from the images of training records that mention them, saved with the "
        "adapter; needs --modules-to-save ''",
    )
    add(
        "--shapes-new-kinds",
        action="store_true",
        help="ShapesVQA adds kinds the reference never saw (star, cross, hexagon, ring), "
        "named by --new-tokens in order: training scenes mix them with the base kinds, eval "
        "scenes show only them",
    )
    add(
        "--quantize",
        type=int,
        choices=(4, 8),
        help="train LoRA on a base whose language-model linears are weight-only quantized "
        "(4: W4 g128, 8: W8 per channel; QLoRA-style)",
    )
    add("--dtype", choices=tuple(DTYPES), help="weight dtype to load, train and save in")
    add(
        "--save-merged",
        metavar="DIR",
        help="also save base + LoRA merged (merge_and_unload) as a plain from_pretrained folder",
    )
    add("--save-every", type=int, help="checkpoint period (steps)")
    add("--resume", help="checkpoint directory or 'latest' (default: start a new run)")
    add("--stop-after-steps", type=int, help="stop early (simulates a crash)")
    add("--no-patch", dest="patch", action="store_false", help="skip ascend_vlm.patch")
    add(
        "--comm-hook",
        choices=COMM_HOOKS,
        help="DDP gradient all-reduce: the sparse-mask hook or plain DDP",
    )
    add(
        "--collective-timeout",
        type=float,
        help="seconds a collective may wait for the other ranks before the job fails, naming "
        "the step and rank",
    )
    add("--eval-batch-size", type=int, help="samples per generate() call in the final eval")
    add("--max-new-tokens", type=int, help="answer tokens generated per eval sample")
    add("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    add(
        "--report-to",
        help="comma-separated Trainer report_to integrations (tensorboard, wandb, ...) ('' for none)",
    )
    add(
        "--eval-steps",
        type=int,
        help="evaluate the loss on the eval data every N steps during training (default: never)",
    )
    add(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass (less memory, more compute)",
    )
    add("--bf16", action="store_true", help="train under bf16 autocast (mixed precision)")
    add(
        "--fsdp",
        action="store_true",
        help="shard the base over the ranks while loading it (FSDP2, one unit per decoder and "
        "vision layer) and train LoRA beside the shards, instead of a full copy per rank "
        "under DDP (default: off); needs 2+ ranks and --modules-to-save '', refuses "
        "--full-finetune, --quantize, --new-tokens and --resume; the sparse hook is DDP's "
        "and stays off",
    )
    add(
        "--overwrite-output-dir",
        action="store_true",
        help="start a new run in a folder holding one, deleting its checkpoints, metrics and result",
    )
    values = vars(parser.parse_args(argv))
    if values["model_path"] == REFERENCE:  # the default base, which main() resolves
        values["model_path"] = None
    elif values["model_path"] is not None:  # a Hub id becomes its snapshot folder in the cache
        values["model_path"] = str(resolve_model(values["model_path"], "model_path"))
    sequences = ("question_types", "eval_question_types", "report_question_types", "report_to")
    for name in ("lora_targets", "modules_to_save", "new_tokens", *sequences):
        values[name] = tuple(part.strip() for part in values[name].split(",") if part.strip())
    return TrainConfig(**values)


def _naming_the_flag(message: str) -> str:
    """``message`` with its leading ``TrainConfig`` field name (``max_steps: ...``, as the
    config's own checks name it for API users) written as the flag a command-line user typed
    (``--max-steps: ...``)."""
    field, colon, rest = message.partition(": ")
    if colon and field in {spec.name for spec in dataclasses.fields(TrainConfig)}:
        return f"--{field.replace('_', '-')}: {rest}"
    return message


def main(argv: list[str], program: str = PROGRAM) -> int:
    """Fine-tune per ``argv`` in this process; returns the exit status: 0, 2 for a user's
    mistake (one ``error:`` line on rank 0), 128 + the signal's number when SIGINT or SIGTERM
    stopped the run after saving a checkpoint."""
    # Trainer's stack loads here, not when the command line of another sub-command is built.
    from ascend_vlm.finetune.train import close_process_group, prepare, run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = parse_args(argv, program)
        # The default base is the reference checkpoint, resolved here (not in prepare(), which
        # the reference build itself runs) so the recorded run config names the folder it used.
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        base = base_model_path(config.model_path, world_size, progress=config.progress)
        prepared = prepare(dataclasses.replace(config, model_path=base))
    except USER_ERRORS as error:
        close_process_group()
        if _rank() == 0:
            print(f"error: {_naming_the_flag(str(error))}", file=sys.stderr, flush=True)
        return 2
    try:
        result = run(prepared)
    finally:
        close_process_group()
    if result.stopped_by_signal is not None:
        if _rank() == 0:
            name = signal.Signals(result.stopped_by_signal).name
            print(
                f"{name}: stopped after a checkpoint of the last finished step; continue with "
                "--resume latest",
                file=sys.stderr,
                flush=True,
            )
        return 128 + result.stopped_by_signal
    return 0


def add_command(commands: Any) -> None:
    """Register ``finetune`` on the ``python -m ascend_vlm`` sub-command parser (an
    ``add_subparsers`` result). Its options are parsed by :func:`parse_args` (every rank parses
    them, rank 0 alone prints), so the sub-command takes its arguments whole."""
    parser = commands.add_parser("finetune", help=HELP, add_help=False, prefix_chars="\0")
    parser.add_argument("argv", nargs="*")
    parser.set_defaults(handler=lambda args: main(args.argv, parser.prog.rsplit(" ", 1)[0]))
