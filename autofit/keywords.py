"""The Python API's words for the command line's flags: one table, and the boundary that uses it.

Messages are written once, in the command line's words (``--overwrite``,
``--log-dir 'runs/x'``). A caller of ``autofit.fit``, ``autofit.plan``, ``autofit.apply_plan`` (and the
``AppliedPlan`` it returns), ``autofit.probe`` or ``autofit.load_plan`` (``python_api`` wraps them in
``autofit/__init__.py``)
gets each flag spelled as the keyword it passes instead (``overwrite=True``,
``log_dir='runs/x'``): in the ``UserError`` it catches, in the one line a
script it left uncaught ends with (``AUTOFIT_DEBUG=1`` keeps the traceback),
and in the lines ``fit`` prints while it trains (``TrainSettings.spell``). A ``TrainingConfig`` a caller builds
itself is the API too: its errors name the keywords (``for_caller``) unless the command line runs it
(``command_line``).
"""
from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from autofit.errors import UserError, one_line

KEYWORDS = {
    # autofit.fit's own
    "--log-dir": "log_dir",
    "--resume": "resume=True",
    "--overwrite": "overwrite=True",
    "--workers": "num_workers",
    "--epochs": "epochs",
    "--lr": "lr",
    "--seed": "seed",
    "--schedule": "schedule",
    "--warmup-steps": "warmup_steps",
    "--max-steps": "max_steps",
    "--max-grad-norm": "max_grad_norm",
    "--plan": "plan",
    "--data": "train_data",
    "--weights": "init_from",
    "--lora": "lora",
    "--merge": "merge=True",
    "--data-changed": "data_changed=True",
    "--input-shape": "input_shape",
    # autofit.plan's (PlanRequest's fields; fit takes budget, batch_size and device too)
    "--budget": "budget",
    "--batch-size": "batch_size",
    "--device": "device",
    "--simulate": "simulate=True",
    "--device-memory": "device_memory",
    "--device-kind": "device_kind",
    "--host-memory": "host_memory",
    "--precisions": "precisions",
    "--gpus": "gpus",
    "--nodes": "nodes",
    "--host-speed": "host_speed",
    "--weights-dtype": "weights_dtype",
    "--allow-lossy-optimizer": "allow_lossy_optimizer=True",
    "--allow-lossy-base": "allow_lossy_base=True",
    "--study": "study",
    "--no-cache": "cache=False",
    "--threads": "threads",
    "--num-classes": "num_classes",
    "--compile": "compile=True",
    # autofit.probe's (a configuration's fields, TrainingConfig's)
    "--micro-batch-size": "micro_batch_size",
    "--steps": "steps",
    "--checkpoint": "checkpoint",
    "--selective-checkpoint": "selective_checkpoint",
    "--offload": "offload",
    "--optimizer-in-backward": "optimizer_in_backward=True",
    # a plan's own fields (TrainingConfig), which errors about a plan given name
    "--precision": "precision",
    "--loss-chunks": "loss_chunks",
    "--optimizer-state": "optimizer_state",
    "--grad-accum-steps": "grad_accum_steps",
    # the command line's way to the traceback behind a line
    "autofit --debug": "AUTOFIT_DEBUG=1",
}
"""A flag (as messages write it) -> the Python API's keyword: a name that takes the flag's value
(``--log-dir 'x'`` -> ``log_dir='x'``), or a switch with its value (``--resume`` -> ``resume=True``)."""

DEBUG_VARIABLE = "AUTOFIT_DEBUG"
"""Set (to anything but "" or "0"), a UserError a script leaves uncaught keeps its traceback."""

