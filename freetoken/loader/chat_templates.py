"""Chat templates of the synthetic checkpoints, one per family (Jinja, rendered with
trim_blocks and lstrip_blocks as Hugging Face does): Qwen ChatML with tools, Mistral
[INST] with [TOOL_CALLS], OLMoE Tulu, Harmony for gpt-oss (`HARMONY_TEMPLATE`), and
Qwen3.5's XML tool calls (`QWEN3_5_TEMPLATE`).
"""

from __future__ import annotations

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

# Shared helper: message content may be a string or a list of OpenAI-style parts.
_CONTENT_MACRO = """\
{%- macro text_of(content) -%}
{%- if content is none -%}
{%- elif content is string -%}
{{- content -}}
{%- else -%}
{%- for part in content -%}
{%- if part is string -%}{{- part -}}
{%- elif part.type == 'text' -%}{{- part.text -}}
{%- else -%}{{- raise_exception('only text content parts are supported, got ' ~ part.type) -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro args_json(arguments) -%}
{%- if arguments is string -%}{{- arguments -}}{%- else -%}{{- arguments | tojson -}}{%- endif -%}
{%- endmacro -%}
"""

CHATML_TEMPLATE = (
    _CONTENT_MACRO
    + """\
{%- set sys_offset = 0 -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set sys_offset = 1 -%}
{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if sys_offset -%}
{{- text_of(messages[0].content) + '\\n\\n' -}}
{%- endif -%}
{{- '# Tools\\n\\nThese functions are available. '
    'Their signatures are listed inside <tools></tools>:\\n<tools>' -}}
{%- for tool in tools -%}
{{- '\\n' -}}{{- tool | tojson -}}
{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and arguments, '
    'wrapped in <tool_call></tool_call> tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif sys_offset -%}
{{- '<|im_start|>system\\n' + text_of(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[sys_offset:] -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\\n' + text_of(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if message.reasoning_content is string and message.reasoning_content -%}
{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- text_of(message.content) -}}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first or text_of(message.content) -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
{{- args_json(fn.arguments) + '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[sys_offset + loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\\n<tool_response>\\n' + text_of(message.content) + '\\n</tool_response>' -}}
{%- if loop.last or messages[sys_offset + loop.index0 + 1].role != 'tool' -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- else -%}
{{- raise_exception('unsupported message role: ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- endif -%}
{%- endif -%}
"""
)

MISTRAL_TEMPLATE = (
    _CONTENT_MACRO
    + """\
{%- set sys_offset = 0 -%}
{%- set system_text = '' -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set sys_offset = 1 -%}
{%- set system_text = text_of(messages[0].content) -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- for message in messages[sys_offset:] -%}
{%- set index = sys_offset + loop.index0 -%}
{%- if message.role == 'user' -%}
{%- if tools and index == ns.last_user -%}
{{- '[AVAILABLE_TOOLS] [' -}}
{%- for tool in tools -%}
{{- tool | tojson -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
{%- endfor -%}
{{- '][/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{%- if system_text and index == ns.last_user -%}
{{- '[INST] ' + system_text + '\\n\\n' + text_of(message.content) + '[/INST]' -}}
{%- else -%}
{{- '[INST] ' + text_of(message.content) + '[/INST]' -}}
{%- endif -%}
{%- elif message.role == 'assistant' -%}
{%- if message.tool_calls -%}
{{- '[TOOL_CALLS] [' -}}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '{"name": "' + fn.name + '", "arguments": ' + args_json(fn.arguments) + '}' -}}
{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
{%- endfor -%}
{{- ']' + eos_token -}}
{%- else -%}
{{- ' ' + text_of(message.content) + eos_token -}}
{%- endif -%}
{%- elif message.role == 'tool' -%}
{{- '[TOOL_RESULTS] {"content": ' + text_of(message.content) | tojson + '}[/TOOL_RESULTS]' -}}
{%- else -%}
{{- raise_exception('after an optional system message, roles must be user, assistant or tool; '
    'got ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
"""
)

TULU_TEMPLATE = (
    _CONTENT_MACRO
    + """\
{%- if tools -%}
{{- '<|system|>\\nYou can call these functions by answering with a JSON object '
    '{"name": ..., "arguments": {...}}:\\n' -}}
{%- for tool in tools -%}
{{- tool | tojson + '\\n' -}}
{%- endfor -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|system|>\\n' + text_of(message.content) + '\\n' -}}
{%- elif message.role == 'user' -%}
{{- '<|user|>\\n' + text_of(message.content) + '\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|assistant|>\\n' + text_of(message.content) -}}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first or text_of(message.content) -%}{{- '\\n' -}}{%- endif -%}
{{- '{"name": "' + fn.name + '", "arguments": ' + args_json(fn.arguments) + '}' -}}
{%- endfor -%}
{%- endif -%}
{{- eos_token + '\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|tool|>\\n' + text_of(message.content) + '\\n' -}}
{%- else -%}
{{- raise_exception('unsupported message role: ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\\n' -}}
{%- endif -%}
"""
)


