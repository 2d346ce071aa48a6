"""Worker processes for the planner's runs over fake tensors: one plan's runs at once on the machine's cores.

A traced run (``memory.traces.run_trace``) is Python over fake tensors: one core
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
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor

import torch

from autofit._torch_private import modes_active
from autofit.errors import UserError
from autofit.measure.other_work import other_work, usable_cores
from autofit.planning.policy import POLICY
from autofit.spec import ModelSpec

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
    """Workers a pool would start: ``AUTOFIT_TRACE_WORKERS``, else the cores this process may use that other work
    leaves free now (``measure.other_work``; at most ``POLICY.max_trace_workers``); 0 where processes cannot be forked, or a pool
    here already found it could not trace.

    Workers on cores that other work holds only add the cost of each one's own start (measured on 2 cores at
    load 2: 27% more CPU time, the plan 8 s slower), so a busy machine traces in this process.
    """
    if _broken or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    wanted = os.environ.get(WORKERS_VARIABLE, "").strip()
    if wanted:
        if not wanted.isdigit():
            raise UserError(f"{WORKERS_VARIABLE}={wanted!r} must be a whole number of trace workers (0 or 1: none); unset it to use the free cores")
        return int(wanted)
    seen = other_work()
    others = seen[0] if seen is not None else 0.0
    return min(int(usable_cores() - others + 0.5), POLICY.max_trace_workers)


class TracePool:
    """Forked workers that run calls over one spec (``memory.traces.run_trace``, ``speed.estimated``'s estimates),
    once ``start`` has forked them.

    Until then, and after ``close``, ``submit`` hands nothing out: the caller runs in its own process.
    """

    def __init__(self) -> None:
        self.spec: ModelSpec | None = None
        self.workers = 0
        self._executor: ProcessPoolExecutor | None = None

    def start(self, spec: ModelSpec) -> None:
        """Fork ``trace_workers`` workers for ``spec`` (none where that is fewer than two, or while a torch mode is on);
        before any backward pass over fake tensors here."""
        global _spec
        workers = trace_workers()
        # A worker keeps the modes on at the fork for good (inside ``torch.device("meta")`` every tensor would be meta).
        if workers < 2 or self._executor is not None or modes_active():
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

    def submit(self, function, spec: ModelSpec, **kwargs) -> Future | None:
        """``function(spec, **kwargs)`` in a worker; None when there is none for ``spec`` (then call it here).

        ``function`` is a module's function (it goes to the worker by name); ``kwargs`` and its result must pickle.
        """
        if self._executor is None or spec is not self.spec:
            return None
        try:
            return self._executor.submit(_run, function, kwargs)
        except RuntimeError:  # the executor broke (a worker died): the rest go here
            self.close()
            return None

    def result(self, future: Future):
        """The call's result, or None where the worker could not make it (then call it here: the same
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
    """In a new worker: leave Ctrl-C to the planner's process (which stops the pool), send the worker's own stderr
    nowhere, and check that backward runs.

    Its errors reach the planner with its results; what a worker writes itself would only interleave with the
    planner's lines. A forked worker whose first backward pass cannot start its threads (seen on a quiet 2-core
    machine, once in a few real-probe plans: PyTorch's thread pool assertion, then an abort) dies with it, and the
    pool, broken, leaves every trace to the planner's process: without this the abort's C++ stack reached the
    user's terminal."""
    import faulthandler
    import signal

    global _worker_fails
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.disable()  # enabled in the parent (pytest, python -X faulthandler), it writes to a copy of its stderr
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError as error:  # forked after the parent's backward: autograd refuses to run
        _worker_fails = str(error)


def _run(function, kwargs: dict):
    if _worker_fails is not None:
        raise WorkerCannotTrace(_worker_fails)
    return function(_spec, **kwargs)


def call(pool: TracePool | None, function, spec: ModelSpec, **kwargs) -> Callable[[], object]:
    """``function(spec, **kwargs)`` started in ``pool``'s workers where it has them: a function that returns its
    result (made here, in this process, where no worker made it)."""
    future = pool.submit(function, spec, **kwargs) if pool is not None else None

    def result():
        done = pool.result(future) if future is not None else None
        return done if done is not None else function(spec, **kwargs)

    return result
