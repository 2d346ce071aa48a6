"""Progress lines, and a heartbeat between them: no long silence while one step runs.

A step that takes minutes (a trace of a large model, a timing round, a simulated probe) used to say nothing until
it ended: one trace of a Mamba-style model's plan was silent for 211 s, and users read a silence that long as a
hang (issue #47). A ``Heartbeat`` passes every progress line on and keeps the stack of what runs now
(``doing``: "tracing fp32 at micro-batch 4", 2 of 9); while it is ``beating``, a daemon thread writes
"still tracing fp32 at micro-batch 4 (2 of 9): 24 s so far" whenever no line has gone out for ``INTERVAL_S``.

``QUIET`` is progress turned off (``--quiet``, a call without a log): the same calls, nothing said, no thread.
A ``Progress`` is itself a log (calling it says a line), so a command's heartbeat can be handed on where a log
callable is taken (``as_progress`` keeps it): one heartbeat, one thread, for the whole command.

Example:
    >>> progress = as_progress(print_progress, started_s=time.perf_counter())
    >>> with progress.beating(), progress.doing("tracing fp32 at micro-batch 4", step=2, of=9):
    ...     progress("memory: tracing fp32")  # a line: "[   0.0 s] memory: tracing fp32"; the heartbeat's clock restarts
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

INTERVAL_S = 10.0
"""Seconds without a line after which the heartbeat says what is still running (read when a ``Heartbeat`` is made;
a test lowers it)."""
_JOIN_S = 5.0
"""How long the end of ``beating`` waits for the thread; it wakes at once (it waits on the stop event), unless a
line it is writing blocks."""


class Progress:
    """Progress that says nothing: the calls every step reports through, and what ``--quiet`` gets.

    Calling it with a line is ``say``: a ``Progress`` goes wherever a log callable does.
    """

    def __call__(self, line: str) -> None:
        self.say(line)

    def say(self, line: str) -> None:
        """A progress line."""

    def doing(self, what: str, *, step: int | None = None, of: int | None = None) -> AbstractContextManager[None]:
        """What runs inside, for the heartbeat's line: ``what``, and with ``step`` and ``of`` "(step of of)"."""
        return nullcontext()

    def beating(self) -> AbstractContextManager[None]:
        """Inside, a silence of ``interval_s`` is broken by a line saying what is still running; nested, the
        outermost starts the heartbeat and stops it."""
        return nullcontext()

    def paused(self) -> AbstractContextManager[None]:
        """Inside, the heartbeat writes nothing (a fork must not copy a line half written; another heartbeat may
        speak for the step inside)."""
        return nullcontext()


QUIET = Progress()
"""Progress turned off."""


@dataclass(eq=False, slots=True)
class _Doing:
    text: str
    started_s: float
    """``time.monotonic()`` when it began."""


class Heartbeat(Progress):
    """Progress lines passed on to ``log``, and while ``beating``, a line from a daemon thread whenever none went
    out for ``interval_s``: "still <what runs now>: N s so far".

    Lines go out one at a time under one lock, the main thread's and the heartbeat's alike, so two never mix.

    Args:
        log: receives the lines (from the heartbeat's thread too).
        interval_s: the silence that makes a heartbeat line (default ``INTERVAL_S``).
    """

    def __init__(self, log: Callable[[str], None], *, interval_s: float | None = None) -> None:
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self._log = log
        self._lock = threading.Lock()
        self._doing: list[_Doing] = []
        self._last_s = time.monotonic()
        """When the last line went out, the heartbeat's too."""
        self._said_s: float | None = None
        """When the last line was said (None: none yet)."""
        self._paused = 0
        self._beats = 0
        """How many ``beating`` blocks are open (the thread runs while there is one)."""
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def say(self, line: str) -> None:
        with self._lock:
            self._log(line)
            self._last_s = self._said_s = time.monotonic()

    @contextmanager
    def doing(self, what: str, *, step: int | None = None, of: int | None = None) -> Iterator[None]:
        doing = _Doing(text=what if step is None else f"{what} ({step} of {of})", started_s=time.monotonic())
        with self._lock:
            self._doing.append(doing)
        try:
            yield
        finally:
            with self._lock:
                self._doing.remove(doing)

    @contextmanager
    def beating(self) -> Iterator[None]:
        with self._lock:
            self._beats += 1
            if self._beats == 1:
                self._last_s = time.monotonic()
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._beat, args=(self._stop,), name="autofit-heartbeat", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._beats -= 1
                stop, thread = (self._stop, self._thread) if self._beats == 0 else (None, None)
            if stop is not None:  # joined outside the lock: the thread may be waiting for it
                stop.set()
                thread.join(timeout=_JOIN_S)

    @contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:  # once held, no heartbeat line is half written, and none starts until the end
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last_s = time.monotonic()

    def _beat(self, stop: threading.Event) -> None:
        """The heartbeat's thread: wake when the silence reaches ``interval_s``, say what is still running, until
        ``stop``."""
        while True:
            with self._lock:
                left_s = self._last_s + self.interval_s - time.monotonic()
                if left_s <= 0 and not self._paused and not stop.is_set():
                    try:
                        self._log(self._still())
                    except (OSError, ValueError):  # the stream is gone (a closed pipe or file): nothing more can be said
                        return
                    self._last_s = time.monotonic()
                if left_s <= 0:
                    left_s = self.interval_s
            if stop.wait(timeout=left_s):
                return

    def _still(self) -> str:
        """The heartbeat's line: every step running now, outermost first, and how long the innermost has run."""
        now = time.monotonic()
        if not self._doing and self._said_s is None:
            return "still starting"
        if not self._doing:
            return f"still working on the step above: {now - self._said_s:.0f} s so far"
        return f"still {', '.join(d.text for d in self._doing)}: {now - self._doing[-1].started_s:.0f} s so far"


def stamped(log: Callable[[str], None], *, started_s: float) -> Callable[[str], None]:
    """``log`` with each line stamped with the seconds since ``started_s`` (``time.perf_counter()``): "[  12.3 s] ..."."""
    def stamp(line: str) -> None:
        log(f"[{time.perf_counter() - started_s:5.1f} s] {line}")

    return stamp


def as_progress(log: Callable[[str], None] | None, *, started_s: float | None = None) -> Progress:
    """``log`` as progress: itself where it is a ``Progress`` already (a command's, beating for the whole command:
    one thread, one clock); ``QUIET`` for None; else a ``Heartbeat`` around it, its lines stamped with the seconds
    since ``started_s`` where that is given."""
    if isinstance(log, Progress):
        return log
    if log is None:
        return QUIET
    return Heartbeat(log if started_s is None else stamped(log, started_s=started_s))


def print_progress(line: str) -> None:
    """A log for the CLI: progress on stderr (``--json`` keeps stdout clean), flushed at once (a heartbeat line
    is read as it comes)."""
    print(f"  {line}", file=sys.stderr, flush=True)
