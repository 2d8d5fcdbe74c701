"""The device side of a captured layer's CPU branch, as two kernels instead of ~11 launches.

Shape legend: N tokens, K top-k, H hidden; the mailbox buffers (kernels/cpu/mailbox.py) are
pinned host memory, read and written in place through unified addressing.

  post_cpu_work: mailbox.x[:N] = x (fp32), mailbox.weights[:N] = weights (fp32),
                 mailbox.fids[:N] = ids + base where routes < 0, else -1; with fills,
                 mailbox.fill_slots[:N] = the plan's background slots, mailbox.fill_fids[:N]
                 = their fids (-1 elsewhere);
  add_cpu_result: y + mailbox.out[:N], the CPU's fp32 sum rounded to y's dtype first, then the
                 sum rounded again (the eager path's two roundings).
  with fill tickets (copy-engine fills, kernels/cpu/copy_engine.py): post_cpu_work first waits
                 for earlier fills into the slots the layer touches, then numbers the layer's fills as the poller
                 will (kernels/triton/fill_tickets.py).
Twins: the torch expressions in `post_cpu_work_torch` / `add_cpu_result_torch`, equal bit for
bit. The host buffer is read with volatile loads: the CPU wrote it after the last kernel ran.

Fused hand-off (the default in captured steps): the same two kernels also do the doorbell's
flag work, so a layer's CPU branch is two graph nodes instead of four (with the stream memory
write of the bell and wait for the answer between them). Where the self-test at start finds the
fused kernels cannot ring and wait, stream memory operations take over (kernels/stream_flags.py).
The fused forms:
  post_cpu_work(..., bell=(addr, value)): after the mailbox rows, a system-scope fence and
                 a release store of the bell word;
  add_cpu_result(..., done=(addr, value)): spins on volatile loads of the done word until
                 (int32)(word - value) >= 0 (the CPU echoes the bell value there; the stream
                 wait's comparison), then a system-scope fence, then adds.
Both run as one program, so the bell follows every row's stores. The spin holds one SM while
the CPU computes (nothing else runs on the stream then) and reads the word without atomics, so
it adds no PCIe read-modify-writes on the line the CPU writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels.stream_flags import RawPointer
from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.fill_tickets import (
    _await_fill_tickets,
    _fence_system,
    _number_fills,
    await_fill_tickets_torch,
    number_fills_torch,
)
from freetoken.kernels.triton.rounding import rne_bf16

MAX_BLOCK_P = 1024  # a layer's N*K plan entries are read in chunks of at most this many (tests shrink it)


@triton.jit
def _cpu_routes(routes_ptr, N, K, BLOCK_K: tl.constexpr):
    """How many of the layer's N x K routes go to the CPU (-1)."""
    k = tl.arange(0, BLOCK_K)
    count = tl.zeros([], dtype=tl.int32)
    for n in range(0, N):
        routes = tl.load(routes_ptr + tl.cast(n, tl.int64) * K + k, mask=k < K, other=0)
        count += tl.sum((routes < 0).to(tl.int32), axis=0)
    return count


