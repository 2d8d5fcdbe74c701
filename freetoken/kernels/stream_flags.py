"""Flag words written and awaited by a CUDA stream: the GPU's half of the CPU doorbell
(kernels/cpu/doorbell.py), usable inside a captured graph.

Two mechanisms, chosen once by `StreamFlags.probe()`:
  - "stream-memops": the driver's stream memory operations (cuStreamWriteValue32 /
    cuStreamWaitValue32), called through ctypes on libcuda. The wait is done by the GPU's
    front end without occupying an SM; both are captured as graph nodes.
  - "triton-spin": where the driver refuses memory operations, two one-thread Triton kernels:
    an atomic system-scope store, and a spin on an atomic system-scope load. The spin holds one
    SM while it waits; everything else is the same.
Flags live in pinned host memory; their addresses are the same for host and device (unified
addressing). A waited-on value is compared as `(int32)(*addr - value) >= 0` (GEQ).
"""

from __future__ import annotations

import ctypes
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: ordered after the stream's earlier writes


@triton.jit
def _write_flag(ptr, value):
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def _wait_flag(ptr, value):
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    while seen - value < 0:
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


class StreamFlags:
    def __init__(self, kind: str) -> None:
        if kind not in ("stream-memops", "triton-spin"):
            raise ValueError(f"unknown stream flag mechanism {kind!r}")
        self.kind = kind
        self._write = self._wait = None
        if kind == "stream-memops":
            self._write, self._wait = _driver_memops()

    @classmethod
    def probe(cls, prefer: str = "stream-memops") -> StreamFlags:
        """The first mechanism that round-trips a value on this device; logs which is in use."""
        order = [prefer] + [k for k in ("stream-memops", "triton-spin") if k != prefer]
        errors = []
        for kind in order:
            try:
                flags = cls(kind)
                flags._self_test()
            except Exception as exc:  # the next mechanism is tried; the reason is reported
                errors.append(f"{kind}: {exc}")
                continue
            log.info("CPU doorbell in captured graphs: %s", kind)
            if errors:
                log.warning("stream flags: %s unavailable (%s)", order[0], "; ".join(errors))
            return flags
        raise RuntimeError("no stream flag mechanism works on this device: " + "; ".join(errors))

    def write(self, addr: int, value: int) -> None:
        """Queue `*addr = value` on the current stream (after everything queued before it)."""
        self._queue(self._write, _write_flag, "cuStreamWriteValue32", addr, value, _WRITE_DEFAULT)

    def wait_geq(self, addr: int, value: int) -> None:
        """Queue a wait until (int32)(*addr - value) >= 0 on the current stream."""
        self._queue(self._wait, _wait_flag, "cuStreamWaitValue32", addr, value, _WAIT_GEQ)

    @staticmethod
    def _queue(memop, kernel, name: str, addr: int, value: int, flags: int) -> None:
        if memop is not None:
            stream = torch.cuda.current_stream().cuda_stream
            _check(memop(ctypes.c_void_p(stream), ctypes.c_uint64(addr), ctypes.c_uint32(value), ctypes.c_uint(flags)),
                   name)
        else:
            kernel[(1,)](RawPointer(addr), value, num_warps=1)

    def _self_test(self) -> None:
        flag = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        addr = flag.data_ptr()
        self.write(addr, 7)
        self.wait_geq(addr, 7)  # already true: must not block
        self.write(addr + 4, 9)
        torch.cuda.synchronize()
        if flag.tolist() != [7, 9]:
            raise RuntimeError(f"wrote [7, 9], read back {flag.tolist()}")


class RawPointer:
    """A raw address passed to a Triton kernel as an int32 pointer."""

    dtype = torch.int32

    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


def _driver_memops():
    lib = ctypes.CDLL("libcuda.so.1")
    fns = []
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return fns[0], fns[1]


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUresult {code}")
