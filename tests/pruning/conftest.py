import pytest

from ascend_vlm import pruning


@pytest.fixture
def pruned():
    """``pruned(model)`` marks a model whose token pruning is disabled after the test."""
    models = []
    yield models.append
    for model in models:
        pruning.disable_token_pruning(model)