@triton.jit
def _post_rows(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, bg_ptr, cf_ptr, ms_ptr, mc_ptr,
               first, last, H, K, base, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, FILLS: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    k = tl.arange(0, BLOCK_K)
    mk = k < K
    for n in range(first, last):
        n = tl.cast(n, tl.int64)
        for h0 in range(0, H, BLOCK_H):
            m = h0 + h < H
            tl.store(mx_ptr + n * H + h0 + h, tl.load(x_ptr + n * H + h0 + h, mask=m).to(tl.float32), mask=m)
        tl.store(mw_ptr + n * K + k, tl.load(w_ptr + n * K + k, mask=mk).to(tl.float32), mask=mk)
        ids = tl.load(ids_ptr + n * K + k, mask=mk, other=0).to(tl.int32)
        routes = tl.load(routes_ptr + n * K + k, mask=mk, other=0)
        fids = ids + base
        tl.store(mf_ptr + n * K + k, tl.where(routes < 0, fids, -1), mask=mk)
        if FILLS:  # the plan's background fills (slot, fid) of this row's entries, -1 elsewhere
            slots = tl.load(bg_ptr + n * K + k, mask=mk, other=-1)
            tl.store(ms_ptr + n * K + k, slots, mask=mk)
            tl.store(mc_ptr + n * K + k, tl.where(slots >= 0, tl.load(cf_ptr + n * K + k, mask=mk, other=-1), -1),
                     mask=mk)


@triton.jit
def _ring_post(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, bg_ptr, cf_ptr, ms_ptr, mc_ptr,
               N, H, K, base, bell_ptr, bell_value, always, tickets_ptr, num_slots, cs_ptr, landed_ptr,
               BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, FILLS: tl.constexpr,
               TICKETS: tl.constexpr, FENCE: tl.constexpr):
    """The fused hand-off's post, in one program (the post kernel's, or the plan kernel's after
    its plan: kernels/triton/plan.py): TICKETS (with FILLS): first wait for earlier fills into the
    slots the layer touches; if the layer routes anything to the CPU (or `always`), number its
    fills where the CPU will queue them, write every row, fence, ring."""
    if TICKETS:
        _await_fill_tickets(tickets_ptr, num_slots, routes_ptr, cs_ptr, bg_ptr, N * K, landed_ptr, BLOCK_P, FENCE)
    if always + _cpu_routes(routes_ptr, N, K, BLOCK_K) > 0:
        if TICKETS:
            _number_fills(tickets_ptr, num_slots, bg_ptr, cf_ptr, N * K, BLOCK_P)
        _post_rows(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, bg_ptr, cf_ptr, ms_ptr, mc_ptr,
                   0, N, H, K, base, BLOCK_H, BLOCK_K, FILLS)
        if FENCE:  # (always on the device; Triton's interpreter has no inline assembly)
            _fence_system()
        tl.debug_barrier()
        tl.atomic_xchg(bell_ptr, bell_value, sem="release", scope="sys")


@triton.jit
def _post_kernel(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, bg_ptr, cf_ptr, ms_ptr, mc_ptr,
                 N, H, K, base, bell_ptr, bell_value, always, tickets_ptr, num_slots, cs_ptr, landed_ptr,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, RING: tl.constexpr,
                 FILLS: tl.constexpr, TICKETS: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    # RING: one program writes every row and rings, if the layer routes anything to the CPU
    # (or `always`); else one program per row, no ring. (A layer with background fills routes
    # those experts to the CPU, so it rings.) TICKETS (with FILLS): first wait for earlier fills
    # into the slots the layer touches; number this layer's fills where the CPU will queue them
    # (when the layer rings; program 0 without a ring).
    if RING:
        _ring_post(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, bg_ptr, cf_ptr, ms_ptr, mc_ptr,
                   N, H, K, base, bell_ptr, bell_value, always, tickets_ptr, num_slots, cs_ptr, landed_ptr,
                   BLOCK_H, BLOCK_K, BLOCK_P, FILLS, TICKETS, FENCE)
    else:
        row = tl.program_id(0)
        if TICKETS:
            if row == 0:
                _await_fill_tickets(tickets_ptr, num_slots, routes_ptr, cs_ptr, bg_ptr, N * K, landed_ptr,
                                    BLOCK_P, FENCE)
                _number_fills(tickets_ptr, num_slots, bg_ptr, cf_ptr, N * K, BLOCK_P)
        _post_rows(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, bg_ptr, cf_ptr, ms_ptr, mc_ptr,
                   row, row + 1, H, K, base, BLOCK_H, BLOCK_K, FILLS)


@triton.jit
def _add_rows(y_ptr, out_ptr, res_ptr, first, last, H, use_cpu, BLOCK_H: tl.constexpr, BF16: tl.constexpr):
    # use_cpu 0: res = y, `out` is not read (the CPU computed nothing for this layer)
    h = tl.arange(0, BLOCK_H)
    for n in range(first, last):
        n = tl.cast(n, tl.int64)
        for h0 in range(0, H, BLOCK_H):
            m = h0 + h < H
            cpu = tl.load(out_ptr + n * H + h0 + h, mask=m & (use_cpu != 0), other=0.0, volatile=True)
            y_in = tl.load(y_ptr + n * H + h0 + h, mask=m, other=0.0)
            y = y_in.to(tl.float32)
            if BF16:
                total = rne_bf16(y + rne_bf16(cpu).to(tl.float32))
            else:
                total = (y + cpu).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + n * H + h0 + h, tl.where(use_cpu != 0, total, y_in), mask=m)


@triton.jit
def _add_kernel(y_ptr, out_ptr, res_ptr, routes_ptr, done_ptr, done_value, always, N, H, K, ack_ptr,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, WAIT: tl.constexpr,
                ACK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    # WAIT: one program; if the layer rang (it routes to the CPU, or `always`), wait for the
    # done word, then add every row (reading `out` only if the CPU computed something); else
    # pass y through. ACK: once the answer is read, echo the done value into the ack word.
    # Without WAIT one program per row adds.
    if WAIT:
        routed = _cpu_routes(routes_ptr, N, K, BLOCK_K) > 0
        rang = always + routed.to(tl.int32) > 0
        if rang:
            seen = tl.load(done_ptr, volatile=True)
            while seen - done_value < 0:
                seen = tl.load(done_ptr, volatile=True)
            _fence_system()  # no read of `out` moves before the answer was seen
            tl.debug_barrier()
        _add_rows(y_ptr, out_ptr, res_ptr, 0, N, H, routed.to(tl.int32), BLOCK_H, BF16)
        if ACK:
            if rang:
                tl.debug_barrier()  # every load of `out` has returned (its values are stored)
                tl.atomic_xchg(ack_ptr, done_value, sem="release", scope="sys")
    else:
        row = tl.program_id(0)
        _add_rows(y_ptr, out_ptr, res_ptr, row, row + 1, H, 1, BLOCK_H, BF16)


def post_cpu_work(x, weights, ids, routes, base: int, mx, mw, mf, bell: tuple[int, int] | None = None,
                  always: bool = False, fills: tuple | None = None, tickets: tuple | None = None) -> None:
    """x [N, H], weights/ids/routes [N, K] on the device; mx [R, H] fp32, mw [R, K] fp32,
    mf [R, K] int32 (R >= N; pinned host, or device tensors for tests). bell: (address of an
    int32 word in pinned host memory, value) to store there once every row is written; with a
    bell, a layer that routes nothing to the CPU writes nothing and does not ring, unless
    `always` (the step's last MoE layer, whose ring ends the poller's step). fills:
    (background_slots [N*K], copy_fids [N*K], ms [R, K], mc [R, K]) from the layer's plan: ms
    receives the background slots and mc their fids (-1 at every other entry), for the CPU to
    queue on the copy engine (kernels/cpu/copy_engine.py). tickets (with fills): (tickets [S + 2]
    int32 on the device, the plan's copy_slots [N*K], the LANDED word as an int32 [1] tensor in
    pinned host memory): wait for earlier fills into the slots the layer touches, then number
    this layer's (see the module's docstring)."""
    n, h = x.shape
    k = ids.shape[1]
    bell_ptr = mf  # unused without a bell
    if bell is not None:  # (a tensor word works too: Triton's interpreter takes no raw address)
        bell_ptr = bell[0] if isinstance(bell[0], torch.Tensor) else RawPointer(bell[0])
    bg, cf, ms, mc = fills if fills is not None else (mf, mf, mf, mf)  # unused without fills
    if tickets is not None and fills is None:
        raise ValueError("post_cpu_work: fill tickets come with the fills they number")
    ticket_words, copy_slots, landed = tickets if tickets is not None else (mf, mf, mf)  # unused without tickets
    _post_kernel[(1 if bell else n,)](x.contiguous(), weights.contiguous(), ids.contiguous(), routes.contiguous(),
                                      mx, mw, mf, bg, cf, ms, mc, n, h, k, base, bell_ptr,
                                      bell[1] if bell else 0,
                                      int(always), ticket_words, ticket_words.shape[0] - 2, copy_slots, landed,
                                      BLOCK_H=min(1024, triton.next_power_of_2(h)),
                                      BLOCK_K=triton.next_power_of_2(k),
                                      BLOCK_P=min(MAX_BLOCK_P, triton.next_power_of_2(n * k)), RING=bell is not None,
                                      FILLS=fills is not None, TICKETS=tickets is not None,
                                      FENCE=x.device.type == "cuda", num_warps=4, **pdl.launch(x))


class HandoffArgs(NamedTuple):
    args: tuple  # the plan kernel's hand-off arguments, in its order
    constants: dict  # its hand-off constexprs (POST apart)


@dataclass
class PlanHandoff:
    """A captured layer's fused hand-off, run by the plan kernel's program once its plan is
    stored (kernels/triton/plan.py, `plan_layer_device(..., handoff=)`): `post_cpu_work` with a
    bell, whose routes and fill lists are the plan's own. x [N, H], weights [N, K] on the
    device; mx, mw, mf the mailbox rows; bell (address or int32 [1] tensor word, value);
    fill_rows (ms, mc): hand the plan's background fills over; tickets (words [S + 2], LANDED
    [1]; with fill_rows): wait for earlier fills into the slots the layer touches and number
    its own."""

    x: torch.Tensor
    weights: torch.Tensor
    mx: torch.Tensor
    mw: torch.Tensor
    mf: torch.Tensor
    bell: tuple
    always: bool = False
    fill_rows: tuple | None = None
    tickets: tuple | None = None

    def kernel_args(self, n: int, k: int, num_slots: int) -> HandoffArgs:
        h = self.x.shape[1]
        if self.x.shape[0] != n or self.weights.shape != (n, k):
            raise ValueError(f"hand-off x {tuple(self.x.shape)} / weights {tuple(self.weights.shape)} do not "
                             f"match the plan's [{n}, {k}] ids")
        if self.tickets is not None and self.fill_rows is None:
            raise ValueError("post_cpu_work: fill tickets come with the fills they number")
        if self.tickets is not None and self.tickets[0].shape[0] != num_slots + 2:
            raise ValueError(f"fill tickets for {self.tickets[0].shape[0] - 2} slots, the cache has {num_slots}")
        word = self.bell[0]
        bell_ptr = word if isinstance(word, torch.Tensor) else RawPointer(word)
        ms, mc = self.fill_rows if self.fill_rows is not None else (self.mf, self.mf)  # unused without fills
        words, landed = self.tickets if self.tickets is not None else (self.mf, self.mf)  # unused without tickets
        return HandoffArgs((self.x.contiguous(), self.weights.contiguous(), self.mx, self.mw, self.mf, ms, mc, n, h,
                            k, bell_ptr, self.bell[1], int(self.always), words, landed),
                           {"BLOCK_H": min(1024, triton.next_power_of_2(h)), "BLOCK_K": triton.next_power_of_2(k),
                            "FILLS": self.fill_rows is not None, "TICKETS": self.tickets is not None,
                            "FENCE": self.x.device.type == "cuda"})

    @staticmethod
    def absent(placeholder: torch.Tensor) -> HandoffArgs:
        """The same arguments for a plan without a hand-off (every pointer `placeholder`, unused)."""
        t = placeholder
        return HandoffArgs((t, t, t, t, t, t, t, 1, 1, 1, t, 0, 0, t, t),
                           {"BLOCK_H": 1, "BLOCK_K": 1, "FILLS": False, "TICKETS": False, "FENCE": False})


def add_cpu_result(y: torch.Tensor, out: torch.Tensor, done: tuple[int, int] | None = None,
                   routes: torch.Tensor | None = None, always: bool = False, ack: int | None = None) -> torch.Tensor:
    """y [N, H] (bf16 or fp32) + out[:N] (fp32, pinned host) -> [N, H] in y's dtype. done:
    (address of an int32 word in pinned host memory, value) to wait for first, until
    (int32)(word - value) >= 0, with routes [N, K] the layer's (as post_cpu_work had them): a
    layer that routed nothing to the CPU passes y through (and, not `always`, rang nothing, so
    it waits for nothing). ack: the address of an int32 word (pinned host) that receives the
    done value once a layer that rang has read its answer."""
    n, h = y.shape
    if (done is None) != (routes is None):
        raise ValueError("add_cpu_result: a done word comes with the layer's routes")
    res = torch.empty_like(y)
    done_ptr = RawPointer(done[0]) if done is not None else out  # unused without a done word
    routes = routes.contiguous() if routes is not None else out  # unused without a done word
    k = routes.shape[1] if done is not None else 1
    if ack is not None and done is None:
        raise ValueError("add_cpu_result: an ack word comes with a done word")
    ack_ptr = RawPointer(ack) if ack is not None else out  # unused without an ack word
    _add_kernel[(1 if done is not None else n,)](y.contiguous(), out, res, routes, done_ptr, done[1] if done else 0,
                                                 int(always), n, h, k, ack_ptr,
                                                 BLOCK_H=min(1024, triton.next_power_of_2(h)),
                                                 BLOCK_K=triton.next_power_of_2(k),
                                                 BF16=y.dtype == torch.bfloat16, WAIT=done is not None,
                                                 ACK=ack is not None, num_warps=4, **pdl.launch(res))
    return res


def post_cpu_work_torch(x, weights, ids, routes, base: int, mx, mw, mf, bell: tuple | None = None,
                        always: bool = False, fills: tuple | None = None, tickets: tuple | None = None) -> None:
    """The twin of `post_cpu_work` (bell: (an int32 [1] tensor word, value); LANDED holds still)."""
    n, k = routes.shape
    if tickets is not None:
        if fills is None:
            raise ValueError("post_cpu_work: fill tickets come with the fills they number")
        await_fill_tickets_torch(tickets, routes, fills[0])
    rings = _rings(routes, bell, always)
    if tickets is not None and rings:
        number_fills_torch(tickets[0], fills[0], fills[1])
    if not rings:
        return
    mx[:n].copy_(x.float(), non_blocking=True)
    mw[:n].copy_(weights.float(), non_blocking=True)
    fids = ids.to(torch.int32) + base
    mf[:n].copy_(torch.where(routes < 0, fids, -1), non_blocking=True)
    if fills is not None:
        background, fids, ms, mc = fills
        ms[:n].copy_(background.view(n, k), non_blocking=True)
        mc[:n].copy_(torch.where(background >= 0, fids, -1).view(n, k), non_blocking=True)
    if bell is not None:
        bell[0].fill_(bell[1])


def _rings(routes: torch.Tensor, bell, always: bool) -> bool:
    """Whether the twin's layer writes its rows (with a bell, a layer without CPU work is quiet)."""
    return bell is None or always or bool((routes < 0).any())


def add_cpu_result_torch(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return y + out[: y.shape[0]].to(device=y.device, non_blocking=True).to(y.dtype)


def fused_handoff_self_test(device: str = "cuda") -> None:
    """Ring a bell word and wait on a done word the host already set, through the fused
    kernels: the bell holds its value, the sum is right."""
    flags = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    mx, mw = torch.zeros(1, 4, pin_memory=True), torch.zeros(1, 1, pin_memory=True)
    mf = torch.zeros(1, 1, dtype=torch.int32, pin_memory=True)
    x = torch.ones(1, 4, device=device)
    routes = torch.full((1, 1), -1, dtype=torch.int32, device=device)
    post_cpu_work(x, x[:, :1], torch.zeros(1, 1, dtype=torch.int64, device=device), routes, 0, mx, mw, mf,
                  bell=(flags.data_ptr(), 7))
    flags[1] = 7  # the CPU's echo of the bell
    out = torch.full((1, 4), 2.0, pin_memory=True)
    y = add_cpu_result(x, out, done=(flags.data_ptr() + 4, 7), routes=routes)
    torch.cuda.synchronize()
    if flags.tolist() != [7, 7] or y.tolist() != [[3.0] * 4] or mx.tolist() != [[1.0] * 4]:
        raise RuntimeError(f"fused hand-off self-test: flags {flags.tolist()} (want [7, 7]), sum {y.tolist()}")


@triton.jit
def _wait_word_kernel(word_ptr, target_ptr, gate_ptr, GATED: tl.constexpr, FENCE: tl.constexpr):
    go = 1
    if GATED:
        go = tl.load(gate_ptr, volatile=True)
    if go != 0:
        target = tl.load(target_ptr, volatile=True)
        seen = tl.load(word_ptr, volatile=True)
        while seen - target < 0:
            seen = tl.load(word_ptr, volatile=True)
        if FENCE:  # (always on the device; Triton's interpreter has no inline assembly)
            _fence_system()  # nothing after the wait moves before the word was seen


def wait_word(addr: int, target_addr: int, gate_addr: int | None = None) -> None:
    """Queue, on the current stream, a wait until (int32)(*addr - *target_addr) >= 0 for two
    int32 words (pinned host or device memory), the target read once when the wait starts (so a
    graph can wait for a value set before each replay, by the host or by earlier kernels). With
    gate_addr, an int32 word read first: 0 skips the wait (the host decides per replay).
    Volatile loads, one program."""
    gate = RawPointer(gate_addr) if gate_addr is not None else RawPointer(addr)  # unused without a gate
    _wait_word_kernel[(1,)](RawPointer(addr), RawPointer(target_addr), gate, GATED=gate_addr is not None,
                            FENCE=True, num_warps=1)
