"""Ctrl-C at any moment of a command is one line, `autofit: interrupted`, exit 130 (#53): also while the command
line is still being imported, before ``cli.main`` has its handler."""
import os
import signal
import subprocess
import sys
import time

from tests.helpers import ROOT


def test_ctrl_c_while_the_command_line_imports_is_one_line_and_exit_130():
    # A command that runs for seconds after its imports (--help could end before the signal on a fast machine): the
    # signal lands in the imports, or later in main()'s handler; either way it must be the one line.
    process = subprocess.Popen(
        [sys.executable, "-m", "autofit", "plan", str(ROOT / "examples" / "digits_cnn.py"), "--budget", "64MB", "-n", "8",
         "--no-cache", "--out", os.devnull],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    time.sleep(0.5)  # Python is up (its SIGINT handler set); importing typer and torch takes a second or more
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip() == "autofit: interrupted" and out == ""


def test_ctrl_c_while_a_plan_runs_ends_with_the_line_too():
    """typer turns a KeyboardInterrupt into a silent exit code 130: the plan's progress lines, then nothing, once."""
    process = subprocess.Popen(
        [sys.executable, "-m", "autofit", "plan", str(ROOT / "examples" / "digits_cnn.py"), "--budget", "64MB", "-n", "8",
         "--no-cache", "--out", os.devnull],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 60
    while "planning" not in (line := process.stderr.readline()) and time.monotonic() < deadline:  # past the imports
        assert line, "the plan ended before it was interrupted"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.strip().splitlines()[-1] == "autofit: interrupted", err
