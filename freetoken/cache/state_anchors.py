"""Anchors: where a linear-attention model's recurrent state is kept, so a later request sharing
the prefix resumes from it instead of prefilling from the start.

KV pages can be shared at any page boundary, but a recurrent state exists only for the position a
sequence has reached: to resume a request at position n, the state after exactly n tokens must
have been saved when some earlier sequence passed n. Saving it everywhere costs a whole state per
page, so the scheduler saves it where agent sessions branch and resume (the semantic anchors):
  - where each message starts (the chat template's message-start token, and tool-call and
    tool-response tags where the vocabulary has them as single tokens), so an edit inside an
    earlier turn resumes from the start of the message it edits;
  - at the end of each prompt, so the next turn (this prompt, the reply, a tool result) resumes
    there and prefills only the reply and what was appended.
Each anchor is rounded down to a page boundary: a resumed request reads the tokens before it from
shared KV pages, which are whole pages.

Saving a state ends a prefill chunk there, and each chunk is a forward of its own: with experts
offloaded, another pass over them (a whole-pool stream, or a round of misses). So an anchor that
would end a chunk shorter than `min_gap` tokens is passed over (its state is not saved): an agent
turn's tool call, its result's message start and its tags lie within a few dozen tokens of each
other, and one forward to the prompt's end serves them all; a later request that would have
resumed at a passed-over anchor resumes at most `min_gap` tokens earlier. The prompt's last anchor,
where the next turn resumes, is always saved.

This index is the scheduler's half: which anchors exist (by the digest of the tokens before
them), in LRU order within a byte budget. The snapshots themselves sit with the GPU runner, which
owns the state pool (actors/gpu_runner.py); the scheduler tells it what to save, restore and drop.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

# Tokens a new message or a tool exchange starts with, in the chat templates of the families with
# recurrent state (those a vocabulary has as single tokens count).
ANCHOR_TOKENS = ("<|im_start|>", "<tool_call>", "<tool_response>")


def prefix_digests(tokens: list[int], page_size: int, limit: int) -> dict[int, bytes]:
    """{n: digest of tokens[:n]} for every page boundary n in 1..limit: one pass over the tokens."""
    digest = hashlib.blake2b(digest_size=16)
    out: dict[int, bytes] = {}
    ids = np.asarray(tokens[:limit], dtype=np.int64)
    for n in range(page_size, limit + 1, page_size):
        digest.update(ids[n - page_size : n].tobytes())
        out[n] = digest.copy().digest()
    return out


class AnchorIndex:
    def __init__(self, page_size: int, anchor_ids: frozenset[int], snapshot_bytes: int, budget_bytes: int,
                 min_gap: int = 0) -> None:
        """snapshot_bytes: one sequence's whole recurrent state; budget_bytes: what every kept
        snapshot may take together (the runner keeps them in host memory); min_gap: the shortest
        chunk an anchor other than the prompt's last may end (tokens)."""
        if snapshot_bytes < 1:
            raise ValueError(f"a state snapshot takes at least a byte, got {snapshot_bytes}")
        if min_gap < 0:
            raise ValueError(f"the anchors' minimum gap is a token count, got {min_gap}")
        self.page_size = page_size
        self.min_gap = min_gap
        self.anchor_ids = anchor_ids
        self.snapshot_bytes = snapshot_bytes
        self.capacity = max(0, budget_bytes) // snapshot_bytes
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        # anchors an admitted sequence will resume from: not evicted before its first chunk restores them
        self._held: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return len(self._lru) * self.snapshot_bytes

    def positions(self, prompt: list[int]) -> list[int]:
        """The prompt's anchors, ascending: page boundaries before each message start and before
        the prompt's last token (a prefill must keep at least one token, to sample from)."""
        ps, last = self.page_size, len(prompt) - 1
        points = {(i // ps) * ps for i, t in enumerate(prompt) if t in self.anchor_ids}
        points.add((last // ps) * ps)
        return sorted(p for p in points if p > 0)

    def chunk_end(self, ahead: list[int], start: int, end: int) -> tuple[int, bool]:
        """(where a prefill chunk from `start`, at most to `end`, stops; whether at an anchor):
        at the next anchor of `ahead` (the prompt's anchors still to come, ascending; consumed
        here) that ends a chunk of at least min_gap tokens or is the prompt's last; else at `end`."""
        while len(ahead) > 1 and ahead[0] - start < self.min_gap:
            ahead.pop(0)  # passed over: its state is not saved
        if ahead and ahead[0] <= end:
            return ahead.pop(0), True
        return end, False

    def deepest(self, digests: dict[int, bytes], limit: int) -> int:
        """The longest prefix, at most `limit` tokens, whose state is kept (0: none); it becomes
        the most recently used."""
        for n in sorted((n for n in digests if n <= limit), reverse=True):
            key = digests[n]
            if key in self._lru:
                self._lru.move_to_end(key)
                return n
        return 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def hold(self, key: bytes) -> None:
        self._held[key] = self._held.get(key, 0) + 1

    def unhold(self, key: bytes) -> None:
        if self._held[key] == 1:
            del self._held[key]
        else:
            self._held[key] -= 1

    def add(self, key: bytes) -> list[bytes]:
        """Keep a new snapshot's key; the keys evicted to stay in budget (their snapshots must go).
        Held anchors are passed over, so the index can exceed its budget while they are held."""
        if self.capacity == 0:
            return [key]
        self._lru[key] = None
        self._lru.move_to_end(key)
        evicted = []
        while len(self._lru) > self.capacity:
            victim = next((k for k in self._lru if k not in self._held and k != key), None)
            if victim is None:
                break
            del self._lru[victim]
            evicted.append(victim)
        return evicted
