"""Device timestamps inside a captured decode step: where the step's device time goes, layer by
layer and phase by phase (plan and hand-off, slot fill, slot GEMM, the wait for the CPU).

`stamp(buf, index)` stores the GPU's global nanosecond timer (%globaltimer) into buf[index]
when the stream reaches it. It is a one-thread kernel, about a microsecond or two of graph
time each, and it runs in plain stream order: between two kernels of a programmatic-launch chain
it makes the second wait for the first to finish (kernels/triton/pdl.py). So stamps are captured
only when tracing is on, and the slot fill, whose start and end the live split times every step,
stamps itself (`globaltimer`, kernels/triton/slot_fill.py) instead. `DeviceClock` maps those stamps
onto the host's `time.perf_counter_ns` clock (the trace recorder's), calibrated by bracketing
stamps between host clock reads.

There is no CPU twin: the stamp is a clock read, not a computation, and only graph-mode
decode (CUDA) takes stamps.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


@triton.jit
def globaltimer():
    """The device time, ns, as a [1] int64 (for kernels that stamp their own work: slot_fill.py)."""
    zero = tl.zeros([1], dtype=tl.int32)
    # The operand only gives the element-wise asm its shape; the timer is read, nothing else.
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _stamp_kernel(buf_ptr, index, count, BLOCK: tl.constexpr):
    now = globaltimer()
    i = tl.arange(0, BLOCK)
    tl.store(buf_ptr + index + i, tl.broadcast_to(now, [BLOCK]), mask=i < count)


def stamp(buf: torch.Tensor, index: int, count: int = 1) -> None:
    """buf int64 on the device (contiguous, indexed flat): buf[index : index + count] = the
    device time, ns (several points of one instant in one launch)."""
    _stamp_kernel[(1,)](buf, index, count, BLOCK=triton.next_power_of_2(count), num_warps=1)


class DeviceClock:
    """Offset from the device's %globaltimer to the host's perf_counter_ns."""

    def __init__(self, offset_ns: int, uncertainty_ns: int) -> None:
        self.offset_ns = offset_ns
        self.uncertainty_ns = uncertainty_ns

    @classmethod
    def calibrate(cls, device: str = "cuda", trials: int = 50) -> DeviceClock:
        """Each trial: host time, a stamp, a synchronise, host time again. The stamp lies between
        the two host reads, so each trial bounds the offset from both sides; the tightest bounds
        over the trials give the offset (their midpoint) and its uncertainty (half their gap)."""
        buf = torch.zeros(1, dtype=torch.int64, device=device)
        stamp(buf, 0)  # compile and warm
        torch.cuda.synchronize()
        low, high = -(1 << 62), 1 << 62
        for _ in range(trials):
            before = time.perf_counter_ns()
            stamp(buf, 0)
            torch.cuda.synchronize()
            after = time.perf_counter_ns()
            device_ns = int(buf.item())
            low, high = max(low, before - device_ns), min(high, after - device_ns)
        if low > high:
            raise RuntimeError(f"device clock calibration is inconsistent (bounds {low} > {high}): "
                               "the device timer does not advance with the host's")
        return cls((low + high) // 2, (high - low) // 2)

    def to_host_ns(self, device_ns: int) -> int:
        return device_ns + self.offset_ns
