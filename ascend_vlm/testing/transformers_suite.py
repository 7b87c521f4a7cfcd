"""pytest plugin that runs transformers' own model tests on patched models.

With ``--ascend-vlm-patch`` every top-level ``PreTrainedModel`` a test builds is
``ascend_vlm.patch(model, strict=False)``-ed right after construction, through a wrapper around
``PreTrainedModel.post_init`` (the last call of every transformers model's ``__init__``). Without
the option the plugin changes nothing, so one command line with and without the option gives the
stock and the patched outcome of the same test ids (``scripts/run_transformers_tests.py``).

Top-level means: no other ``PreTrainedModel`` is in the middle of its ``__init__`` further up the
call stack. A composite model (``Qwen2VLForConditionalGeneration``) builds its base model, vision
tower and language model inside its own ``__init__``; their ``post_init`` calls run while the
composite's ``__init__`` is on the stack, so only the composite is patched, once, as a user would.

Each test report carries the user property ``ascend_vlm_patched``: how many models the test had
patched (0 in a stock run), so a patched pass that never patched anything is visible as such.
Load with ``pytest -p ascend_vlm.testing.transformers_suite``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from types import FrameType

import pytest
import torch.nn as nn

PATCH_OPTION = "--ascend-vlm-patch"
PATCHED_PROPERTY = "ascend_vlm_patched"


class AutoPatcher:
    """Wraps ``PreTrainedModel.post_init`` so top-level models are patched as they are built.

    ``install()`` / ``uninstall()`` put the wrapper in place and restore the original exactly;
    ``patched`` counts the models patched since the last ``reset()``. Inside ``suspended()``
    models are built stock (for helpers that need a throwaway model to size their inputs).
    """

    def __init__(self, patch: Callable[[nn.Module], object] | None = None) -> None:
        if patch is None:
            import ascend_vlm

            def patch(model: nn.Module) -> object:
                return ascend_vlm.patch(model, strict=False)

        self._patch = patch
        self._original: Callable | None = None
        self._suspended = 0
        self.patched = 0

    def install(self) -> None:
        from transformers import PreTrainedModel

        if self._original is not None:
            raise RuntimeError("AutoPatcher.install: already installed")
        original = PreTrainedModel.__dict__["post_init"]
        patcher = self

        def post_init(model, *args, **kwargs):
            result = original(model, *args, **kwargs)
            if not patcher._suspended and is_top_level(model, inspect.currentframe().f_back):
                patcher._patch(model)
                patcher.patched += 1
            return result

        post_init.__wrapped__ = original
        PreTrainedModel.post_init = post_init
        self._original = original

    def uninstall(self) -> None:
        from transformers import PreTrainedModel

        if self._original is not None:
            PreTrainedModel.post_init = self._original
            self._original = None

    def reset(self) -> None:
        self.patched = 0

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1


def is_top_level(model: nn.Module, frame: FrameType | None) -> bool:
    """True unless a frame at or above `frame` is the ``__init__`` of another PreTrainedModel."""
    from transformers import PreTrainedModel

    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, PreTrainedModel):
                return False
        frame = frame.f_back
    return True


_ACTIVE: AutoPatcher | None = None


@contextlib.contextmanager
def models_built_stock() -> Iterator[None]:
    """Build models unpatched inside this block, also in a ``--ascend-vlm-patch`` run."""
    if _ACTIVE is None:
        yield
        return
    with _ACTIVE.suspended():
        yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("ascend_vlm").addoption(
        PATCH_OPTION,
        action="store_true",
        help="ascend_vlm.patch(model, strict=False) every top-level transformers model a test builds",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _ACTIVE
    if config.getoption(PATCH_OPTION):
        _ACTIVE = AutoPatcher()
        _ACTIVE.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.uninstall()
        _ACTIVE = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _ACTIVE is not None:
        _ACTIVE.reset()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    # The teardown report (the one junitxml reads properties from) is built after this hook.
    item.user_properties.append((PATCHED_PROPERTY, _ACTIVE.patched if _ACTIVE else 0))
