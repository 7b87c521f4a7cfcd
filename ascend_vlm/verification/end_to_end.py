"""End to end: how far a model's outputs are from its reference's on the same samples.

For each sample, both models read the same prompt (the processor's chat template over the
question and image, as the evaluation prompts them). Over the prompt positions:

* top-1 agreement: the share of positions where both models' most likely next token is the
  same;
* ``KL(reference || model) = sum_v p_ref(v) (log p_ref(v) - log p_model(v))`` of the
  next-token distributions at each position, its mean and max. Logits are moved to the CPU in
  fp32 (the model under test may be on an NPU in bf16) and compared in float64.

Then both generate greedily (``max_new_tokens``): the first index where the two generations
differ and the two tokens there, decoded. When samples carry gold answers (ShapesVQA, JSONL
files: :class:`~ascend_vlm.data.vqa.VQASample`), each answer is scored with the evaluation's
primary metric and the two accuracies are compared with the paired test of
:func:`~ascend_vlm.data.statistics.paired_accuracies` (``difference`` = model -
reference, its 95% interval, McNemar's p).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ascend_vlm.data.answer_metrics import METRICS, PRIMARY_METRIC
from ascend_vlm.data.statistics import paired_accuracies
from ascend_vlm.data.vqa import VQASample, collate, encode_sample, pad_token_id_of

DEFAULT_MAX_NEW_TOKENS = 16


@dataclass(frozen=True)
class SampleComparison:
    """One sample: ``positions`` prompt positions compared, how many agree at top 1, the mean
    and max KL there; the greedy ``first_divergence`` index (None when both generations are
    the same) with the two tokens there (``"<end>"`` where a generation stopped); the two
    decoded answers and the gold ``answer`` (None without one)."""

    index: int
    positions: int
    top1_agreeing: int
    mean_kl: float
    max_kl: float
    first_divergence: int | None
    model_token: str | None
    reference_token: str | None
    model_answer: str
    reference_answer: str
    answer: str | None


@dataclass(frozen=True)
class EndToEndReport:
    """Every :class:`SampleComparison`, the totals over all prompt positions, and
    ``accuracy``: :func:`paired_accuracies` of (reference, model) when every sample has a gold
    answer, else None."""

    samples: tuple[SampleComparison, ...]
    top1_agreement: float
    mean_kl: float
    max_kl: float
    accuracy: dict[str, Any] | None
    metric: str

    @property
    def first_divergence(self) -> int | None:
        """The earliest greedy index where any sample's generations differ, or None."""
        indices = [s.first_divergence for s in self.samples if s.first_divergence is not None]
        return min(indices, default=None)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {**asdict(self), "first_divergence": self.first_divergence}

    def table(self) -> str:
        """A readable summary: the totals, one row per sample, and the paired accuracies."""
        lines = [
            f"end to end over {len(self.samples)} samples: top-1 agreement "
            f"{self.top1_agreement:.4f}, KL(reference || model) mean {self.mean_kl:.3e} "
            f"max {self.max_kl:.3e}",
            f"{'sample':>6}  {'top-1':>7}  {'mean KL':>10}  {'max KL':>10}  first divergence",
        ]
        for s in self.samples:
            where = (
                "none"
                if s.first_divergence is None
                else f"token {s.first_divergence}: model {s.model_token!r} vs reference "
                f"{s.reference_token!r}"
            )
            lines.append(
                f"{s.index:>6}  {s.top1_agreeing / s.positions:>7.4f}  {s.mean_kl:>10.3e}  "
                f"{s.max_kl:>10.3e}  {where}"
            )
        if self.accuracy is not None:
            a = self.accuracy
            low, high = a["ci95"]
            lines.append(
                f"accuracy ({self.metric}): reference {a['first_accuracy']:.4f}, model "
                f"{a['second_accuracy']:.4f}, difference {a['difference']:+.4f} "
                f"(95% paired interval [{low:+.4f}, {high:+.4f}], McNemar p {a['mcnemar_p']:.3g})"
            )
        return "\n".join(lines)


