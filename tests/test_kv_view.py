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


@settings(max_examples=40, deadline=None)
@given(steps(), st.integers(0, 2))
def test_step_inputs_follow_the_page_tables(case, rewrites):
    """A captured decode step's inputs (one new token a sequence), written into the pinned
    buffer and uploaded (the kernel's twin here; the kernel is the `host_read` pair): tokens,
    positions and both KV indices as the page-table rule says, also after the buffer was
    rewritten for other steps, whose values must not survive anywhere."""
    from freetoken.engine.step_inputs import ALIGN, StepInputs

    tables, positions, key_len, z = case
    rows = len(tables)
    last = [pos[-1] for pos in positions]
    inputs = StepInputs(rows, key_len, "cpu")
    for r in range(rewrites):  # earlier steps of the shape
        inputs.fill([900 + r] * rows, [0] * rows, [[39]] * rows, z)
        inputs.upload()
    tokens = [7 * b + 1 for b in range(rows)]
    inputs.fill(tokens, last, tables, z)
    inputs.upload()
    write, read = _expected(tables, [[p] for p in last], key_len, z)
    assert inputs.tokens.tolist() == [[t] for t in tokens]
    assert inputs.positions.tolist() == [[p] for p in last]
    assert inputs.write_index.tolist() == write
    assert inputs.read_index.tolist() == read
    for part in (inputs.tokens, inputs.positions, inputs.write_index, inputs.read_index):
        assert part.data_ptr() % (ALIGN * 8) == inputs.buffer.data_ptr() % (ALIGN * 8)  # aligned parts
    # the next step on the same pages (the read index kept, only the new tokens' places written)
    nxt = [pos[0] for pos in positions]
    inputs.fill(tokens, nxt, [list(t) for t in tables], z)
    inputs.upload()
    write, read = _expected(tables, [[p] for p in nxt], key_len, z)
    assert inputs.write_index.tolist() == write and inputs.read_index.tolist() == read
    with pytest.raises(IndexError, match="outside"):
        inputs.fill(tokens, [len(tables[0]) * z] + nxt[1:], tables, z)
    # the pages changed: the read index follows them
    grown = [t + [39 - b] for b, t in enumerate(tables)]
    inputs.fill(tokens, nxt, grown, z)
    inputs.upload()
    write, read = _expected(grown, [[p] for p in nxt], key_len, z)
    assert inputs.write_index.tolist() == write and inputs.read_index.tolist() == read


def test_step_inputs_refuse_a_wrong_row_count():
    from freetoken.engine.step_inputs import StepInputs

    with pytest.raises(ValueError, match="2 rows got 1 tokens"):
        StepInputs(2, 8, "cpu").fill([1], [0, 0], [[0], [1]], 4)
