"""Where programmatic dependent launch applies (kernels/triton/pdl.py): CUDA devices of compute
capability 9+ only, never on the CPU or under Triton's interpreter, and never when the engine's
setting turns it off; a kernel's launch arguments follow that decision."""

from __future__ import annotations

import torch

from freetoken.config import EngineConfig, KernelConfig
from freetoken.kernels.triton import pdl


def test_pdl_never_applies_on_the_cpu():
    t = torch.empty(1)
    assert not pdl.enabled_for(t)
    assert pdl.launch(t) == {"PDL": False, "launch_pdl": False}


def test_setting_turns_pdl_off_and_on(monkeypatch):
    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    try:
        assert pdl.enabled_for(FakeCuda())
        pdl.set_enabled(False)
        assert not pdl.enabled_for(FakeCuda())
        assert pdl.launch(FakeCuda()) == {"PDL": False, "launch_pdl": False}
        pdl.set_enabled(True)
        assert pdl.launch(FakeCuda()) == {"PDL": True, "launch_pdl": True}
    finally:
        pdl.set_enabled(True)


def test_interpreter_never_launches_with_pdl(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pdl._capable.cache_clear()
    try:
        assert not pdl._capable(0)  # decided before asking the device anything
    finally:
        pdl._capable.cache_clear()


def test_engine_setting_defaults_on():
    assert EngineConfig(model="m").kernels.pdl is True
    assert EngineConfig(model="m", kernels=KernelConfig(pdl=False)).kernels.pdl is False
