"""Ctrl-C at any moment of a command is one line, `autofit: interrupted`, exit 130 (#53): also while the command
line is still being imported, before ``cli.main`` has its handler."""
import os
import signal
import subprocess
import sys
import time

from tests.helpers import ROOT


def test_ctrl_c_while_the_command_line_imports_is_one_line_and_exit_130():
    process = subprocess.Popen(
        [sys.executable, "-m", "autofit", "plan", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    time.sleep(0.8)  # Python is up (its SIGINT handler set); importing typer and torch takes seconds more
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip() == "autofit: interrupted" and out == ""