# Harmony, gpt-oss's format, written from its public description. A system message names the
# model, the reasoning effort (`reasoning_effort`: low | medium | high, default medium) and the
# channels; the request's system prompt and tools go in a developer message (tools as a
# TypeScript-like `namespace functions`); an assistant turn is an analysis message (its
# reasoning: kept only for the turns after the last user message, the tool loop under way, as
# the format asks), commentary preambles and calls (`to=functions.NAME`, ended by <|call|>) or
# a final message; a tool result is a message from `functions.NAME` (found by the tool_call_id
# of the call it answers).
HARMONY_TEMPLATE = (
    _CONTENT_MACRO
    + r"""
{%- macro ts_union(schemas) -%}
{%- for item in schemas -%}{{- ts_type(item) -}}{{- ' | ' if not loop.last -}}{%- endfor -%}
{%- endmacro -%}
{%- macro ts_type(schema) -%}
{%- if schema is not mapping -%}{{- 'any' -}}
{%- elif schema.enum is defined -%}
{%- for value in schema.enum -%}{{- value | tojson -}}{{- ' | ' if not loop.last -}}{%- endfor -%}
{%- elif schema.anyOf is defined -%}{{- ts_union(schema.anyOf) -}}
{%- elif schema.oneOf is defined -%}{{- ts_union(schema.oneOf) -}}
{%- elif schema.type is defined and schema.type is not string -%}
{%- for kind in schema.type -%}{{- ts_type({'type': kind}) -}}{{- ' | ' if not loop.last -}}{%- endfor -%}
{%- elif schema.type == 'string' -%}{{- 'string' -}}
{%- elif schema.type in ('number', 'integer') -%}{{- 'number' -}}
{%- elif schema.type == 'boolean' -%}{{- 'boolean' -}}
{%- elif schema.type == 'null' -%}{{- 'null' -}}
{%- elif schema.type == 'array' -%}{{- (ts_type(schema['items']) if 'items' in schema else 'any') + '[]' -}}
{%- elif schema.type == 'object' and schema.properties -%}{{- '{
' + ts_fields(schema) + '}' -}}
{%- else -%}{{- 'any' -}}
{%- endif -%}
{%- endmacro -%}
{%- macro ts_fields(schema) -%}
{%- for name, prop in schema.properties.items() -%}
{%- if prop is mapping and prop.description -%}{{- '// ' + prop.description + '
' -}}{%- endif -%}
{{- name + ('' if name in (schema.required or []) else '?') + ': ' + ts_type(prop) + ',' -}}
{%- if prop is mapping and prop.default is defined -%}{{- ' // default: ' + prop.default | tojson -}}{%- endif -%}
{{- '
' -}}
{%- endfor -%}
{%- endmacro -%}
{%- macro render_tool(tool) -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{%- if fn.description -%}{{- '// ' + fn.description + '
' -}}{%- endif -%}
{%- if fn.parameters is mapping and fn.parameters.properties -%}
{{- 'type ' + fn.name + ' = (_: {
' + ts_fields(fn.parameters) + '}) => any;

' -}}
{%- else -%}
{{- 'type ' + fn.name + ' = () => any;

' -}}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set sys_offset = 1 if messages and messages[0].role in ('system', 'developer') else 0 -%}
{%- set instructions = text_of(messages[0].content) if sys_offset else '' -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}
{%- if effort not in ('low', 'medium', 'high') -%}
{{- raise_exception('reasoning_effort must be low, medium or high, got ' ~ effort) -}}
{%- endif -%}
{{- '<|start|>system<|message|>' -}}
{{- model_identity if model_identity is defined else 'You are ChatGPT, a large language model trained by OpenAI.' -}}
{{- '
Knowledge cutoff: 2024-06
' -}}
{%- if strftime_now is defined -%}{{- 'Current date: ' + strftime_now('%Y-%m-%d') + '
' -}}{%- endif -%}
{{- '
Reasoning: ' + effort + '

' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "
Calls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if instructions or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if instructions -%}
{{- '# Instructions

' + instructions -}}
{%- if tools -%}{{- '

' -}}{%- endif -%}
{%- endif -%}
{%- if tools -%}
{{- '# Tools

## functions

namespace functions {

' -}}
{%- for tool in tools -%}{{- render_tool(tool) -}}{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for message in messages[sys_offset:] -%}
{%- set index = sys_offset + loop.index0 -%}
{%- if message.role == 'user' -%}
{{- '<|start|>user<|message|>' + text_of(message.content) + '<|end|>' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if reasoning and index > ns.last_user -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' -}}
{%- endif -%}
{%- if message.tool_calls -%}
{%- if text_of(message.content) -%}
{{- '<|start|>assistant<|channel|>commentary<|message|>' + text_of(message.content) + '<|end|>' -}}
{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + fn.name + ' <|constrain|>json<|message|>' -}}
{{- args_json(fn.arguments) + '<|call|>' -}}
{%- endfor -%}
{%- else -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + text_of(message.content) + '<|end|>' -}}
{%- endif -%}
{%- elif message.role == 'tool' -%}
{%- set found = namespace(name=message.name if message.name is string else '') -%}
{%- if message.tool_call_id is defined -%}
{%- for earlier in messages[:index] -%}
{%- for call in earlier.tool_calls or [] -%}
{%- if call.id is defined and call.id == message.tool_call_id -%}
{%- set found.name = (call.function if call.function is defined else call).name -%}
{%- endif -%}
{%- endfor -%}
{%- endfor -%}
{%- endif -%}
{%- if not found.name -%}
{{- raise_exception('a tool message needs the function it answers: the tool_call_id of an earlier '
    'assistant tool call, or a name') -}}
{%- endif -%}
{{- '<|start|>functions.' + found.name + ' to=assistant<|channel|>commentary<|message|>' -}}
{{- text_of(message.content) + '<|end|>' -}}
{%- else -%}
{{- raise_exception('after an optional first system message, roles must be user, assistant or tool; '
    'got ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start|>assistant' -}}
{%- endif -%}
"""
)


