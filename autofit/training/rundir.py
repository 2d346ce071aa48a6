"""A run's folder (its ``--log-dir``): one run holds it at a time, and a new run never writes over an earlier one's files.

``hold_run_directory`` takes an OS-level lock (``fcntl.flock`` on
``.autofit.lock``, released by the kernel when the process ends, however it
ends, and not kept by the processes it forks) for as long as the run trains; a second run in the folder is refused
with one line naming the holder. Holding it, the run cleans up what a killed
run may have left half-done: temporary files of ``autofit.atomic.write_atomic``
and an interrupted replacement of ``last_sharded/``.

A folder holds a run when it has ``last.pt``, ``best.pt``, ``last_sharded/``
or a non-empty ``metrics.jsonl``; a new run there (not ``--resume``) is
refused unless asked to ``overwrite``, which moves those files aside to
``.previous/`` and deletes them only once the new run has saved its first
checkpoint: a new run that fails before (a bad plan, a loss that raises, a
signal, a kill) gives the folder back to the earlier run.

The run's copy of its plan is ``run_plan.json`` (``RUN_PLAN``), not
``plan.json``: a plan.json in the folder (``autofit plan``'s, perhaps another
model's) is never replaced.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autofit.atomic import move_into
from autofit.errors import UserError

LOCK_FILE = ".autofit.lock"
"""The file a run holds the lock on (it stays when the run ends; the lock does not)."""

RUN_FILES = ("last.pt", "best.pt", "last_sharded", "metrics.jsonl")
"""What a run writes that a new run must not lose (metrics.jsonl only when it holds a record)."""

RUN_PLAN = "run_plan.json"
"""The plan the run trains with (rewritten when it changes): not ``plan.json``, the name ``autofit plan`` writes."""

PREVIOUS = ".previous"
"""Where ``--overwrite`` keeps the earlier run's files until the new run has saved its first checkpoint."""

HF_COMPLETE = ".complete"
"""The mark ``hf_export`` leaves in a whole ``hf.partial/`` before it moves the files into ``hf/``."""

HF_OWNED = ".autofit-files.json"
"""In ``hf/``: the files the run wrote there (paths relative to ``hf/``), so that ``--overwrite`` sets aside and
deletes only those; anything else in ``hf/`` (a model card) is the user's and stays."""

_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")
"""``write_atomic``'s temporary names: ``.<name>.<8 hex digits>.tmp``."""

_HELD_LOCKS: set[int] = set()
"""File descriptors of the locks this process holds now."""


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker): let go of the parent's locks.

    flock belongs to the open file, which a fork shares: a worker that
    outlives a killed run would hold its folder for seconds, and an immediate
    ``--resume`` would be refused naming a dead process. Each inherited
    descriptor is pointed at /dev/null instead of closed, so that the number
    stays taken until the child's copy of the file object closes it.
    """
    if not _HELD_LOCKS:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in _HELD_LOCKS:
        os.dup2(null, fd)
    os.close(null)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork (and no flock)
    os.register_at_fork(after_in_child=_drop_inherited_locks)


@contextmanager
def hold_run_directory(log_dir: Path, *, holder: bool = True) -> Iterator[Path]:
    """Hold ``log_dir`` for one run: create it, lock it, tidy what a killed run left.

    Args:
        log_dir: the run's folder; created when missing.
        holder: False in processes that write no files of their own there
            (ranks other than 0): they neither lock nor tidy.

    Yields:
        ``log_dir``.

    Raises:
        UserError: ``log_dir`` is a file, cannot be created or written, or
            another run holds it (the line names its process and host).
    """
    if not holder:
        yield log_dir
        return
    _make_folder(log_dir)
    lock_path = log_dir / LOCK_FILE
    try:
        lock = open(lock_path, "a+")
    except OSError as error:
        raise UserError(f"--log-dir {str(log_dir)!r} cannot be written ({error.strerror}); choose a writable folder") from error
    try:
        _lock(lock, log_dir)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        _HELD_LOCKS.add(lock.fileno())
        remove_leftovers(log_dir)
        yield log_dir
    finally:
        _HELD_LOCKS.discard(lock.fileno())
        lock.close()  # closing the file releases the lock


def _make_folder(log_dir: Path) -> None:
    if log_dir.exists() and not log_dir.is_dir():
        raise UserError(f"--log-dir {str(log_dir)!r} is a file, not a folder; give a folder for the run's files")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--log-dir {str(log_dir)!r} cannot be created ({error.strerror}); choose a writable folder") from error


def _lock(lock, log_dir: Path) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the folder is not locked
        return

    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise UserError(f"--log-dir {str(log_dir)!r} cannot be locked ({error.strerror}); choose a folder on a local disk") from error
        lock.seek(0)
        holder = lock.read().strip() or "a process that has not said which"
        raise UserError(
            f"{log_dir} is in use by another run ({holder}); wait for it to end or stop it, or give another --log-dir"
        ) from None


def remove_leftovers(log_dir: Path) -> list[str]:
    """Delete what a run killed while saving left behind; put back ``last_sharded/`` if it was mid-replacement.

    Only call this holding the folder (``hold_run_directory``): another run's
    temporary files would be in use.

    Returns:
        The names deleted.
    """
    removed = []
    for entry in log_dir.iterdir():
        if _TEMPORARY.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if (log_dir / PREVIOUS).is_dir():  # an --overwrite run was killed: before its first save, or just after it
        saved = (log_dir / "last.pt").exists() or (log_dir / "last_sharded").exists()
        discard_previous_run(log_dir) if saved else restore_previous_run(log_dir)
    sharded, previous = log_dir / "last_sharded", log_dir / "last_sharded.previous"
    if previous.is_dir() and not sharded.exists():
        previous.rename(sharded)  # killed between moving the old save aside and moving the new one in
    if (log_dir / "hf.old").is_dir() and not (log_dir / "hf").exists():
        (log_dir / "hf.old").rename(log_dir / "hf")  # an earlier autofit killed between moving hf/ aside and the new one in
    if (log_dir / "hf.partial" / HF_COMPLETE).is_file():  # killed while moving a whole save into hf/: finish it
        move_into(log_dir / "hf.partial", log_dir / "hf", skip=(HF_COMPLETE,))
    for name in ("last_sharded.partial", "last_sharded.previous", "hf.partial", "hf.old"):
        if (log_dir / name).is_dir():
            shutil.rmtree(log_dir / name, ignore_errors=True)
            removed.append(name)
    return removed


def run_files(log_dir: Path) -> list[str]:
    """The names of an earlier run's files in ``log_dir`` (``RUN_FILES``), in that order."""
    found = []
    for name in RUN_FILES:
        path = log_dir / name
        if name == "metrics.jsonl":
            if path.is_file() and path.stat().st_size > 0:
                found.append(name)
        elif path.exists():
            found.append(name)
    return found


