"""The name a pool's expert format goes by in the bandwidth profile file: what `bench bw --format`
measures and saves under, and what the engine looks up for the pool it serves.

Keys:
  - "bf16": unquantized bfloat16 experts (the unquantized format the CPU kernel computes);
  - a GGML block type, "Q8_0", "Q4_K", "Q5_K", "Q6_K": gate, up and down all of that type;
  - a file mix named as llama.cpp's file types name it: "Q4_K_M" (Q4_K gate/up, Q6_K down) and
    "Q5_K_M" (Q5_K gate/up, Q6_K down);
  - any other (gate/up type, down type) pair as "GU/D", e.g. "Q8_0/Q6_K";
  - "mxfp4+bias": gpt-oss's MXFP4 experts with their biases (moe/mxfp4_format.py, whose format
    name it is), measured with bf16 biases as the released checkpoints store them.
Keys are read case-insensitively and saved as spelled here.

A block pool's key is the pair of its widest gate/up type and its widest down type. Those types
set the width of the banks (every slot holds any layer's expert, block_format.py), so every slot
fill copies exactly that pair's bytes per expert, whatever layer it is for; and the pair is the
name the file goes by: a Q4_K_M file keeps Q4_K down projections in some layers and Q6_K in the
others, and its key is "Q4_K_M", the mix `bench bw --format Q4_K_M` measures. Its narrower layers
make the CPU kernel read fewer bytes than the banks hold, at a rate per byte of the same
kernels, so the measured bytes-per-second figures still apply to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the block modules import numpy and torch; the CLI parser reads ACCEPTED without them)
    from freetoken.quant.ggml_blocks import GGMLType

UNQUANTIZED_KEY = "bf16"
# file mix -> (gate/up type, down type), by GGML type name
NAMED_MIXES: dict[str, tuple[str, str]] = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
BLOCK_TYPE_NAMES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # block_format.BLOCK_QUANT_TYPES' names
MXFP4_KEY = "mxfp4+bias"  # Mxfp4ExpertFormat.name (moe/mxfp4_format.py imports torch; this module must not)
ACCEPTED = (UNQUANTIZED_KEY, *BLOCK_TYPE_NAMES, *NAMED_MIXES, "GU/D (e.g. Q8_0/Q6_K)", MXFP4_KEY)


def profile_key(fmt) -> str:
    """The profile key of a pool's expert format (module docstring); an unquantized format goes by
    its own name ("bf16", or "fp32"/"fp16", which only the device computes and no profile holds)."""
    from freetoken.moe.block_format import BlockQuantFormat

    if isinstance(fmt, BlockQuantFormat):
        return pair_key(_widest(t for t, _ in fmt.layer_types), _widest(d for _, d in fmt.layer_types))
    return fmt.name


def pair_key(gate_up: GGMLType, down: GGMLType) -> str:
    """The key of experts whose gate/up rows are `gate_up` blocks and down rows `down` blocks."""
    from freetoken.quant.ggml_blocks import GGMLType

    if gate_up == down:
        return GGMLType(gate_up).name
    for name, pair in NAMED_MIXES.items():
        if pair == (GGMLType(gate_up).name, GGMLType(down).name):
            return name
    return f"{GGMLType(gate_up).name}/{GGMLType(down).name}"


def parse_profile_key(text: str) -> tuple[GGMLType, GGMLType] | None:
    """A bf16 or GGML `--format` value -> its (gate/up, down) block types, or None for bf16;
    ValueError naming the value and the accepted ones (and for the MXFP4 key, which names no block
    types: see `canonical_key`). `pair_key` of the result is the canonical spelling."""
    from freetoken.quant.ggml_blocks import GGMLType

    key = text.strip()
    if key.lower() == UNQUANTIZED_KEY:
        return None
    if key.lower() == MXFP4_KEY:
        raise ValueError(f"{MXFP4_KEY} experts are MXFP4 blocks, not a pair of GGML block types")
    upper = key.upper()
    if upper in NAMED_MIXES:
        gate_up, down = NAMED_MIXES[upper]
        return GGMLType[gate_up], GGMLType[down]
    parts = upper.split("/")
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not all(p in BLOCK_TYPE_NAMES for p in parts):
        raise ValueError(f"unknown expert format {text!r} for a bandwidth profile; accepted: {', '.join(ACCEPTED)}")
    return GGMLType[parts[0]], GGMLType[parts[1]]


def canonical_key(text: str) -> str:
    """`text` as the profile file spells it ("q4_k_m" -> "Q4_K_M", "MXFP4+BIAS" -> "mxfp4+bias");
    ValueError as `parse_profile_key`."""
    if text.strip().lower() == MXFP4_KEY:
        return MXFP4_KEY
    pair = parse_profile_key(text)
    return UNQUANTIZED_KEY if pair is None else pair_key(*pair)


def _widest(types) -> GGMLType:
    """The type of most bytes per element (block types differ in it, so there are no ties)."""
    from freetoken.quant.ggml_blocks import BLOCK_SIZES

    return max(types, key=lambda t: BLOCK_SIZES[t][1] / BLOCK_SIZES[t][0])
