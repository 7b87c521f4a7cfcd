"""Every op's error inputs raise ValueError naming the argument, what was expected and what came."""

from __future__ import annotations

import re

import pytest
from _error_inputs import ERROR_INPUTS

CASES = [(op, name) for op, table in ERROR_INPUTS.items() for name in sorted(table)]


@pytest.mark.parametrize(("op", "name"), CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_bad_inputs_raise_value_error_naming_argument(op: str, name: str) -> None:
    call, message = ERROR_INPUTS[op][name]
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
