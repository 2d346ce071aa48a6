"""The trace workers: the same traces as runs in this process, and this process's runs where a worker cannot trace.

A forked worker cannot run autograd once its parent has run a backward pass
over fake tensors (one on real CPU tensors does not stop it): the pool is
checked in a fresh interpreter (a subprocess), where it must do the runs, and
here after such a pass, where it must give them back.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autofit.planning import trace_pool
from autofit.planning.memory_model import trace_memory_sizes
from autofit.planning.trace_pool import TracePool, trace_workers
from tests.models import layout_specs

ROOT = Path(__file__).resolve().parents[1]

FRESH_PROCESS = textwrap.dedent("""
    import json
    import autofit.planning.memory_model as memory_model
    from autofit.planning.memory_model import trace_memory_sizes
    from autofit.planning.trace_pool import TracePool
    from tests.models import layout_specs

    here = []
    run_trace = memory_model.run_trace
    def counted(spec, **kwargs):  # the workers inherit it too, but count in their own memory
        here.append(kwargs["mode"])
        return run_trace(spec, **kwargs)
    memory_model.run_trace = counted

    spec = layout_specs()["lm"]
    pool = TracePool()
    pool.start(spec)
    workers = pool.workers
    pooled = trace_memory_sizes(spec, sizes=[4, 2], precision="bf16", pool=pool)
    in_pool = len(here)
    pool.close()
    # A whole plan: its pool starts before its first backward pass, and every traced run goes to the workers.
    from autofit.planning.planner import plan_with_report
    report = plan_with_report(spec, budget="1GB", batch_size=4, simulate=True, cache=False)
    in_plan = len(here) - in_pool
    alone = trace_memory_sizes(spec, sizes=[4, 2], precision="bf16")
    print(json.dumps({
        "workers": workers, "runs_here_with_pool": in_pool, "runs_here_in_plan": in_plan, "runs_alone": len(here) - in_pool - in_plan,
        "same": [t.to_dict() for t in pooled] == [t.to_dict() for t in alone],
        "traced_in_plan": list(report.cost_model["precisions"]),
    }))
""")


def test_a_fresh_process_traces_in_its_workers_and_gets_the_same_traces():
    env = dict(os.environ, AUTOFIT_TRACE_WORKERS="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["workers"] == 2
    assert result["same"]
    # Alone: plain and all-checkpointed (and all-selective where it frees bytes) at two sizes; with the pool none here.
    assert result["runs_alone"] >= 4
    assert result["runs_here_with_pool"] == 0
    assert result["traced_in_plan"] and result["runs_here_in_plan"] == 0


def test_no_pool_inside_a_torch_mode(monkeypatch):
    import torch

    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", "2")
    monkeypatch.setattr(trace_pool, "_broken", False)
    pool = TracePool()
    with torch.device("meta"):  # a worker would keep it on for good: every tensor it made would be meta
        pool.start(layout_specs()["lm"])
    assert pool.workers == 0


def test_workers_forked_after_a_backward_pass_give_their_runs_back(monkeypatch):
    import torch

    from autofit._torch_private import new_fake_mode

    with new_fake_mode():  # a backward over fake tensors starts autograd's device threads: no fork can run autograd after it
        torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", "2")
    monkeypatch.setattr(trace_pool, "_broken", False)
    spec = layout_specs()["lm"]
    pool = TracePool()
    pool.start(spec)
    assert pool.workers == 2
    try:
        pooled = trace_memory_sizes(spec, sizes=[2], precision="fp32", pool=pool, blocks=None)
    finally:
        pool.close()
    assert trace_pool._broken  # no pool is forked again in this process
    assert trace_workers() == 0
    alone = trace_memory_sizes(spec, sizes=[2], precision="fp32")
    assert [t.to_dict() for t in pooled] == [t.to_dict() for t in alone]


@pytest.mark.parametrize("setting", ["0", "1"])
def test_one_worker_or_none_means_no_pool(monkeypatch, setting):
    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", setting)
    monkeypatch.setattr(trace_pool, "_broken", False)
    pool = TracePool()
    pool.start(layout_specs()["lm"])
    assert pool.workers == 0
    assert pool.submit(len, layout_specs()["lm"]) is None
