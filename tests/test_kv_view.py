"""A step's KV positions (`KVCache.view`, `step_index`) against a plain-Python statement of the
page-table rule: position p of a sequence lives at page_table[p // Z] * Z + p % Z."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.models.kv_cache import KVCache, step_index


def _expected(page_tables, positions, key_len, z):
    def where(table, p):
        return table[p // z] * z + p % z

    write = [where(t, p) for t, pos in zip(page_tables, positions, strict=True) for p in pos]
    read = []
    for table in page_tables:
        held = min(key_len, len(table) * z)
        keys = [where(table, p) for p in range(held)]
        read.append(keys + [keys[0]] * (key_len - held))  # past its pages: its first position (masked)
    return write, read


@st.composite
def steps(draw):
    z = draw(st.sampled_from([1, 4, 16]))
    rows = draw(st.integers(1, 4))
    pool = draw(st.permutations(range(40)))  # distinct pages across sequences, as the scheduler hands out
    tables, positions, used = [], [], 0
    for _ in range(rows):
        pages = draw(st.integers(1, 6))
        table = list(pool[used:used + pages])
        used += pages
        tables.append(table)
        positions.append(sorted(draw(st.lists(st.integers(0, pages * z - 1), min_size=1, max_size=3))))
    key_len = draw(st.integers(1, 6 * z + 3))
    return tables, positions, key_len, z


@settings(max_examples=60, deadline=None)
@given(steps())
def test_view_follows_the_page_tables(case):
    tables, positions, key_len, z = case
    cache = KVCache(1, 40, z, 1, 2, torch.float32, "cpu")
    view = cache.view(tables, positions, key_len, padded=True)
    write, read = _expected(tables, positions, key_len, z)
    assert view.write_index.tolist() == write
    assert view.read_index.tolist() == read
    assert view.write_index.dtype == view.read_index.dtype == torch.int64 and view.padded


def test_positions_outside_the_pages_are_refused():
    with pytest.raises(IndexError, match="outside its 2 pages"):
        step_index([[0, 1]], [[8]], 8, 4)
    with pytest.raises(IndexError, match="outside"):
        step_index([[0, 1]], [[-1]], 8, 4)
    with pytest.raises(IndexError, match="no page"):
        step_index([[]], [[]], 8, 4)
