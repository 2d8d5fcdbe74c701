"""The slot GEMM's launch order in captured decode steps, taking turns in one process on one host
pool (kernels/triton/moe_gemm.py, kernels/triton/pdl.py).

    python -m benchmarks.slot_gemm_ab --model DIR --moe-cache-slots 768 --bw-profile F \
        --policies transfer,hybrid [--routing-replay TRACE] --repeats 3 --out F

Takes `bench decode`'s arguments (graph mode only) plus --variants, from:
  wait        the act kernel waits for the fill kernel before it loads anything
  hits-early  it computes its routes to slots not being filled while the fill kernel runs
              (the engine's default)
Each (policy, variant) runs --repeats times, the variants taking turns (variant_turns.py).
(At d02b712 the script also had `down` and `both`: the down kernel loading its weight tiles
before its wait, measured and removed; docs/lab/decode-rounds.md.)
"""

from __future__ import annotations

from benchmarks.variant_turns import main
from freetoken.kernels.triton import moe_gemm

VARIANTS = {"wait": (False,), "hits-early": (True,)}  # name -> (HITS_EARLY,)


def _setter(hits_early: bool):
    def apply() -> None:
        moe_gemm.HITS_EARLY = hits_early

    return apply


if __name__ == "__main__":
    main("slot_gemm_ab", VARIANTS, _setter)