def compare_end_to_end(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    processor: Any,
    samples: Sequence[VQASample | Mapping[str, torch.Tensor]],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> EndToEndReport:
    """Compare ``model`` with ``reference`` on ``samples`` (module docstring): VQA samples
    (prompted through ``processor``) or ready model inputs with a batch of one (no gold
    answer). Each model runs on its own device and dtype. Raises ValueError for no samples,
    ``max_new_tokens`` below 1, or a batch of inputs that is not one row."""
    if not len(samples):
        raise ValueError("samples: expected at least one sample, got none")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    pad_id = pad_token_id_of(processor)
    compared = []
    with torch.no_grad():
        for index in range(len(samples)):
            sample = samples[index]
            inputs, answer = _prompt(processor, sample, pad_id, index)
            comparison = _compare_sample(model, reference, processor, inputs, max_new_tokens)
            compared.append(replace(comparison, index=index, answer=answer))
    return _report(compared)


def _prompt(
    processor: Any, sample: VQASample | Mapping[str, torch.Tensor], pad_id: int, index: int
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The batch-of-one model inputs of ``sample`` (its tensors but ``labels``) and its gold
    answer (None without one)."""
    if isinstance(sample, VQASample):
        batch = collate([encode_sample(processor, sample, with_answer=False)], pad_id)
        del batch["labels"]
        return batch, sample.answer
    inputs = {k: v for k, v in sample.items() if isinstance(v, torch.Tensor) and k != "labels"}
    if "input_ids" not in inputs or inputs["input_ids"].dim() != 2 or len(inputs["input_ids"]) != 1:
        raise ValueError(
            f"samples[{index}]: expected a VQASample or model inputs with input_ids of shape "
            f"[1, S], got {type(sample).__name__}"
        )
    return inputs, None


def _on(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    return {key: value.to(device) for key, value in inputs.items()}


def _compare_sample(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    processor: Any,
    inputs: dict[str, torch.Tensor],
    max_new_tokens: int,
) -> SampleComparison:
    """The comparison of one prompt (as sample 0, without a gold answer)."""
    log_p_model = _next_token_log_probs(model, inputs)
    log_p_reference = _next_token_log_probs(reference, inputs)
    kl = (log_p_reference.exp() * (log_p_reference - log_p_model)).sum(-1)
    agreeing = int((log_p_model.argmax(-1) == log_p_reference.argmax(-1)).sum())
    pad_id = pad_token_id_of(processor)
    model_tokens = _greedy(model, inputs, max_new_tokens, pad_id)
    reference_tokens = _greedy(reference, inputs, max_new_tokens, pad_id)
    divergence = _first_difference(model_tokens, reference_tokens)
    return SampleComparison(
        index=0,
        positions=len(kl),
        top1_agreeing=agreeing,
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        first_divergence=divergence,
        model_token=None
        if divergence is None
        else _token_text(processor, model_tokens, divergence),
        reference_token=None
        if divergence is None
        else _token_text(processor, reference_tokens, divergence),
        model_answer=processor.decode(model_tokens, skip_special_tokens=True),
        reference_answer=processor.decode(reference_tokens, skip_special_tokens=True),
        answer=None,
    )


def _next_token_log_probs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[P, V]`` float64 log-probabilities of the next token at the P attended prompt
    positions, from logits moved to the CPU in fp32."""
    logits = model(**_on(model, inputs)).logits[0].to("cpu", torch.float32)
    attended = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))[0].bool().cpu()
    return torch.log_softmax(logits[attended].double(), dim=-1)


def _greedy(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], max_new_tokens: int, pad_id: int
) -> list[int]:
    """The tokens ``model`` generates greedily after the prompt."""
    output = model.generate(
        **_on(model, inputs), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id
    )
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def _first_difference(first: list[int], second: list[int]) -> int | None:
    """The first index where the two token lists differ (one ending counts), or None."""
    for position, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return position
    return None if len(first) == len(second) else min(len(first), len(second))


def _token_text(processor: Any, tokens: list[int], position: int) -> str:
    return processor.decode([tokens[position]]) if position < len(tokens) else "<end>"


def _report(compared: list[SampleComparison]) -> EndToEndReport:
    positions = sum(s.positions for s in compared)
    scored = all(s.answer is not None for s in compared)
    metric = METRICS[PRIMARY_METRIC]
    accuracy = (
        paired_accuracies(
            [metric(s.reference_answer, s.answer) for s in compared],
            [metric(s.model_answer, s.answer) for s in compared],
        )
        if scored
        else None
    )
    return EndToEndReport(
        samples=tuple(compared),
        top1_agreement=sum(s.top1_agreeing for s in compared) / positions,
        mean_kl=sum(s.mean_kl * s.positions for s in compared) / positions,
        max_kl=max(s.max_kl for s in compared),
        accuracy=accuracy,
        metric=PRIMARY_METRIC,
    )
