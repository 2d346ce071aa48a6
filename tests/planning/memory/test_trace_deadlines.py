"""No wait on a trace worker without a deadline (issue #47): a worker that blocks for good or dies gives its runs
back to this process, which makes the same results, and the plan says so in one line; and a worker forked from a
process whose OpenMP threads ran kernels still runs its own.

The workers here are told to skip their autograd check (``_start_worker``) where their functions run no backward:
whether this process ran a backward over fake tensors before is up to the tests before, and a worker that cannot
trace would hand its runs back before blocking. The checks that need real workers run in a fresh interpreter.
"""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import autofit.planning.memory.traces as memory_model
from autofit.planning.memory import workers as trace_pool
from autofit.planning.memory.traces import trace_memory_sizes
from autofit.planning.memory.workers import Deadlines, TracePool, call
from tests.helpers.models import layout_specs

ROOT = Path(__file__).resolve().parents[3]
SHORT = Deadlines(floor_s=1.0, times=2.0, first_s=3.0)
"""Deadlines a test can wait out: a blocked worker is stopped within seconds."""
RUN_TRACE = memory_model.run_trace


def _in_a_worker() -> bool:
    return multiprocessing.parent_process() is not None


def _blocks_in_a_worker(spec, **kwargs):
    """``run_trace``, except that in a worker it waits for good (as the forked LSTM worker of issue #47 did)."""
    if _in_a_worker():
        threading.Event().wait()
    return RUN_TRACE(spec, **kwargs)


def _exits_in_a_worker(spec, **kwargs):
    if _in_a_worker():
        os._exit(3)
    return RUN_TRACE(spec, **kwargs)


def _killed_in_a_worker(spec, **kwargs):
    if _in_a_worker():
        os.kill(os.getpid(), signal.SIGKILL)
    return RUN_TRACE(spec, **kwargs)


def _sleeps(spec, *, seconds: float) -> float:
    """Waits ``seconds`` in a worker (none here) and returns them."""
    if _in_a_worker():
        time.sleep(seconds)
    return seconds


@pytest.fixture
def pool(monkeypatch):
    """A started pool of two workers over the LM with ``SHORT`` deadlines, closed after the test."""
    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", "2")
    monkeypatch.setattr(trace_pool, "_broken", False)
    monkeypatch.setattr(trace_pool, "_worker_fails", None)  # inherited by the fork
    monkeypatch.setattr(trace_pool, "_start_worker", lambda: None)  # their functions run no backward
    started = TracePool(deadlines=SHORT)
    started.start(layout_specs()["lm"])
    assert started.workers == 2
    yield started
    started.close()


@pytest.mark.parametrize("run_trace, why", [
    (_blocks_in_a_worker, "one run passed its deadline of 3 s"),
    (_exits_in_a_worker, "a worker died (it exited with status 3)"),
    (_killed_in_a_worker, "a worker died (killed by SIGKILL)"),
])
def test_a_worker_that_blocks_or_dies_gives_its_runs_back(monkeypatch, pool, run_trace, why):
    monkeypatch.setattr(memory_model, "run_trace", run_trace)
    spec, began = pool.spec, time.monotonic()
    pooled = trace_memory_sizes(spec, sizes=[2, 1], precision="fp32", pool=pool)
    assert time.monotonic() - began < 15
    assert pool.note == f"trace workers: {why}; the pool was stopped and the runs went on in this process"
    assert pool.workers == 0 and pool.submit(_sleeps, spec, seconds=0.0) is None  # stopped for the rest of the plan
    assert trace_pool.trace_workers() == 2  # a later plan forks again
    monkeypatch.setattr(memory_model, "run_trace", RUN_TRACE)
    alone = trace_memory_sizes(spec, sizes=[2, 1], precision="fp32")
    assert pooled == alone  # the same traces (what making each cost aside)


def test_a_run_is_given_a_multiple_of_its_finished_siblings_time(pool):
    slow = call(pool, _sleeps, pool.spec, seconds=10**6)
    quick = call(pool, _sleeps, pool.spec, seconds=0.0)
    began = time.monotonic()
    assert quick() == 0.0 and not pool.note  # answered by its worker
    assert slow() == 10**6  # made here, once its worker was stopped
    # The quick sibling finished: the slow run was given the floor (1 s), not the 3 s of a run with none finished.
    assert time.monotonic() - began < SHORT.first_s
    assert "passed its deadline of 1 s" in pool.note


