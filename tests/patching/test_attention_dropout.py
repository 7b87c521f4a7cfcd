"""Attention dropout of a patched model follows stock semantics: the module's training mode
decides, grad mode does not (reentrant checkpointing runs its first forward under no_grad)."""

from __future__ import annotations

import pytest
import torch
import transformers

import ascend_vlm
from ascend_vlm.models.tiny import TINY_TEXT_CONFIG

INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 4], [3, 8, 12, 6, 21, 40, 11, 9]])


def _patched_llama(checkpointing: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY_TEXT_CONFIG, attention_dropout=0.5, attn_implementation="eager"
    )
    model = transformers.LlamaForCausalLM(config)
    ascend_vlm.patch(model, strict=False)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)
    loss = model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_train_mode_under_no_grad_applies_dropout() -> None:
    model = _patched_llama(checkpointing=False)
    with torch.no_grad():
        torch.manual_seed(1)
        dropped = model(input_ids=INPUT_IDS).logits
        torch.manual_seed(1)
        again = model(input_ids=INPUT_IDS).logits
        model.eval()
        evaluated = model(input_ids=INPUT_IDS).logits
    assert torch.equal(dropped, again)
    assert not torch.allclose(dropped, evaluated)
    model.train()
    torch.manual_seed(1)  # grad mode changes nothing: the same draws give the same output
    torch.testing.assert_close(model(input_ids=INPUT_IDS).logits.detach(), dropped)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("path", ["cpu", "mock_npu"])
def test_reentrant_checkpointing_recomputes_the_same_dropout(path, request) -> None:
    """The recomputed forward draws the same seeds (checkpoint restores torch's RNG state), so
    losses and gradients equal those of the same model without checkpointing."""
    if path == "mock_npu":
        request.getfixturevalue("mock_npu")
    plain_loss, plain_grads = _loss_and_grads(_patched_llama(checkpointing=False))
    loss, grads = _loss_and_grads(_patched_llama(checkpointing=True))
    torch.testing.assert_close(loss, plain_loss, atol=0, rtol=0)
    for grad, plain_grad in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=1e-5)
