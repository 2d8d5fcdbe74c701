"""`bench bw`'s random host banks (bench/bw.py): one layer of random experts in a format, laid out
as the pool's host banks and the device slots hold that format's experts, one builder per kind
of profile key (moe/profile_key.py):
  - bf16: w13 uint16 [E, 2I, H], w2 uint16 [E, H, I] of normal values (so no denormals);
  - GGML blocks (a type, a mix, a pair): uint8 [E, bytes], rows 16 bytes apart (block_format.py);
  - mxfp4+bias (gpt-oss): uint8 [E, bytes], each row a projection's blocks, scales and bf16
    biases, written by the format's own `read_layer` (moe/mxfp4_format.py).
Each builder makes one random expert, repeated E times: contents do not change the speed,
addresses do.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

from freetoken.moe.profile_key import MXFP4_KEY, UNQUANTIZED_KEY, parse_profile_key


class HostBanks(NamedTuple):
    w13: Any  # numpy [E, ...], the rows the CPU kernel reads
    w2: Any
    w13_t: Any  # the pinned torch tensors they view (for the copies), else None
    w2_t: Any
    layout: Any  # the CPU kernel's layout (kernels/cpu/cpu_kernel.py: `kernel_for`); None for bf16


def random_banks(rng, expert_format: str, experts: int, hidden: int, inter: int, pinned: bool) -> HostBanks:
    """Host banks of `experts` random experts in `expert_format` (a canonical profile key), pinned
    when asked (CUDA present). ValueError for a shape the format cannot hold."""
    if expert_format == UNQUANTIZED_KEY:
        ones, layout = _bf16_expert(rng, hidden, inter), None
    elif expert_format == MXFP4_KEY:
        ones, layout = _mxfp4_expert(rng, experts, hidden, inter)
    else:
        ones, layout = _block_expert(rng, parse_profile_key(expert_format), experts, hidden, inter)
    banks, tensors = [], []
    for one in ones:
        a, t = _bank((experts, *one.shape), one.dtype, pinned)
        a[:] = one
        banks.append(a)
        tensors.append(t)
    return HostBanks(banks[0], banks[1], tensors[0], tensors[1], layout)


def _bf16_expert(rng, hidden: int, inter: int) -> list:
    """bf16 bits, uint16 [2I, H] and [H, I]."""
    import numpy as np

    return [((rng.standard_normal(shape, dtype=np.float32) * 0.05).view(np.uint32) >> 16).astype(np.uint16)
            for shape in ((2 * inter, hidden), (hidden, inter))]


def _block_expert(rng, pair, experts: int, hidden: int, inter: int) -> tuple[list, Any]:
    """Random GGML block rows of the (gate/up, down) types, each bank's row padded to 16 bytes."""
    import numpy as np

    from freetoken.kernels.cpu.quant_experts import QuantLayout
    from freetoken.quant.random_blocks import random_rows

    layout = QuantLayout(np.array([[int(t) for t in pair]], np.int32), experts, hidden, inter)
    ones = [np.zeros(-(-width // 16) * 16, np.uint8) for width in layout.bank_bytes()]
    for one, rows in zip(ones, (random_rows(pair[0], 2 * inter, hidden, rng),
                                random_rows(pair[1], hidden, inter, rng)), strict=True):
        one[: rows.size] = rows
    return ones, layout


def _mxfp4_expert(rng, experts: int, hidden: int, inter: int) -> tuple[list, Any]:
    """gpt-oss's MXFP4 expert rows (bf16 biases, as the released checkpoints): random normal
    weights quantized, copied into the rows by the format as it reads a checkpoint's layer."""
    import numpy as np
    import torch

    from freetoken.moe.mxfp4_format import PROJECTIONS, Mxfp4ExpertFormat
    from freetoken.quant.mxfp4 import BLOCK, quantize_mxfp4

    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(f"{MXFP4_KEY} experts are blocks of {BLOCK} values: --hidden and --intermediate must be "
                         f"multiples of {BLOCK}, got {hidden} and {inter}")
    fmt = Mxfp4ExpertFormat(hidden, inter, torch.bfloat16)
    tensors = {}
    for name, proj in zip(PROJECTIONS, (fmt.gate_up, fmt.down), strict=True):
        weights = torch.from_numpy(rng.standard_normal((1, proj.rows, proj.columns), dtype=np.float32) * 0.05)
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(weights)
        tensors[name + "_bias"] = torch.from_numpy(rng.standard_normal((1, proj.rows), dtype=np.float32) * 0.05)
    one = tuple(torch.zeros(1, *bank.row_shape, dtype=bank.dtype) for bank in fmt.banks(None))
    fmt.read_layer(_Tensors(tensors), SimpleNamespace(num_experts=1), 0, out=one)
    return [bank[0].numpy() for bank in one], fmt.cpu_layout(SimpleNamespace(num_experts=experts))


class _Tensors:
    """A checkpoint reader over one layer's tensors, by the name after the experts' prefix."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def get_packed(self, name: str, shape: tuple[int, ...]):
        return self.tensors[name.rpartition(".")[2]].reshape(shape)

    def get(self, name: str, shape: tuple[int, ...], dtype):
        return self.tensors[name.rpartition(".")[2]].reshape(shape).to(dtype)


def _bank(shape: tuple[int, ...], dtype, pinned: bool):
    """(numpy array, the pinned torch tensor it views or None) of `shape` and numpy `dtype`."""
    import numpy as np

    if not pinned:
        return np.empty(shape, dtype), None
    import torch

    t = torch.empty(shape, dtype=torch.int16 if dtype == np.uint16 else torch.uint8, pin_memory=True)
    return t.numpy().view(dtype), t
