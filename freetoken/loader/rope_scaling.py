"""RoPE scaling as a checkpoint's config.json gives it: the default rotary, or YaRN (gpt-oss).

YaRN keeps the high-frequency dimensions as trained, divides the low-frequency ones by `factor`,
ramps linearly between the two over the dimensions whose wavelengths fall between `beta_fast`
and `beta_slow` rotations of the original context, and scales cos/sin by `attention_factor`.
The tables themselves are computed in reference/rotary.py.
"""

from __future__ import annotations

import math

import msgspec

from freetoken.loader.json_fields import JsonFields


class YarnRope(msgspec.Struct, frozen=True, kw_only=True):
    factor: float  # how much longer than the original context the model runs
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool  # round the ramp's ends to whole dimensions
    attention_factor: float  # what cos and sin are multiplied by


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_yarn(rope: JsonFields, max_position_embeddings: int) -> YarnRope:
    """A `rope_parameters` / `rope_scaling` object of rope_type "yarn"; the defaults are the
    ones transformers applies to absent fields."""
    original = rope.integer("original_max_position_embeddings")
    factor = rope.positive_number("factor", max_position_embeddings / original)
    attention_factor = rope.positive_number("attention_factor", None)
    if attention_factor is None:
        mscale, mscale_all = rope.positive_number("mscale", None), rope.positive_number("mscale_all_dim", None)
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                            else _mscale(factor))
    return YarnRope(factor=factor, original_max_position_embeddings=original,
                    beta_fast=rope.positive_number("beta_fast", 32.0), beta_slow=rope.positive_number("beta_slow", 1.0),
                    truncate=rope.flag("truncate", True), attention_factor=attention_factor)
