"""Worker processes for the memory model's traced runs: one plan's runs at once on the machine's cores.

A traced run (``memory_model.run_trace``) is Python over fake tensors: one core
each, and a plan makes up to nine per precision (three micro-batch sizes,
plain, all-checkpointed and all-selective). A ``TracePool`` forks workers
that run them side by side, each with the plan's model spec inherited (a model
file's functions need not pickle; only the run's arguments and its result
cross).

PyTorch's autograd cannot run in a process forked after its parent ran a
backward pass over fake tensors (that starts autograd's device threads), so
the pool is started before the plan runs any (``PlanContext.sim_spec``); a
worker checks that its own backward works before its first run. Where it does not (a Python session that trained before
planning), the pool stops for the rest of this process and the runs go in
turn here, as without a pool: the same traces, only slower.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

import torch

from autofit.spec import ModelSpec

MAX_WORKERS = 8
WORKERS_VARIABLE = "AUTOFIT_TRACE_WORKERS"
"""Environment variable: how many workers (0 or 1: no pool, every run in the planner's process)."""

_spec: ModelSpec | None = None
"""The spec the forked workers trace: set before forking, so each worker inherits it."""
_worker_fails: str | None = None
"""In a worker: why it cannot run backward (None: it can)."""
_broken = False
"""In the planner's process: a pool found its workers unable to run backward (this process ran one first)."""


class WorkerCannotTrace(RuntimeError):
    """A forked worker cannot run autograd (its parent had run a backward pass)."""


def trace_workers() -> int:
    """Workers a pool would start: the cores this process may use (at most ``MAX_WORKERS``) or ``AUTOFIT_TRACE_WORKERS``;
    0 where processes cannot be forked, or a pool here already found it could not trace."""
    if _broken or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    wanted = os.environ.get(WORKERS_VARIABLE, "").strip()
    if wanted.isdigit():
        return int(wanted)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS)


class TracePool:
    """Forked workers that run ``memory_model.run_trace`` for one spec, once ``start`` has forked them.

    Until then, and after ``close``, ``submit`` hands nothing out: the caller runs in its own process.
    """

    def __init__(self) -> None:
        self.spec: ModelSpec | None = None
        self.workers = 0
        self._executor: ProcessPoolExecutor | None = None

    def start(self, spec: ModelSpec) -> None:
        """Fork ``trace_workers`` workers for ``spec`` (none where that is fewer than two); before any backward pass here."""
        global _spec
        workers = trace_workers()
        if workers < 2 or self._executor is not None:
            return
        _spec = spec
        try:
            self._executor = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker,
            )
            self._executor.submit(int).result()  # fork every worker now
        except (OSError, RuntimeError):  # no processes to be had (limits, a sandbox): trace here
            self.close()
            return
        self.spec, self.workers = spec, workers

    def submit(self, spec: ModelSpec, kwargs: dict) -> Future | None:
        """A run of ``run_trace(spec, **kwargs)`` in a worker; None when there is none for ``spec`` (then run it here)."""
        if self._executor is None or spec is not self.spec:
            return None
        try:
            return self._executor.submit(_run, kwargs)
        except RuntimeError:  # the executor broke (a worker died): the rest go here
            self.close()
            return None

    def result(self, future: Future):
        """The run's trace, or None where the worker could not make it (then make it here: the same run's
        result or its error). A worker that cannot run backward stops the pool for the rest of this process."""
        global _broken
        try:
            return future.result()
        except WorkerCannotTrace:
            _broken = True
            self.close()
        except Exception:  # the user's model failing, or a result that would not pickle: its own error comes here
            pass
        return None

    def close(self) -> None:
        global _spec
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor, self.spec, self.workers = None, None, 0
        _spec = None


def _start_worker() -> None:
    """In a new worker: leave Ctrl-C to the planner's process (which stops the pool), and check that backward runs."""
    import signal

    global _worker_fails
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError as error:  # forked after the parent's backward: autograd refuses to run
        _worker_fails = str(error)


def _run(kwargs: dict):
    from autofit.planning.memory_model import run_trace

    if _worker_fails is not None:
        raise WorkerCannotTrace(_worker_fails)
    return run_trace(_spec, **kwargs)
