"""Programmatic dependent launch (PDL): a kernel of a decode step's chain starts while the
kernel before it drains, instead of after it has finished.

A decode step is a chain of small dependent kernels, and each boundary costs the next kernel's
launch and ramp on a device left idle. On Hopper and later, a kernel launched with the
programmatic stream-serialization attribute may start once every program of the kernel before
it has signalled (or exited); it then waits (`griddepcontrol.wait`) until that kernel has
finished and its writes are visible. Inside a captured graph the launch becomes a programmatic
edge. A chain of a decode step's dense shapes runs each layer in less time when every kernel
signals its dependents as it starts and then waits (what `enter` does) than in plain stream
order (benchmarks/pdl_probe.py; docs/lab, "Kernels that start while the one before drains").

The rule every kernel taking a PDL flag keeps: `enter(PDL)` is its first statement, before any
load or store. Signalling first lets the next kernel's programs be placed early; waiting first
means nothing is read before the kernel before has written it (transitively: that kernel had
itself waited for its own predecessor). Exceptions, each stated where it is used:
- `signal` then `wait`, with loads between them of what no kernel of the chain writes, the
  model's dense weights, so that a placed-early program streams its weight tile in while the
  kernels before it still run (kernels/triton/decode_linear.py: the attention's projections and
  the router at one row; kernels/triton/norm_linear.py, which loads the norm's weight there too).
- `wait` then `signal`: the next kernel is placed only once everything before this one has
  finished, so it may read, before its own wait, what those earlier kernels wrote. The MoE
  layer's slot fill does so, and the slot GEMM's act kernel after it computes its routes to the
  slots that fill leaves alone (hits) before waiting; routes to the slots it fills wait, and so
  does one program, so that the act grid's end still implies the fill's
  (kernels/triton/moe_gemm.py, given the plan's fill list in captured steps). Those programs
  never run `griddepcontrol.wait`: they rely on the writes of grids that finished before theirs
  was placed being visible to it, as any kernel in plain stream order does (PTX states the
  visibility guarantee for the waiting grid only).
Kernels launched without the attribute keep plain stream order, so mixing is safe: cuBLAS,
torch's elementwise kernels, and the kernels whose only work is to spin (stream flags,
fill-ticket waits, the device clock).

Who takes part: the dense path (norms, q/k prep, attention, router linear, routing, the slot
GEMM, the step's input read; the norms inside the router's linear layer and, at one row, the
q/k/v projection; at one row also the attention's projections, which are cuBLAS kernels outside
the chain at more rows) and the MoE layer's plan, tally, CPU post and merge, and
slot fill.
Programs placed early sit waiting on SMs, so a kernel that takes part may spin only on a word
the CPU or a copy engine's stream write sets (the CPU's answer, a fill's ticket), never on
another kernel's work: a chain of waiting programs could hold the SMs that kernel needs.

Twin: none needed; the flag changes when a kernel starts, never what it computes (the GPU tests
check outputs with PDL on and off bit for bit).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = True


def set_enabled(on: bool) -> None:
    """Turn PDL launches on or off for this process (the engine's `pdl` setting)."""
    global _enabled
    _enabled = bool(on)


def enabled_for(t: torch.Tensor) -> bool:
    """Whether kernels working on t's device launch with PDL: on CUDA devices of compute
    capability 9 or later, not under Triton's interpreter, unless turned off."""
    return _enabled and t.is_cuda and _capable(t.device.index if t.device.index is not None else 0)


@functools.cache
def _capable(index: int) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.get_device_capability(index)[0] >= 9


def launch(t: torch.Tensor) -> dict:
    """The keyword arguments a PDL-aware kernel's launch takes: its `PDL` flag and the launch
    attribute, both from `enabled_for(t)`."""
    on = enabled_for(t)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: let the next kernel be placed, then wait for the
    one before to finish."""
    signal(PDL)
    wait(PDL)


@triton.jit
def signal(PDL: tl.constexpr):
    """Let the next kernel be placed (first statement; `wait` must follow before any load of
    what a kernel of the chain writes)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before to finish, its writes visible."""
    if PDL:
        gdc_wait()
