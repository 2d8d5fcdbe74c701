"""Build a small byte-level BPE tokenizer offline, plus a chat template per model family.

Synthetic checkpoints need a real tokenizer (so the server can round-trip text and render
chats) without downloading one. This module trains a byte-level BPE on a corpus embedded
below: deterministic, well under a second, and any Unicode string survives
`decode(encode(s))` because every byte has its own token.

Token id layout (identical for every family, so tests can rely on it):
  0 ..  n-1   control tokens (special: dropped by `decode(skip_special_tokens=True)`)
  n .. m-1    the 256 byte tokens and the learned merges
  m ..        markup tokens (`<tool_call>`, `<think>`, ...): added tokens that are *not*
              special, so they survive decoding and a tool-call parser can see them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from freetoken.loader.chat_templates import FAMILIES, chat_template_for

DEFAULT_VOCAB_SIZE = 1000

# Control tokens, in id order. `<s>` = 1 and `</s>` = 2 match the Mistral convention.
CONTROL_TOKENS = (
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<|padding|>",
    "<|im_start|>",
    "<|im_end|>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)

# Markup the model writes as part of its answer; kept by decode(skip_special_tokens=True).
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# A few KB of mixed text: prose, code, JSON, chat markup and some non-ASCII, so the merges
# look like those of a real tokenizer (common words, indentation, JSON punctuation).
_CORPUS = r"""
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. In the beginning there was a small idea, and the idea grew into a project that
many people worked on together. They wrote code, tested it, and shipped it to the users who
had been waiting for a long time.

Mixture-of-experts language models route every token to a few experts out of many. The
router computes a score for each expert, keeps the top k, and the token's hidden state is
sent only to those experts. Because most experts are idle for any given token, a model with
thirty billion parameters may activate only three billion of them per step. The challenge
for a serving engine is memory: the experts that are not on the GPU must be fetched from
host memory, and the time spent copying weights over PCIe can dominate the decode step.

A good cache keeps the experts that are used most often close to the compute units. When a
request arrives, the engine tokenizes the prompt, runs the prefill in one batch, and then
decodes one token at a time. Each new token is sampled from the distribution that the model
predicts; with a temperature of zero the engine simply picks the most likely token.

What is the capital of France? The capital of France is Paris. What is the weather like
today? It is sunny with a light breeze and a temperature of twenty-one degrees. Can you help
me write a function that sorts a list of numbers? Of course! Here is a short example.

def sort_numbers(values: list[int]) -> list[int]:
    \"\"\"Return a new list with the values in ascending order.\"\"\"
    result = list(values)
    for i in range(len(result)):
        for j in range(i + 1, len(result)):
            if result[j] < result[i]:
                result[i], result[j] = result[j], result[i]
    return result


class Cache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.entries.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self.entries) >= self.capacity:
            oldest = next(iter(self.entries))
            del self.entries[oldest]
        self.entries[key] = value


import json
import os
from pathlib import Path

def load_config(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)

if __name__ == "__main__":
    config = load_config(os.environ.get("CONFIG", "config.json"))
    print(f"loaded {len(config)} keys from the config file")

