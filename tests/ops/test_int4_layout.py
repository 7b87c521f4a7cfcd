"""The library's int4 layout: round trips, the documented nibble positions, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_vlm.ops.int4_layout import pack_int4, unpack_int4


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(0, 6), columns=st.integers(1, 41), seed=st.integers(0, 2**16))
def test_pack_then_unpack_is_the_identity(rows, columns, seed):
    values = torch.randint(-8, 8, (rows, columns), generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, (columns + 1) // 2)
    unpacked = unpack_int4(packed, columns)
    assert unpacked.dtype == torch.int8 and torch.equal(unpacked.long(), values)


def test_nibbles_sit_where_the_layout_says():
    # column 2i in the low nibble of byte i, column 2i+1 in the high one, two's complement
    packed = pack_int4(torch.tensor([[-1, 2, 7, -8, 5]]))
    assert packed.tolist() == [[0x2F, 0x87, 0x05]]
    assert unpack_int4(torch.tensor([[0x2F, 0x87, 0x05]], dtype=torch.uint8), 5).tolist() == [
        [-1, 2, 7, -8, 5]
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (torch.tensor([[8]]), r"^values: expected int4 values in \[-8, 7\], got \[8, 8\]"),
        (torch.tensor([[-9, 0]]), r"^values: expected int4 values in \[-8, 7\], got \[-9, 0\]"),
        (torch.zeros(2, dtype=torch.int8), r"^values: expected a 2-D \(N, K\) tensor"),
        (torch.zeros(2, 2), r"^values: expected an integer dtype, got torch.float32"),
    ],
)
def test_pack_refuses_what_does_not_fit(values, message):
    with pytest.raises(ValueError, match=message):
        pack_int4(values)


def test_unpack_refuses_a_wrong_layout():
    with pytest.raises(ValueError, match=r"^packed: expected a 2-D uint8 tensor, got torch.int8"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.int8), 4)
    with pytest.raises(ValueError, match=r"^packed: expected 3 bytes per row for in_features=5"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.uint8), 5)
