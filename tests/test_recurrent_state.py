"""The recurrent-state pool (models/recurrent_state.py): slots handed out zeroed, given back once."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.recurrent_state import RecurrentStatePool


def test_slots_are_zeroed_and_given_back_once():
    pool = RecurrentStatePool(3, 2, conv_channels=7, conv_width=4, value_heads=2, key_dim=3, value_dim=5,
                              device="cpu", dtype=torch.bfloat16)
    assert pool.conv.shape == (3, 2, 7, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.ssm.shape == (3, 2, 2, 3, 5) and pool.ssm.dtype == torch.float32
    assert pool.nbytes == 3 * 2 * (7 * 3 * 2 + 2 * 3 * 5 * 4)
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {0, 1} and pool.free == 0
    with pytest.raises(RuntimeError, match="every one of the 2"):
        pool.acquire()
    pool.conv[:, first].fill_(1.0)
    pool.ssm[:, first].fill_(2.0)
    pool.release(first)
    with pytest.raises(ValueError, match="not held"):
        pool.release(first)
    again = pool.acquire()
    assert again == first and not pool.conv[:, again].any() and not pool.ssm[:, again].any()
