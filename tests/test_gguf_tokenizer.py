"""The tokenizer a GGUF file carries: equal to the one transformers builds from the same file,
special and user-defined tokens as the source tokenizer has them, and the chat template."""

from __future__ import annotations

import pytest

from freetoken.errors import CheckpointError
from freetoken.loader.tokenizer import Tokenizer
from tests.gguf_testfiles import write_gguf

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEXTS = [
    "Hello world! The quick brown fox, 123 + 4567 = 4690.",
    "<|im_start|>user\nWhat's the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "  indented\tcode():\n    return {'a': [1, 2]}\r\n<|endoftext|>",
    "Ünïcödé — 日本語 and emoji 🎉, it's done; they'll see.",
]


@pytest.fixture(scope="module")
def gguf_path(make_checkpoint, tmp_path_factory):
    source = make_checkpoint("qwen3_moe", "tiny")
    return write_gguf(source, tmp_path_factory.mktemp("gguf_tok") / "tok.gguf", template=TEMPLATE)


def test_encode_decode_equal_transformers_gguf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_checkpoint(gguf_path)
    theirs = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_special_and_user_defined_tokens_as_the_source_has_them(gguf_path, make_checkpoint):
    source = Tokenizer.from_dir(make_checkpoint("qwen3_moe", "tiny"))
    ours = Tokenizer.from_checkpoint(gguf_path)
    text = "<tool_call>{}</tool_call><think>x</think><|im_end|>"
    ids = ours.encode(text)
    assert ids[0] == source.token_to_id("<tool_call>") and ids[-1] == source.token_to_id("<|im_end|>")
    assert ours.decode(ids) == "<tool_call>{}</tool_call><think>x</think>"  # markup kept, control dropped
    assert ours.eos_token_ids == source.eos_token_ids[:1]
    assert ours.eos_token == source.eos_token and ours.vocab_size == 1024


def test_chat_template_from_the_file(gguf_path):
    tok = Tokenizer.from_checkpoint(gguf_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_unsupported_pre_tokenizer_is_named(make_checkpoint, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre", lambda self, pre: self.add_string(
        "tokenizer.ggml.pre", "llama-bpe"))
    path = write_gguf(make_checkpoint("qwen3_moe", "tiny"), tmp_path / "llama-bpe.gguf")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre: unsupported pre-tokenizer 'llama-bpe'"):
        Tokenizer.from_checkpoint(path)
