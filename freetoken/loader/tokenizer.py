"""The tokenizer the engine uses: a `tokenizers` fast tokenizer plus the chat template.

Reads a Hugging Face checkpoint's tokenizer files directly (no transformers at run time) and
behaves like transformers' tokenizer where it matters to a server: special tokens written in
the text are recognised, and chat templates render exactly as `apply_chat_template` does
(same sandboxed Jinja environment, same filters and globals, same variables).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken.errors import CheckpointError, RequestError
from freetoken.loader.json_fields import JsonFields, read_json_object
from freetoken.loader.paths import checkpoint_file, is_gguf

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(root: Path, name: str) -> dict[str, Any]:
    """An optional JSON file of the checkpoint ({} when absent)."""
    path = checkpoint_file(root, name)
    return read_json_object(path) if path.is_file() else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in training templates):
    renders its body unchanged, as transformers does outside assistant-mask mode."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Like transformers' filter: no HTML escaping (unlike Jinja's built-in tojson), optional indent.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _checked_template(source: str, where: str) -> str:
    """A chat template that compiles; a broken one is the checkpoint's fault, refused at load
    rather than failing every chat request."""
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"{where}: invalid Jinja template (line {exc.lineno}): {exc.message}") from exc
    return source


class Tokenizer:
    """A checkpoint's tokenizer and chat template."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | dict[str, str] | None,
        special_tokens: dict[str, str],
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        source: str = "",
    ) -> None:
        self._tok = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # named special tokens (bos_token, eos_token, ...)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.source = source

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer:
        """A checkpoint directory's tokenizer, or the one a GGUF file carries."""
        if is_gguf(path):
            from freetoken.loader.gguf_file import GgufFile
            from freetoken.loader.gguf_tokenizer import tokenizer_fields

            fields = tokenizer_fields(GgufFile(path))
            if fields["chat_template"] is not None:
                fields["chat_template"] = _checked_template(fields["chat_template"], f"{path}: tokenizer.chat_template")
            return cls(**fields)
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as FastTokenizer

        root = Path(model_dir)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory")
        tok_path = checkpoint_file(root, "tokenizer.json")
        if not tok_path.is_file():
            raise CheckpointError(f"{tok_path}: not found (only tokenizer.json tokenizers are supported)")
        try:
            backend = FastTokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise CheckpointError(f"{tok_path}: cannot load tokenizer: {exc}") from exc
        tok_cfg = _read_json(root, "tokenizer_config.json")
        gen_cfg = JsonFields(_read_json(root, "generation_config.json"), str(root / "generation_config.json"))
        model_cfg = JsonFields(_read_json(root, "config.json"), str(root / "config.json"))

        # Where transformers 5 saves templates (chat_template.jinja, plus named ones under
        # additional_chat_templates/), else the older tokenizer_config.json entry.
        template: str | dict[str, str] | None
        jinja_path = checkpoint_file(root, "chat_template.jinja")
        if jinja_path.is_file():
            template = _checked_template(_read_text(jinja_path), str(jinja_path))
        else:
            template = cls._template_from_config(tok_cfg, root / "tokenizer_config.json")
        extra_dir = root / "additional_chat_templates"
        if extra_dir.is_dir():
            named = {
                p.stem: _checked_template(_read_text(checkpoint_file(root, str(p.relative_to(root)))), str(p))
                for p in sorted(extra_dir.glob("*.jinja"))
            }
            if named:
                base = {"default": template} if isinstance(template, str) else (template or {})
                template = {**named, **base}

        special = {}
        for key in _NAMED_SPECIAL:
            text = _token_text(tok_cfg.get(key))
            if text is not None:
                special[key] = text

        def id_of(token: str | None) -> int | None:
            return None if token is None else backend.token_to_id(token)

        # Generation stops at any of generation_config's eos ids and at the tokenizer's eos.
        eos: list[int] = []
        for i in [*gen_cfg.integers("eos_token_id"), id_of(special.get("eos_token"))]:
            if i is not None and i not in eos:
                eos.append(i)
        if not eos:
            eos = model_cfg.integers("eos_token_id")

        if "bos_token" in tok_cfg:
            bos = id_of(special.get("bos_token"))
        else:
            ids = gen_cfg.integers("bos_token_id") or model_cfg.integers("bos_token_id")
            bos = ids[0] if ids else None

        return cls(
            backend,
            chat_template=template,
            special_tokens=special,
            eos_token_ids=tuple(eos),
            bos_token_id=bos,
            source=str(root),
        )

    @staticmethod
    def _template_from_config(tok_cfg: dict[str, Any], path: Path) -> str | dict[str, str] | None:
        raw = tok_cfg.get("chat_template")
        if raw is None:
            return None
        if isinstance(raw, str):
            return _checked_template(raw, f"{path}: chat_template")
        if isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
            out: dict[str, str] = {}
            for item in raw:
                if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                    raise CheckpointError(f"{path}: chat_template list entries need 'name' and 'template'")
                if not isinstance(item.get("template"), str):
                    raise CheckpointError(f"{path}: chat_template {item['name']!r} has no template string")
                out[item["name"]] = _checked_template(item["template"], f"{path}: chat_template {item['name']!r}")
            return out
        raise CheckpointError(f"{path}: chat_template must be a string or a list, got {type(raw).__name__}")

    def check_model_vocab(self, model_vocab: int) -> None:
        """Refuse a tokenizer whose ids the model's embedding has no rows for."""
        gguf = is_gguf(self.source)  # a GGUF file holds what a directory keeps in three files
        if self.vocab_size > model_vocab:
            where, limit = (
                (f"{self.source}: tokenizer.ggml.tokens", "token_embd.weight's rows")
                if gguf else (f"{Path(self.source) / 'tokenizer.json'}: vocabulary", "config.json's vocab_size")
            )
            raise CheckpointError(f"{where}: {self.vocab_size} tokens, more than {limit} ({model_vocab})")
        outside = [i for i in self.eos_token_ids if i >= model_vocab]
        if outside:
            where = (
                f"{self.source}: tokenizer.ggml.eos_token_id" if gguf
                else f"{Path(self.source) / 'generation_config.json'}: eos_token_id"
            )
            raise CheckpointError(
                f"{where}: {outside} is outside the model's vocabulary (vocab_size {model_vocab})"
            )

    # -- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text become their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        pad = self.special_tokens.get("pad_token")
        return None if pad is None else self._tok.token_to_id(pad)

    # -- chat ------------------------------------------------------------------------------

    def get_chat_template(self, tools: list[dict] | None = None) -> str:
        template = self.chat_template
        if template is None:
            raise RequestError(
                "this model has no chat template; send a plain completion request instead", param="messages"
            )
        if isinstance(template, dict):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise RequestError(
                f"this model has several chat templates ({', '.join(sorted(template))}) "
                "and none is named 'default'",
                param="messages",
            )
        return template

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt text, as transformers'
        `apply_chat_template(..., tokenize=False)` would. Template errors become RequestError."""
        compiled = _compile_template(self.get_chat_template(tools))  # checked when the tokenizer loaded
        # Same variables as transformers: the named special tokens, then the caller's kwargs.
        variables: dict[str, Any] = {"documents": None, **self.special_tokens, **kwargs}
        try:
            return compiled.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template error: {exc}", param="messages") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise RequestError(f"chat template failed on these messages: {exc}", param="messages") from exc

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, eos={list(self.eos_token_ids)})"
