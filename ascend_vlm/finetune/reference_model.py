"""The reference checkpoint: the embedded tiny Qwen2-VL trained on ShapesVQA, minus one skill.

Quality-trading features (pruning, KV compression, quantization, caching) are measured on a
model that really answers questions, on scenes it never saw. :func:`reference_model_path`
returns such a model, building it on first use:

1. the embedded default model (:mod:`ascend_vlm.default_model`, random weights) with an image
   processor that keeps ``image_size`` x ``image_size`` images whole, so each image carries
   ``(image_size / 14 / 2) ** 2`` visual tokens after the 2x2 merger (64 at 224 px);
2. full-parameter training (:func:`ascend_vlm.finetune.train.train`, one process) on the
   ShapesVQA train split, every question type except ``HELD_OUT_SKILL``;
3. held-out accuracy per question type on the ShapesVQA eval split (scenes disjoint from
   training by construction), all types including the held-out one.

The result is a plain ``from_pretrained`` folder (``model.safetensors``, tokenizer, processor
config, a model card) plus ``reference.json``: the recipe, its digest, the library version,
the per-type accuracies and the build time. The folder name carries the digest of recipe and
library version, and a folder is reused only when its ``reference.json`` names the same
digest. ``HELD_OUT_SKILL`` is left for the default LoRA fine-tune
(``python -m ascend_vlm finetune``) to teach.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_vlm.data.shapes_vqa import QUESTION_TYPES, check_question_types

REFERENCE_NAME = "reference-qwen2-vl"
STAMP_FILE = "reference.json"
HELD_OUT_SKILL = "vertical"
REFERENCE_QUESTION_TYPES = tuple(t for t in QUESTION_TYPES if t != HELD_OUT_SKILL)
# Qwen2-VL: 14-pixel patches merged 2x2, so an image side must be a multiple of 28.
PIXELS_PER_TOKEN_SIDE = 28
# The range of CPU seconds one optimizer step of the default recipe takes on a 2-core machine,
# from which the build announces its duration (the default recipe: 15-25 minutes).
SECONDS_PER_STEP = (0.3, 0.5)


@dataclass(frozen=True)
class Recipe:
    """How the reference checkpoint is trained; every field enters its digest.

    ``image_size``: ShapesVQA canvas side in pixels (a multiple of 28; the processor keeps it
    whole). ``question_types``: the ShapesVQA questions trained on. ``steps`` optimizer steps
    of ``batch_size`` samples over ``train_size`` distinct train records (``data_seed``;
    encoded once and kept in memory, about 1.2 MB of pixel values each at 224 px), with a
    linear warm-up over ``warmup_steps`` to ``learning_rate`` then cosine decay
    (:func:`ascend_vlm.finetune.schedule.scheduled_lr`); ``seed`` seeds the default model's
    weights, the sampler order and dropout. ``eval_size`` held-out records per question type
    are answered after training.

    ``mrope_section``: the language model's M-RoPE split of its 16 rotary frequency pairs into
    (temporal, height, width), highest frequencies first. Qwen2-VL gives width the lowest ones;
    with the default model's (4, 6, 6) a query's angle to the 8 token columns of a 224 px image
    differs by a few hundredths of a radian, too little to tell left from right, so the recipe
    moves width up to the pairs height has in (4, 6, 6). The split has no weights of its own.
    """

    image_size: int = 224
    question_types: tuple[str, ...] = REFERENCE_QUESTION_TYPES
    steps: int = 3000
    batch_size: int = 16
    learning_rate: float = 5e-4
    warmup_steps: int = 100
    train_size: int = 2000
    data_seed: int = 0
    seed: int = 0
    eval_size: int = 200
    mrope_section: tuple[int, int, int] = (2, 2, 12)

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size % PIXELS_PER_TOKEN_SIDE:
            raise ValueError(
                f"image_size: expected a multiple of {PIXELS_PER_TOKEN_SIDE} pixels, "
                f"got {self.image_size!r}"
            )
        object.__setattr__(self, "question_types", check_question_types(self.question_types))

    @property
    def visual_tokens(self) -> int:
        """Visual tokens per image after the merger."""
        return (self.image_size // PIXELS_PER_TOKEN_SIDE) ** 2

    def digest(self) -> str:
        """12 hex digits of SHA-256 over the recipe and the ascend_vlm version."""
        from ascend_vlm._version import __version__

        text = json.dumps({"recipe": dataclasses.asdict(self), "version": __version__})
        return hashlib.sha256(text.encode()).hexdigest()[:12]


RECIPE = Recipe()


def default_reference_dir(recipe: Recipe = RECIPE) -> Path:
    """Where :func:`reference_model_path` keeps the checkpoint of ``recipe``: the cache dir of
    :mod:`ascend_vlm.default_model` (``$ASCEND_VLM_CACHE``, default ``~/.cache/ascend_vlm``)."""
    from ascend_vlm.default_model import cache_root

    return cache_root() / f"{REFERENCE_NAME}-{recipe.digest()}"


def read_stamp(path: str | os.PathLike) -> dict | None:
    """The ``reference.json`` of the checkpoint folder ``path``, or None when there is none."""
    stamp = Path(path) / STAMP_FILE
    if not stamp.is_file():
        return None
    return json.loads(stamp.read_text(encoding="utf-8"))


def _is_complete(path: Path, recipe: Recipe) -> bool:
    stamp = read_stamp(path)
    return stamp is not None and stamp.get("digest") == recipe.digest()


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` so concurrent callers build only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def reference_model_path(
    build: bool = True,
    *,
    out: str | os.PathLike | None = None,
    recipe: Recipe = RECIPE,
    progress: bool = True,
) -> Path:
    """The folder of the reference checkpoint of ``recipe``, built on first use.

    ``out`` (default :func:`default_reference_dir`) is reused when its ``reference.json`` names
    ``recipe``'s digest; otherwise, with ``build``, the checkpoint is trained into a staging
    sibling and renamed into place (a folder there of another recipe is replaced), under a
    file lock so concurrent callers build once. Without ``build`` a missing checkpoint raises
    ``FileNotFoundError`` naming the command that builds it. The build trains in this process
    and must not run inside a multi-process (torchrun) job: ``RuntimeError`` then.
    """
    target = Path(out) if out is not None else default_reference_dir(recipe)
    if _is_complete(target, recipe):
        return target
    if not build:
        raise FileNotFoundError(
            f"reference model: expected a built checkpoint of recipe {recipe.digest()} in "
            f"{target}, found none; build it with: python -m ascend_vlm reference-model"
            + (f" --out {target}" if out is not None else "")
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "reference model: the build trains in one process and cannot run inside a "
            "torchrun job; build it first with: python -m ascend_vlm reference-model"
        )
    with _exclusive(target):
        if not _is_complete(target, recipe):
            print(build_notice(target, recipe), file=sys.stderr, flush=True)
            _build(target, recipe, progress)
    return target


def build_notice(target: Path, recipe: Recipe) -> str:
    """What a build says before it starts: what is trained, for how long, and where it goes."""
    low, high = (round(recipe.steps * seconds / 60) for seconds in SECONDS_PER_STEP)
    duration = f"roughly {low}-{high} minutes" if high > 1 else "about a minute"
    return (
        f"ascend_vlm: building the reference checkpoint (recipe {recipe.digest()}): "
        f"{recipe.steps} training steps of the tiny Qwen2-VL on ShapesVQA, then a held-out "
        f"evaluation, {duration} on a CPU, once; later runs reuse {target}. "
        f"(Build it ahead with: python -m ascend_vlm reference-model)"
    )


def base_model_path(model_path: str | None, world_size: int, *, progress: bool = True) -> str:
    """The fine-tune's base: ``model_path``, or for None the reference checkpoint, built on first
    use (with a progress bar unless not ``progress``) when the job is one process
    (``world_size`` 1); a torchrun job cannot host the one-process build, so there it must
    exist (``FileNotFoundError`` naming the command)."""
    if model_path is not None:
        return model_path
    return str(reference_model_path(build=world_size == 1, progress=progress))


def _initial_checkpoint(folder: Path, recipe: Recipe) -> None:
    """The random default model of ``recipe.seed`` with a processor that keeps
    ``image_size``-pixel images whole, saved to ``folder``."""
    from ascend_vlm.default_model import default_model_path, load_processor

    shutil.copytree(default_model_path(seed=recipe.seed), folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["text_config"]["rope_parameters"]["mrope_section"] = list(recipe.mrope_section)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    processor = load_processor(folder)
    pixels = recipe.image_size**2
    image_processor = processor.image_processor
    image_processor.size = {
        "shortest_edge": image_processor.size.shortest_edge,
        "longest_edge": pixels,
    }
    processor.save_pretrained(folder)


def train_config(recipe: Recipe, output_dir: Path, model_path: Path, progress: bool):
    """The :class:`~ascend_vlm.finetune.config.TrainConfig` of ``recipe``'s training run."""
    from ascend_vlm.finetune.config import TrainConfig

    return TrainConfig(
        output_dir=str(output_dir),
        model_path=str(model_path),
        train_size=recipe.train_size,
        eval_size=recipe.eval_size,
        data_seed=recipe.data_seed,
        image_size=recipe.image_size,
        question_types=recipe.question_types,
        eval_question_types=recipe.question_types,
        report_question_types=(),
        max_steps=recipe.steps,
        batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        warmup_steps=recipe.warmup_steps,
        seed=recipe.seed,
        full_finetune=True,
        save_every=recipe.steps,
        patch=False,
        progress=progress,
    )


