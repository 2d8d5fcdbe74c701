"""Load a Hugging Face MoE checkpoint directory (or a GGUF file, loader/gguf_reader.py) into ModelWeights.

Reads `config.json` and single or sharded `*.safetensors` (with `model.safetensors.index.json`),
checks every tensor's presence and shape, and repacks per-expert tensors into per-layer banks
`w13 [E, 2I, H]` and `w2 [E, H, I]` (see models/weights.py). Errors name the file and tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.loader.gguf_file import GgufFile
from freetoken.loader.gguf_reader import GgufTensorReader
from freetoken.loader.json_fields import read_json_object
from freetoken.loader.paths import checkpoint_file, is_gguf
from freetoken.loader.qwen3_5_weights import (
    TextModelReader,
    gated_attention_weights,
    is_linear_layer,
    linear_attention_weights,
    text_model_reader,
)
from freetoken.models.families import family_of
from freetoken.models.family import (
    expert_tensor_names,
    fused_expert_tensor_names,
    layer_prefix,
    router_tensor_name,
)
from freetoken.models.weights import (
    AttentionWeights,
    DenseMLPWeights,
    LayerWeights,
    LinearAttentionWeights,
    ModelWeights,
    MoEWeights,
)
from freetoken.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from freetoken.quant.mxfp4 import BLOCK_BYTES as MXFP4_BLOCK_BYTES
from freetoken.quant.mxfp4 import dequantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
# safetensors' names of the float dtypes a checkpoint's weights come in
_STORED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


# Floating-point storage the loader converts from. Anything else (integers, bool, fp8 without its
# scales) would convert to numbers that are not the model's weights.
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")  # as safetensors headers name them


class TensorReader:
    """Reads named tensors from a directory's safetensors files, checking shapes and dtypes."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self.dir = model_dir
        self._stack = stack
        self._handles: dict[str, object] = {}
        self.file_of = self._map_tensors_to_files()

    def _map_tensors_to_files(self) -> dict[str, str]:
        index = checkpoint_file(self.dir, INDEX_FILE)
        if index.is_file():
            return self._read_index(index)
        files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files and no {INDEX_FILE}")
        mapping: dict[str, str] = {}
        for file in files:
            checkpoint_file(self.dir, file)  # refuses a *.safetensors symlink out of the directory
            for name in self._handle(file).keys():
                if name in mapping:
                    raise CheckpointError(
                        f"{self.dir / file}: tensor {name!r} is also in {mapping[name]}; which one is meant is "
                        f"unclear without a {INDEX_FILE}"
                    )
                mapping[name] = file
        return mapping

    def _read_index(self, index: Path) -> dict[str, str]:
        raw = read_json_object(index)
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            got = (
                "nothing" if "weight_map" not in raw
                else "null" if weight_map is None
                else "an empty object" if weight_map == {}
                else f"a {type(weight_map).__name__}"
            )
            raise CheckpointError(f"{index}: weight_map: expected an object of tensor name -> shard file, got {got}")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(
                    f"{index}: weight_map: tensor {name!r} maps to {type(file).__name__}, expected a file name"
                )
        for file in sorted(set(weight_map.values())):
            if not checkpoint_file(self.dir, file, named_in=f"{index}: weight_map").is_file():
                raise CheckpointError(f"{index}: weight_map: lists shard {file!r}, which is missing from {self.dir}")
        return dict(weight_map)

    def _handle(self, file: str):
        if file not in self._handles:
            path = self.dir / file
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._read(name, shape, WEIGHT_DTYPES).to(dtype)

    def get_packed(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of packed codes (MXFP4 blocks and scales), stored and returned as uint8."""
        return self._read(name, shape, ("U8",))

    def _read(self, name: str, shape: tuple[int, ...], stored_as: tuple[str, ...]) -> torch.Tensor:
        file = self.file_of.get(name)
        if file is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing")
        path, handle = self.dir / file, self._handle(file)
        if name not in handle.keys():
            raise CheckpointError(f"{path}: tensor {name!r} is missing (the {INDEX_FILE} puts it in this file)")
        # the header's shape and dtype first: a wrong tensor is refused before it is read
        header = _safetensors_call(path, name, lambda: handle.get_slice(name))
        stored_shape, stored_dtype = tuple(header.get_shape()), header.get_dtype()
        if stored_shape != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {stored_shape}, expected {shape}")
        if stored_dtype not in stored_as:
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored as {stored_dtype}, expected one of {', '.join(stored_as)}"
            )
        return _safetensors_call(path, name, lambda: handle.get_tensor(name))

    def optional(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return self.get(name, shape, dtype) if self.has(name) else None

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The dtype a tensor is stored in, read from its file's header (None: not a float dtype)."""
        file = self.file_of.get(name)
        if file is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing")
        return _STORED_DTYPES.get(self._handle(file).get_slice(name).get_dtype())


def open_tensor_reader(path: Path, stack: ExitStack) -> TensorReader | GgufTensorReader:
    """The tensor reader of a checkpoint directory (safetensors) or of a GGUF file."""
    if is_gguf(path):
        return GgufTensorReader(GgufFile(path))
    return text_model_reader(TensorReader(path, stack))


def _safetensors_call(path: Path, name: str, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({exc})") from exc


Reader = TensorReader | GgufTensorReader | TextModelReader


def _attention(
    r: Reader, cfg: ModelConfig, layer: int, dtype: torch.dtype
) -> AttentionWeights | LinearAttentionWeights:
    if is_linear_layer(cfg, layer):
        return linear_attention_weights(r, cfg, layer, dtype)
    if cfg.attention_output_gate:
        return gated_attention_weights(r, cfg, layer, dtype)
    p = f"{layer_prefix(layer)}self_attn."
    H, D, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attn = AttentionWeights(
        wq=r.get(p + "q_proj.weight", (hq * D, H), dtype),
        wk=r.get(p + "k_proj.weight", (hkv * D, H), dtype),
        wv=r.get(p + "v_proj.weight", (hkv * D, H), dtype),
        wo=r.get(p + "o_proj.weight", (H, hq * D), dtype),
    )
    if cfg.qkv_bias:
        attn.bq = r.get(p + "q_proj.bias", (hq * D,), dtype)
        attn.bk = r.get(p + "k_proj.bias", (hkv * D,), dtype)
        attn.bv = r.get(p + "v_proj.bias", (hkv * D,), dtype)
    if cfg.o_bias:
        attn.bo = r.get(p + "o_proj.bias", (H,), dtype)
    if cfg.attention_sinks:
        attn.sinks = r.get(p + "sinks", (hq,), dtype)
    if cfg.qk_norm == "head":
        attn.q_norm = r.get(p + "q_norm.weight", (D,), dtype)
        attn.k_norm = r.get(p + "k_norm.weight", (D,), dtype)
    elif cfg.qk_norm == "full":
        attn.q_norm = r.get(p + "q_norm.weight", (hq * D,), dtype)
        attn.k_norm = r.get(p + "k_norm.weight", (hkv * D,), dtype)
    return attn


def _dense_mlp(r: Reader, prefix: str, H: int, F: int, dtype: torch.dtype) -> DenseMLPWeights:
    return DenseMLPWeights(
        gate=r.get(prefix + "gate_proj.weight", (F, H), dtype),
        up=r.get(prefix + "up_proj.weight", (F, H), dtype),
        down=r.get(prefix + "down_proj.weight", (H, F), dtype),
    )


def read_expert_banks(
    r: Reader,
    cfg: ModelConfig,
    layer: int,
    dtype: torch.dtype,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's experts as (w13 [E,2I,H], w2 [E,H,I]); fills `out` in place when given
    (so a caller can read straight into pinned host banks)."""
    if cfg.expert_bias:
        raise CheckpointError(f"{cfg.arch}: experts with biases are read by their expert format "
                              "(read_biased_expert_banks), not into w13/w2 banks")
    family = family_of(cfg)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    w13, w2 = out if out is not None else (torch.empty(E, 2 * I, H, dtype=dtype), torch.empty(E, H, I, dtype=dtype))
    fused_gate_up, fused_down = fused_expert_tensor_names(family, layer)
    if r.has(fused_gate_up):
        w13.copy_(r.get(fused_gate_up, (E, 2 * I, H), dtype))
        w2.copy_(r.get(fused_down, (E, H, I), dtype))
        return w13, w2
    for e in range(E):
        gate, up, down = expert_tensor_names(family, layer, e)
        w13[e, :I].copy_(r.get(gate, (I, H), dtype))
        w13[e, I:].copy_(r.get(up, (I, H), dtype))
        w2[e].copy_(r.get(down, (H, I), dtype))
    return w13, w2


def read_biased_expert_banks(r: Reader, cfg: ModelConfig, layer: int, dtype: torch.dtype,
                             out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One layer of gpt-oss experts, as transformers saves them in bf16 (gate_up_proj [E, H, 2I]
    with gate and up in its even and odd columns, down_proj [E, I, H], and their biases), into
    banks w13 [E, 2I, H+1] (gate rows, then up rows; the bias in the last column) and w2
    [E, H, I+1] (down rows; the bias in the last column): moe/biased_expert_format.py.
    MXFP4 checkpoints (the released ones) store the two projections as `*_blocks` and `*_scales`
    with a row per output: they are dequantized here, exactly (quant/mxfp4.py)."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    base = f"{layer_prefix(layer)}mlp.experts."
    w13, w2 = out
    if r.has(base + "gate_up_proj_blocks"):  # MXFP4: rows are the outputs, blocks run along the inputs
        gate_up = _mxfp4(r, base + "gate_up_proj", (E, 2 * I), H, dtype).transpose(1, 2)
        down_rows = _mxfp4(r, base + "down_proj", (E, H), I, dtype)
    else:
        gate_up = r.get(base + "gate_up_proj", (E, H, 2 * I), dtype)
        down_rows = r.get(base + "down_proj", (E, I, H), dtype).transpose(1, 2)
    gate_up_bias = r.get(base + "gate_up_proj_bias", (E, 2 * I), dtype)
    w13[:, :I, :H].copy_(gate_up[:, :, 0::2].transpose(1, 2))
    w13[:, I:, :H].copy_(gate_up[:, :, 1::2].transpose(1, 2))
    w13[:, :I, H].copy_(gate_up_bias[:, 0::2])
    w13[:, I:, H].copy_(gate_up_bias[:, 1::2])
    w2[:, :, :I].copy_(down_rows)
    w2[:, :, I].copy_(r.get(base + "down_proj_bias", (E, H), dtype))


def _mxfp4(r: Reader, name: str, rows: tuple[int, ...], columns: int, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 expert tensor (`name`_blocks, `name`_scales) dequantized: [*rows, columns]."""
    if columns % MXFP4_BLOCK:
        raise CheckpointError(f"{r.dir}: {name}: MXFP4 rows of {columns} values are not whole blocks of {MXFP4_BLOCK}")
    groups = columns // MXFP4_BLOCK
    blocks = r.get_packed(name + "_blocks", (*rows, groups, MXFP4_BLOCK_BYTES))
    scales = r.get_packed(name + "_scales", (*rows, groups))
    return dequantize_mxfp4(blocks, scales, dtype)


def _moe(r: Reader, cfg: ModelConfig, layer: int, dtype: torch.dtype, experts: bool) -> MoEWeights:
    family = family_of(cfg)
    E, H = cfg.num_experts, cfg.hidden_size
    moe = MoEWeights(router=r.get(router_tensor_name(family, layer), (E, H), dtype))
    if cfg.router_bias:
        moe.router_bias = r.get(router_tensor_name(family, layer, "bias"), (E,), dtype)
    if experts:
        moe.w13, moe.w2 = read_expert_banks(r, cfg, layer, dtype)
    if cfg.shared_expert_intermediate_size:
        p = f"{layer_prefix(layer)}mlp."
        moe.shared = _dense_mlp(r, p + "shared_expert.", H, cfg.shared_expert_intermediate_size, dtype)
        moe.shared_gate = r.get(p + "shared_expert_gate.weight", (1, H), dtype)
    return moe


def iter_layers(r: Reader, cfg: ModelConfig, dtype: torch.dtype, experts: bool) -> Iterator[LayerWeights]:
    H = cfg.hidden_size
    for layer in range(cfg.num_layers):
        p = layer_prefix(layer)
        mlp = (
            _moe(r, cfg, layer, dtype, experts)
            if cfg.sparse_layers[layer]
            else _dense_mlp(r, p + "mlp.", H, cfg.intermediate_size, dtype)
        )
        yield LayerWeights(
            input_norm=r.get(p + "input_layernorm.weight", (H,), dtype),
            post_attention_norm=r.get(p + "post_attention_layernorm.weight", (H,), dtype),
            attn=_attention(r, cfg, layer, dtype),
            mlp=mlp,
        )


def load_weights(
    model_path: str | Path, dtype: torch.dtype = torch.float32, experts: bool = True
) -> tuple[ModelConfig, ModelWeights]:
    """Read a checkpoint (a directory or a GGUF file) into host memory in `dtype`; without the
    routed experts when `experts` is False (the host expert pool loads those, see cache/host_pool.py)."""
    model_path = Path(model_path)
    cfg = ModelConfig.from_checkpoint(model_path)
    V, H = cfg.vocab_size, cfg.hidden_size
    with ExitStack() as stack:
        r = open_tensor_reader(model_path, stack)
        if isinstance(r, TextModelReader):
            r.log_skipped()
        embed = r.get("model.embed_tokens.weight", (V, H), dtype)
        layers = list(iter_layers(r, cfg, dtype, experts))
        final_norm = r.get("model.norm.weight", (H,), dtype)
        if cfg.tie_word_embeddings and not r.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = r.get("lm_head.weight", (V, H), dtype)
    return cfg, ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
