"""The tokenizer and chat template a GGUF file carries (`tokenizer.ggml.*`, `tokenizer.chat_template`).

A GPT-2 style (`tokenizer.ggml.model` = gpt2) vocabulary is rebuilt as a `tokenizers` byte-level
BPE: the token list (id = position), the merges in rank order, and the pre-tokenizer llama.cpp
names by `tokenizer.ggml.pre`. Token types decide the added tokens: CONTROL tokens are special
(recognised in text, dropped by `decode(skip_special_tokens=True)`), USER_DEFINED ones are
recognised in text but kept when decoding (as transformers keeps Qwen's `<think>`).
"""

from __future__ import annotations

from typing import Any

from gguf import TokenType

from freetoken.errors import CheckpointError
from freetoken.loader.gguf_file import GgufFile


class PreTokenizer:
    """How text is split before BPE, per `tokenizer.ggml.pre`: the split pattern and the
    Unicode normalisation applied first (None: none)."""

    def __init__(self, pattern: str, normalization: str | None) -> None:
        self.pattern = pattern
        self.normalization = normalization


# tokenizer.ggml.pre -> the split the model's own tokenizer makes. A new pre type is a new row.
PRE_TOKENIZERS = {
    "qwen2": PreTokenizer(
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "NFC",
    ),
    # o200k's split (gpt-oss): cased words with their contractions, numbers in threes, no normalisation
    "gpt-4o": PreTokenizer(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        None,
    ),
}


def _backend(gguf: GgufFile, tokens: list[str], types: list[int]) -> Any:
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    pre_name = gguf.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise CheckpointError(
            f"{gguf.path}: tokenizer.ggml.pre: unsupported pre-tokenizer {pre_name!r}; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    merges = []
    for rank, merge in enumerate(gguf.get("tokenizer.ggml.merges")):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise CheckpointError(f"{gguf.path}: tokenizer.ggml.merges[{rank}]: {merge!r} is not two tokens")
        merges.append((left, right))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.tokens: the list repeats a token")
    backend = FastTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre.normalization is not None:
        backend.normalizer = getattr(normalizers, pre.normalization)()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pre.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tokens[i], special=t == TokenType.CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    backend.add_tokens(added)  # ids already in the vocabulary: they keep them
    return backend


def tokenizer_fields(gguf: GgufFile) -> dict[str, Any]:
    """`loader/tokenizer.py`'s Tokenizer arguments (the template unchecked: Tokenizer checks it)."""
    model = gguf.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"{gguf.path}: tokenizer.ggml.model: {model!r} tokenizers are not supported (only gpt2: byte-level BPE)"
        )
    tokens = gguf.get("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type", [int(TokenType.NORMAL)] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{gguf.path}: tokenizer.ggml.token_type: {len(types)} types for {len(tokens)} tokens"
        )

    def special_id(key: str) -> int | None:
        value = gguf.get(f"tokenizer.ggml.{key}", None)
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise CheckpointError(f"{gguf.path}: tokenizer.ggml.{key}: {value} is outside the {len(tokens)} tokens")
        return int(value)

    # A model that never starts with its BOS (add_bos_token false, as Qwen's) has none, as in
    # its transformers tokenizer: the chat template then renders no bos_token.
    bos = special_id("bos_token_id") if gguf.get("tokenizer.ggml.add_bos_token", True) else None
    named = {"bos_token": bos, "eos_token": special_id("eos_token_id"),
             "pad_token": special_id("padding_token_id"), "unk_token": special_id("unknown_token_id")}
    eos = [i for i in (named["eos_token"], special_id("eot_token_id")) if i is not None]
    return {
        "backend": _backend(gguf, tokens, types),
        "chat_template": gguf.get("tokenizer.chat_template", None),
        "special_tokens": {name: tokens[i] for name, i in named.items() if i is not None},
        "eos_token_ids": tuple(dict.fromkeys(eos)),
        "bos_token_id": bos,
        "source": str(gguf.path),
    }
