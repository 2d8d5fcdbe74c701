"""Typed reads of a checkpoint's JSON files: every bad value names its file and field.

JSON from a download can hold anything: a string where a count belongs, `true` where a size
belongs (Python's bool is an int), `-1` layers. `int("2")` or `bool("false")` would pass such a
value on silently or fail far from its cause; these readers refuse it at load instead, as
`<file>: <field>: <problem>`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from freetoken.errors import CheckpointError


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


class JsonFields:
    """Reads fields of one JSON object, raising CheckpointError that names `source` and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {field}: {problem}")

    def present(self, *names: str) -> str | None:
        """The first of `names` with a non-null value, or None."""
        return next((n for n in names if self.raw.get(n) is not None), None)

    def _int(self, name: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"expected an integer, got {_kind(value)}")
        if value < minimum:
            raise self.error(name, f"must be at least {minimum}, got {value}")
        return value

    def integer(self, *names: str, minimum: int = 1, default: int | None = None) -> int:
        """The first present of `names` (aliases across families) as an int >= minimum."""
        name = self.present(*names)
        if name is None:
            if default is None:
                raise self.error(names[0], "missing")
            return default
        return self._int(name, self.raw[name], minimum)

    def optional_integer(self, name: str, minimum: int = 0) -> int | None:
        value = self.raw.get(name)
        return None if value is None else self._int(name, value, minimum)

    def integers(self, name: str, minimum: int = 0) -> list[int]:
        """An int, a list of ints, or null (as eos_token_id is written) -> list."""
        value = self.raw.get(name)
        if value is None:
            return []
        if isinstance(value, list):
            return [self._int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]
        return [self._int(name, value, minimum)]

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"expected true or false, got {_kind(value)}")
        return value

    def positive_number(self, name: str, default: float | None) -> float | None:
        """A finite number > 0 (JSON ints count), the default when absent or null."""
        value = self.raw.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(name, f"expected a number, got {_kind(value)}")
        if not math.isfinite(value) or value <= 0:
            raise self.error(name, f"must be a finite number > 0, got {value}")
        return float(value)

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(name, f"expected a string, got {_kind(value)}")
        return value

    def object(self, *names: str) -> JsonFields | None:
        """The first present of `names` as a nested object (its fields named `outer.inner`)."""
        name = self.present(*names)
        if name is None:
            return None
        value = self.raw[name]
        if not isinstance(value, dict):
            raise self.error(name, f"expected an object, got {_kind(value)}")
        return JsonFields(value, f"{self.source}: {name}")
