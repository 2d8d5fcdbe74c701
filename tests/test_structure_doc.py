"""docs/structure.md lists every module of freetoken/, one short line each, and nothing else.

A module entry is a line `- `path/to/module.py` — what it is`, its path relative to freetoken/.
Every `.py` file under freetoken/ is a module to list, except a package's `__init__.py` that
holds nothing but a docstring.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "freetoken"
STRUCTURE = ROOT / "docs" / "structure.md"
ENTRY = re.compile(r"^- `([^`]+\.py)` — \S")
MAX_ENTRY_CHARS = 120


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return not body


def modules_in_tree() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and _only_a_docstring(path):
            continue
        found.add(path.relative_to(PACKAGE).as_posix())
    return found


def entries() -> list[tuple[int, str, str]]:
    """(line number, module path, whole line) of every module entry in docs/structure.md."""
    lines = STRUCTURE.read_text(encoding="utf-8").splitlines()
    return [(n, m.group(1), line) for n, line in enumerate(lines, 1) if (m := ENTRY.match(line))]


def test_structure_doc_lists_exactly_the_modules_in_the_tree():
    listed = [path for _, path, _ in entries()]
    tree = modules_in_tree()
    missing = sorted(tree - set(listed))
    extra = sorted(set(listed) - tree)
    twice = sorted({path for path in listed if listed.count(path) > 1})
    problems = []
    if missing:
        problems.append("modules under freetoken/ that docs/structure.md does not list "
                        "(add a line `- `PATH` — what it is`):\n  " + "\n  ".join(missing))
    if extra:
        problems.append("modules docs/structure.md lists that freetoken/ does not have "
                        "(moved or deleted: fix or drop the line):\n  " + "\n  ".join(extra))
    if twice:
        problems.append("modules listed more than once:\n  " + "\n  ".join(twice))
    assert not problems, "\n".join(problems)


def test_structure_doc_entries_are_one_short_line():
    long = [f"line {n} ({len(line)} chars): {path}" for n, path, line in entries() if len(line) > MAX_ENTRY_CHARS]
    assert not long, f"module entries over {MAX_ENTRY_CHARS} characters:\n  " + "\n  ".join(long)
