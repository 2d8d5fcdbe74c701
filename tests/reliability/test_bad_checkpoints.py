"""The bad-checkpoint matrix: each case copies a valid tiny checkpoint, corrupts one thing (as a
broken or tampered download would) and expects the exact one-line error naming file and field.

The loader is driven as the engine drives it at start (`open_checkpoint`, then every tensor);
a few cases go through the real CLI (`generate`, `serve`): exit code 2, one `freetoken: error:`
line, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.config import EngineConfig
from freetoken.engine.llm import open_checkpoint
from freetoken.errors import CheckpointError
from freetoken.loader.checkpoint import INDEX_FILE, load_weights

REPO = Path(__file__).resolve().parents[2]
DELETE = object()  # edit_json: remove the field
SHARD_BYTES = 200_000  # splits the tiny checkpoint into a few shards with an index
NORM = "model.norm.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
LAST_EXPERT = "model.layers.1.mlp.experts.7.down_proj.weight"


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def edit_config(**changes) -> Callable[[Path], None]:
    return lambda d: edit_json(d / "config.json", **changes)


def edit_file(name: str, **changes) -> Callable[[Path], None]:
    return lambda d: edit_json(d / name, **changes)


def write_bytes(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def truncate(name: str) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])

    return corrupt


def edit_tensors(name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        tensors = load_file(str(d / name))
        change(tensors)
        save_file(tensors, str(d / name), metadata={"format": "pt"})

    return corrupt


def retype(tensor: str, dtype: torch.dtype) -> Callable[[Path], None]:
    return edit_tensors("model.safetensors", lambda t: t.update({tensor: t[tensor].to(dtype)}))


def shard_of(d: Path, tensor: str) -> str:
    return json.loads((d / INDEX_FILE).read_text())["weight_map"][tensor]


def edit_weight_map(change: Callable[[dict[str, str], Path], None]) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        index = json.loads((d / INDEX_FILE).read_text())
        change(index["weight_map"], d)
        (d / INDEX_FILE).write_text(json.dumps(index))

    return corrupt


def symlink_out(name: str) -> Callable[[Path], None]:
    """`name` replaced by a symlink to an identical copy outside the checkpoint directory."""

    def corrupt(d: Path) -> None:
        outside = d.parent / f"{d.name}-outside-{Path(name).name}"
        shutil.move(d / name, outside)
        (d / name).symlink_to(outside)

    return corrupt


def empty_dir(d: Path) -> None:
    shutil.rmtree(d)
    d.mkdir()


def dir_to_file(d: Path) -> None:
    shutil.rmtree(d)
    d.write_text("{}")


def template_in_config(template) -> Callable[[Path], None]:
    """The template in tokenizer_config.json (the older layout), no chat_template.jinja."""

    def corrupt(d: Path) -> None:
        (d / "chat_template.jinja").unlink()
        edit_json(d / "tokenizer_config.json", chat_template=template)

    return corrupt


def remove(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def duplicate_tensor(d: Path) -> None:
    save_file({NORM: torch.ones(64, dtype=torch.bfloat16)}, str(d / "extra.safetensors"))


def misplace_tensor(weight_map: dict[str, str], d: Path) -> None:
    others = sorted(set(weight_map.values()) - {weight_map[NORM]})
    weight_map[NORM] = others[0]


CFG = "{d}/config.json"
SHARD2 = "model-00002-of-00004.safetensors"

# (case id, sharded base?, corruption, expected message with {d} the checkpoint directory)
CASES: list[tuple[str, bool, Callable[[Path], None], str]] = [
    # the directory and config.json
    ("empty-dir", False, empty_dir, "{d}: not a checkpoint (no config.json)"),
    ("dir-missing", False, shutil.rmtree, "{d}: not a directory"),
    ("dir-a-file", False, dir_to_file, "{d}: not a directory"),
    ("config-garbage", False, write_bytes("config.json", b'{"model_type": '), CFG + ": cannot read JSON: "),
    ("config-not-utf8", False, write_bytes("config.json", b"\xff\xfe{}"), CFG + ": cannot read JSON: "),
    ("config-a-list", False, write_bytes("config.json", b"[1, 2]"), CFG + ": expected a JSON object, got list"),
    ("config-nested-deep", False, write_bytes("config.json", b"[" * 100_000 + b"]" * 100_000),
     CFG + ": cannot read JSON: "),
    ("config-symlink-out", False, symlink_out("config.json"),
     "{d}/config.json: 'config.json' leads outside the checkpoint directory {d}; refused"),
    ("model-type-unknown", False, edit_config(model_type="llama"),
     CFG + ": model_type: unsupported 'llama'; supported: qwen3_moe, mixtral, olmoe, qwen2_moe"),
    ("model-type-missing", False, edit_config(model_type=DELETE), CFG + ": model_type: unsupported None"),
    ("top-k-over-experts", False, edit_config(num_experts_per_tok=9),
     CFG + ": num_experts_per_tok: 9 is more than the number of experts (8)"),
    ("top-k-zero", False, edit_config(num_experts_per_tok=0), CFG + ": num_experts_per_tok: must be at least 1, got 0"),
    ("layers-negative", False, edit_config(num_hidden_layers=-1),
     CFG + ": num_hidden_layers: must be at least 1, got -1"),
    ("hidden-zero", False, edit_config(hidden_size=0), CFG + ": hidden_size: must be at least 1, got 0"),
    ("heads-negative", False, edit_config(num_attention_heads=-4),
     CFG + ": num_attention_heads: must be at least 1, got -4"),
    ("experts-missing", False, edit_config(num_experts=DELETE), CFG + ": num_experts: missing"),
    ("vocab-a-string", False, edit_config(vocab_size="1024"),
     CFG + ": vocab_size: expected an integer, got str '1024'"),
    ("hidden-a-float", False, edit_config(hidden_size=64.0),
     CFG + ": hidden_size: expected an integer, got float 64.0"),
    ("experts-a-bool", False, edit_config(num_experts=True), CFG + ": num_experts: expected an integer, got bool True"),
    ("kv-heads-do-not-divide", False, edit_config(num_key_value_heads=3),
     CFG + ": num_key_value_heads: 3 does not divide num_attention_heads (4)"),
    ("heads-do-not-divide-hidden", False, edit_config(head_dim=DELETE, num_attention_heads=3, num_key_value_heads=3),
     CFG + ": num_attention_heads: 3 does not divide hidden_size (64), and no head_dim"),
    ("eps-negative", False, edit_config(rms_norm_eps=-1), CFG + ": rms_norm_eps: must be a finite number > 0, got -1"),
    ("eps-a-string", False, edit_config(rms_norm_eps="1e-6"),
     CFG + ": rms_norm_eps: expected a number, got str '1e-6'"),
    ("norm-topk-a-string", False, edit_config(norm_topk_prob="false"),
     CFG + ": norm_topk_prob: expected true or false, got str 'false'"),
    ("rope-dynamic", False, edit_config(rope_parameters={"rope_type": "dynamic", "factor": 4.0}),
     CFG + ": rope_parameters: rope_type: 'dynamic' is not supported yet (default RoPE or yarn)"),
    ("rope-a-list", False, edit_config(rope_parameters=[1]),
     CFG + ": rope_parameters: expected an object, got list [1]"),
    ("rope-theta-zero", False, edit_config(rope_parameters={"rope_type": "default", "rope_theta": 0}),
     CFG + ": rope_parameters: rope_theta: must be a finite number > 0, got 0"),
    ("dtype-unknown", False, edit_config(dtype="int8"),
     CFG + ": dtype: unknown dtype 'int8'; expected one of bfloat16, float16, float32, float64"),
    ("eos-outside-vocab", False, edit_config(eos_token_id=5000),
     CFG + ": eos_token_id: [5000] is outside the vocabulary (vocab_size 1024)"),
    ("eos-a-string", False, edit_config(eos_token_id="5"), CFG + ": eos_token_id: expected an integer, got str '5'"),
    ("mlp-only-layer-outside", False, edit_config(mlp_only_layers=[7]),
     CFG + ": mlp_only_layers: layer ids must be below num_hidden_layers (2)"),
    ("sparse-step-zero", False, edit_config(decoder_sparse_step=0),
     CFG + ": decoder_sparse_step: must be at least 1, got 0"),
    ("max-positions-negative", False, edit_config(max_position_embeddings=-1),
     CFG + ": max_position_embeddings: must be at least 1, got -1"),
    ("sliding-window-binds", False, edit_config(use_sliding_window=True, sliding_window=64),
     CFG + ": sliding_window: this model attends over a sliding window of 64 tokens, which freetoken does not "
     "implement; the context is 4096 tokens: pass --max-model-len 64 or less (the window then never binds)"),
    # config.json against the tensors and the tokenizer
    ("head-dim-against-tensors", False, edit_config(head_dim=16),
     "{d}/model.safetensors: tensor '" + Q_PROJ + "' has shape (128, 64), expected (64, 64)"),
    ("hidden-against-tensors", False, edit_config(hidden_size=32),
     "{d}/model.safetensors: tensor 'model.embed_tokens.weight' has shape (1024, 64), expected (1024, 32)"),
    ("vocab-below-tokenizer", False, edit_config(vocab_size=512),
     "{d}/tokenizer.json: vocabulary: 1000 tokens, more than config.json's vocab_size (512)"),
    # tokenizer files
    ("tokenizer-missing", False, remove("tokenizer.json"),
     "{d}/tokenizer.json: not found (only tokenizer.json tokenizers are supported)"),
    ("tokenizer-garbage", False, write_bytes("tokenizer.json", b'{"model": '),
     "{d}/tokenizer.json: cannot load tokenizer: "),
    ("tokenizer-config-garbage", False, write_bytes("tokenizer_config.json", b"{not json"),
     "{d}/tokenizer_config.json: cannot read JSON: "),
    ("generation-config-garbage", False, write_bytes("generation_config.json", b"\x00\x01"),
     "{d}/generation_config.json: cannot read JSON: "),
    ("generation-eos-outside-vocab", False, edit_file("generation_config.json", eos_token_id=4096),
     "{d}/generation_config.json: eos_token_id: [4096] is outside the model's vocabulary (vocab_size 1024)"),
    ("generation-eos-a-string", False, edit_file("generation_config.json", eos_token_id="x"),
     "{d}/generation_config.json: eos_token_id: expected an integer, got str 'x'"),
    ("chat-template-broken", False, write_bytes("chat_template.jinja", b"{% for m in messages %}{{ m.content }"),
     "{d}/chat_template.jinja: invalid Jinja template (line 1): "),
    ("config-chat-template-broken", False, template_in_config("{% if messages %}x"),
     "{d}/tokenizer_config.json: chat_template: invalid Jinja template (line 1): "),
    ("config-chat-template-a-number", False, template_in_config(3),
     "{d}/tokenizer_config.json: chat_template must be a string or a list, got int"),
    # a single safetensors file
    ("weights-missing", False, remove("model.safetensors"), "{d}: no *.safetensors files and no " + INDEX_FILE),
    ("weights-truncated", False, truncate("model.safetensors"),
     "{d}/model.safetensors: cannot read safetensors file (Error while deserializing header: incomplete metadata"),
    ("weights-empty", False, write_bytes("model.safetensors", b""),
     "{d}/model.safetensors: cannot read safetensors file (Error while deserializing header: header too small)"),
    ("weights-garbage", False, write_bytes("model.safetensors", b"\x10" + b"\x00" * 7 + b"not a header...."),
     "{d}/model.safetensors: cannot read safetensors file (Error while deserializing header: "),
    ("weights-symlink-out", False, symlink_out("model.safetensors"),
     "{d}/model.safetensors: 'model.safetensors' leads outside the checkpoint directory {d}; refused"),
    ("tokenizer-symlink-out", False, symlink_out("tokenizer.json"),
     "{d}/tokenizer.json: 'tokenizer.json' leads outside the checkpoint directory {d}; refused"),
    ("tensor-missing", False, edit_tensors("model.safetensors", lambda t: t.pop(NORM)),
     "{d}: tensor '" + NORM + "' is missing"),
    ("expert-missing", False, edit_tensors("model.safetensors", lambda t: t.pop(LAST_EXPERT)),
     "{d}: tensor '" + LAST_EXPERT + "' is missing"),
    ("tensor-wrong-shape", False, edit_tensors("model.safetensors", lambda t: t.update({NORM: t[NORM][:32]})),
     "{d}/model.safetensors: tensor '" + NORM + "' has shape (32,), expected (64,)"),
    ("tensor-wrong-dtype", False, retype(NORM, torch.int32),
     "{d}/model.safetensors: tensor '" + NORM + "' is stored as I32, expected one of BF16, F16, F32, F64"),
    ("tensor-fp8", False, retype(Q_PROJ, torch.float8_e4m3fn),
     "{d}/model.safetensors: tensor '" + Q_PROJ + "' is stored as F8_E4M3, expected one of BF16, F16, F32, F64"),
    ("tensor-in-two-files", False, duplicate_tensor,
     "{d}/model.safetensors: tensor '" + NORM + "' is also in extra.safetensors; which one is meant is unclear "
     "without a " + INDEX_FILE),
    # sharded: the index and its shards
    ("index-garbage", True, write_bytes(INDEX_FILE, b'{"weight_map": {'), "{d}/" + INDEX_FILE + ": cannot read JSON: "),
    ("index-a-list", True, write_bytes(INDEX_FILE, b"[]"), "{d}/" + INDEX_FILE + ": expected a JSON object, got list"),
    ("weight-map-missing", True, edit_file(INDEX_FILE, weight_map=DELETE),
     "{d}/" + INDEX_FILE + ": weight_map: expected an object of tensor name -> shard file, got nothing"),
    ("weight-map-a-list", True, edit_file(INDEX_FILE, weight_map=["model-00001-of-00004.safetensors"]),
     "{d}/" + INDEX_FILE + ": weight_map: expected an object of tensor name -> shard file, got a list"),
    ("weight-map-a-string", True, edit_file(INDEX_FILE, weight_map="model-00001-of-00004.safetensors"),
     "{d}/" + INDEX_FILE + ": weight_map: expected an object of tensor name -> shard file, got a str"),
    ("weight-map-null", True, edit_file(INDEX_FILE, weight_map=None),
     "{d}/" + INDEX_FILE + ": weight_map: expected an object of tensor name -> shard file, got null"),
    ("weight-map-empty", True, edit_file(INDEX_FILE, weight_map={}),
     "{d}/" + INDEX_FILE + ": weight_map: expected an object of tensor name -> shard file, got an empty object"),
    ("weight-map-value-an-int", True, edit_weight_map(lambda m, d: m.update({NORM: 2})),
     "{d}/" + INDEX_FILE + ": weight_map: tensor '" + NORM + "' maps to int, expected a file name"),
    ("shard-missing", True, remove(SHARD2),
     "{d}/" + INDEX_FILE + ": weight_map: lists shard '" + SHARD2 + "', which is missing from {d}"),
    ("shard-path-traversal", True, edit_weight_map(lambda m, d: m.update({NORM: "../../etc/passwd"})),
     "{d}/" + INDEX_FILE + ": weight_map: '../../etc/passwd' leads outside the checkpoint directory {d}; refused"),
    ("shard-absolute-path", True, edit_weight_map(lambda m, d: m.update({NORM: "/etc/passwd"})),
     "{d}/" + INDEX_FILE + ": weight_map: '/etc/passwd' is an absolute path; checkpoint files must be inside {d}"),
    ("shard-symlink-out", True, symlink_out(SHARD2),
     "{d}/" + INDEX_FILE + ": weight_map: '" + SHARD2 + "' leads outside the checkpoint directory {d}; refused"),
    ("shard-truncated", True, truncate(SHARD2),
     "{d}/" + SHARD2 + ": cannot read safetensors file (Error while deserializing header: incomplete metadata"),
    ("index-misplaces-a-tensor", True, edit_weight_map(misplace_tensor),
     "{d}/model-00001-of-00004.safetensors: tensor '" + NORM + "' is missing (the " + INDEX_FILE
     + " puts it in this file)"),
]


@pytest.fixture(scope="session")
def bases(make_checkpoint) -> dict[bool, Path]:
    """The valid checkpoints every case starts from: one safetensors file, or shards with an index."""
    return {False: make_checkpoint("qwen3_moe"), True: make_checkpoint("qwen3_moe", max_shard_bytes=SHARD_BYTES)}


def corrupted(bases: dict[bool, Path], tmp_path: Path, sharded: bool, corrupt: Callable[[Path], None]) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(bases[sharded], d)
    corrupt(d)
    return d


def load_as_the_engine_does(model_dir: Path, **engine) -> None:
    """What a start reads before serving: the checks, then every tensor (experts included)."""
    open_checkpoint(model_dir, EngineConfig(model=str(model_dir), **engine))
    load_weights(model_dir, torch.float32, experts=True)


def test_the_bases_load(bases):
    for d in bases.values():
        load_as_the_engine_does(d)
    index = json.loads((bases[True] / INDEX_FILE).read_text())
    assert shard_of(bases[True], NORM) != "model-00001-of-00004.safetensors"  # misplace_tensor moves it there
    assert SHARD2 in index["weight_map"].values()


@pytest.mark.parametrize(("sharded", "corrupt", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_checkpoint_is_one_clear_error(bases, tmp_path, sharded, corrupt, expected):
    d = corrupted(bases, tmp_path, sharded, corrupt)
    with pytest.raises(CheckpointError) as info:
        load_as_the_engine_does(d)
    message = str(info.value)
    assert message.startswith(expected.format(d=d)), message
    assert "\n" not in message and len(message) < 600


def test_a_window_that_cannot_bind_is_accepted(bases, tmp_path):
    d = corrupted(bases, tmp_path, False, edit_config(use_sliding_window=True, sliding_window=64))
    load_as_the_engine_does(d, max_model_len=64)
    d = corrupted(bases, tmp_path / "big", False, edit_config(use_sliding_window=True, sliding_window=4096))
    load_as_the_engine_does(d)  # max_position_embeddings is 4096: the window spans every context


def test_hub_cache_snapshot_with_symlinks_into_blobs_loads(bases, tmp_path):
    """The Hugging Face cache layout: snapshots/<rev>/ holds symlinks into the repository's blobs/."""
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(bases[True].iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    load_as_the_engine_does(snapshot)


CLI_CASES = ["top-k-over-experts", "weight-map-a-list", "empty-dir", "tensor-wrong-shape"]


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "freetoken", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def assert_one_error_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len([line for line in lines if line.startswith("freetoken: error:")]) == 1, proc.stderr
    assert lines[-1].startswith(f"freetoken: error: {expected}"), proc.stderr


@pytest.mark.parametrize("case", CLI_CASES)
def test_generate_cli_exits_2_with_one_line(bases, tmp_path, case):
    sharded, corrupt, expected = next(c[1:] for c in CASES if c[0] == case)
    d = corrupted(bases, tmp_path, sharded, corrupt)
    proc = run_cli("generate", "--model", str(d), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2")
    assert_one_error_line(proc, expected.format(d=d))
    assert proc.stdout == ""


def test_serve_refuses_to_start_on_a_bad_config(bases, tmp_path):
    """top-k above the expert count: refused at start, before anything listens."""
    d = corrupted(bases, tmp_path, False, edit_config(num_experts_per_tok=9))
    proc = run_cli("serve", "--model", str(d), "--device", "cpu", "--port", "0")
    assert_one_error_line(proc, f"{d}/config.json: num_experts_per_tok: 9 is more than the number of experts (8)")
    assert "Uvicorn running" not in proc.stderr