def test_deadlines_follow_the_slowest_sibling_above_a_floor():
    deadlines = Deadlines()
    assert deadlines.for_run(None) == deadlines.first_s
    assert deadlines.for_run(0.5) == deadlines.floor_s >= 10  # a healthy run on a busy machine is not killed
    assert deadlines.for_run(60.0) == deadlines.times * 60.0


FORKED_AFTER_KERNELS = textwrap.dedent("""
    import torch
    from autofit.planning.memory import workers
    from autofit.planning.memory.workers import Deadlines, TracePool
    from tests.helpers.models import layout_specs

    def lstm_output(spec, *, seed):
        torch.manual_seed(seed)
        lstm = torch.nn.LSTM(16, 32, num_layers=2)  # a real mkldnn_rnn_layer, as in issue #47
        return lstm(torch.randn(12, 4, 16))[0].sum().item()

    torch.set_num_threads(2)  # OpenMP's threads run kernels here before the fork
    torch.nn.LSTM(16, 32, num_layers=2)(torch.randn(12, 4, 16))[0].sum().backward()
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()
    pool = TracePool(deadlines=Deadlines(floor_s=10.0, first_s=20.0))  # a worker waiting for good is stopped
    pool.start(layout_specs()["lm"])
    run = pool.submit(lstm_output, pool.spec, seed=0)
    answered = pool.result(run)
    pool.close()
    print(answered is not None, abs((answered or 0.0) - lstm_output(None, seed=0)) < 1e-3, repr(pool.note))
""")


def test_a_worker_forked_after_multithreaded_kernels_runs_its_own():
    env = dict(os.environ, AUTOFIT_TRACE_WORKERS="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", FORKED_AFTER_KERNELS], check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "''"], done.stdout


PLAN_WITH_A_BLOCKED_WORKER = textwrap.dedent("""
    import json, multiprocessing, os, threading
    import autofit.planning.memory.traces as memory_model
    from autofit.planning.summary import summary_lines
    from autofit.planning.memory import workers
    from autofit.planning.planner import plan_with_report
    from autofit.planning.request import PlanRequest
    from tests.helpers.models import layout_specs

    run_trace = memory_model.run_trace
    def blocks_once(spec, **kwargs):  # one plain run at micro-batch 2 waits for good in its worker
        if multiprocessing.parent_process() is not None and kwargs["mode"] == "none" and kwargs["micro_batch_size"] == 2:
            threading.Event().wait()
        return run_trace(spec, **kwargs)
    memory_model.run_trace = blocks_once
    workers.DEADLINES = workers.Deadlines(floor_s=2.0, times=3.0, first_s=10.0)

    spec = layout_specs()["lm"]
    request = PlanRequest(budget="1GB", batch_size=4, simulate=True, cache=False, precisions=["fp32"])
    pooled = plan_with_report(spec, request)
    os.environ["AUTOFIT_TRACE_WORKERS"] = "0"
    alone = plan_with_report(spec, request)
    print(json.dumps({
        "same": [pooled.plan.config.key(), pooled.plan.predicted.peak_bytes] == [alone.plan.config.key(), alone.plan.predicted.peak_bytes],
        "notes": [n for n in pooled.plan.notes if n.startswith("trace workers")],
        "summary": [line for line in summary_lines(pooled) if "trace workers" in line],
        "alone": [n for n in alone.plan.notes if n.startswith("trace workers")],
    }))
""")


def test_a_plan_with_a_blocked_worker_finishes_with_the_same_plan_and_one_note():
    env = dict(os.environ, AUTOFIT_TRACE_WORKERS="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PLAN_WITH_A_BLOCKED_WORKER], check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"], result
    assert len(result["notes"]) == 1 and len(result["summary"]) == 1, result
    assert "passed its deadline" in result["notes"][0] and "went on in this process" in result["notes"][0]
    assert result["alone"] == []


def test_a_bad_worker_count_is_refused_before_anything_is_traced_or_read_from_the_cache(monkeypatch):
    """AUTOFIT_TRACE_WORKERS=abc: one line from the plan's first step, also where the cache would leave nothing to
    trace (it was once read only when a pool started, and its error then read as "the model fails to train")."""
    from autofit.errors import UserError
    from autofit.planning.context import plan_context
    from autofit.planning.request import plan_request

    monkeypatch.setenv(trace_pool.WORKERS_VARIABLE, "abc")
    with pytest.raises(UserError, match="AUTOFIT_TRACE_WORKERS='abc' must be a whole number"):
        plan_context(layout_specs()["cnn"], plan_request(budget="1GB", batch_size=2))
