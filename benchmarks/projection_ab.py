"""The attention's projections at one row, in captured decode steps: cuBLAS against
`decode_linear` with and without its weight tile loaded before the PDL wait, taking turns in
one process on one host pool (kernels/triton/decode_linear.py).

    python -m benchmarks.projection_ab --model DIR --moe-cache-slots 768 --bw-profile F \
        --policies resident,hybrid [--routing-replay TRACE] --repeats 3 --out F

Takes `bench decode`'s arguments (graph mode only) plus --variants, from:
  cublas      F.linear for q/k/v and the output projection (the router stays on decode_linear)
  triton      decode_linear, weights loaded after the wait
  prefetch    decode_linear, weights loaded before the wait (the engine's default)
  prefetch-4k the same with 4096-element tiles (twice the programs)
Each (policy, variant) runs --repeats times, the variants taking turns (variant_turns.py); the
JSON has every sample and the median run of each, with `bench decode`'s fields and floor.
"""

from __future__ import annotations

from benchmarks.variant_turns import main
from freetoken.kernels.triton import decode_linear

VARIANTS = {  # name -> (PROJECTION_ROWS, PREFETCH_WEIGHTS, TILE_ELEMENTS)
    "cublas": (0, True, 8192),
    "triton": (1, False, 8192),
    "prefetch": (1, True, 8192),
    "prefetch-4k": (1, True, 4096),
}


def _setter(rows: int, prefetch: bool, tile: int):
    def apply() -> None:
        decode_linear.PROJECTION_ROWS, decode_linear.PREFETCH_WEIGHTS = rows, prefetch
        decode_linear.TILE_ELEMENTS = tile

    return apply


if __name__ == "__main__":
    main("projection_ab", VARIANTS, _setter)
