"""How a run stops: on a signal after its step (last.pt saved, ``TrainingInterrupted``), or on an error with one line
saying what happened, what last.pt still holds and how to go on."""
from __future__ import annotations

import os
import signal
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path

from autofit.errors import UserError
from autofit.training.resume import read_saved_run


def disk_full_line(error: OSError, log_dir: Path) -> str:
    """The one line for a full disk: what failed, what last.pt still holds, and how to go on."""
    where = f" writing {Path(error.filename).name}" if error.filename else ""
    step = saved_step(log_dir)
    if step is None:
        return f"the disk holding {log_dir} is full ({error.strerror}{where}) before anything was saved; free space, then start again with --overwrite"
    return f"the disk holding {log_dir} is full ({error.strerror}{where}); last.pt keeps step {step} intact: free space, then continue with --resume"


def user_code_line(error: Exception, frame: traceback.FrameSummary, log_dir: Path) -> str:
    """The one line for an error in the user's code (their loss, forward or optimizer): where, and how to go on."""
    message = (str(error).strip().splitlines() or [""])[0][:300]
    raised = f"{type(error).__name__}: {message} ({Path(frame.filename).name}, line {frame.lineno}, in {frame.name})"
    step = saved_step(log_dir)
    if step is None:
        return f"training stopped: your code raised {raised}; nothing was saved yet: fix it, then start again (autofit --debug shows the traceback)"
    return (
        f"training stopped: your code raised {raised}; last.pt keeps step {step}: fix it, then continue with --resume "
        "(autofit --debug shows the traceback)"
    )


def saved_step(log_dir: Path) -> int | None:
    """The step last.pt in ``log_dir`` holds; None when there is none (nothing saved yet)."""
    try:
        return read_saved_run(log_dir)["position"]["global_step"]
    except (UserError, KeyError, OSError):
        return None


class TrainingInterrupted(KeyboardInterrupt):
    """A signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP) stopped training after a step; last.pt holds everything to resume."""

    def __init__(self, *, last_path: Path, epoch: int, step: int, signal_number: int = signal.SIGINT) -> None:
        super().__init__(f"stopped by {signal.Signals(signal_number).name} at epoch {epoch}, step {step}; saved {last_path}")
        self.last_path, self.epoch, self.step, self.signal_number = last_path, epoch, step, signal_number

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by the signal: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signal_number


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""Signals that stop a run after its step, with last.pt saved: Ctrl-C, a polite kill, a closed terminal."""


class StopRequest:
    """Set by the first stop signal; the loop saves after its step and raises ``interrupted``."""

    def __init__(self) -> None:
        self.signal_number: int | None = None

    def is_set(self) -> bool:
        return self.signal_number is not None

    def interrupted(self, *, last_path: Path, epoch: int, step: int) -> TrainingInterrupted:
        # On several processes a rank may stop because another got the signal: torchrun passes SIGTERM on.
        return TrainingInterrupted(last_path=last_path, epoch=epoch, step=step, signal_number=self.signal_number or signal.SIGTERM)


@contextmanager
def stop_on_signals():
    """The first SIGINT, SIGTERM or SIGHUP asks the loop to stop after its step; a second one ends the run at once.

    A second Ctrl-C raises KeyboardInterrupt; a second SIGTERM or SIGHUP ends
    the process as that signal does by default.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals reach only the main thread
        return

    def request_stop(signum, frame) -> None:
        if not stop.is_set():
            stop.signal_number = signum
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {number: signal.signal(number, request_stop) for number in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
