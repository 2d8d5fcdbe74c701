"""Write random-weight checkpoints in the exact Hugging Face layout of each supported family.

The output directory looks like a Hub checkpoint: `config.json`, `generation_config.json`,
safetensors weights (one `model.safetensors`, or numbered shards plus
`model.safetensors.index.json`), and the tokenizer files with a chat template. Weights are
stored per expert (`mlp.experts.N.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.N.w1`),
which is how published checkpoints ship.

Every tensor is drawn in blocks of rows, each from its own generator seeded from (arch,
seed, tensor name, block): the output is deterministic, a tensor does not depend on what
else is in the checkpoint, blocks can be drawn in parallel, and large presets stream one
shard at a time so peak memory stays about one shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from freetoken.loader import synth_gpt_oss, synth_qwen3_5
from freetoken.loader import tokenizer_builder as tb
from freetoken.loader.chat_templates import chat_template_for
from freetoken.loader.presets import TOKENIZER_VOCAB, Shape, preset_shape
from freetoken.progress import Progress

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
DTYPES = ("bfloat16", "float16", "float32")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM", **synth_qwen3_5.ARCHITECTURES,
}

# Weight scales. Projections use 1/sqrt(fan_in) (about 0.02 at hidden 2048) so every layer
# contributes at the scale of the residual stream; embeddings have unit scale and the output
# head is a little hotter, so a few random layers still give peaked, non-tied logits.
EMBED_STD = 1.0
LM_HEAD_GAIN = 2.5
ROUTER_GAIN = 2.0
NORM_NOISE = 0.1
BIAS_STD = 0.1

# Bump when the output of the demo builder changes, so cached copies are rebuilt.
DEMO_VERSION = 1


class TensorSpec:
    __slots__ = ("name", "shape", "kind", "std", "live_rows")

    def __init__(self, name: str, shape: tuple[int, ...], kind: str, std: float = 0.0, live_rows: int = 0):
        self.name = name
        self.shape = shape
        self.kind = kind  # "normal" | "norm" | "head"
        self.std = std
        self.live_rows = live_rows  # "head": rows past this are zero (padding ids)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def config_dict(shape: Shape, dtype: str = "bfloat16") -> dict[str, Any]:
    """`config.json` for `shape`, with the fields and names the family's real checkpoints use."""
    special = tb.SpecialTokens(shape.arch)
    common: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[shape.arch]],
        "attention_dropout": 0.0,
        "bos_token_id": special.config_bos_id,
        "dtype": dtype,
        "eos_token_id": special.config_eos_id,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "max_position_embeddings": shape.max_position_embeddings,
        "model_type": shape.arch,
        "num_attention_heads": shape.num_heads,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "output_router_logits": False,
        "pad_token_id": special.config_pad_id,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }
    if shape.arch == "qwen3_moe":
        extra = {
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "head_dim": shape.head_dim,
            "intermediate_size": shape.dense_intermediate_size,
            "mlp_only_layers": [],
            "moe_intermediate_size": shape.moe_intermediate_size,
            "norm_topk_prob": shape.norm_topk_prob,
            "num_experts": shape.num_experts,
            "sliding_window": None,
            "use_sliding_window": False,
        }
    elif shape.arch == "mixtral":
        extra = {
            "head_dim": shape.head_dim,
            "intermediate_size": shape.moe_intermediate_size,
            "num_local_experts": shape.num_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    elif shape.arch == "olmoe":
        extra = {
            "attention_bias": False,
            "clip_qkv": None,
            "intermediate_size": shape.moe_intermediate_size,
            "norm_topk_prob": shape.norm_topk_prob,
            "num_experts": shape.num_experts,
            "router_aux_loss_coef": 0.01,
        }
    elif shape.arch == "gpt_oss":
        extra = synth_gpt_oss.config_fields(shape)
    elif shape.arch in synth_qwen3_5.ARCHITECTURES:
        config = dict(sorted({**common, **synth_qwen3_5.text_config_fields(shape)}.items()))
        return synth_qwen3_5.nest_text_config(config, shape) if shape.arch == "qwen3_5_moe" else config
    else:  # qwen2_moe
        extra = {
            "decoder_sparse_step": 1,
            "intermediate_size": shape.dense_intermediate_size,
            "layer_types": ["full_attention"] * shape.num_layers,
            "max_window_layers": shape.num_layers,
            "mlp_only_layers": [],
            "moe_intermediate_size": shape.moe_intermediate_size,
            "norm_topk_prob": shape.norm_topk_prob,
            "num_experts": shape.num_experts,
            "qkv_bias": True,
            "shared_expert_intermediate_size": shape.shared_expert_intermediate_size,
            "sliding_window": None,
            "use_sliding_window": False,
        }
    return dict(sorted({**common, **extra}.items()))


def generation_config_dict(arch: str) -> dict[str, Any]:
    special = tb.SpecialTokens(arch)
    out: dict[str, Any] = {"bos_token_id": special.config_bos_id, "eos_token_id": special.generation_eos}
    pad = special.config_pad_id
    if pad is None and arch in ("qwen3_moe", "qwen2_moe"):
        pad = tb.token_id("<|endoftext|>")  # Qwen pads with <|endoftext|> at generation time
    out["pad_token_id"] = pad
    if arch in ("qwen3_moe", "qwen2_moe"):
        out.update(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    else:
        out["do_sample"] = False
    return {k: v for k, v in out.items() if v is not None}


def tensor_specs(shape: Shape) -> Iterator[TensorSpec]:
    """Every tensor of the checkpoint, in module order (embeddings, layer by layer, head)."""
    h, hd, nh, nkv = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads
    inv = 1.0 / math.sqrt(h)
    hybrid = shape.arch in synth_qwen3_5.ARCHITECTURES  # (whose norms are stored zero-centred)
    top = synth_qwen3_5.TEXT_MODEL if shape.arch == "qwen3_5_moe" else "model."  # the text model's tensors

    def norm(name: str) -> TensorSpec:
        return TensorSpec(name, (h,), "normal", NORM_NOISE) if hybrid else TensorSpec(name, (h,), "norm")

    def proj(name: str, out_f: int, in_f: int) -> TensorSpec:
        return TensorSpec(name, (out_f, in_f), "normal", 1.0 / math.sqrt(in_f))

    yield TensorSpec(f"{top}embed_tokens.weight", (shape.vocab_size, h), "normal", EMBED_STD)
    for i in range(shape.num_layers):
        p = f"{top}layers.{i}."
        yield norm(p + "input_layernorm.weight")
        if hybrid:
            yield from synth_qwen3_5.layer_specs(shape, i, p, TensorSpec, NORM_NOISE, ROUTER_GAIN * inv)
            continue
        if shape.arch == "gpt_oss":
            yield from synth_gpt_oss.layer_specs(shape, p, TensorSpec, BIAS_STD, ROUTER_GAIN * inv)
            continue
        yield proj(p + "self_attn.q_proj.weight", nh * hd, h)
        yield proj(p + "self_attn.k_proj.weight", nkv * hd, h)
        yield proj(p + "self_attn.v_proj.weight", nkv * hd, h)
        if shape.arch == "qwen2_moe":
            yield TensorSpec(p + "self_attn.q_proj.bias", (nh * hd,), "normal", BIAS_STD)
            yield TensorSpec(p + "self_attn.k_proj.bias", (nkv * hd,), "normal", BIAS_STD)
            yield TensorSpec(p + "self_attn.v_proj.bias", (nkv * hd,), "normal", BIAS_STD)
        yield proj(p + "self_attn.o_proj.weight", h, nh * hd)
        if shape.arch == "qwen3_moe":
            yield TensorSpec(p + "self_attn.q_norm.weight", (hd,), "norm")
            yield TensorSpec(p + "self_attn.k_norm.weight", (hd,), "norm")
        elif shape.arch == "olmoe":
            yield TensorSpec(p + "self_attn.q_norm.weight", (nh * hd,), "norm")
            yield TensorSpec(p + "self_attn.k_norm.weight", (nkv * hd,), "norm")
        yield TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm")
        inter = shape.moe_intermediate_size
        if shape.arch == "mixtral":
            m = p + "block_sparse_moe."
            yield TensorSpec(m + "gate.weight", (shape.num_experts, h), "normal", ROUTER_GAIN * inv)
            for e in range(shape.num_experts):
                yield proj(f"{m}experts.{e}.w1.weight", inter, h)
                yield proj(f"{m}experts.{e}.w2.weight", h, inter)
                yield proj(f"{m}experts.{e}.w3.weight", inter, h)
        else:
            m = p + "mlp."
            yield TensorSpec(m + "gate.weight", (shape.num_experts, h), "normal", ROUTER_GAIN * inv)
            for e in range(shape.num_experts):
                yield proj(f"{m}experts.{e}.gate_proj.weight", inter, h)
                yield proj(f"{m}experts.{e}.up_proj.weight", inter, h)
                yield proj(f"{m}experts.{e}.down_proj.weight", h, inter)
            if shape.arch == "qwen2_moe":
                si = shape.shared_expert_intermediate_size
                yield proj(m + "shared_expert.gate_proj.weight", si, h)
                yield proj(m + "shared_expert.up_proj.weight", si, h)
                yield proj(m + "shared_expert.down_proj.weight", h, si)
                yield TensorSpec(m + "shared_expert_gate.weight", (1, h), "normal", inv)
    yield norm(f"{top}norm.weight")
    live = min(shape.tokenizer_vocab_size, shape.vocab_size)
    yield TensorSpec("lm_head.weight", (shape.vocab_size, h), "head", LM_HEAD_GAIN * inv, live_rows=live)


# Tensors are drawn in blocks of rows, each block from its own generator: big tensors are
# then drawn in parallel and never exist in fp32 as a whole. Fixed, so outputs never change.
_BLOCK_ELEMS = 1 << 22


def _block_seed(arch: str, seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"freetoken-synth/{arch}/{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _blocks(spec: TensorSpec) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of a tensor's blocks (a 1-D tensor is one block of rows)."""
    rows = spec.shape[0]
    per_row = spec.numel // rows if rows else 0
    step = max(1, _BLOCK_ELEMS // max(per_row, 1))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _fill_block(out: Any, spec: TensorSpec, arch: str, seed: int, block: int, start: int, stop: int) -> None:
    import torch

    if spec.kind == "head" and start >= spec.live_rows:
        return  # padding ids of the output head stay zero
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_block_seed(arch, seed, spec.name, block))
    values = torch.randn((stop - start, *spec.shape[1:]), generator=gen, dtype=torch.float32)
    if spec.kind == "norm":
        values.mul_(NORM_NOISE).add_(1.0)
    else:
        values.mul_(spec.std)
    if spec.kind == "head" and stop > spec.live_rows:
        values[spec.live_rows - start :] = 0.0
    out[start:stop].copy_(values)


def _empty(spec: TensorSpec, dtype: str) -> Any:
    import torch

    alloc = torch.zeros if spec.kind == "head" else torch.empty
    return alloc(spec.shape, dtype=getattr(torch, dtype))


def make_tensor(spec: TensorSpec, arch: str, seed: int, dtype: str) -> Any:
    """Materialise one tensor; deterministic in (arch, seed, name)."""
    out = _empty(spec, dtype)
    for block, (start, stop) in enumerate(_blocks(spec)):
        _fill_block(out, spec, arch, seed, block, start, stop)
    return out


def make_tensors(
    specs: list[TensorSpec], arch: str, seed: int, dtype: str, progress: Progress | None = None
) -> dict[str, Any]:
    """Materialise tensors by name. Big sets are drawn in a thread pool: torch releases
    the GIL while drawing and every block has its own generator, so the result is the same.
    `progress` (in bytes) advances as the tensors fill."""
    workers = min(16, os.cpu_count() or 1)
    if workers == 1 or sum(s.numel for s in specs) < 4 * _BLOCK_ELEMS:
        tensors = {}
        for spec in specs:
            tensors[spec.name] = make_tensor(spec, arch, seed, dtype)
            if progress is not None:
                progress.advance(spec.numel * _DTYPE_BYTES[dtype], spec.name)
        return tensors
    tensors = {spec.name: _empty(spec, dtype) for spec in specs}
    jobs = [(spec, block, start, stop) for spec in specs for block, (start, stop) in enumerate(_blocks(spec))]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(_fill_block, tensors[spec.name], spec, arch, seed, block, start, stop)
            for spec, block, start, stop in jobs
        ]
        for future, (spec, _, start, stop) in zip(futures, jobs, strict=True):
            future.result()
            if progress is not None:
                progress.advance((stop - start) * (spec.numel // spec.shape[0]) * _DTYPE_BYTES[dtype], spec.name)
    return tensors


def _plan_shards(specs: list[TensorSpec], elem_bytes: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * elem_bytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(
    out_dir: str | Path, arch: str, model_max_length: int = 4096, vocab_size: int = TOKENIZER_VOCAB
) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` (template included, as older
    transformers expect) and `chat_template.jinja` (where transformers 5 keeps it)."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(tb.tokenizer_json_for(arch, vocab_size), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tb.tokenizer_config_for(arch, model_max_length))
    (out / "chat_template.jinja").write_text(chat_template_for(arch), encoding="utf-8")


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def write_synthetic_checkpoint(
    out_dir: str | Path,
    arch: str,
    preset: str = "tiny",
    *,
    layers: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    norm_topk_prob: bool | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    quiet: bool = True,
    draw_stored: Callable[[TensorSpec], dict[str, Any] | None] | None = None,
) -> Path:
    """Write a random-weight checkpoint of `arch` at `preset` size into `out_dir` and return it.
    `draw_stored(spec)` may return the tensors a spec is stored as instead of drawing it in
    `dtype` (synth --mxfp4's experts, drawn as MXFP4 codes and scales); None draws it as usual.

    ValueError on an unknown arch/preset/dtype or a bad override. Existing weight files in
    `out_dir` are replaced; `config.json` is written last.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shape = preset_shape(
        arch, preset, layers=layers, experts=experts, top_k=top_k, norm_topk_prob=norm_topk_prob
    )
    from safetensors.torch import save_file

    start = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json", out / "config.json"]:
        stale.unlink(missing_ok=True)

    elem = _DTYPE_BYTES[dtype]
    specs = list(tensor_specs(shape))
    shards = _plan_shards(specs, elem, max_shard_bytes)
    total_bytes = sum(s.numel for s in specs) * elem
    total_params = sum(s.numel for s in specs)
    _log(
        f"synth: {arch} preset={preset} layers={shape.num_layers} experts={shape.num_experts} "
        f"top_k={shape.top_k} -> {out} ({total_params / 1e6:.1f}M params, {total_bytes / 1e9:.2f} GB "
        f"{dtype}, {len(shards)} file(s))",
        quiet,
    )
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    written = 0
    with Progress("synth weights", total_bytes, unit="B", quiet=quiet) as progress:
        for fname, shard in zip(names, shards, strict=True):
            stored = {spec.name: draw_stored(spec) for spec in shard} if draw_stored else {}
            tensors = make_tensors([s for s in shard if stored.get(s.name) is None], arch, seed, dtype, progress)
            for spec in shard:
                if stored.get(spec.name) is not None:
                    tensors.update(stored[spec.name])
                    progress.advance(spec.numel * elem, spec.name)
            tmp = out / (fname + ".partial")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, out / fname)
            written += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, fname))
            del tensors
            if len(shards) > 1:
                progress.write(f"synth: wrote {fname} ({written / 1e9:.2f}/{total_bytes / 1e9:.2f} GB)")
    if len(shards) > 1:
        _write_json(
            out / "model.safetensors.index.json",
            {
                "metadata": {"total_parameters": total_params, "total_size": written},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )
    write_tokenizer_files(out, arch, shape.max_position_embeddings, shape.tokenizer_vocab_size)
    _write_json(out / "generation_config.json", generation_config_dict(arch))
    _write_json(out / "config.json", config_dict(shape, dtype))
    _log(f"synth: done, {written / 1e6:.1f} MB of weights in {time.monotonic() - start:.1f} s", quiet)
    return out


def ensure_demo_checkpoint(cache_dir: str | Path) -> Path:
    """The built-in `demo` model (qwen3_moe, 4 layers, 16 experts, top-4), built once under
    `cache_dir` and reused. Safe when several processes race: each builds into a private
    temporary directory and the first rename wins."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"demo-v{DEMO_VERSION}"
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=cache))
    try:
        write_synthetic_checkpoint(tmp, "qwen3_moe", "demo", seed=0)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
