"""Which settings a resumed run may change, and what a change does.

A run saves its settings as ``<output_dir>/train_config.json`` when it starts. Resuming compares
the new settings against that file, one setting at a time:

* run control (``RUN_CONTROL``: where to resume from, when to stop early, the checkpoint period,
  the progress bar, the final evaluation's data, question types and batch, the per-type report,
  the merged copy, ``report_to``, ``eval_steps``, ``patch``, ``comm_hook`` and
  ``gradient_checkpointing``, which give the same gradients either way) may change freely;
* the step count (``STEP_COUNTS``: ``max_steps``) may change to any count not below the steps
  already trained: training continues to the new count (a finished run too, replacing its
  adapter at the end; its checkpoints stay), and the learning-rate schedule is recomputed to
  end there;
* every other setting defines which weights are trained and their shapes, the data and its
  order, or the optimizer and schedule of the steps already taken; a change is refused, naming
  the setting, and the saved file is left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONFIG_FILE = "train_config.json"
RUN_CONTROL = frozenset(
    {
        "output_dir",
        "resume",
        "stop_after_steps",
        "save_every",
        "progress",
        "eval_data",
        "eval_size",
        "eval_question_types",
        "report_question_types",
        "save_merged",
        "eval_batch_size",
        "max_new_tokens",
        "patch",
        "comm_hook",
        "collective_timeout",
        "report_to",
        "eval_steps",
        "gradient_checkpointing",
        "overwrite_output_dir",
    }
)
STEP_COUNTS = {"max_steps": "the LoRA phase"}
# Why a fixed setting cannot change under a saved run; settings not listed define the model.
_DATA = (
    "train_data",
    "train_size",
    "data_seed",
    "image_size",
    "shapes_binding",
    "shapes_new_kinds",
    "question_types",
    "on_bad_record",
)
_ORDER = ("batch_size", "grad_accum", "seed")
_OPTIMIZER = (
    "learning_rate",
    "weight_decay",
    "warmup_steps",
    "max_grad_norm",
)
_REASONS = {
    **dict.fromkeys(_DATA, "the saved data position indexes this training set"),
    **dict.fromkeys(_ORDER, "the saved data position and batches follow it"),
    **dict.fromkeys(_OPTIMIZER, "the saved optimizer state and learning-rate schedule follow it"),
    "bf16": "the steps already taken ran in its precision",
    "fsdp": "a run sharded with it saves no optimizer state to continue from",
}
_MODEL_REASON = "it defines which weights are trained and their shapes"


class ResumeError(ValueError):
    """A resumed run asks for settings its saved run cannot continue with."""


def flag(name: str) -> str:
    """The command-line flag of a ``TrainConfig`` field: ``lora_r`` -> ``--lora-r``."""
    return "--" + name.replace("_", "-")


def check_resume(
    saved: Mapping[str, Any],
    requested: Mapping[str, Any],
    trained: Mapping[str, int | None],
    config_path: str,
) -> list[str]:
    """Compare ``requested`` settings with the ``saved`` ones of the run being resumed.

    Both map field names to JSON values (lists for sequences); a field missing from either side
    is not compared. ``trained`` maps each ``STEP_COUNTS`` name to the steps already trained.
    Returns one log line per accepted change of
    a step count. Raises :class:`ResumeError` naming every refused setting with its saved and
    requested value (``config_path`` names the saved file in the message).
    """
    notes, refused = [], []
    for name in sorted(set(saved) & set(requested)):
        old, new = saved[name], requested[name]
        if old == new or name in RUN_CONTROL:
            continue
        if name in STEP_COUNTS:
            done = trained[name]
            phase = STEP_COUNTS[name]
            if new < done:
                refused.append(
                    f"{flag(name)}: saved {old!r}, got {new!r}; expected at least {done}, the "
                    f"steps {phase} has already trained (a larger count continues training)"
                )
            else:
                notes.append(
                    f"resume: {flag(name)} {old} -> {new}: {phase} continues from step {done} "
                    f"to step {new}; its learning-rate schedule is recomputed to end at {new}"
                )
            continue
        reason = _REASONS.get(name, _MODEL_REASON)
        refused.append(f"{flag(name)}: saved {old!r}, got {new!r}; {reason}")
    if refused:
        raise ResumeError(
            "resume: the saved run cannot continue with changed settings:\n  "
            + "\n  ".join(refused)
            + f"\nResume with the saved values ({config_path}), or start a new run in "
            "another --output-dir."
        )
    return notes
