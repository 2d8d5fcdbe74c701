"""How compiled CPU code waits for another thread: spin a bounded time, then yield the core,
then sleep.

A waiter that spins forever keeps its core from whoever it waits for when the machine has
more runnable threads than cores (another process's busy loop, a compositor, a build): the
thread it waits for may be queued behind the spinner on the very core the spinner holds. So a
wait spins only briefly (a ring usually comes within microseconds), then calls `sched_yield`
(costs a system call and no latency while the core is free, gives the core away while it is
not), and after about a millisecond sleeps in short naps, leaving its core to the rest.

The C library's functions are declared by name, so cached compiled code holds no address that
differs between processes; the loader binds them to the process's libc.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# Cycle budgets of a wait's phases (at 2-4 GHz: spin ~25-50 us, yield until ~1 ms), and a nap.
SPIN_CYCLES = 100_000
YIELD_CYCLES = 3_000_000
NAP_MICROSECONDS = 50


@intrinsic
def pause(typingctx):
    """A spin-wait hint (x86 `pause`): eases the spinning core's pressure on its neighbours."""

    def codegen(context, builder, sig, args):
        if platform.machine().lower() in ("x86_64", "amd64"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (wait budgets, and timestamps for the trace)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def _sched_yield(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _usleep(typingctx, microseconds):
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32]), "usleep")
        builder.call(fn, [context.cast(builder, args[0], sig.args[0], types.uint32)])
        return context.get_dummy_value()

    return types.none(microseconds), codegen


@njit(nogil=True)
def relax(since):
    """One turn of a wait loop that began at cycle count `since`: spin, yield or nap by how long
    the wait has lasted."""
    waited = cycles() - since
    if waited < SPIN_CYCLES:
        pause()
    elif waited < YIELD_CYCLES:
        _sched_yield()
    else:
        _usleep(NAP_MICROSECONDS)
