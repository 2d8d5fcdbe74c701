"""Small device results the host reads every decode step (the sampled tokens), brought back by a
kernel's stores into pinned memory instead of a copy-engine transfer.

A `.tolist()` of a device tensor is a synchronous device-to-host copy on a copy engine, and the
copy engines are shared with every other process on the GPU: beside another process's large
host-to-device copies, such a read waited milliseconds for its turn (the contention run,
docs/lab). `write_host` (kernels/triton/host_read.py) stores the values into pinned memory from
the SMs; the host waits on an event recorded after it, then reads the buffer in place.
"""

from __future__ import annotations

import torch

from freetoken.kernels.triton.host_read import write_host


class HostReadback:
    """A pinned buffer per dtype, grown on demand. `read` returns only after the values are on
    the host, so one buffer serves every call; one thread at a time (the step's)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None

    def read(self, t: torch.Tensor) -> list:
        """t.tolist(), read without the copy engine when t is on CUDA."""
        if not t.is_cuda:
            return t.tolist()
        flat = t.contiguous().view(-1)
        n = flat.numel()
        buffer = self._buffers.get(t.dtype)
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[t.dtype] = torch.empty(max(n, 64), dtype=t.dtype, pin_memory=True)
        if self._done is None:
            self._done = torch.cuda.Event()
        write_host(flat, buffer[:n])
        self._done.record()
        self._done.synchronize()
        return buffer[:n].view(t.shape).tolist()
