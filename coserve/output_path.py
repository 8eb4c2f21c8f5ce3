"""A command's output, its directory made before the work that fills it: a path that cannot be written is refused at
once, naming the flag, rather than after minutes of measuring (or a whole batch of answers) are lost."""

from __future__ import annotations

from pathlib import Path


def prepare_directory(flag: str, path: str | Path) -> Path:
    """The directory ``path``, made; ValueError naming ``flag`` when it cannot be."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}: cannot make {path} ({e.strerror or e})") from e
    return path


def prepare_output(flag: str, path: str | Path | None) -> Path | None:
    """The file ``path`` with its directory made (None stays None); ValueError naming ``flag`` when it cannot be."""
    if path is None:
        return None
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}: cannot make the directory of {path} ({e.strerror or e})") from e
    return path