for (int i = 0; i < n; ++i) {
    sum += values[i] * weights[i];
}
return sum / (float) n;

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "mixture of experts", "max_results": 5}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the current
weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type":
"string", "description": "The name of the city."}, "unit": {"type": "string", "enum":
["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"role": "user", "content": "Hello, how are you?"}
{"role": "assistant", "content": "I am fine, thank you. How can I help you today?"}
{"role": "system", "content": "You are a helpful assistant."}
{"id": "call_0", "object": "chat.completion", "created": 1700000000, "model": "demo",
"choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls":
[{"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
"finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 12, "completion_tokens": 34,
"total_tokens": 46}}
{"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 256, "stream": true}

<|system|>
You are a helpful assistant.
<|user|>
Tell me a story about a robot who learns to paint.
<|assistant|>
Once upon a time, in a quiet town by the sea, there lived a robot named Pixel. Every
morning Pixel watched the painters on the harbour wall, and every evening it tried to copy
their colours with a brush that was far too small for its metal hand.
<|user|>
What happened next?
<|assistant|>
Pixel practised for a whole year. The first paintings were strange, but the people of the
town liked them, and soon the robot had a little gallery of its own.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 32 42 64 100 128 256 512 1000 1024 2048 4096
2024-05-17 12:30:45 3.14159 2.71828 -1 +1 1e-6 1e6 0.02 0x1F 100% $19.99 #1 @user

Markdown: # Title ## Section - item one - item two * bold * `code` [link](http://example.com)
| column | value |
|--------|-------|
| alpha  | 1     |
| beta   | 2     |

Les modèles de langue apprennent à prédire le mot suivant. Où est la bibliothèque ? Ça va
très bien, merci. Die Straße ist schön, und das Mädchen läuft über die Brücke. El niño come
una manzana en el jardín. Привет, как дела? 你好，世界。今天天气很好。こんにちは、元気ですか。
안녕하세요. 🙂 👍 🚀 ✨ — “quotes” ‘single’ … € £ ¥ © ® ™ ° ± × ÷ → ← ↑ ↓ ∞ ≤ ≥ ≠ √ π Σ λ μ

SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY count(*) DESC;
git commit -m "Fix the cache eviction order" && git push origin main
$ python -m pip install --upgrade package && echo "done"
<div class="container"><p>Hello, <b>world</b>!</p></div>

The system answered in the same language as the question. Please think step by step before
answering, and show your reasoning only when the user asks for it. Let me think about this:
first we compute the sum, then we divide by the count, and finally we round the result.
The answer is 42. Thank you for your question, and have a wonderful day!
"""


def corpus() -> str:
    """The embedded training text (also handy as varied input for tests)."""
    return _CORPUS


@functools.lru_cache(maxsize=8)
def build_tokenizer_json(vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
    """Train the byte-level BPE and return its `tokenizer.json` text (without a post-processor).

    `vocab_size` counts every token, added ones included. Deterministic for a given size.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = len(CONTROL_TOKENS) + 256 + len(MARKUP_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        min_frequency=1,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Each paragraph is one training "document"; repeating the corpus does not change the merges.
    tok.train_from_iterator(_training_texts(), trainer=trainer)
    # The corpus may not support as many merges as asked for: pad with filler tokens so the
    # size is exactly what the caller asked for (ids stay dense, markup tokens stay last).
    missing = vocab_size - len(MARKUP_TOKENS) - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:  # pragma: no cover - a tokenizers behaviour change
        raise RuntimeError(f"built a tokenizer of {size} tokens, wanted {vocab_size}")
    return tok.to_str()


def _training_texts() -> list[str]:
    paragraphs = [p for p in _CORPUS.split("\n\n") if p.strip()]
    # Lines of numbers, so that digits and common numerals get merged too.
    numbers = " ".join(str(i * 37 % 1000) for i in range(200))
    return paragraphs + [numbers]


def tokenizer_json_for(family: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
    """`tokenizer.json` text for a family: Mixtral prepends `<s>` when special tokens are
    added; the others only byte-level post-processing."""
    data = json.loads(build_tokenizer_json(vocab_size))
    if family == "mixtral":
        bos_id = CONTROL_TOKENS.index("<s>")
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<s>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos_id], "tokens": ["<s>"]}},
        }
    else:
        data["post_processor"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        }
    return json.dumps(data, ensure_ascii=False, indent=2)


def token_id(token: str) -> int:
    """Id of a control token (same in every family's tokenizer)."""
    return CONTROL_TOKENS.index(token)


class SpecialTokens:
    """Which tokens play bos/eos/pad for a family, and the ids that go into config.json."""

    def __init__(self, family: str) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
        self.family = family
        if family == "mixtral":
            self.bos_token: str | None = "<s>"
            self.eos_token = "</s>"
            self.pad_token: str | None = None
            self.unk_token: str | None = None
            # config.json
            self.config_bos_id: int | None = token_id("<s>")
            self.config_eos_id: int | list[int] = token_id("</s>")
            self.config_pad_id: int | None = None
            self.generation_eos: int | list[int] = token_id("</s>")
        elif family == "olmoe":
            self.bos_token = None
            self.eos_token = "<|endoftext|>"
            self.pad_token = "<|padding|>"
            self.unk_token = None
            self.config_bos_id = None
            self.config_eos_id = token_id("<|endoftext|>")
            self.config_pad_id = token_id("<|padding|>")
            self.generation_eos = token_id("<|endoftext|>")
        else:  # Qwen: chat turns end with <|im_end|>; <|endoftext|> ends documents and pads.
            self.bos_token = None
            self.eos_token = "<|im_end|>"
            self.pad_token = "<|endoftext|>"
            self.unk_token = None
            self.config_bos_id = token_id("<|endoftext|>")
            self.config_eos_id = token_id("<|im_end|>")
            self.config_pad_id = None
            self.generation_eos = [token_id("<|im_end|>"), token_id("<|endoftext|>")]


def tokenizer_config_for(family: str, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json` content. The class is the generic fast tokenizer, so Hugging
    Face loads `tokenizer.json` as is (family classes such as Qwen2Tokenizer rebuild the
    pipeline with their own normaliser, which would break byte-exact round trips)."""
    special = SpecialTokens(family)
    return {
        "add_prefix_space": False,
        "backend": "tokenizers",
        "bos_token": special.bos_token,
        "chat_template": chat_template_for(family),
        "clean_up_tokenization_spaces": False,
        "eos_token": special.eos_token,
        "model_max_length": model_max_length,
        "pad_token": special.pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": special.unk_token,
    }
