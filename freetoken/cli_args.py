"""Command-line flags generated from the config tree's leaves, so a flag's name, default and help
are written once, on its field (`cli_flag`, config_tree.py). serve, generate and the bench
commands all take their engine flags from here.

A leaf marked with `cli_flag` becomes its flag, of the field's type: a Literal gives the choices,
`X | None` takes an X, a bool is a switch (`--no-<name>` when the field is on by default).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from typing import Any

import msgspec

from freetoken.config import EngineConfig, ServerConfig
from freetoken.config_tree import Leaf, leaves, nested


def config_flags(config: type[msgspec.Struct], only: Iterable[str] | None = None) -> list[Leaf]:
    """The leaves of `config` that are flags, in tree order; `only`: just these flags (as typed)."""
    flags = [leaf for leaf in leaves(config) if leaf.flag is not None]
    if only is None:
        return flags
    wanted = set(only)
    unknown = wanted - {leaf.flag for leaf in flags}
    if unknown:
        raise TypeError(f"{config.__name__} has no flags {sorted(unknown)}")
    return [leaf for leaf in flags if leaf.flag in wanted]


def _value_type(hint: Any) -> Any:
    """`X | None` -> X; any other type as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _add_flag(container: Any, flag: Leaf, help: str | None) -> None:
    assert flag.flag is not None
    value_type = _value_type(flag.type)
    if value_type is bool:
        if flag.flag.startswith("--no-") != bool(flag.default):
            raise TypeError(f"{flag.path}: a switch is --no-<name> exactly when its field is on by default")
        action = "store_false" if flag.default else "store_true"
        container.add_argument(flag.flag, dest=flag.dest, action=action, help=help)
        return
    kwargs: dict[str, Any] = {"dest": flag.dest, "default": flag.default, "help": help}
    if typing.get_origin(value_type) is typing.Literal:
        kwargs["choices"] = list(typing.get_args(value_type))
    elif flag.choices is not None:
        kwargs["choices"] = list(flag.choices)
    if value_type in (int, float):
        kwargs["type"] = value_type
    elif value_type is not str and "choices" not in kwargs:
        raise TypeError(f"{flag.path}: no command-line form for {value_type!r}")
    container.add_argument(flag.flag, **kwargs)


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config: type[msgspec.Struct],
    only: Iterable[str] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """`config`'s flags (`only`: just these), group by group in the order the groups first appear;
    the flags of one `exclusive` set go in one mutually exclusive group. `helps` replaces a flag's
    help where a command uses it in its own way."""
    flags = config_flags(config, only)
    helps = helps or {}
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
            _add_flag(container, flag, helps.get(flag.flag, flag.help))


def config_from(
    args: argparse.Namespace, config: type[msgspec.Struct], only: Iterable[str] | None = None, **fields: Any
) -> Any:
    """`config` built from the parsed flags (`only`: just these; the others keep their defaults),
    plus top-level `fields`, for what no flag sets."""
    values = {leaf.path: getattr(args, leaf.dest) for leaf in config_flags(config, only)}
    return msgspec.convert({**nested(values), **fields}, config)


def add_engine_arguments(
    parser: argparse.ArgumentParser, only: Iterable[str] | None = None, helps: dict[str, str] | None = None
) -> None:
    """The engine flags (`only`: the ones a bench command takes), then the diagnostics group. The
    expert hierarchy's own parameters (hybrid's ratio, fills and depth) are not flags here:
    `bench decode/prefill --moe-param key=value` sets them."""
    add_config_arguments(parser, EngineConfig, only, helps)


def engine_config_from(args: argparse.Namespace, only: Iterable[str] | None = None) -> EngineConfig:
    return config_from(args, EngineConfig, only)


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
