"""The decode step's norms inside the kernels after them, or as kernels of their own, taking turns
in captured decode steps in one process on one host pool (kernels/triton/norm_linear.py).

    python -m benchmarks.norm_fusion_ab --model DIR --moe-cache-slots 768 --bw-profile F \
        --policies resident,transfer,hybrid [--routing-replay TRACE] --repeats 3 --out F

Takes `bench decode`'s arguments (graph mode only) plus --variants, from:
  separate    an RMSNorm kernel before the q/k/v projection, an add + norm kernel before the
              router's linear layer
  projection  the input norm inside the q/k/v projection
  both        that, and the post-attention add and norm inside the router's linear layer (the
              engine's default)
Each (policy, variant) runs --repeats times, the variants taking turns (variant_turns.py).
"""

from __future__ import annotations

from benchmarks.variant_turns import main
from freetoken.kernels.triton import norm_linear

VARIANTS = {"separate": (False, False), "projection": (True, False), "both": (True, True)}  # (projection, router)


def _setter(projection: bool, router: bool):
    def apply() -> None:
        norm_linear.FUSE_PROJECTION, norm_linear.FUSE_ROUTER = projection, router

    return apply


if __name__ == "__main__":
    main("norm_fusion_ab", VARIANTS, _setter)
