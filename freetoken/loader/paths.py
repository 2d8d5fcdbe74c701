"""Which files of a checkpoint directory the loader may open.

A checkpoint names files of its own (the index names its shards), so a downloaded one could
point the loader anywhere: `../../etc/passwd`, an absolute path, a symlink out of the
directory. Every file the loader reads is resolved here and must stay inside the model
directory. One exception keeps the Hugging Face hub cache working: a snapshot directory
(`models--org--name/snapshots/<revision>/`) holds symlinks into the repository's own
`blobs/` folder, which is therefore inside too.
"""

from __future__ import annotations

from pathlib import Path

from freetoken.errors import CheckpointError


def _allowed_roots(model_dir: Path) -> list[Path]:
    root = model_dir.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def checkpoint_file(model_dir: Path, name: str, *, named_in: str | None = None) -> Path:
    """`model_dir / name`, refused (CheckpointError) when it would lead out of the checkpoint.

    `named_in`: where the name came from (`<index file>: weight_map`), for the error message;
    None for the fixed names the loader itself asks for (config.json, tokenizer.json, ...).
    """
    where = named_in or str(model_dir / name)
    if not name or "\x00" in name:
        raise CheckpointError(f"{where}: file name {name!r} is not a valid file name")
    relative = Path(name)
    if relative.is_absolute():
        raise CheckpointError(f"{where}: {name!r} is an absolute path; checkpoint files must be inside {model_dir}")
    path = model_dir / relative
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise CheckpointError(f"{where}: cannot resolve {name!r}: {exc}") from exc
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(model_dir)):
        raise CheckpointError(f"{where}: {name!r} leads outside the checkpoint directory {model_dir}; refused")
    return path


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF model file (or a split model's first part), not a directory."""
    return Path(path).suffix == ".gguf" and not Path(path).is_dir()
