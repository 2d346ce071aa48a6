"""The heartbeat (issue #47): a plan, a simulated probe and a compare slowed on purpose are never silent for long,
say what still runs, stop their thread when they end, and say nothing with --quiet."""
import re
import threading
import time
from pathlib import Path

import pytest

import autofit.measure.probe as probe_module
import autofit.planning.memory.traces as traces
import autofit.progress as progress
from autofit.progress import QUIET, Heartbeat, as_progress

TINY_MLP = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def example_batch(n):
    return torch.rand(n, 8), torch.randint(0, 3, (n,))
"""
INTERVAL_S = 0.5
"""The heartbeat's interval in these tests (10 s in use)."""
SLOW_S = 1.5
"""How long the step slowed on purpose takes: three intervals without a line of its own."""
STAMP_S = 0.1
"""A stamp's resolution ("[  12.3 s]"): two stamps' difference is off by up to this much."""
PLAN = ["-b", "20MB", "-n", "2", "--simulate", "--precisions", "fp32", "--no-cache"]


@pytest.fixture
def tiny_mlp(tmp_path) -> Path:
    path = tmp_path / "tiny_mlp.py"
    path.write_text(TINY_MLP)
    return path


@pytest.fixture
def short_interval(monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", INTERVAL_S)


def slowed_once(monkeypatch, module, name: str, *, seconds: float = SLOW_S) -> None:
    """``module.name`` sleeping ``seconds`` before its first call, as a long trace or step would take."""
    real, calls = getattr(module, name), []

    def slow(*args, **kwargs):
        if not calls:
            calls.append(1)
            time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)


def stamps(stderr: str) -> list[float]:
    return [float(s) for s in re.findall(r"^\s*\[\s*([0-9.]+) s\]", stderr, flags=re.MULTILINE)]


def assert_never_silent(times_s: list[float], *, resolution_s: float = 0.0) -> None:
    """No gap between the start (0), the lines and each other over 1.5 intervals."""
    gaps = [b - a for a, b in zip([0.0, *times_s], times_s)]
    assert gaps and max(gaps) <= 1.5 * INTERVAL_S + resolution_s, gaps


def assert_no_heartbeat_left() -> None:
    assert not [t for t in threading.enumerate() if t.name == "autofit-heartbeat"]


def test_a_heartbeat_speaks_only_while_beating_and_not_paused():
    lines = []
    heartbeat = Heartbeat(lines.append, interval_s=0.05)
    # nested blocks: one thread, started and stopped by the outermost
    with heartbeat.beating(), heartbeat.beating(), heartbeat.doing("tracing fp32 at micro-batch 4", step=2, of=9):
        time.sleep(0.3)
        with heartbeat.paused():
            heartbeat("a line of its own")
            time.sleep(0.2)
            while_paused = lines[lines.index("a line of its own"):]
    assert "still tracing fp32 at micro-batch 4 (2 of 9): 0 s so far" in lines
    assert while_paused == ["a line of its own"]
    assert_no_heartbeat_left()
    said = len(lines)
    time.sleep(0.15)
    assert len(lines) == said  # nothing after the block
    assert as_progress(heartbeat) is heartbeat and as_progress(None) is QUIET


def test_a_slowed_plan_is_never_silent_for_long(run_cli, tiny_mlp, tmp_path, monkeypatch, short_interval):
    slowed_once(monkeypatch, traces, "run_trace")
    code, out, err = run_cli("plan", tiny_mlp, *PLAN, "--out", tmp_path / "plan.json")
    assert code == 0, err
    assert_never_silent(stamps(err), resolution_s=STAMP_S)
    # the slowed trace said what it was, k of n
    assert re.search(r"still tracing fp32 at micro-batch \d+ \(1 of 1\): \d+ s so far", err), err
    assert_no_heartbeat_left()


def test_a_quiet_plan_says_nothing_even_when_slow(run_cli, tiny_mlp, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.1)
    slowed_once(monkeypatch, traces, "run_trace", seconds=0.5)  # five intervals
    code, out, err = run_cli("plan", tiny_mlp, *PLAN, "--out", tmp_path / "plan.json", "--quiet", "--json")
    assert code == 0 and err == "", err
    assert_no_heartbeat_left()


def test_a_slowed_simulated_probe_is_never_silent_for_long(run_cli, tiny_mlp, monkeypatch, short_interval):
    slowed_once(monkeypatch, probe_module, "train_step")
    code, out, err = run_cli("probe", tiny_mlp, "-m", "4", "--steps", "2", "--simulate")
    assert code == 0, err
    assert_never_silent(stamps(err), resolution_s=STAMP_S)
    assert "still probing fp32 at micro-batch 4 x 1, simulated optimizer step (1 of 2)" in err, err
    assert_no_heartbeat_left()


def test_a_slowed_compare_is_never_silent_for_long(tiny_mlp, monkeypatch, short_interval, one_thread):
    import autofit.tools.compare as compare_module
    from autofit.spec import load_spec

    rows = compare_module.configurations
    monkeypatch.setattr(compare_module, "configurations", lambda **settings: rows(**settings)[:1])  # fp32 alone: one probe, one timing
    slowed_once(monkeypatch, probe_module, "train_step")
    started, times_s, lines = time.monotonic(), [], []

    def heard(line: str) -> None:
        times_s.append(time.monotonic() - started)
        lines.append(line)

    compare_module.compare(load_spec(str(tiny_mlp)), global_batch_size=2, probe_steps=2, rounds=1, progress=heard, all_rows=True)
    assert_never_silent(times_s)
    assert any(line.startswith("still row 1 of 1, fp32: measuring its peak, optimizer step (1 of 2)") for line in lines), lines
    assert_no_heartbeat_left()
