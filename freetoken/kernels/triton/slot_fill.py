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
def _copy_row(src_ptr, dst_ptr, slot, fid, row_words, BLOCK: tl.constexpr):
    end = tl.where((slot >= 0) & (fid >= 0), row_words, 0)  # an unused plan entry copies nothing
    src = src_ptr + fid.to(tl.int64) * row_words
    dst = dst_ptr + slot.to(tl.int64) * row_words
    for start in range(tl.program_id(1) * BLOCK, end, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _copy_split_row(src_ptr, dst_ptr, slot, fid, row_words, first, unit, period, BLOCK: tl.constexpr):
    """A split miss's GPU rows: the words w of the row with (w // unit) % period >= first."""
    end = tl.where((slot >= 0) & (fid >= 0), row_words, 0)
    src = src_ptr + fid.to(tl.int64) * row_words
    dst = dst_ptr + slot.to(tl.int64) * row_words
    for start in range(tl.program_id(1) * BLOCK, end, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = (offs < end) & ((offs // unit) % period >= first)
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["words_a", "words_b", "num_copies"])
def _fill_kernel(src_a, dst_a, words_a, src_b, dst_b, words_b, slots_ptr, fids_ptr, split_ptr, num_copies,
                 unit_a, period_a, div_a, unit_b, period_b, div_b, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                 PDL: tl.constexpr):
    pdl.enter(PDL)
    # grid (copies, parts, banks): the third axis picks bank a or b, so an expert's two banks
    # (w13 and w2) fill in one launch; a lone bank runs with one program along it. SPLIT: one
    # more program along the first axis fills the plan's split miss (its GPU rows only).
    if SPLIT and tl.program_id(0) == num_copies:
        slot = tl.load(split_ptr)
        fid = tl.load(split_ptr + 1)
        first = tl.load(split_ptr + 2)
        if tl.program_id(2) == 1:
            _copy_split_row(src_b, dst_b, slot, fid, words_b, first // div_b, unit_b, period_b, BLOCK)
        else:
            _copy_split_row(src_a, dst_a, slot, fid, words_a, first // div_a, unit_a, period_a, BLOCK)
    else:
        slot = tl.load(slots_ptr + tl.program_id(0))
        fid = tl.load(fids_ptr + tl.program_id(0))
        if tl.program_id(2) == 1:
            _copy_row(src_b, dst_b, slot, fid, words_b, BLOCK)
        else:
            _copy_row(src_a, dst_a, slot, fid, words_a, BLOCK)


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
    and up halves and columns [c, I) of its w2, and nothing else (c a multiple of the words'
    elements).
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
    layout = (1, 1, 1, 1, 1, 1)  # (unit, period, div) of bank a, then of bank b: used with a split only
    if split is not None:
        layout = _split_layout(host_banks, words)
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
            SPLIT=split is not None, **pdl.launch(copy_slots))


def _split_layout(host_banks: Sequence[torch.Tensor], words: list) -> tuple[int, ...]:
    """Where a split's rows lie in the word views of (w13 [F, 2I, H], w2 [F, H, I]): per bank
    (unit, period, div), a word w of a row belonging to intermediate row (w // unit) % period,
    counted in units of div rows. w13: a word row-block per intermediate row, the gate then the
    up half (period I); w2: a word per div columns of each H row (period I / div)."""
    if len(host_banks) != 2 or host_banks[0].dim() != 3 or host_banks[1].dim() != 3:
        raise ValueError("a split fill takes the two banks w13 [F, 2I, H] and w2 [F, H, I]")
    w13, w2 = host_banks
    inter, hidden = w2.shape[2], w2.shape[1]
    if w13.shape[1:] != (2 * inter, hidden):
        raise ValueError(f"banks {tuple(w13.shape)} / {tuple(w2.shape)} are not w13 [F, 2I, H] and w2 [F, H, I]")
    per_word = words[1][0].element_size() // w2.element_size()  # elements a word holds
    if inter % per_word or (hidden * w13.element_size()) % words[0][0].element_size():
        raise ValueError("a split fill needs whole words per intermediate row")
    return (words[0][0].shape[1] // (2 * inter), inter, 1, 1, inter // per_word, per_word)


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
