"""``write_atomic``: replace a file so that a crash leaves the old one or the new one, never half of one.

Every file autofit replaces goes through it: plan.json, last.pt and best.pt,
metrics.jsonl when a resumed run cuts it back, compare.md and compare.json.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | Path, content: str | bytes | Callable[[BinaryIO], None]) -> Path:
    """Write ``content`` to a temporary file beside ``path``, then rename it over ``path``.

    The temporary file is flushed to disk (fsync) before the rename, and the
    folder after it, so that neither the content nor the rename is lost to a
    power cut. The file gets the permissions a plain ``open(path, "w")`` gives
    (0o666 less the umask).

    Args:
        path: the file to write; its folder is created when missing.
        content: text (written as UTF-8), bytes, or a function that writes to
            the open binary file, e.g. ``lambda file: torch.save(obj, file)``.

    Returns:
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_beside(path)
    try:
        with os.fdopen(fd, "wb") as file:
            if callable(content):
                content(file)
            else:
                file.write(content.encode("utf-8") if isinstance(content, str) else content)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def _create_beside(path: Path) -> tuple[int, Path]:
    """A new, uniquely named file in ``path``'s folder, opened for writing.

    Not ``tempfile.mkstemp``: its files are private (0o600) whatever the umask.
    """
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; Windows cannot open a folder to fsync it)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
