"""Slot fill: copy planned experts from the host pool banks into the GPU slot banks.

Shape legend: L layers, E experts per layer, S slots, P planned copies (N*K), I intermediate,
H hidden. A bank is one tensor per expert format field, e.g. w13 [L*E, 2I, H] in the host
pool (indexed by fid) and w13 [S, 2I, H] in the slot cache (indexed by slot).

`fill_slots` is one kernel launch per two banks driven by the device-side copy plan (copy_slots,
copy_fids, -1 = nothing), so it needs no host round trip and can sit in a CUDA graph. On CUDA
the host banks are pinned CPU tensors read in place through unified addressing (zero-copy:
the GPU pulls the bytes over PCIe). `fill_slots_copies` is the eager alternative: one
`copy_` per (slot, fid) on the current stream, from a plan already on the host.
Both are plain byte copies, so the twin (`slot[s] = host[f]`) is matched bit for bit. Where the
slots are wider than the pool (bf16 experts computed in fp32), the same kernel copies elements
and widens them on the way: still exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.device_clock import globaltimer

BLOCK = 4096  # words per load/store round
# Programs per copied row: each keeps one BLOCK load from host memory in flight, and a lone
# expert (decode's usual fill) needs several hundred in flight to approach the link's rate
# (benchmarks/slot_fill_probe.py); past this count a lone expert fills no faster.
MAX_PROGRAMS_PER_COPY = 256


@triton.jit
def _copy_row(src_ptr, dst_ptr, slot, fid, row_words, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # (row_words // ALIGN) * ALIGN: the compiler then knows every row starts ALIGN words apart,
    # and loads and stores whole vectors (ALIGN divides the row; 1 where nothing larger does)
    row_words = (row_words // ALIGN) * ALIGN
    end = tl.where((slot >= 0) & (fid >= 0), row_words, 0)  # an unused plan entry copies nothing
    src = src_ptr + fid.to(tl.int64) * row_words
    dst = dst_ptr + slot.to(tl.int64) * row_words
    for start in range(tl.program_id(1) * BLOCK, end, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        # (a no-op cast between equal types; bf16 -> fp32 where the slots are wider)
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["words_a", "words_b"])
def _fill_kernel(src_a, dst_a, words_a, src_b, dst_b, words_b, slots_ptr, fids_ptr, stamps_ptr,
                 BLOCK: tl.constexpr, ALIGN_A: tl.constexpr, ALIGN_B: tl.constexpr, PDL: tl.constexpr,
                 STAMP: tl.constexpr):  # 0: no stamps; 1: the end; 2: the start and the end
    # Waits, then signals: the slot GEMM's act kernel after it computes its routes to other slots
    # before its own wait, trusting that every kernel before this one (the plan and its post)
    # has finished (moe_gemm.py).
    pdl.wait(PDL)
    pdl.signal(PDL)
    one = tl.arange(0, 1)
    if STAMP == 2:  # the fill's start: the first program, past the wait for the plan
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            tl.store(stamps_ptr + one, globaltimer())
    # grid (copies, parts, banks): the third axis picks bank a or b, so an expert's two banks
    # (w13 and w2) fill in one launch; a lone bank runs with one program along it.
    slot = tl.load(slots_ptr + tl.program_id(0))
    fid = tl.load(fids_ptr + tl.program_id(0))
    if tl.program_id(2) == 1:
        _copy_row(src_b, dst_b, slot, fid, words_b, BLOCK, ALIGN_B)
    else:
        _copy_row(src_a, dst_a, slot, fid, words_a, BLOCK, ALIGN_A)
    if STAMP > 0:  # the fill's end: the latest program's (the device timer only grows, so the word
        # needs no reset between steps: an earlier step's end is always below this one's)
        tl.atomic_max(stamps_ptr + 1 + one, globaltimer())


def _as_words(bank: torch.Tensor) -> torch.Tensor:
    """[rows, ...] -> [rows, words]: the widest integer view that divides a row (a copy moves bits)."""
    flat = bank.reshape(bank.shape[0], -1)
    row_bytes = flat.shape[1] * flat.element_size()
    for dtype in (torch.int32, torch.int16, torch.uint8):
        if row_bytes % dtype.itemsize == 0:
            return flat.view(dtype)
    raise AssertionError("unreachable: uint8 divides every row")


def fill_slots(
    copy_slots: torch.Tensor,
    copy_fids: torch.Tensor,
    host_banks: Sequence[torch.Tensor],
    slot_banks: Sequence[torch.Tensor],
    programs_per_copy: int = MAX_PROGRAMS_PER_COPY,
    stamps: torch.Tensor | None = None,
) -> None:
    """slot_banks[b][copy_slots[p]] = host_banks[b][copy_fids[p]] for every p with both >= 0.

    copy_slots / copy_fids [P] int32 on the slot banks' device (the plan kernel's output).
    host_banks[b] [L*E, ...] and slot_banks[b] [S, ...] with equal per-row shape and dtype (or
    bf16/fp16 host rows into fp32 slots, widened), both contiguous; on CUDA the host banks must be
    pinned.
    stamps: [2] int64 on the device, or None: the fill times itself (device ns, %globaltimer):
    stamps[0] = when it starts (past its wait for the kernel before), stamps[1] = max(stamps[1],
    when its last program ends). In the kernel, not as stamp launches around it: a launch there
    would end the programmatic chain from the plan through the fill into the slot GEMM (pdl.py).
    With two launches (four banks), the first stamps the start and both the end.
    """
    if len(host_banks) != len(slot_banks):
        raise ValueError("one slot bank per host bank")
    if stamps is not None and (stamps.shape != (2,) or stamps.dtype != torch.int64
                               or stamps.device != copy_slots.device or not stamps.is_contiguous()):
        raise ValueError(f"stamps must be a contiguous [2] int64 tensor on {copy_slots.device}")
    words = []
    for host, slots in zip(host_banks, slot_banks, strict=True):
        widens = host.dtype in (torch.bfloat16, torch.float16) and slots.dtype == torch.float32
        if host.shape[1:] != slots.shape[1:] or (host.dtype != slots.dtype and not widens):
            raise ValueError(f"bank rows differ: host {host.dtype}{tuple(host.shape)}, "
                             f"slots {slots.dtype}{tuple(slots.shape)}")
        if not (host.is_contiguous() and slots.is_contiguous()):
            raise ValueError("banks must be contiguous")
        if slots.is_cuda and not host.is_cuda and not host.is_pinned():
            raise ValueError("host banks must be pinned to be read by a CUDA kernel")
        # equal dtypes move as words; a widening fill moves elements
        words.append((host.reshape(host.shape[0], -1), slots.reshape(slots.shape[0], -1)) if widens
                     else (_as_words(host), _as_words(slots)))
    for i in range(0, len(words), 2):  # two banks a launch
        pair = words[i : i + 2]
        (src_a, dst_a), (src_b, dst_b) = pair[0], pair[-1]
        # programs_per_copy per bank: side by side, a copy starts with up to twice that in flight,
        # then the larger bank's share
        parts = min(triton.cdiv(max(src_a.shape[1], src_b.shape[1]), BLOCK), programs_per_copy)
        # STAMP: 0 none, 1 the end, 2 the start (the first launch) and the end
        stamp = 0 if stamps is None else 2 if i == 0 else 1
        _fill_kernel[(copy_slots.numel(), parts, len(pair))](
            src_a, dst_a, src_a.shape[1], src_b, dst_b, src_b.shape[1], copy_slots, copy_fids,
            stamps if stamps is not None else copy_slots,  # (unused without STAMP)
            BLOCK=BLOCK, ALIGN_A=_align(src_a.shape[1]),
            ALIGN_B=_align(src_b.shape[1]), STAMP=stamp, **pdl.launch(copy_slots))


def _align(row_words: int) -> int:
    """The largest of 16, 8, 4, 2, 1 words that divides a row (the copy's vector width, at most)."""
    return next(a for a in (16, 8, 4, 2, 1) if row_words % a == 0)


def fill_slots_copies(
    copies: Iterable[tuple[int, int]],
    host_banks: Sequence[torch.Tensor],
    slot_banks: Sequence[torch.Tensor],
) -> None:
    """The same fill from a host-side plan: one async `copy_` per (slot, fid) and bank, current stream."""
    for slot, fid in copies:
        if slot >= 0 and fid >= 0:
            for host, slots in zip(host_banks, slot_banks, strict=True):
                slots[slot].copy_(host[fid], non_blocking=True)
