"""Limits a checkpoint or the engine's settings put on what can be served, refused at start:
a sliding window that would bind (read as transformers reads each family's config), and
settings under which no request fits."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import transformers

from freetoken.config import EngineConfig, ModelConfig
from freetoken.config_tree import nested
from freetoken.engine.llm import AsyncLLM
from freetoken.errors import CheckpointError, ConfigError
from freetoken.loader.presets import preset_shape
from freetoken.loader.synth import config_dict


def transformers_window(raw: dict) -> int | None:
    """The window transformers' modeling code applies to some layer of this config, or None."""
    hf = transformers.AutoConfig.for_model(**raw)
    if raw["model_type"] == "olmoe":  # its attention has no window, whatever the config holds
        return None
    if raw["model_type"] == "qwen2_moe":  # per layer, from the layer_types it derives
        return hf.sliding_window if "sliding_attention" in hf.layer_types else None
    return hf.sliding_window  # mixtral and qwen3_moe: every layer, or none


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_sliding_window_as_each_family_writes_it(arch):
    """Where transformers applies a window for each family, and only there, a binding one is refused."""
    base = config_dict(preset_shape(arch, "tiny"))
    variants = [
        {"sliding_window": None},
        {"sliding_window": 64},
        {"use_sliding_window": False, "sliding_window": 64},
        {"use_sliding_window": True, "sliding_window": 64},
        {"use_sliding_window": True, "sliding_window": None},
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": None},
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": None, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
    ]
    seen = set()
    for changes in variants:
        raw = {**base, **changes}
        cfg = ModelConfig.from_hf_dict(raw)
        assert cfg.sliding_window == transformers_window(raw), changes
        seen.add(cfg.sliding_window)
        if cfg.sliding_window is None:
            cfg.check_context(1 << 20)
            continue
        cfg.check_context(64)
        with pytest.raises(CheckpointError, match="sliding_window: .* window of 64 tokens.*--max-model-len 64 or less"):
            cfg.check_context(65)
    assert seen == ({None} if arch == "olmoe" else {None, 64})


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("max_model_len", 0, "--max-model-len: must be at least 1, got 0"),
    ("max_running_requests", 0, "--max-running-requests: must be at least 1, got 0"),
    ("kv.tokens", -5, "--kv-tokens: must be at least 1, got -5"),
    ("scheduler.prefill_chunk", 0, "--prefill-chunk: must be at least 1, got 0"),
    ("kv.page_size", 0, "kv.page_size: must be at least 1, got 0"),
    ("moe.gpu_memory_headroom_gb", float("nan"), "moe.gpu_memory_headroom_gb: must be a finite number >= 0, got nan"),
])
def test_engine_settings_no_request_fits_are_refused_at_start(make_checkpoint, path, value, expected):
    """Each made `serve` start and then fail every request (a 0-token context, a 0-token prefill chunk)."""
    fields = {"model": str(make_checkpoint("qwen3_moe")), "device": "cpu", **nested({path: value})}
    config = msgspec.convert(fields, EngineConfig)

    async def start():
        async with AsyncLLM.start(config):
            pytest.fail("the engine started")

    with pytest.raises(ConfigError) as info:
        anyio.run(start)
    assert str(info.value) == expected
