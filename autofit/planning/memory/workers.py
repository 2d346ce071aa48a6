"""Worker processes for the planner's traced runs (over fake tensors, or on real ones where those cost less): one
plan's runs at once on the machine's cores.

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

No wait on a worker is without a deadline (``Deadlines``): a worker past it, or
one that dies, stops the pool for the rest of the plan, its runs go on here, and
the plan says so in one note (``TracePool.note``). A worker forked from a
process whose OpenMP threads had run kernels sat in its first parallel kernel
for good (issue #47); each worker runs its kernels on one thread
(``_start_worker``).
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

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
    wanted = configured_trace_workers()
    if _broken or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    if wanted is not None:
        return wanted
    seen = other_work()
    others = seen[0] if seen is not None else 0.0
    return min(int(usable_cores() - others + 0.5), POLICY.max_trace_workers)


def configured_trace_workers() -> int | None:
    """``AUTOFIT_TRACE_WORKERS`` as a number of workers; None where it is not set. Every plan reads it first, so a bad
    value is refused whether or not the plan then traces (a plan served by the cache traces nothing).

    Raises:
        UserError: the variable is set to something other than a whole number.
    """
    wanted = os.environ.get(WORKERS_VARIABLE, "").strip()
    if not wanted:
        return None
    if not wanted.isdigit():
        raise UserError(f"{WORKERS_VARIABLE}={wanted!r} must be a whole number of trace workers (0 or 1: none); unset it to use the free cores")
    return int(wanted)


@dataclass(frozen=True, kw_only=True, slots=True)
class Deadlines:
    """How long a worker may hold one run before the pool is stopped and the run goes on in this process."""

    floor_s: float = 60.0
    """The least a run is given: on a machine busy with other work a healthy run can take many times its siblings' time."""
    times: float = 10.0
    """A run is given this many times the slowest run of the same function finished in this pool (its siblings:
    the same traced step at another size or with other blocks checkpointed)."""
    first_s: float = 300.0
    """Given while no run of the function has finished in this pool (nothing yet to measure it by)."""

    def for_run(self, slowest_s: float | None) -> float:
        """Seconds a run may take, given its slowest finished sibling's (None: none finished yet)."""
        return self.first_s if slowest_s is None else max(self.floor_s, self.times * slowest_s)


DEADLINES = Deadlines()
"""What a ``TracePool`` made without ``deadlines`` is given (a test sets shorter ones here)."""
_EXIT_S = 5.0
"""How long a worker told to stop is given to exit before it is killed."""
_STOPPED = "the pool was stopped and the runs went on in this process"


@dataclass(eq=False)
class PendingRun:
    """One call handed to a ``TracePool``: what goes to a worker, and once one answered, its result."""

    name: str
    """The function's module and name: runs of the same function are siblings (``Deadlines.times``)."""
    message: bytes
    """The function (by name) and its keyword arguments, pickled."""
    value: object = None
    """The worker's result (None until it comes, and where it cannot)."""
    answered: bool = False


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    run: PendingRun | None = None
    """The run it holds (None: idle)."""
    sent_s: float = 0.0
    """``time.monotonic()`` when it was handed ``run``."""


