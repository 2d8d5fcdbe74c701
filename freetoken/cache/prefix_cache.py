"""KV pages and the radix prefix cache: plain Python over ints, owned by the Scheduler.

The KV cache is a pool of pages of `page_size` token positions. A sequence holds a page table
(its pages in order). Full pages of finished sequences stay in a radix tree keyed by their
tokens, so a later prompt that starts with the same tokens (the same system prompt, an agent's
previous turn) shares those pages instead of prefilling them again; at the first token that
differs (an edited tail: a tool result replaced, a thinking block dropped) sharing stops and
only the rest is prefilled. Shared pages are never written: a sequence writes only its own
pages. Unreferenced cached pages are evicted least recently used first when pages run out.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    page: int
    tokens: tuple[int, ...]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    refs: int = 0  # running sequences sharing this page
    last_used: int = 0


class PrefixCache:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages))[::-1]
        self.root = Node(page=-1, tokens=(), parent=None)
        self._clock = itertools.count(1)
        self.cached_pages = 0  # pages held by tree nodes
        self.unreferenced = 0  # tree nodes no running sequence shares: all evictable, leaves first
        # Candidate leaves by last use; entries go stale (node reused, grown, removed) and are
        # skipped when popped, so an eviction costs O(log n), not a scan of the tree.
        self._leaves: list[tuple[int, int, Node]] = []

    # -- queries ------------------------------------------------------------------------------
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def available(self) -> int:
        """Pages a new sequence can get: free ones plus evictable cached ones."""
        return len(self.free) + self.unreferenced

    def match(self, tokens: list[int]) -> list[Node]:
        """The cached full pages that `tokens` starts with, in order (not yet referenced)."""
        nodes, node, ps = [], self.root, self.page_size
        for i in range(0, len(tokens) - ps + 1, ps):
            node = node.children.get(tuple(tokens[i : i + ps]))
            if node is None:
                break
            nodes.append(node)
        return nodes

    # -- a sequence's life ----------------------------------------------------------------------
    def acquire(self, nodes: list[Node]) -> None:
        now = next(self._clock)
        for n in nodes:
            self.unreferenced -= n.refs == 0
            n.refs += 1
            n.last_used = now

    def allocate(self, count: int) -> list[int] | None:
        """`count` private pages, evicting unreferenced cached pages (LRU leaves first) when
        needed; None (and nothing changed) when even that cannot give enough. Acquire the
        pages a sequence shares before allocating its own, so they cannot be evicted."""
        if count > len(self.free) + self.unreferenced:
            return None
        while len(self.free) < count:
            self._evict_one()
        return [self.free.pop() for _ in range(count)]

    def unacquire(self, nodes: list[Node]) -> None:
        for n in nodes:
            n.refs -= 1
            if n.refs == 0:
                self.unreferenced += 1
                self._maybe_leaf(n)

    def release(self, nodes: list[Node], tokens: list[int], own_pages: list[int]) -> None:
        """A sequence ends. `nodes`: the shared pages it acquired; `tokens`: what its KV holds
        (in order, the shared prefix included); `own_pages`: its private pages, in order after
        the shared ones. Its full pages join the tree (or are freed if the tree already has
        those tokens), the partial last page is freed."""
        self.unacquire(nodes)
        node = nodes[-1] if nodes else self.root
        ps, now = self.page_size, next(self._clock)
        start = len(nodes) * ps
        for i, page in enumerate(own_pages):
            chunk = tuple(tokens[start + i * ps : start + (i + 1) * ps])
            if len(chunk) < ps or node is None:
                self.free.append(page)
                node = None  # everything after a partial page is unreachable
                continue
            child = node.children.get(chunk)
            if child is None:
                child = Node(page=page, tokens=chunk, parent=node, last_used=now)
                node.children[chunk] = child
                self.cached_pages += 1
                self.unreferenced += 1
            else:
                self.free.append(page)  # the same tokens are cached already
                child.last_used = now
            self._maybe_leaf(child)
            node = child

    def clear(self) -> None:
        """Drop every unreferenced cached page (a resized pool starts without them)."""
        for n in sorted(self.nodes(), key=lambda n: -self._depth(n)):
            if n.refs == 0 and not n.children:
                self._remove(n)

    # -- internals ----------------------------------------------------------------------------
    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    def _depth(self, n: Node) -> int:
        d = 0
        while n.parent is not None:
            n, d = n.parent, d + 1
        return d

    def _maybe_leaf(self, n: Node) -> None:
        if n.refs == 0 and not n.children:
            heapq.heappush(self._leaves, (n.last_used, id(n), n))

    def _evict_one(self) -> None:
        # A referenced node's ancestors are referenced too (sequences share whole chains from
        # the root), so while unreferenced nodes exist, some leaf among them is evictable.
        while True:
            used, _, n = heapq.heappop(self._leaves)
            if n.parent is not None and n.refs == 0 and not n.children and n.last_used == used:
                self._remove(n)
                return

    def _remove(self, n: Node) -> None:
        parent = n.parent
        del parent.children[n.tokens]
        n.parent = None  # marks stale heap entries
        self.free.append(n.page)
        self.cached_pages -= 1
        self.unreferenced -= 1
        if parent is not self.root:
            self._maybe_leaf(parent)

    def remap(self, mapping: dict[int, int], num_pages: int) -> None:
        """After the page pool is rebuilt: nodes move to their new page ids, the free list is
        every page not in use. Unreferenced nodes must have been cleared first."""
        for n in self.nodes():
            n.page = mapping[n.page]
        used = set(mapping.values())
        self.num_pages = num_pages
        self.free = [p for p in range(num_pages - 1, -1, -1) if p not in used]