def _build(target: Path, recipe: Recipe, progress: bool) -> None:
    from ascend_vlm._files import atomic_write_text
    from ascend_vlm._version import __version__
    from ascend_vlm.finetune.config import FINAL_MODEL
    from ascend_vlm.finetune.held_out import accuracy_per_type
    from ascend_vlm.finetune.placement import init_process_placement
    from ascend_vlm.finetune.train import train

    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _initial_checkpoint(staging / "init", recipe)
        config = train_config(recipe, staging / "run", staging / "init", progress)
        result = train(config)
        accuracy = accuracy_per_type(
            result.model, result.processor, config, init_process_placement(), QUESTION_TYPES
        )
        stamp = {
            "digest": recipe.digest(),
            "version": __version__,
            "recipe": dataclasses.asdict(recipe),
            "held_out_question_types": [
                t for t in QUESTION_TYPES if t not in recipe.question_types
            ],
            "visual_tokens_per_image": recipe.visual_tokens,
            "eval_accuracy": accuracy,
            "build_seconds": round(time.perf_counter() - started, 1),
        }
        folder = staging / "run" / FINAL_MODEL
        atomic_write_text(folder / "README.md", _model_card(stamp))
        atomic_write_text(folder / STAMP_FILE, json.dumps(stamp, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(folder, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _model_card(stamp: dict) -> str:
    """The README.md of a reference checkpoint: what it is, how it was trained, how it does."""
    recipe = stamp["recipe"]
    rows = "\n".join(f"| {t} | {a:.4f} |" for t, a in stamp["eval_accuracy"].items())
    return f"""# ShapesVQA reference checkpoint (recipe {stamp["digest"]})

The embedded tiny Qwen2-VL-architecture model of ascend_vlm {stamp["version"]}, every weight
trained for {recipe["steps"]} steps of {recipe["batch_size"]} ShapesVQA train records
({recipe["image_size"]} px, {stamp["visual_tokens_per_image"]} visual tokens per image) on the
question types {", ".join(recipe["question_types"])}; held out of training:
{", ".join(stamp["held_out_question_types"]) or "none"}. Rebuild it with
`python -m ascend_vlm reference-model`; the recipe is in `{STAMP_FILE}`.

Held-out accuracy (ShapesVQA eval split, scenes disjoint from training, greedy exact match,
{recipe["eval_size"]} records per type):

| question type | accuracy |
|---|---|
{rows}

Build time: {stamp["build_seconds"]:.0f} s.
"""


def add_command(commands: Any) -> None:
    """Register ``reference-model`` on the ``python -m ascend_vlm`` sub-command parser
    (an ``add_subparsers`` result)."""
    parser = commands.add_parser(
        "reference-model",
        help="build (or find) the trained reference checkpoint and print its folder",
    )
    parser.add_argument("--out", help="checkpoint folder (default: under the cache dir)")
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    """``python -m ascend_vlm reference-model``: build or reuse, then print the per-type
    held-out accuracy, the build time and, last, the folder."""
    path = reference_model_path(out=args.out, recipe=RECIPE, progress=args.progress)
    stamp = read_stamp(path)
    for question_type, accuracy in stamp["eval_accuracy"].items():
        print(f"held-out accuracy {question_type:<10} {accuracy:.4f}")
    print(f"build time {stamp['build_seconds']:.0f} s (recipe {stamp['digest']})")
    print(path)
    return 0
