"""The expert format table: bank layouts and bytes, which format a checkpoint's pool gets, and the
CPU kernel's refusal of formats it does not compute."""

from __future__ import annotations

import pytest
import torch

from freetoken.cache.host_pool import HostExpertPool
from freetoken.config import ModelConfig
from freetoken.moe.expert_format import BF16, FLOAT32


def test_banks_and_bytes_follow_the_shapes(make_checkpoint):
    cfg = ModelConfig.from_dir(make_checkpoint("qwen3_moe", "tiny"))
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert [(b.name, b.row_shape, b.dtype) for b in BF16.banks(cfg)] == [
        ("w13", (2 * I, H), torch.bfloat16), ("w2", (H, I), torch.bfloat16)]
    assert BF16.expert_bytes(cfg) == 3 * H * I * 2 == cfg.expert_bytes_bf16
    assert FLOAT32.expert_bytes(cfg) == 2 * BF16.expert_bytes(cfg)


def test_the_pool_takes_its_format_from_the_checkpoint_and_the_compute_dtype(make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny")  # experts stored in bf16
    cfg = ModelConfig.from_dir(model_dir)
    for compute in (torch.bfloat16, torch.float32):  # bf16 banks hold exactly what either would read
        pool = HostExpertPool.load(model_dir, cfg, compute)
        assert pool.format is BF16 and pool.w13.dtype == torch.bfloat16
        assert pool.w13.shape[1:] == BF16.banks(cfg)[0].row_shape
        assert pool.expert_bytes == BF16.expert_bytes(cfg)


def test_the_cpu_kernel_takes_bf16_banks_only():
    banks = (torch.ones(2, 4, 3, dtype=torch.bfloat16), torch.ones(2, 3, 2, dtype=torch.bfloat16))
    bits = BF16.cpu_banks(banks)
    assert [b.dtype.name for b in bits] == ["uint16", "uint16"] and bits[0][0, 0, 0] == 0x3F80  # shares memory
    with pytest.raises(ValueError, match="does not compute fp32 experts"):
        FLOAT32.cpu_banks(tuple(b.float() for b in banks))
