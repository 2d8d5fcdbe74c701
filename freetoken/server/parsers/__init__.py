"""Output parsers: reasoning (`<think>`) and tool calls, chosen by model family.

    parser = make_parser(FAMILIES["qwen3_moe"], tools=True, starts_in_reasoning=False)
    events = parser.feed(text) ... + parser.finish()     # TextDelta / ReasoningDelta / ToolCall

Families (`ModelConfig.arch`): Qwen and OLMoE write Hermes-style `<tool_call>` JSON and may
think in `<think>` blocks; Qwen3.5 / Qwen3.6 write the calls in XML, typed by the offered
tools' schemas (`tool_schemas`), as do the Coder models of Qwen3 and Qwen3-Next, which share
their architectures with JSON-writing siblings (the chat template tells them apart); Mixtral
writes `[TOOL_CALLS]` (a special token: the engine has to keep special tokens in the text, see
`Family.needs_special_tokens`); gpt-oss writes Harmony, whose channels carry reasoning, answers
and tool calls alike, all marked by special tokens (`Family.markup_is_special`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.server.parsers.base import (
    Chain,
    Event,
    Parser,
    PlainText,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    coalesce,
    parse_all,
)
from freetoken.server.parsers.harmony import HarmonyParser, open_message
from freetoken.server.parsers.hermes import HermesToolParser
from freetoken.server.parsers.mistral import MistralToolParser
from freetoken.server.parsers.qwen_xml import QwenXmlToolParser, ToolSchemas, tool_schemas
from freetoken.server.parsers.reasoning import ReasoningParser

__all__ = [
    "Event",
    "Family",
    "Parser",
    "ReasoningDelta",
    "TextDelta",
    "ToolCall",
    "ToolSchemas",
    "coalesce",
    "family_of",
    "make_parser",
    "parse_all",
    "prompt_open_message",
    "prompt_opens_reasoning",
    "tool_schemas",
]

_TOOL_PARSERS = {"hermes": HermesToolParser, "mistral": MistralToolParser}
QWEN_XML = "qwen_xml"  # the one tool parser that reads the tools' schemas (the XML form carries no types)
HARMONY = "harmony"  # a tool_format that is a whole output format: one parser reads everything


@dataclass(frozen=True)
class Family:
    tool_format: str  # a key of _TOOL_PARSERS, QWEN_XML or HARMONY
    reasoning: bool  # may write <think> blocks
    # The tool-call marker is a special token: tool parsing needs the engine's text decoded
    # with special tokens left in.
    needs_special_tokens: bool = False
    # All of the output's structure is special tokens: every response needs them left in.
    markup_is_special: bool = False

    def keeps_special_tokens(self, *, tools: bool) -> bool:
        """Whether the engine must decode this response with special tokens left in."""
        return self.markup_is_special or (tools and self.needs_special_tokens)


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("hermes", reasoning=True),
    "qwen2_moe": Family("hermes", reasoning=True),
    "olmoe": Family("hermes", reasoning=True),
    "qwen3_next": Family("hermes", reasoning=True),  # Qwen3-Next; its Coder model's template says XML
    "qwen3_5_moe": Family(QWEN_XML, reasoning=True),
    "qwen3_5_moe_text": Family(QWEN_XML, reasoning=True),
    "mixtral": Family("mistral", reasoning=False, needs_special_tokens=True),
    "gpt_oss": Family(HARMONY, reasoning=True, needs_special_tokens=True, markup_is_special=True),
}


def family_of(arch: str | None, chat_template: Any = None) -> Family:
    """The parsing family of a model: by architecture, else guessed from the chat template
    (an engine that does not say its architecture), else Hermes-style. A template that writes
    XML calls (`<function=`) makes a Hermes family XML: Qwen3-Coder is a qwen3_moe and
    Qwen3-Coder-Next a qwen3_next, while their siblings write JSON."""
    source = chat_template if isinstance(chat_template, str) else " ".join((chat_template or {}).values())
    xml_calls = "<function=" in source
    if arch in FAMILIES:
        family = FAMILIES[arch]
        return FAMILIES["qwen3_5_moe"] if xml_calls and family.tool_format == "hermes" else family
    if xml_calls:
        return FAMILIES["qwen3_5_moe"]
    if "[TOOL_CALLS]" in source:
        return FAMILIES["mixtral"]
    if "<|channel|>" in source:
        return FAMILIES["gpt_oss"]
    return FAMILIES["qwen3_moe"]


def make_parser(
    family: Family,
    *,
    tools: bool,
    starts_in_reasoning: bool = False,
    open_message: str = "",
    schemas: ToolSchemas | None = None,
) -> Parser:
    """A fresh parser for one response. `tools` False: tool-call syntax stays text.
    `open_message`: Harmony only, the prompt's unfinished last message (see harmony.py).
    `schemas`: the offered tools' parameter schemas (`tool_schemas`), which type XML calls."""
    if family.tool_format == HARMONY:
        return HarmonyParser(tools=tools, open_message=open_message)
    tool_parser: Parser
    if not tools:
        tool_parser = PlainText()
    elif family.tool_format == QWEN_XML:
        tool_parser = QwenXmlToolParser(schemas)
    else:
        tool_parser = _TOOL_PARSERS[family.tool_format]()
    if not family.reasoning:
        return tool_parser
    return Chain(ReasoningParser(starts_in_reasoning=starts_in_reasoning), tool_parser)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the chat template left a `<think>` block open at the end of the prompt, so the
    output starts inside it."""
    return prompt_text.rstrip().endswith("<think>")


def prompt_open_message(family: Family, prompt_text: str) -> str:
    """Harmony: the message the prompt leaves unfinished, which the output continues ('' for
    the other families, whose parsers need only `prompt_opens_reasoning`)."""
    return open_message(prompt_text) if family.tool_format == HARMONY else ""
