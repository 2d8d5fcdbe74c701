"""The slot GEMM's launch order in captured decode steps, taking turns in one process on one host
pool (kernels/triton/moe_gemm.py, kernels/triton/pdl.py).

    python -m benchmarks.slot_gemm_ab --model DIR --moe-cache-slots 768 --bw-profile F \
        --policies resident,hybrid [--routing-replay TRACE] --repeats 2 --out F

Takes `bench decode`'s arguments (graph mode only) plus --variants, from:
  wait        both kernels wait before loading anything (the act kernel signals first)
  down        the down kernel loads every route's weight tile before its wait
  both        that, and the act kernel computes routes to slots not being filled while the
              fill kernel runs (the engine's default)
  both-rows1  both, with one hidden row per down program (twice the programs, half the tile)
Each (policy, variant) runs --repeats times, the variants taking turns (variant_turns.py).
"""

from __future__ import annotations

from benchmarks.variant_turns import parse, take_turns
from freetoken.kernels.triton import moe_gemm

VARIANTS = {  # name -> (PREFETCH_DOWN, HITS_EARLY, DOWN_BLOCKS)
    "wait": (False, False, moe_gemm.DOWN_BLOCKS),
    "down": (True, False, moe_gemm.DOWN_BLOCKS),
    "both": (True, True, moe_gemm.DOWN_BLOCKS),
    "both-rows1": (True, True, (1, moe_gemm.DOWN_BLOCKS[1])),
}


def _setter(prefetch: bool, hits_early: bool, down_blocks: tuple[int, int]):
    def apply() -> None:
        moe_gemm.PREFETCH_DOWN, moe_gemm.HITS_EARLY, moe_gemm.DOWN_BLOCKS = prefetch, hits_early, down_blocks

    return apply


def main() -> None:
    setters = {name: _setter(*v) for name, v in VARIANTS.items()}
    args, chosen = parse("slot_gemm_ab", setters)
    take_turns("slot_gemm_ab", args, setters, chosen)


if __name__ == "__main__":
    main()