_VALUE = r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|(?:-?inf|nan|None|True|False|cpu|cuda)\b|[\w+%=-]*\d[\w+%=-]*(?:[.,][\w+%=-]+)*"""
"""What follows a flag as its value: a repr'd string, a number (``1e-3``, ``-3``, ``nan``), a device (``cpu``, ``cuda``) or
a word holding a digit (``16GB``, ``bf16``, ``r=16,alpha=32``); anything else (``--workers sets it``) is prose."""

_FLAG = re.compile(
    r"(?<![\w-])(" + "|".join(map(re.escape, sorted(KEYWORDS, key=len, reverse=True))) + rf")(?![\w-])(?: ({_VALUE}))?"
)


def as_flags(line: str) -> str:
    """A line as written: in the command line's flags (what ``autofit train`` prints)."""
    return line


def in_python(line: str) -> str:
    """``line`` with each flag of ``KEYWORDS`` spelled as the Python API's keyword; commands in backticks stay
    as they are (``autofit train --log-dir DIR --resume`` is still that command).

    Example:
        >>> in_python("runs/x already holds a run; continue it with --resume, give another --log-dir, or --overwrite")
        'runs/x already holds a run; continue it with resume=True, give another log_dir, or overwrite=True'
        >>> in_python("--log-dir '' names no folder")
        "log_dir='' names no folder"
    """
    parts = line.split("`")
    parts[::2] = [_FLAG.sub(_keyword, part) for part in parts[::2]]
    return "`".join(parts)


def _keyword(match: re.Match) -> str:
    keyword, value = KEYWORDS[match.group(1)], match.group(2)
    if value is None:
        return keyword
    if "=" in keyword:  # a switch: what follows is not its value
        return f"{keyword} {value}"
    return f"{keyword}={_python_value(value)}"


def _python_value(value: str) -> str:
    """``value`` as Python writes it: repr'd strings, numbers and constants as they are, other words quoted."""
    if value[0] in "'\"" or value in ("None", "True", "False"):
        return value
    try:
        float(value)
    except ValueError:
        return repr(value)  # 16GB, bf16
    return value


_COMMAND_LINE: ContextVar[bool] = ContextVar("autofit_command_line", default=False)
"""Whether the command line runs what raises now (``command_line``): its readers typed flags."""


@contextmanager
def command_line() -> Iterator[None]:
    """Run inside as the command line: ``for_caller`` keeps the flags (``cli.main`` runs each command in it)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def for_caller(line: str) -> str:
    """``line`` in its reader's words: the flags where the command line runs (``command_line``), else the Python API's
    keywords (``in_python``), for an error raised where no ``python_api`` boundary stands between it and its caller
    (a ``TrainingConfig`` built in Python)."""
    return line if _COMMAND_LINE.get() else in_python(line)


def python_api(function: Callable) -> Callable:
    """``function`` as the Python API offers it: a ``UserError`` it raises names keywords, not flags, and a script
    that leaves one uncaught ends with its line, as the command line does, not with a traceback."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            result = function(*args, **kwargs)
        except UserError as error:
            error.args = (in_python(str(error)),)  # the same error: its type, cause and traceback stay
            _end_scripts_with_one_line()
            raise
        if callable(getattr(result, "spell", None)):  # what it returns words its own later errors so too (AppliedPlan)
            result.spell = in_python
        return result

    return call


class _OneLineHook:
    """``sys.excepthook`` for a script: an uncaught ``UserError`` is its one line on stderr (exit code 1, as any
    uncaught error); anything else, or any error with ``AUTOFIT_DEBUG`` set, goes to the hook it replaced."""

    def __init__(self, previous: Callable) -> None:
        self.previous = previous

    def __call__(self, kind, error, traceback) -> None:
        if issubclass(kind, UserError) and os.environ.get(DEBUG_VARIABLE, "") in ("", "0"):
            print(f"autofit: error: {one_line(str(error))}", file=sys.stderr)
        else:
            self.previous(kind, error, traceback)


def _end_scripts_with_one_line() -> None:
    """Install ``_OneLineHook`` once, when a UserError first leaves the API (notebooks keep their own display)."""
    if not isinstance(sys.excepthook, _OneLineHook):
        sys.excepthook = _OneLineHook(sys.excepthook)
