"""Banks of rows that grow and shrink in place: the expert slots and the KV pages.

Shape legend: G groups (1 for the slot banks, L layers for the KV pool), R rows per group
(slots, or page positions), then each row's own shape.

A bank reserves address space for `max_rows` rows per group once and commits memory only for
the first R rows of each group, so a resize never builds a second bank beside the first:
growing commits what is new, shrinking gives the tail back to the device (or the system),
really freed (`torch.cuda.mem_get_info` sees it), and the rows kept stay where they were, at
addresses that never change. A device whose whole memory holds the caches can therefore
still shrink one to grow the other, which a copy into a new bank could not.

On CUDA the reservation is the driver's virtual memory management (address range reserved,
physical pieces created and mapped on demand); on the host it is an anonymous mapping without
access whose pages are opened for the rows in use and discarded when given back. Both commit
or fail as a whole: a commit the device refuses raises torch.OutOfMemoryError and leaves the
bank as it was.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

MAX_PIECES = 512  # pieces of device memory per group at most (each is one driver allocation)
MAX_PIECE_BYTES = 128 << 20


class _HostReservation:
    """Address space from the kernel with no access; committed pages are opened read-write,
    released ones discarded (they read back as zeros) and closed again."""

    PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]
        for name in ("mprotect", "madvise"):
            getattr(self.libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.granularity = mmap.PAGESIZE
        self.address = None

    def reserve(self, nbytes: int) -> None:
        self.nbytes = nbytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        addr = self.libc.mmap(None, nbytes, self.PROT_NONE, flags, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise torch.OutOfMemoryError(f"cannot reserve {nbytes} bytes of address space: "
                                         f"{os.strerror(ctypes.get_errno())}")
        self.address = addr

    def commit(self, offset: int, nbytes: int) -> None:
        if self.libc.mprotect(self.address + offset, nbytes, self.PROT_RW) != 0:
            raise torch.OutOfMemoryError(f"cannot commit {nbytes} bytes of host memory: "
                                         f"{os.strerror(ctypes.get_errno())}")

    def release(self, offset: int, nbytes: int) -> None:
        self.libc.madvise(self.address + offset, nbytes, mmap.MADV_DONTNEED)
        self.libc.mprotect(self.address + offset, nbytes, self.PROT_NONE)

    def tensor(self) -> torch.Tensor:
        """uint8 [nbytes] over the whole reservation (only committed bytes may be touched); the
        tensor keeps the reservation alive, so no view outlives the mapping."""
        buffer = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
        buffer.owner = self
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def __del__(self) -> None:
        if getattr(self, "address", None) is not None:
            self.libc.munmap(self.address, self.nbytes)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_CU_MEM_ALLOCATION_TYPE_PINNED, _CU_MEM_LOCATION_TYPE_DEVICE, _CU_MEM_ACCESS_READWRITE = 1, 1, 3
_CUDA_ERROR_OUT_OF_MEMORY = 2


class _CudaReservation:
    """A device address range (cuMemAddressReserve) backed piece by piece by physical memory
    (cuMemCreate + cuMemMap); a released piece is unmapped and its memory handed back."""

    def __init__(self, device: torch.device, piece_hint: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._make_current()
        self.prop = _AllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED,
                                    location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index))
        gran = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 1),
                    "cuMemGetAllocationGranularity")
        self.granularity = max(gran.value, piece_hint - piece_hint % gran.value)
        self.address = None
        self.pieces: dict[int, int] = {}  # offset -> physical allocation handle

    def reserve(self, nbytes: int) -> None:
        """The address range, once the caller has sized it in whole pieces."""
        addr = ctypes.c_uint64()
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(addr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                                                 ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self.address, self.nbytes = addr.value, nbytes

    def _make_current(self) -> None:
        """The driver calls need the device's context current on this thread (torch's own is
        the primary context; a worker thread may not have made it current yet)."""
        torch.cuda.synchronize(self.device)  # (also: nothing in flight reads what a release unmaps)
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), self.index), "cuDeviceGet")
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _check(self, status: int, call: str) -> None:
        if status == 0:
            return
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(status, ctypes.byref(name))
        text = f"{call} failed: {(name.value or b'?').decode()} ({status})"
        raise torch.OutOfMemoryError(text) if status == _CUDA_ERROR_OUT_OF_MEMORY else RuntimeError(text)

    def commit(self, offset: int, nbytes: int) -> None:
        self._make_current()
        done: list[int] = []
        size = ctypes.c_size_t(self.granularity)
        access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index), _CU_MEM_ACCESS_READWRITE)
        try:
            for at in range(offset, offset + nbytes, self.granularity):
                handle = ctypes.c_uint64()
                self._check(self.lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self.prop),
                                                 ctypes.c_ulonglong(0)), "cuMemCreate")
                self.pieces[at] = handle.value
                done.append(at)
                ptr = ctypes.c_uint64(self.address + at)
                self._check(self.lib.cuMemMap(ptr, size, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)),
                            "cuMemMap")
                self._check(self.lib.cuMemSetAccess(ptr, size, ctypes.byref(access), ctypes.c_size_t(1)),
                            "cuMemSetAccess")
        except BaseException:
            for at in done:  # all or nothing
                self._release_piece(at)
            raise

    def release(self, offset: int, nbytes: int) -> None:
        self._make_current()
        for at in range(offset, offset + nbytes, self.granularity):
            self._release_piece(at)

    def _release_piece(self, at: int) -> None:
        handle = self.pieces.pop(at)
        # (a piece whose map failed is not mapped: that unmap fails, harmlessly)
        self.lib.cuMemUnmap(ctypes.c_uint64(self.address + at), ctypes.c_size_t(self.granularity))
        self._check(self.lib.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")

    def tensor(self) -> torch.Tensor:
        """uint8 [nbytes] over the whole range (only committed bytes may be touched); the tensor
        keeps the reservation alive, so no view outlives the mapping."""
        return torch.as_tensor(_CudaArray(self), device=self.device)

    def __del__(self) -> None:
        if getattr(self, "address", None) is None:
            return
        try:
            self._make_current()
            for at in list(self.pieces):
                self._release_piece(at)
            self.lib.cuMemAddressFree(ctypes.c_uint64(self.address), ctypes.c_size_t(self.nbytes))
        except Exception:  # (at interpreter exit the driver may be gone; the process gives it all back)
            pass


class _CudaArray:
    """The CUDA array interface of a reservation, for torch.as_tensor (no copy); torch keeps
    this object, and through it the reservation, as long as the tensor lives."""

    def __init__(self, reservation: _CudaReservation) -> None:
        self.reservation = reservation
        self.__cuda_array_interface__ = {"shape": (reservation.nbytes,), "typestr": "|u1",
                                         "data": (reservation.address, False), "version": 2, "strides": None}


class ResizableRows:
    """[G, R, *row_shape] rows of `dtype` on `device`, R in [0, max_rows], resized in place
    (`tensor` is the current view; its address never changes)."""

    def __init__(self, groups: int, max_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 device: str | torch.device, rows: int = 0) -> None:
        self.groups, self.max_rows, self.row_shape, self.dtype = groups, max_rows, tuple(row_shape), dtype
        self.device = torch.device(device)
        self.row_bytes = math.prod(self.row_shape) * dtype.itemsize
        raw = max(1, max_rows * self.row_bytes)
        if self.device.type == "cuda":
            self._memory = _CudaReservation(self.device, min(MAX_PIECE_BYTES, raw // MAX_PIECES))
        elif self.device.type == "cpu":
            self._memory = _HostReservation()
        else:
            raise ValueError(f"resizable rows live on cuda or cpu, not {self.device}")
        unit = self._memory.granularity
        self.region = -(-raw // unit) * unit  # each group starts on a piece boundary
        self._memory.reserve(groups * self.region)
        self.rows = 0
        self._committed = 0  # bytes committed per group
        self._base: torch.Tensor | None = None
        self.tensor = self._view()
        self.resize(rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows in use (the committed memory rounds each group up to a piece)."""
        return self.groups * self.rows * self.row_bytes

    def committed_bytes(self, rows: int) -> int:
        """The memory `rows` rows per group commit, every group together."""
        unit = self._memory.granularity
        return self.groups * (-(-rows * self.row_bytes // unit) * unit)

    def resize(self, rows: int) -> None:
        """Grow (the new rows read as zeros) or shrink (the tail is given back; rows below
        `rows` keep their contents and addresses). A refused commit raises
        torch.OutOfMemoryError and changes nothing."""
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"rows must be in [0, {self.max_rows}], got {rows}")
        target = self.committed_bytes(rows) // self.groups
        grow = target - self._committed
        if grow > 0:
            committed: list[int] = []
            try:
                for g in range(self.groups):
                    self._memory.commit(g * self.region + self._committed, grow)
                    committed.append(g)
            except BaseException:
                for g in committed:
                    self._memory.release(g * self.region + self._committed, grow)
                raise
        elif grow < 0:
            for g in range(self.groups):
                self._memory.release(g * self.region + target, -grow)
        old, self._committed, self.rows = self.rows, target, rows
        self.tensor = self._view()
        if rows > old:
            self.tensor[:, old:].zero_()

    def _view(self) -> torch.Tensor:
        if self._base is None:
            if self._committed == 0:  # (the CUDA array interface needs mapped memory at its address)
                return torch.empty((self.groups, 0, *self.row_shape), dtype=self.dtype, device=self.device)
            self._base = self._memory.tensor().view(self.dtype)
        inner = [math.prod(self.row_shape[i + 1:]) for i in range(len(self.row_shape))]
        return self._base.as_strided((self.groups, self.rows, *self.row_shape),
                                     (self.region // self.dtype.itemsize, math.prod(self.row_shape), *inner))


def resize_together(banks: list[ResizableRows], rows: int) -> None:
    """Resize every bank to `rows` rows, or none: a refused commit puts the banks already
    resized back (shrinking back cannot fail) and raises."""
    done: list[tuple[ResizableRows, int]] = []
    try:
        for bank in banks:
            before = bank.rows
            bank.resize(rows)
            done.append((bank, before))
    except BaseException:
        for bank, before in reversed(done):
            bank.resize(before)
        raise
