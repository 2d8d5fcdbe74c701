"""Command-line flags generated from the config's fields, so a flag's default and help are written
once, on its field (`cli_flag` in config.py).

A field marked with `cli_flag` becomes `--<field-name>` of its field's type: a Literal gives the
choices, `X | None` takes an X, a bool is a switch (`--no-<field>` when the field is on by default).
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import msgspec

from freetoken.config import EngineConfig, ServerConfig


class _Flag(msgspec.Struct, frozen=True, kw_only=True):
    field: str
    type: Any  # the field's type, without its Annotated metadata
    default: Any
    help: str | None
    group: str
    choices: tuple[str, ...] | None
    exclusive: str | None


def config_flags(config: type[msgspec.Struct]) -> list[_Flag]:
    """The fields of `config` marked as flags, in field order."""
    hints = typing.get_type_hints(config, include_extras=True)
    flags = []
    for field in msgspec.structs.fields(config):
        hint = hints[field.name]
        meta = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        if meta is None or "cli" not in (meta.extra or {}):
            continue
        if field.default is msgspec.NODEFAULT:
            raise TypeError(f"{config.__name__}.{field.name}: a flag's field needs a default (the flag's)")
        cli = meta.extra["cli"]
        flags.append(_Flag(field=field.name, type=typing.get_args(hint)[0], default=field.default,
                           help=meta.description, group=cli["group"], choices=cli["choices"],
                           exclusive=cli["exclusive"]))
    return flags


def _value_type(hint: Any) -> Any:
    """`X | None` -> X; any other type as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _add_flag(container: Any, flag: _Flag) -> None:
    name = flag.field.replace("_", "-")
    value_type = _value_type(flag.type)
    if value_type is bool:
        if flag.default:
            container.add_argument(f"--no-{name}", dest=flag.field, action="store_false", help=flag.help)
        else:
            container.add_argument(f"--{name}", dest=flag.field, action="store_true", help=flag.help)
        return
    kwargs: dict[str, Any] = {"dest": flag.field, "default": flag.default, "help": flag.help}
    if typing.get_origin(value_type) is typing.Literal:
        kwargs["choices"] = list(typing.get_args(value_type))
    elif flag.choices is not None:
        kwargs["choices"] = list(flag.choices)
    if value_type in (int, float):
        kwargs["type"] = value_type
    elif value_type is not str and "choices" not in kwargs:
        raise TypeError(f"{flag.field}: no command-line form for {value_type!r}")
    container.add_argument(f"--{name}", **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser, config: type[msgspec.Struct]) -> None:
    """`config`'s flags, group by group in the order the groups first appear; the flags of one
    `exclusive` set go in one mutually exclusive group."""
    flags = config_flags(config)
    exclusive: dict[str, Any] = {}
    for group in dict.fromkeys(f.group for f in flags):
        # (one group per title: serve's config classes add to the engine's groups)
        same = [g for g in parser._action_groups if g.title == group]
        arguments = (same[0] if same else parser.add_argument_group(group)) if group else parser
        for flag in (f for f in flags if f.group == group):
            container = arguments
            if flag.exclusive is not None:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = arguments.add_mutually_exclusive_group()
                container = exclusive[flag.exclusive]
            _add_flag(container, flag)


def config_from(args: argparse.Namespace, config: type[msgspec.Struct], **fields: Any) -> Any:
    """`config` built from the parsed flags (plus `fields`, for what no flag sets)."""
    return config(**{f.field: getattr(args, f.field) for f in config_flags(config)}, **fields)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags `serve` and `generate` share, then the diagnostics group. The expert
    hierarchy's own parameters (hybrid's ratio, fills and depth) are not flags here:
    `bench decode/prefill --moe-param key=value` sets them."""
    add_config_arguments(parser, EngineConfig)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return config_from(args, EngineConfig)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve`'s own flags: where it listens, then the security group (secrets may come from a
    file or the environment too, so those flags are not fields one to one)."""
    add_config_arguments(parser, ServerConfig)
    sec = parser.add_argument_group("security")
    sec.add_argument("--api-key", default=None,
                     help="required on every route but /health, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                     "(default: $FREETOKEN_API_KEY; none: no key asked)")
    sec.add_argument("--api-key-file", default=None, help="read the API key from this file (kept out of `ps`)")
    sec.add_argument("--admin-token", default=None,
                     help="required (as a bearer token) by POST /v1/cache/resize, and accepted as the API key; "
                     "without it resizing is allowed on a loopback address only (default: $FREETOKEN_ADMIN_TOKEN)")
    sec.add_argument("--admin-token-file", default=None, help="read the admin token from this file")
    sec.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                     help="let web pages from ORIGIN (e.g. http://localhost:3000) call the APIs (CORS; repeatable; "
                     "default: none)")


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    return config_from(
        args,
        ServerConfig,
        api_key=ServerConfig.secret(args.api_key, args.api_key_file, ServerConfig.API_KEY_ENV, "api-key"),
        admin_token=ServerConfig.secret(
            args.admin_token, args.admin_token_file, ServerConfig.ADMIN_TOKEN_ENV, "admin-token"
        ),
        allow_origins=tuple(args.allow_origin),
    )
