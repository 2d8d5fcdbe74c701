"""The tokenizer wrapper against transformers' own tokenizer and chat-template rendering."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.errors import CheckpointError, RequestError
from freetoken.loader import tokenizer_builder as tb
from freetoken.loader.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Current weather in a city. Accepts <b>names</b> & "quotes"; café ☀',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Web search",
        "parameters": {"type": "object", "properties": {}},
    },
}

CONVERSATIONS = {
    "single": ([{"role": "user", "content": "Hi there"}], None),
    "system_multi_turn": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me about ünïcödé 你好 🙂\nand newlines\n\n"},
        ],
        None,
    ),
    "tools_no_calls": (
        [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Weather in Paris?"}],
        [WEATHER_TOOL, SEARCH_TOOL],
    ),
    "tool_calls_and_results": (
        [
            {"role": "user", "content": "Weather in Paris and Lyon?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Lyon", "unit": "celsius"}',
                        },
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 °C, sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 20}'},
            {"role": "assistant", "content": "Paris is 18 °C and Lyon 20 °C."},
            {"role": "user", "content": "Thanks!"},
        ],
        [WEATHER_TOOL],
    ),
    "content_parts_and_text_with_call": (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}],
            },
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {}}}],
            },
            {"role": "tool", "content": "nothing found"},
        ],
        [SEARCH_TOOL],
    ),
}

TEXTS = [
    "",
    " ",
    "hello world",
    "   leading and trailing   ",
    "Hello, world! <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] question [/INST] answer</s>",
    '[AVAILABLE_TOOLS] [{}][/AVAILABLE_TOOLS][TOOL_CALLS] [{"name": "f"}][TOOL_RESULTS] x[/TOOL_RESULTS]',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>\nhmm\n</think>\n\nok <tool_response>r</tool_response>",
    "<|endoftext|><|endoftext|><|padding|>",
    "a<s>b</s>c<|im_end|>d",
    "ünïcödé e\u0301 你好，世界 こんにちは 🙂👍🏽🇫🇷 Привет Ω≈ç√",
    "\x00\x01\t\r\n\x7f\u2028\ufeff",
    "def f(x):\n    return x * 2  # comment\n\n\n",
    '{"key": [1, 2.5, -3e-4, null, true], "nested": {"a": "b"}}',
    "<|im_start",
    "|im_end|>",
    "<tool_call",
    "[INST",
]


@pytest.fixture(scope="module")
def pairs(make_checkpoint):
    """(ours, transformers') tokenizers for every family."""
    out = {}
    for family in FAMILIES:
        d = make_checkpoint(family)
        out[family] = (Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(pairs, family, name):
    ours, hf = pairs[family]
    messages, tools = CONVERSATIONS[name]
    for gen in (True, False):
        a = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen)
        b = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
        assert a == b
        assert ours.encode(a) == hf.encode(b, add_special_tokens=False)


def test_chat_template_shapes(pairs):
    qwen, _ = pairs["qwen3_moe"]
    messages, tools = CONVERSATIONS["tool_calls_and_results"]
    text = qwen.apply_chat_template(messages, tools=tools)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 °C, sunny\n</tool_response>\n<tool_response>\n" in text
    no_think = qwen.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    mixtral, _ = pairs["mixtral"]
    text = mixtral.apply_chat_template(CONVERSATIONS["system_multi_turn"][0])
    assert text.startswith("<s>[INST] Hi[/INST] Hello! How can I help?</s>[INST] Be brief.\n\n")
    olmoe, _ = pairs["olmoe"]
    text = olmoe.apply_chat_template(CONVERSATIONS["single"][0])
    assert text == "<|user|>\nHi there\n<|assistant|>\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_decode_match_transformers(pairs, family):
    ours, hf = pairs[family]
    assert ours.vocab_size == len(hf) == 1000
    for text in [*TEXTS, tb.corpus()]:
        for add in (False, True):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                text
            )
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_ids(pairs):
    qwen = pairs["qwen3_moe"][0]
    assert qwen.encode("<|im_start|>") == [qwen.token_to_id("<|im_start|>")] == [4]
    assert qwen.eos_token_ids == (5, 0)  # <|im_end|> and <|endoftext|>, from generation_config
    assert qwen.bos_token_id is None
    assert qwen.token_to_id("no such token") is None
    # Markup tokens are single ids and survive skip_special_tokens; control tokens do not.
    ids = qwen.encode("<|im_start|>x<tool_call>{}</tool_call><think>t</think><|im_end|>")
    assert qwen.token_to_id("<tool_call>") in ids
    assert qwen.decode(ids) == "x<tool_call>{}</tool_call><think>t</think>"
    mixtral = pairs["mixtral"][0]
    assert (mixtral.bos_token_id, mixtral.eos_token_ids) == (1, (2,))
    assert mixtral.encode("hi", add_special_tokens=True)[0] == 1
    assert mixtral.encode("hi", add_special_tokens=False)[0] != 1
    olmoe = pairs["olmoe"][0]
    assert (olmoe.bos_token_id, olmoe.eos_token_ids, olmoe.pad_token_id) == (None, (0,), 3)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_round_trip_any_text(pairs, text):
    tok = pairs["qwen3_moe"][0]
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.one_of(st.text(max_size=20), st.sampled_from(tb.MARKUP_TOKENS + tb.CONTROL_TOKENS))))
def test_round_trip_with_special_tokens(pairs, parts):
    tok = pairs["mixtral"][0]
    text = "".join(parts)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_builder_is_deterministic_across_processes():
    code = (
        "import hashlib; from freetoken.loader import tokenizer_builder as tb; "
        "print(hashlib.sha256(tb.build_tokenizer_json(1000).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(tb.build_tokenizer_json(1000).encode()).hexdigest()


def test_builder_vocab_sizes():
    for size in (400, 1000, 3000):  # 3000 needs filler tokens: the corpus cannot support that many merges
        data = json.loads(tb.build_tokenizer_json(size))
        ids = [t["id"] for t in data["added_tokens"]] + list(data["model"]["vocab"].values())
        assert sorted(set(ids)) == list(range(size))
        markup = [t["id"] for t in data["added_tokens"] if t["content"] in tb.MARKUP_TOKENS]
        assert markup == list(range(size - len(tb.MARKUP_TOKENS), size))
    with pytest.raises(ValueError):
        tb.build_tokenizer_json(100)


# -- loading and errors ------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_and_corrupt_files(make_checkpoint, tmp_path):
    src = make_checkpoint("qwen3_moe")
    with pytest.raises(CheckpointError, match="nowhere"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    d = _copy(src, tmp_path / "a")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    d = _copy(src, tmp_path / "b")
    (d / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    d = _copy(src, tmp_path / "c")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    d = _copy(src, tmp_path / "d")
    (d / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        Tokenizer.from_dir(d)


def test_template_sources_and_hf_variants(make_checkpoint, tmp_path):
    src = make_checkpoint("mixtral")
    # chat_template.jinja wins over tokenizer_config.json.
    d = _copy(src, tmp_path / "jinja")
    (d / "chat_template.jinja").write_text("FROM FILE {{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "FROM FILE x"
    # Older layout: only tokenizer_config.json, named templates, AddedToken-style special tokens,
    # eos from config.json when there is no generation config.
    d = _copy(src, tmp_path / "named")
    (d / "chat_template.jinja").unlink()
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D{{ bos_token }}{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{{ eos_token }}"},
    ]
    cfg["eos_token"] = {"__type": "AddedToken", "content": "</s>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == (2,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D<s>1"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[SEARCH_TOOL]) == "T1</s>"
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "D<s>1"


def test_environment_matches_transformers(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("olmoe"), tmp_path / "env")
    template = (
        "{{ messages[0].content | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ tools | tojson }}|"
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ custom }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{{ strftime_now('%Y') | length }}|{% generation %}gen{% endgeneration %}\n"
        "  {% if add_generation_prompt %}\n  PROMPT\n  {% endif %}\n"
    )
    (d / "chat_template.jinja").write_text(template)
    ours = Tokenizer.from_dir(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "<b>&'\"ü🙂"}, {"role": "assistant", "content": "y"}]
    for kwargs in ({}, {"custom": 3}, {"tools": [WEATHER_TOOL]}, {"eos_token": "override"}):
        a = ours.apply_chat_template(messages, **kwargs)
        b = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert a == b
    assert '"<b>&\'\\"ü🙂"' in a


def test_template_errors_are_request_errors(make_checkpoint, tmp_path):
    qwen = Tokenizer.from_dir(make_checkpoint("qwen3_moe"))
    with pytest.raises(RequestError, match="unsupported message role: robot"):
        qwen.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(RequestError, match="only text content parts"):
        qwen.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    mixtral = Tokenizer.from_dir(make_checkpoint("mixtral"))
    with pytest.raises(RequestError, match="roles must be"):
        mixtral.apply_chat_template([{"role": "narrator", "content": "x"}])

    d = _copy(make_checkpoint("qwen3_moe"), tmp_path / "bad")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(CheckpointError, match="chat_template.jinja: invalid Jinja template"):
        Tokenizer.from_dir(d)  # a broken template is refused at load, not in every request
    (d / "chat_template.jinja").write_text("{{ messages[0].content.__class__.__mro__ }}")
    with pytest.raises(RequestError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(RequestError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
