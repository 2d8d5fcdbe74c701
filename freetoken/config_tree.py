"""The configuration as a tree of frozen structs, and its leaves.

A leaf is a field that is not itself a config struct; it is named by its dotted path
(`moe.cache_slots`). Each leaf carries its default (written once, on the field) and one of two
markers: `cli_flag` (the command-line flag that sets it; cli_args.py builds the parsers from
these) or `no_flag` (set by the library, the bench commands or tests only, with the reason).
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec

MOE_GROUP = "expert hierarchy"
DIAGNOSTICS = "diagnostics"


def cli_flag(
    flag: str,
    help: str | None = None,
    *,
    group: str = "",
    choices: tuple[str, ...] | None = None,
    exclusive: str | None = None,
) -> msgspec.Meta:
    """Marks a config field as a command-line flag: the flag as typed (`--no-<name>` for a switch
    that is on by default), its help, its help group ("" for the command's own options), choices
    where the type does not name them, and a mutually exclusive set it belongs to. The flag's
    default is the field's default."""
    return msgspec.Meta(
        description=help, extra={"cli": {"flag": flag, "group": group, "choices": choices, "exclusive": exclusive}}
    )


def no_flag(why: str) -> msgspec.Meta:
    """Marks a config field that no command-line flag sets, saying who sets it instead."""
    return msgspec.Meta(description=why, extra={"no_flag": True})


class Leaf(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # dotted, from the root config
    type: Any  # the field's type, without its Annotated metadata
    default: Any
    flag: str | None  # None: a no_flag field
    help: str | None
    group: str
    choices: tuple[str, ...] | None
    exclusive: str | None

    @property
    def dest(self) -> str:
        """The parsed flag's attribute (what argparse names it: `--no-pdl` -> `pdl`)."""
        assert self.flag is not None
        return self.flag.removeprefix("--").removeprefix("no-").replace("-", "_")


def is_config(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def leaves(config: type[msgspec.Struct], prefix: str = "") -> list[Leaf]:
    """Every leaf of `config`, depth first in field order. TypeError names a leaf without a default
    or without a marker."""
    hints = typing.get_type_hints(config, include_extras=True)
    found = []
    for field in msgspec.structs.fields(config):
        path = f"{prefix}{field.name}"
        hint = hints[field.name]
        if is_config(hint):
            found += leaves(hint, f"{path}.")
            continue
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            raise TypeError(f"{config.__name__}.{field.name}: a config leaf needs a default")
        meta = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        extra = (meta.extra or {}) if meta is not None else {}
        if "cli" not in extra and "no_flag" not in extra:
            raise TypeError(f"{config.__name__}.{field.name}: mark the field with cli_flag(...) or no_flag(...)")
        cli = extra.get("cli", {})
        found.append(Leaf(path=path, type=typing.get_args(hint)[0], default=default, flag=cli.get("flag"),
                          help=meta.description if cli else None, group=cli.get("group", ""),
                          choices=cli.get("choices"), exclusive=cli.get("exclusive")))
    return found


def value_at(config: msgspec.Struct, path: str) -> Any:
    for name in path.split("."):
        config = getattr(config, name)
    return config


def nested(values: dict[str, Any]) -> dict[str, Any]:
    """{"moe.cache_slots": 4} -> {"moe": {"cache_slots": 4}} (what msgspec.convert takes)."""
    tree: dict[str, Any] = {}
    for path, value in values.items():
        *parents, name = path.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tree
