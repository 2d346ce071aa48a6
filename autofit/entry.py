"""The process's entry point (the ``autofit`` script, ``python -m autofit``), kept free of heavy imports.

Importing the command line (typer, the commands, torch) takes seconds; a Ctrl-C in them arrives before
``cli.main`` has its handler, and used to end in a KeyboardInterrupt traceback. Here it is the same line as
anywhere else: ``autofit: interrupted``, exit 130.
"""
from __future__ import annotations

import os
import signal
import sys

INTERRUPTED_EXIT = 130
"""128 + SIGINT, what a shell reports for a process Ctrl-C ended."""


def run() -> None:
    """Import the command line and run it (``cli.run``); a Ctrl-C at any moment is one line and exit 130."""
    # While importing, a KeyboardInterrupt can be swallowed by a library's bare ``except:`` around an optional import
    # (the command then ran on): nothing is done yet, so the process ends at once instead.
    signal.signal(signal.SIGINT, _interrupted_while_importing)
    try:
        from autofit.cli import run as run_command_line

        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here, a KeyboardInterrupt the command handles
        run_command_line()
    except KeyboardInterrupt:
        print("autofit: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)


def _interrupted_while_importing(signum, frame) -> None:
    os.write(2, b"autofit: interrupted\n")  # the process's stderr itself: an import may have swapped sys.stderr for now
    os._exit(INTERRUPTED_EXIT)
