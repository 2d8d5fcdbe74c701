"""The A/B scripts' variants set the module switches they name (their turns run on CUDA only)."""

from __future__ import annotations

import importlib

import pytest

# script -> (module, the switches its _setter sets, in VARIANTS' value order)
SCRIPTS = {
    "projection_ab": ("freetoken.kernels.triton.decode_linear",
                      ("PROJECTION_ROWS", "PREFETCH_WEIGHTS", "TILE_ELEMENTS")),
    "slot_gemm_ab": ("freetoken.kernels.triton.moe_gemm", ("HITS_EARLY",)),
    "norm_fusion_ab": ("freetoken.kernels.triton.norm_linear", ("FUSE_PROJECTION", "FUSE_ROUTER")),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_variant_sets_its_switches(script, monkeypatch):
    ab = importlib.import_module(f"benchmarks.{script}")
    module_name, names = SCRIPTS[script]
    module = importlib.import_module(module_name)
    for name in names:  # restored after the test
        monkeypatch.setattr(module, name, getattr(module, name))
    defaults = tuple(getattr(module, name) for name in names)
    assert defaults in ab.VARIANTS.values(), "the engine's defaults are one of the variants"
    for values in ab.VARIANTS.values():
        ab._setter(*values)()
        assert tuple(getattr(module, name) for name in names) == values
