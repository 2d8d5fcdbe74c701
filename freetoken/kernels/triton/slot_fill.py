"""Slot fill: copy planned experts from the host pool banks into the GPU slot banks.

Shape legend: L layers, E experts per layer, S slots, P planned copies (N*K), I intermediate,
H hidden. A bank is one tensor per expert format field, e.g. w13 [L*E, 2I, H] in the host
pool (indexed by fid) and w13 [S, 2I, H] in the slot cache (indexed by slot).

`fill_slots` is one kernel launch per two banks driven by the device-side copy plan (copy_slots,
copy_fids, -1 = nothing), so it needs no host round trip and can sit in a CUDA graph. On CUDA
the host banks are pinned CPU tensors read in place through unified addressing (zero-copy:
the GPU pulls the bytes over PCIe). `fill_slots_copies` is the eager alternative: one
`copy_` per (slot, fid) on the current stream, from a plan already on the host.
Both are plain byte copies, so the twin (`slot[s] = host[f]`) is matched bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.reference.expert_cache import SPLIT_GRAIN as _SPLIT_GRAIN

SPLIT_GRAIN = tl.constexpr(_SPLIT_GRAIN)

BLOCK = 4096  # words per load/store round
# Programs per copied row: each keeps one BLOCK load from host memory in flight, and a lone
# expert (decode's usual fill) needs several hundred in flight to approach the link's rate. On
# the H200 (benchmarks/slot_fill_probe.py): one qwen3-30b-a3b expert in 268 us at 64 programs,
# 206 us at 256 or 512, against 179 us for a DMA copy; 2 and 4 experts ~48-50 GB/s at any count.
MAX_PROGRAMS_PER_COPY = 256
# Fills no GEMM waits for (background fills) take fewer: they share the SMs with the step's
# kernels, and 64 programs still move an expert within ~270 us.
BACKGROUND_PROGRAMS_PER_COPY = 64


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
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _copy_split_rows(src_ptr, dst_ptr, slot, fid, row_words, first, inter, unit, BLOCK: tl.constexpr,
                     ALIGN: tl.constexpr):
    """A split miss's GPU rows of w13 [2I, H] (one row = `unit` words): rows [first, I) of the
    gate half and of the up half, two contiguous ranges."""
    row_words = (row_words // ALIGN) * ALIGN
    src = src_ptr + fid.to(tl.int64) * row_words
    dst = dst_ptr + slot.to(tl.int64) * row_words
    lo = (first // SPLIT_GRAIN) * SPLIT_GRAIN * unit  # (a whole number of vectors: see _copy_row)
    n = tl.where((slot >= 0) & (fid >= 0), inter * unit - lo, 0)
    for half in range(2):
        base = half * inter * unit + lo
        for start in range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
            offs = base + start + tl.arange(0, BLOCK)
            mask = start + tl.arange(0, BLOCK) < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _copy_split_cols(src_ptr, dst_ptr, slot, fid, row_words, first, hidden, period, ROWS: tl.constexpr,
                     PER_WORD: tl.constexpr, PERIOD: tl.constexpr, ALIGN: tl.constexpr):
    """A split miss's GPU rows of w2 [H, I] (a row of H = `period` words, PER_WORD elements a
    word): columns [first, I) of every row, as [ROWS, PERIOD] tiles."""
    row_words = (row_words // ALIGN) * ALIGN
    src = src_ptr + fid.to(tl.int64) * row_words
    dst = dst_ptr + slot.to(tl.int64) * row_words
    lo = (first // SPLIT_GRAIN) * (SPLIT_GRAIN // PER_WORD)  # (whole vectors: SPLIT_GRAIN rows a unit)
    cols = tl.arange(0, PERIOD)
    live = (cols >= lo) & (cols < period)
    end = tl.where((slot >= 0) & (fid >= 0), hidden, 0)
    for r0 in range(tl.program_id(1) * ROWS, end, tl.num_programs(1) * ROWS):
        rows = r0 + tl.arange(0, ROWS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = (rows < end)[:, None] & live[None, :]
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["words_a", "words_b", "num_copies"])
def _fill_kernel(src_a, dst_a, words_a, src_b, dst_b, words_b, slots_ptr, fids_ptr, split_ptr, num_copies,
                 inter, unit_a, hidden, period_b, BLOCK: tl.constexpr, SPLIT: tl.constexpr, PER_WORD: tl.constexpr,
                 PERIOD: tl.constexpr, ROWS: tl.constexpr, ALIGN_A: tl.constexpr, ALIGN_B: tl.constexpr,
                 PDL: tl.constexpr):
    # Waits, then signals: the slot GEMM's act kernel after it computes its routes to other slots
    # before its own wait, trusting that every kernel before this one (the plan, its post and
    # tally) has finished (moe_gemm.py).
    pdl.wait(PDL)
    pdl.signal(PDL)
    # grid (copies, parts, banks): the third axis picks bank a or b, so an expert's two banks
    # (w13 and w2) fill in one launch; a lone bank runs with one program along it. SPLIT: one
    # more program along the first axis fills the plan's split miss (its GPU rows only).
    if SPLIT and tl.program_id(0) == num_copies:
        slot = tl.load(split_ptr)
        fid = tl.load(split_ptr + 1)
        first = tl.load(split_ptr + 2)
        if tl.program_id(2) == 1:
            _copy_split_cols(src_b, dst_b, slot, fid, words_b, first, hidden, period_b, ROWS, PER_WORD, PERIOD,
                             ALIGN_B)
        else:
            _copy_split_rows(src_a, dst_a, slot, fid, words_a, first, inter, unit_a, BLOCK, ALIGN_A)
    else:
        slot = tl.load(slots_ptr + tl.program_id(0))
        fid = tl.load(fids_ptr + tl.program_id(0))
        if tl.program_id(2) == 1:
            _copy_row(src_b, dst_b, slot, fid, words_b, BLOCK, ALIGN_B)
        else:
            _copy_row(src_a, dst_a, slot, fid, words_a, BLOCK, ALIGN_A)


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
    split: torch.Tensor | None = None,
) -> None:
    """slot_banks[b][copy_slots[p]] = host_banks[b][copy_fids[p]] for every p with both >= 0.

    copy_slots / copy_fids [P] int32 on the slot banks' device (the plan kernel's output).
    host_banks[b] [L*E, ...] and slot_banks[b] [S, ...] with equal per-row shape and dtype,
    both contiguous; on CUDA the host banks must be pinned.
    split: the plan's split row (int32 [4]: slot, fid, first row c, ...; slot -1: none), with the
    banks (w13 [., 2I, H], w2 [., H, I]): that slot also receives rows [c, I) of that fid's gate
    and up halves and columns [c, I) of its w2, and nothing else. c is a multiple of SPLIT_GRAIN,
    as plans make it (the kernel rounds it down to one: it cannot check a device value).
    """
    if len(host_banks) != len(slot_banks):
        raise ValueError("one slot bank per host bank")
    words = []
    for host, slots in zip(host_banks, slot_banks, strict=True):
        if host.shape[1:] != slots.shape[1:] or host.dtype != slots.dtype:
            raise ValueError(f"bank rows differ: host {host.dtype}{tuple(host.shape)}, "
                             f"slots {slots.dtype}{tuple(slots.shape)}")
        if not (host.is_contiguous() and slots.is_contiguous()):
            raise ValueError("banks must be contiguous")
        if slots.is_cuda and not host.is_cuda and not host.is_pinned():
            raise ValueError("host banks must be pinned to be read by a CUDA kernel")
        words.append((_as_words(host), _as_words(slots)))
    layout = (1, 1, 1, 1)  # (I, words a row of w13, H, words a row of w2's H rows): used with a split only
    per_word = period = 1
    if split is not None:
        layout, per_word = _split_layout(host_banks, words)
        period = triton.next_power_of_2(layout[3])
        if split.shape != (4,) or split.dtype != torch.int32 or split.device != copy_slots.device:
            raise ValueError(f"split must be a plan's [4] int32 row on {copy_slots.device}")
    for i in range(0, len(words), 2):  # two banks a launch
        pair = words[i : i + 2]
        (src_a, dst_a), (src_b, dst_b) = pair[0], pair[-1]
        # programs_per_copy per bank: side by side, a copy starts with up to twice that in flight
        # (512 for a waited fill, at which one expert filled as fast as at 256 on the H200; the
        # fill kernel as background engine, not the default, 128), then the larger bank's share
        parts = min(triton.cdiv(max(src_a.shape[1], src_b.shape[1]), BLOCK), programs_per_copy)
        _fill_kernel[(copy_slots.numel() + (split is not None), parts, len(pair))](
            src_a, dst_a, src_a.shape[1], src_b, dst_b, src_b.shape[1], copy_slots, copy_fids,
            split if split is not None else copy_slots, copy_slots.numel(), *layout, BLOCK=BLOCK,
            SPLIT=split is not None, PER_WORD=per_word, PERIOD=period, ROWS=max(1, BLOCK // period),
            ALIGN_A=_align(src_a.shape[1]),
            ALIGN_B=_align(src_b.shape[1]), **pdl.launch(copy_slots))


def _align(row_words: int) -> int:
    """The largest of 16, 8, 4, 2, 1 words that divides a row (the copy's vector width, at most)."""
    return next(a for a in (16, 8, 4, 2, 1) if row_words % a == 0)


def _split_layout(host_banks: Sequence[torch.Tensor], words: list) -> tuple[tuple[int, int, int, int], int]:
    """Where a split's rows lie in the word views of (w13 [F, 2I, H], w2 [F, H, I]): (I, the
    words of one w13 row, H, the words of one of w2's H rows), and the elements a word holds."""
    if len(host_banks) != 2 or host_banks[0].dim() != 3 or host_banks[1].dim() != 3:
        raise ValueError("a split fill takes the two banks w13 [F, 2I, H] and w2 [F, H, I]")
    w13, w2 = host_banks
    inter, hidden = w2.shape[2], w2.shape[1]
    if w13.shape[1:] != (2 * inter, hidden):
        raise ValueError(f"banks {tuple(w13.shape)} / {tuple(w2.shape)} are not w13 [F, 2I, H] and w2 [F, H, I]")
    per_word = words[1][0].element_size() // w2.element_size()  # elements a word holds
    unit_bytes = hidden * w13.element_size()
    if inter % per_word or unit_bytes % words[0][0].element_size() or _SPLIT_GRAIN % per_word:
        raise ValueError("a split fill needs whole words per intermediate row")
    return (inter, unit_bytes // words[0][0].element_size(), hidden, inter // per_word), per_word


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
