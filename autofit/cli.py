"""The `autofit` command line. Commands live in autofit/commands/, one module each;
this file owns the app and turns a UserError into one line and a non-zero exit.
"""
from __future__ import annotations

import gc
import importlib
import logging
import signal
import sys
import threading
import traceback
import warnings

import typer

from autofit.errors import UserError, one_line
from autofit.keywords import command_line

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fit PyTorch training into a memory budget: probe, plan, train.",
)



def _print_version(value: bool) -> None:
    if value:
        from autofit.version import __version__

        print(f"autofit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print autofit's version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="With an error, print the traceback behind its line too."),
) -> None:
    """Fit PyTorch training into a memory budget: probe, plan, train."""
    _options["debug"] = debug


COMMAND_MODULES = ("probe", "plan", "capacity", "train", "val", "plot", "compare", "export")
"""Modules under autofit/commands/ that register their command on ``app``."""

for _name in COMMAND_MODULES:
    importlib.import_module(f"autofit.commands.{_name}")


def _click_types(name: str) -> tuple[type, ...]:
    """The click exception class that typer raises: from its vendored click
    (typer >= 0.20 carries its own) and/or from the click package."""
    found = []
    for module_name in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


_USAGE_ERRORS = _click_types("UsageError")
_CLICK_ERRORS = _click_types("ClickException")
_ABORTS = _click_types("Abort")


_options = {"debug": False}
"""The root options of this invocation (``autofit --debug COMMAND ...``), for the error handling below."""


def main() -> None:
    """Entry point: user errors are one line on stderr and exit code 2 (after the traceback behind them with --debug)."""
    if len(sys.argv) <= 1:
        app()  # prints the help
        return
    # Libraries' notices nothing a user of autofit acts on: Inductor's C++ build (torch.compile on the CPU) says on
    # a machine without CUDA that no CUDA runtime is found; importing torchao (PEFT does, for --lora) logs that its
    # enums need no pytree registration; PEFT calls transformers' deprecated is_gradient_checkpointing.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    command = typer.main.get_command(app)
    interrupts = []

    def interrupted(signum, frame) -> None:  # a command with handlers of its own (train, compare) replaces this one
        interrupts.append(signum)
        signal.default_int_handler(signum, frame)

    main_thread = threading.current_thread() is threading.main_thread()  # (tests call main() in their own process)
    previous = signal.signal(signal.SIGINT, interrupted) if main_thread else None
    try:
        with command_line():  # errors keep the flags their reader typed (``keywords.for_caller``)
            code = command.main(standalone_mode=False)
    except UserError as error:
        if _options["debug"] and error.__cause__ is not None:
            traceback.print_exception(error.__cause__, file=sys.stderr)
        _fail(str(error))
    except _USAGE_ERRORS as error:
        where = f"autofit {error.ctx.info_name}" if error.ctx is not None and error.ctx.parent is not None else "autofit"
        _fail(f"{error.format_message()}; see `{where} --help`".replace("\n", " "))
    except _CLICK_ERRORS as error:
        _fail(error.format_message())
    except _ABORTS:
        print("autofit: aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("autofit: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if code == 130 and interrupts:  # typer turns a KeyboardInterrupt into a silent exit code 130
        print("autofit: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


def run() -> None:
    """The process's entry point (the ``autofit`` script, ``python -m autofit``): ``main`` with what the imports made
    out of the collector's reach, and then the collector leaves the objects the run made alone while Python ends.

    Every full collection walks every object the process holds: the imports' (torch, typer, the commands), which
    live as long as the process, included. A plan frees memory between its probes (``release_device_memory``), and a
    ResNet-18 plan's 19 full collections took 2.9 s (bench/RESULTS.md, "Noisy threads"); ``gc.freeze`` first moves
    the imports' objects out of their walk. At exit Python would walk every object still held, to collect cycles
    that are about to go anyway: 1.1-1.5 s after importing torchvision, a quarter of a simulated plan's start. A
    second ``gc.freeze`` moves them out of its reach; everything else about exit (threads joined, exit handlers,
    files flushed and closed) stays as it was.
    """
    gc.freeze()
    try:
        main()
    finally:
        gc.freeze()


def _fail(message: str) -> None:
    print(f"autofit: error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)
