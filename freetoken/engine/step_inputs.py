"""A captured decode shape's inputs: written by the host into one pinned buffer, read by the
step's first kernel.

Shape legend: R the captured batch size, Lk the key bucket.

Layout of the buffer (int64; each part starts on a 128-byte boundary, so kernels reading the
device copy keep the aligned loads they would have on tensors of their own):
    tokens [R] | positions [R] | write_index [R] | state_slots [R] | state_rows [R] | read_index [R, Lk]
state_slots and state_rows are for models with linear-attention layers (filled only for them):
each row's recurrent-state slot, and the row whose linear-attention output it takes. A padding
row repeats row 0, but it may not write row 0's state a second time: its slot is read-only,
-(s + 1) (reference/gated_delta.py), and it takes row 0's output, since it may read row 0's slot
before or after row 0 has written it (models/gated_deltanet.py).
The host fills it with numpy (`fill`) before the replay; the graph starts with `upload`
(kernels/triton/host_read.py), which reads it over the bus into the device buffer the step's
kernels read. So the host makes no CUDA call for a step's inputs, and the device does not idle
while the host builds torch tensors and copies them (the KV view and four copies took 88-148
us a step on the H200's host: benchmarks/results/step-inputs-ab-h200.json).

The host may rewrite the buffer only once the last step that read it is over: `DecodeGraphs.decode`
waits for the last step's end before it fills the buffer.
"""

from __future__ import annotations

import torch

from freetoken.models.kv_cache import KVCache, KVView, fill_step_index

ALIGN = 16  # int64 elements: 128 bytes


class StepInputs:
    def __init__(self, rows: int, key_len: int, device: str) -> None:
        self.rows, self.key_len = rows, key_len
        a = -(-rows // ALIGN) * ALIGN
        self._starts = (0, a, 2 * a, 3 * a, 4 * a, 5 * a)
        n = 5 * a + rows * key_len
        on_cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=on_cuda)
        self._host_np = self.host.numpy()
        self.buffer = torch.zeros(n, dtype=torch.int64, device=device)
        t, p, w, s, o, r = self._starts
        self.tokens = self.buffer[t:t + rows].view(rows, 1)  # [R, 1]
        self.positions = self.buffer[p:p + rows].view(rows, 1)  # [R, 1]
        self.write_index = self.buffer[w:w + rows]  # [R]
        self.state_slots = self.buffer[s:s + rows]  # [R]
        self.state_rows = self.buffer[o:o + rows]  # [R]
        self.read_index = self.buffer[r:].view(rows, key_len)  # [R, Lk]
        self._tables: list[list[int]] | None = None  # the page tables the buffer's read index is of
        self._page_size = 0

    def fill(self, tokens: list[int], positions: list[int], page_tables: list[list[int]], page_size: int,
             state_slots: list[int] | None = None) -> None:
        """The step's inputs into the pinned buffer: R of each, padding included (rows past the
        `len(state_slots)` sequences, which must repeat row 0). state_slots: the sequences'
        recurrent-state slots, for models with linear-attention layers."""
        if not len(tokens) == len(positions) == len(page_tables) == self.rows:
            raise ValueError(f"a step of {self.rows} rows got {len(tokens)} tokens, {len(positions)} positions "
                             f"and {len(page_tables)} page tables")
        h, rows = self._host_np, self.rows
        t, p, w, s, o, r = self._starts
        h[t:t + rows] = tokens
        h[p:p + rows] = positions
        if state_slots is not None:
            b = len(state_slots)
            if not 1 <= b <= rows or min(state_slots) < 0:
                raise ValueError(f"a step of {rows} rows got state slots {state_slots}")
            h[s:s + b], h[s + b:s + rows] = state_slots, -state_slots[0] - 1
            h[o:o + b], h[o + b:o + rows] = range(b), 0
        if page_tables == self._tables and page_size == self._page_size:
            # The same pages as this shape's last step (a sequence gains a page every page_size
            # tokens): the read index in the buffer stands; only the new tokens' places change.
            for b, (table, q) in enumerate(zip(page_tables, positions, strict=True)):
                if not 0 <= q < len(table) * page_size:
                    raise IndexError(f"sequence {b}: a new token's position is outside its {len(table)} pages")
                h[w + b] = table[q // page_size] * page_size + q % page_size
            return
        self._tables = None  # (a failed fill leaves nothing to reuse)
        fill_step_index(page_tables, [[q] for q in positions], self.key_len, page_size, h[w:w + rows],
                        h[r:].reshape(rows, self.key_len))
        self._tables = [list(table) for table in page_tables]  # a copy: callers may append to theirs
        self._page_size = page_size

    def upload(self) -> None:
        """Into the device buffer (the step's first kernel; on the CPU, the kernel's twin)."""
        from freetoken.kernels.triton.host_read import load_into

        load_into(self.host, self.buffer)

    def kv_view(self, cache: KVCache, states=None) -> KVView:
        """The step's KV access through the device buffer's indices; with `states` (the recurrent
        state pool of a linear-attention model), its state slots too."""
        kv = KVView(cache, self.write_index, self.read_index, padded=True)
        if states is not None:  # (one row is never padded: it takes its own output)
            kv.attach_state_slots(states, self.state_slots, self.state_rows if self.rows > 1 else None)
        return kv
