"""gpt-oss: biases on q/k/v/o, attention sinks, sliding-window layers alternating with full
attention, YaRN rope, a biased router whose softmax runs over the top-k logits, and biased
experts with the clamped SwiGLU. All of it is options of the shared blocks (models/attention.py,
models/router.py, reference/moe.py) that the config turns on; the experts' biases and activation
live in their expert format (moe/biased_expert_format.py).

In bf16 every op rounds where transformers' eager gpt-oss forward rounds (its checkpoints have no
SDPA path there): the sink attention of reference/sink_attention.py, RMSNorms that multiply by
the weight in fp32 and round once (the fused norm kernels are not used for it), and the router's
bias added inside its linear op. Other rounding points parted the greedy tokens within 4-11 steps.
The one exception: the served (fused) bundle computes prefill chunks of at least
sink_sdpa.MIN_QUERIES tokens through SDPA's fused kernels (models/sink_sdpa.py), where the eager
scores would be gigabytes a layer.
"""

from __future__ import annotations

from freetoken.models.attention import Attention
from freetoken.models.family import Family


class SinkWindowAttention(Attention):
    # The fused decode kernels know neither sinks nor windows (nor the norms rounded once): one-token
    # steps keep the reference path.
    supports_fused_decode = False


# (the expert names are unused: the experts are stored fused, mlp.experts.gate_up_proj / down_proj)
GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", "mlp", ("gate_up_proj", "gate_up_proj", "down_proj"),
                 attention=SinkWindowAttention, router_name="router", norms_rounded_once=True)