def log_dir_path(value: str | Path | None) -> Path | None:
    """The folder ``--log-dir`` names (None: not given, runs/<date>-<time>).

    Raises:
        UserError: an empty name, which Path would take for the current folder.
    """
    if isinstance(value, str) and not value.strip():
        raise UserError(f"--log-dir {value!r} names no folder; give one (e.g. runs/NAME), or leave it out for runs/<date>-<time>")
    return Path(value) if value is not None else None


def check_fresh_start(log_dir: Path, *, overwrite: bool) -> list[str]:
    """Refuse a new run in a folder that holds one, unless asked to ``overwrite`` it (``fit`` asks before planning).

    Returns:
        The earlier run's files (``run_files``); none in a folder that holds no run.

    Raises:
        UserError: the folder holds an earlier run's files and ``overwrite`` is False.
    """
    found = run_files(log_dir)
    if found and not overwrite:
        resume = "continue it with --resume, " if "last.pt" in found else ""
        raise UserError(
            f"{log_dir} already holds a run ({', '.join(found)}); {resume}give another --log-dir, "
            "or --overwrite to delete its files and start again"
        )
    return found


def start_fresh(log_dir: Path, *, overwrite: bool) -> None:
    """Make sure a new run loses nothing: refuse a folder that holds a run, or with ``overwrite`` move that run's files
    (and its run_plan.json, its own files in hf/ and TensorBoard events) aside to ``.previous/`` (``discard_previous_run`` deletes them
    once the new run has saved; ``restore_previous_run`` puts them back if it never does).

    Raises:
        UserError: the folder holds an earlier run's files and ``overwrite`` is False.
    """
    found = check_fresh_start(log_dir, overwrite=overwrite)
    if not found:
        return
    aside = log_dir / PREVIOUS
    aside.mkdir()
    extras = [log_dir / RUN_PLAN, *log_dir.glob("events.out.tfevents.*")]
    for path in [*(log_dir / name for name in found), *(path for path in extras if path.exists())]:
        path.rename(aside / path.name)
    _set_aside_hf(log_dir / "hf", aside / "hf")


def _set_aside_hf(hf: Path, aside: Path) -> None:
    """Move the earlier run's files in ``hf`` to ``aside``: those its ``HF_OWNED`` lists, or all of ``hf`` when it
    lists none (a run from before the list); the user's own files stay where they are."""
    owned = hf / HF_OWNED
    if not owned.is_file():
        if hf.exists():
            hf.rename(aside)
        return
    try:
        names = [str(name) for name in json.loads(owned.read_text(encoding="utf-8"))]
    except (ValueError, UnicodeDecodeError):  # an unreadable list: keep every file, as the run's
        hf.rename(aside)
        return
    for name in [*names, HF_OWNED]:
        source = hf / name
        if source.is_file() and hf.resolve() in source.resolve().parents:
            (aside / name).parent.mkdir(parents=True, exist_ok=True)
            source.rename(aside / name)
    for folder in sorted((p for p in hf.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()  # emptied of the run's files


def discard_previous_run(log_dir: Path) -> None:
    """The new run saved its first checkpoint: the files ``--overwrite`` moved aside go."""
    shutil.rmtree(log_dir / PREVIOUS, ignore_errors=True)


def restore_previous_run(log_dir: Path) -> bool:
    """A new run that ``--overwrite`` started ended before its first checkpoint: put the earlier run's files back.

    Returns:
        Whether there was an earlier run to put back.
    """
    aside = log_dir / PREVIOUS
    if not aside.is_dir():
        return False
    for events in log_dir.glob("events.out.tfevents.*"):  # the new run's
        events.unlink()
    for entry in aside.iterdir():
        target = log_dir / entry.name
        if entry.name == "hf" and target.is_dir():  # the user's files stayed in hf/: the run's go back beside them
            move_into(entry, target)
            continue
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        entry.rename(target)
    aside.rmdir()
    return True