class TracePool:
    """Forked workers that run calls over one spec (``memory.traces.run_trace``, ``speed.estimated``'s estimates),
    once ``start`` has forked them.

    Until then, and after ``close``, ``submit`` hands nothing out: the caller runs in its own process. Runs go to
    idle workers as they free up, from ``submit`` and ``result``; every wait has a deadline (``deadlines``).
    """

    def __init__(self, *, deadlines: Deadlines | None = None) -> None:
        self.spec: ModelSpec | None = None
        self.workers = 0
        self.deadlines = deadlines or DEADLINES
        self.note = ""
        """One line for the plan where a worker passed its deadline or died (then the pool stopped); "" otherwise."""
        self._forked: list[_Worker] = []
        self._waiting: deque[PendingRun] = deque()
        self._slowest_s: dict[str, float] = {}

    def start(self, spec: ModelSpec) -> None:
        """Fork ``trace_workers`` workers for ``spec`` (none where that is fewer than two, or while a torch mode is on);
        before any backward pass over fake tensors here."""
        global _spec
        workers = trace_workers()
        # A worker keeps the modes on at the fork for good (inside ``torch.device("meta")`` every tensor would be meta).
        if workers < 2 or self._forked or modes_active():
            return
        _spec = spec
        try:
            for _ in range(workers):
                self._forked.append(self._fork())
        except (OSError, RuntimeError):  # no processes to be had (limits, a sandbox): trace here
            self.close()
            return
        self.spec, self.workers = spec, workers

    def _fork(self) -> _Worker:
        """One worker, started now; it closes the ends of the pipes it inherits that are this process's, so that
        every worker sees its own pipe end when this process closes it (or dies)."""
        mine, its = multiprocessing.Pipe()
        inherited = [w.conn for w in self._forked] + [mine]
        process = multiprocessing.get_context("fork").Process(target=_serve, args=(its, inherited), daemon=True)
        process.start()
        its.close()
        return _Worker(process=process, conn=mine)

    def submit(self, function, spec: ModelSpec, **kwargs) -> PendingRun | None:
        """``function(spec, **kwargs)`` in a worker; None when there is none for ``spec`` (then call it here).

        ``function`` is a module's function (it goes to the worker by name); ``kwargs`` and its result must pickle.
        """
        if not self._forked or spec is not self.spec:
            return None
        try:
            message = pickle.dumps((function, kwargs))
        except (pickle.PicklingError, TypeError, AttributeError):  # a local function, an argument that will not pickle: it runs here
            return None
        run = PendingRun(name=f"{function.__module__}.{function.__qualname__}", message=message)
        self._waiting.append(run)
        self._hand_out()
        return run

    def result(self, run: PendingRun):
        """The call's result, or None where no worker made it (then call it here: the same result or its error).

        A worker that cannot run backward stops the pool for the rest of this process; one past its deadline or
        dead stops it for the rest of this plan (``note`` says which)."""
        while not run.answered and self._forked:
            self._wait_once()
        return run.value

    def close(self) -> None:
        """Stop every worker: told to (``terminate``), killed after ``_EXIT_S`` where it has not exited; the runs
        not answered yet are left to their callers (``result`` returns None)."""
        global _spec
        for worker in self._forked:
            worker.conn.close()
            worker.process.terminate()
        for worker in self._forked:
            worker.process.join(timeout=_EXIT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=_EXIT_S)
        self._forked, self._waiting, self.spec, self.workers = [], deque(), None, 0
        _spec = None

    def _hand_out(self) -> None:
        """Give waiting runs to idle workers (one that died idle stops the pool)."""
        for worker in self._forked:
            if not self._waiting:
                return
            if worker.run is None:
                run = self._waiting.popleft()
                try:
                    worker.conn.send_bytes(run.message)
                except OSError:
                    return self._stop(_died(worker))
                worker.run, worker.sent_s = run, time.monotonic()

    def _wait_once(self) -> None:
        """Wait for an answer or a death until the first busy worker's deadline; past it, stop the pool."""
        busy = [w for w in self._forked if w.run is not None]
        if not busy:  # cannot happen while runs wait (``_hand_out`` gives them out); guards ``min``
            return self._stop(f"trace workers: a run was left with no worker; {_STOPPED}")
        given_s, passes_s = min((self._deadline(w) for w in busy), key=lambda deadline: deadline[1])
        ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=max(0.0, passes_s - time.monotonic()))
        if not ready:
            return self._stop(f"trace workers: one run passed its deadline of {given_s:.0f} s; {_STOPPED}")
        for worker in busy:
            if worker.conn in ready:
                self._answer(worker)
            elif worker.process.sentinel in ready:
                return self._stop(_died(worker))
            if not self._forked:  # stopped while answering
                return
        self._hand_out()

    def _deadline(self, worker: _Worker) -> tuple[float, float]:
        """The seconds ``worker``'s run is given, and the ``time.monotonic()`` at which they run out."""
        given_s = self.deadlines.for_run(self._slowest_s.get(worker.run.name))
        return given_s, worker.sent_s + given_s

    def _answer(self, worker: _Worker) -> None:
        """Take ``worker``'s answer to its run: the result, or why there is none (a model's error is raised again
        where the caller runs it here)."""
        global _broken
        try:
            kind, value, seconds = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):  # it died while answering
            return self._stop(_died(worker))
        except Exception:  # a result that does not unpickle here: the run goes on here
            kind, value, seconds = "failed", None, 0.0
        run, worker.run = worker.run, None
        run.answered = True
        if kind == "done":
            run.value = value
            self._slowest_s[run.name] = max(seconds, self._slowest_s.get(run.name, 0.0))
        elif kind == "cannot":  # forked after this process's backward pass: no worker forked here can trace
            _broken = True
            self.close()

    def _stop(self, note: str) -> None:
        """Stop the pool for the rest of the plan, saying why once."""
        self.note = self.note or note
        self.close()


