"""Mixtral: plain attention; the router's top-k weights stay fp32 into the expert sum."""

from __future__ import annotations

from freetoken.models.family import Family
from freetoken.models.router import Router


class Fp32WeightsRouter(Router):
    weights_fp32 = True


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), router=Fp32WeightsRouter)
