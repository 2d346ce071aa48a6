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


def check_writable(path: str | Path, *, option: str) -> Path:
    """Make sure ``write_atomic(path, ...)`` can succeed, before any work is done for it; nothing is left behind.

    A temporary file is created and deleted in ``path``'s folder, or, when that
    folder is missing (``write_atomic`` creates it), in its nearest existing parent.

    Args:
        path: the file to be written.
        option: the flag that named it, for the message (e.g. "--out").

    Returns:
        ``path``.

    Raises:
        UserError: ``path`` is a folder, a parent of it is a file, or its folder cannot be written.
    """
    from autofit.errors import UserError

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {str(path)!r} is a folder; give the path of a file to write")
    existing = next(folder for folder in (path.absolute().parents) if folder.exists())
    if not existing.is_dir():
        raise UserError(f"{option} {str(path)!r} cannot be written: {str(existing)!r} is a file, not a folder; choose another place")
    try:
        fd, tmp = _create_beside(existing / path.name)
        os.close(fd)
        tmp.unlink()
    except OSError as error:
        raise UserError(f"{option} {str(path)!r} cannot be written ({error.strerror}); choose a writable place") from error
    return path


def move_into(source: str | Path, target: str | Path, *, skip: tuple[str, ...] = ()) -> None:
    """Move every file under ``source`` to the same place under ``target``, each replacing (``os.replace``) only the
    file of its own name: what else ``target`` holds (a file a user put there) stays. ``source`` is deleted after.

    Args:
        skip: names directly under ``source`` that are not moved (a marker of the writer's own).
    """
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        if entry.name in skip:
            continue
        if entry.is_dir() and not entry.is_symlink():
            move_into(entry, target / entry.name)
        else:
            os.replace(entry, target / entry.name)
    for name in skip:
        (source / name).unlink(missing_ok=True)
    source.rmdir()
    _fsync_folder(target)