def _died(worker: _Worker) -> str:
    """The plan's line for a worker that died: the signal that killed it or the status it exited with."""
    worker.process.join(timeout=_EXIT_S)
    code = worker.process.exitcode
    how = (
        "it did not answer and its pipe closed" if code is None
        else f"killed by {signal.Signals(-code).name}" if code < 0 else f"it exited with status {code}"
    )
    return f"trace workers: a worker died ({how}); {_STOPPED}"


def _serve(conn: Connection, inherited: list[Connection]) -> None:
    """A worker's life: the runs ``conn`` brings, one at a time, each answered on it, until this process's end
    of it closes."""
    for end in inherited:  # this process's ends: held here, they would keep those pipes open after the pool closes
        end.close()
    _start_worker()
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(_outcome(message))


def _outcome(message: bytes) -> bytes:
    """A run's answer, pickled: ("done", result, seconds), ("cannot", why, seconds) where this worker cannot run
    backward, or ("failed", error, seconds) where the function raised or its result does not pickle."""
    started = time.perf_counter()
    try:
        function, kwargs = pickle.loads(message)
        answer = ("done", _run(function, kwargs))
    except WorkerCannotTrace as error:
        answer = ("cannot", str(error))
    except Exception as error:  # the user's model failing: its own error comes where the run is made again here
        answer = ("failed", repr(error))
    seconds = time.perf_counter() - started
    try:
        return pickle.dumps((*answer, seconds))
    except (pickle.PicklingError, TypeError, AttributeError) as error:  # the result: the run goes on in the planner
        return pickle.dumps(("failed", repr(error), seconds))


def _start_worker() -> None:
    """In a new worker: run kernels on one thread, leave Ctrl-C to the planner's process (which stops the pool),
    send the worker's own stderr nowhere, and check that backward runs.

    A process forked from one whose OpenMP threads had run a kernel inherits a thread pool whose threads are not
    there: its first parallel kernel (an LSTM's ``mkldnn_rnn_layer`` in ``rnn_workspace_bytes``, even an add)
    waits for them for good (issue #47). On one thread OpenMP and oneDNN run the kernel inline; a worker's few
    real kernels are that small (its runs are over fake tensors).

    Its errors reach the planner with its results; what a worker writes itself would only interleave with the
    planner's lines. A forked worker whose first backward pass cannot start its threads (seen on a quiet 2-core
    machine, once in a few real-probe plans: PyTorch's thread pool assertion, then an abort) dies with it, and the
    pool, broken, leaves every trace to the planner's process: without this the abort's C++ stack reached the
    user's terminal."""
    import faulthandler

    global _worker_fails
    torch.set_num_threads(1)  # before any kernel: it also sets OpenMP's (omp_set_num_threads) and MKL's threads
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
    """``function`` over the spec this worker inherited, where this worker can run backward."""
    if _worker_fails is not None:
        raise WorkerCannotTrace(_worker_fails)
    return function(_spec, **kwargs)


def call(pool: TracePool | None, function, spec: ModelSpec, **kwargs) -> Callable[[], object]:
    """``function(spec, **kwargs)`` started in ``pool``'s workers where it has them: a function that returns its
    result (made here, in this process, where no worker made it)."""
    run = pool.submit(function, spec, **kwargs) if pool is not None else None

    def result():
        done = pool.result(run) if run is not None else None
        return done if done is not None else function(spec, **kwargs)

    return result