# Qwen3.5 / Qwen3.6, written from the family's public description. The system turn lists the
# tools as JSON in <tools></tools>, followed by the system prompt; calls are XML, one
# <parameter=P> block per argument (a string as it is, any other value as JSON), so the
# arguments must be an object; tool results are user turns of <tool_response> blocks (a run
# of tool messages shares one turn). The reasoning of the assistant turns after the last user
# message (the tool loop under way) is kept, in a <think> block that is written even when
# empty (the prompt's own empty block when thinking is off), so a turn renders as the prompt
# plus what the model wrote; earlier turns lose theirs. The generation prompt opens <think>
# unless enable_thinking is false.
QWEN3_5_TEMPLATE = (
    _CONTENT_MACRO
    + r"""
{%- set sys_offset = 1 if messages and messages[0].role == 'system' else 0 -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\n# Tools\n\n'
    'These functions can be called. Their signatures are inside <tools></tools>:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' -}}{{- tool | tojson -}}
{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, answer with this form and nothing after it:\n\n<tool_call>\n'
    '<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n</tool_call>\n\n'
    'Rules:\n- Write each parameter in its own block; a value that is not a string is written as JSON.\n'
    '- Several calls may follow each other; text may come before the first call, never after the last.\n'
    '- If no function is needed, answer without calling one.' -}}
{%- if sys_offset -%}
{{- '\n\n' + text_of(messages[0].content) -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif sys_offset -%}
{{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[sys_offset:] -%}
{%- set index = sys_offset + loop.index0 -%}
{%- if message.role == 'user' -%}
{{- '<|im_start|>user\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set content = text_of(message.content) -%}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if '</think>' in content -%}
{%- if not reasoning -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}{%- endif -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
{%- set content = content.strip() -%}
{{- '<|im_start|>assistant\n' -}}
{%- if index > ns.last_query -%}
{{- '<think>\n' + reasoning.strip() + '\n</think>\n\n' -}}
{%- endif -%}
{{- content -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- '\n' -}}{%- elif content -%}{{- '\n\n' -}}{%- endif -%}
{{- '<tool_call>\n<function=' + fn.name + '>\n' -}}
{%- if fn.arguments is mapping -%}
{%- for name, value in fn.arguments.items() -%}
{{- '<parameter=' + name + '>\n' -}}
{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
{{- '\n</parameter>\n' -}}
{%- endfor -%}
{%- elif fn.arguments is defined and fn.arguments is not none -%}
{{- raise_exception('the arguments of a call to ' ~ fn.name ~ ' must be a JSON object, got ' ~ fn.arguments) -}}
{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if index == sys_offset or messages[index - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
{%- if loop.last or messages[index + 1].role != 'tool' -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- elif message.role == 'system' -%}
{{- raise_exception('a system message must come first') -}}
{%- else -%}
{{- raise_exception('unsupported message role: ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- else -%}
{{- '<think>\n' -}}
{%- endif -%}
{%- endif -%}
"""
)


def chat_template_for(family: str) -> str:
    if family in ("qwen3_moe", "qwen2_moe"):
        return CHATML_TEMPLATE
    if family == "mixtral":
        return MISTRAL_TEMPLATE
    if family == "olmoe":
        return TULU_TEMPLATE
    if family == "gpt_oss":
        return HARMONY_TEMPLATE
    if family in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return QWEN3_5_TEMPLATE
    if family == "qwen3_next":
        return CHATML_TEMPLATE  # Qwen3-Next ships the Hermes JSON form (its Coder model, the XML one)
    raise ValueError(f"unknown family {family!r}; known: {', '.join((*FAMILIES, 'gpt_oss'))}")
