"""The paged KV prefix cache: sharing full pages, private pages, LRU eviction, remapping."""

from __future__ import annotations

import pytest

from freetoken.cache.prefix_cache import PrefixCache

Z = 4


def run(cache: PrefixCache, tokens: list[int], budget: int):
    """Admit a sequence over `tokens` with room for `budget` tokens, then finish it."""
    shared = cache.match(tokens)
    cache.acquire(shared)
    own = cache.allocate(cache.pages_for(budget) - len(shared))
    assert own is not None
    cache.release(shared, tokens, own)
    return shared, own


def test_full_pages_are_shared_and_partial_pages_freed():
    cache = PrefixCache(num_pages=10, page_size=Z)
    run(cache, list(range(10)), budget=12)  # pages: [0..3] [4..7] [8, 9] (partial)
    assert cache.cached_pages == 2 and len(cache.free) == 8
    shared = cache.match(list(range(8)) + [99, 98, 97])
    assert [n.tokens for n in shared] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert len(cache.match([0, 1, 2, 9])) == 0  # differs inside the first page


def test_referenced_pages_are_never_evicted_and_lru_goes_first():
    cache = PrefixCache(num_pages=4, page_size=Z)
    run(cache, [1] * 4, budget=4)  # cached: page A (tokens 1111)
    run(cache, [2] * 4, budget=4)  # cached: page B (tokens 2222), more recent
    held = cache.match([2] * 4)
    cache.acquire(held)
    own = cache.allocate(3)  # needs one eviction: A (B is referenced)
    assert own is not None and len(cache.free) == 0
    assert cache.match([1] * 4) == [] and cache.match([2] * 4) == held
    assert cache.allocate(1) is None  # nothing left: refused, nothing changed
    cache.release(held, [2] * 4 + [5] * 8, own)


def test_same_tokens_twice_keep_one_page():
    cache = PrefixCache(num_pages=6, page_size=Z)
    run(cache, list(range(8)), budget=8)
    free_before = len(cache.free)
    # a concurrent twin wrote the same tokens into its own pages: they are freed on release
    own = cache.allocate(2)
    cache.release([], list(range(8)), own)
    assert cache.cached_pages == 2 and len(cache.free) == free_before


def test_remap_renumbers_nodes_and_rebuilds_free_list():
    cache = PrefixCache(num_pages=8, page_size=Z)
    run(cache, list(range(8)), budget=8)
    pages = sorted(n.page for n in cache.nodes())
    mapping = {old: new for new, old in enumerate(pages)}
    cache.remap(mapping, num_pages=3)
    assert sorted(n.page for n in cache.nodes()) == [0, 1] and cache.free == [2]
    cache.clear()
    assert cache.cached_pages == 0 and cache.match(list(range(8))) == []


@pytest.mark.parametrize("seed", range(5))
def test_random_sessions_never_lose_or_double_count_pages(seed):
    import random

    rng = random.Random(seed)
    cache = PrefixCache(num_pages=40, page_size=Z)
    held = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            shared, tokens, own = held.pop(rng.randrange(len(held)))
            cache.release(shared, tokens, own)
        else:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            shared = cache.match(tokens)
            cache.acquire(shared)
            own = cache.allocate(cache.pages_for(len(tokens) + 4) - len(shared))
            if own is None:
                cache.unacquire(shared)
                continue
            held.append((shared, tokens, own))
        in_use = {p for shared, _, own in held for p in own}
        tree = [n.page for n in cache.nodes()]
        assert len(tree) == len(set(tree)) and not in_use & set(tree) and not in_use & set(cache.free)
        assert len(in_use) + len(tree) + len(cache.free) == 40
        assert cache.unreferenced == sum(1 for n in cache.nodes() if n.refs == 0)
