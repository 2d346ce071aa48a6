"""Records at other sequence lengths, traced in processes of their own beside this one's (``capacity --longest``).

A record at one length is a minute or more of Python over fake tensors on one core for an 8B model, and the
longest-sequence answers need three (``lengths.traced_lengths``). Where other work leaves the cores free
(``memory.workers.trace_workers``: at least two), the lengths other than the user's are traced each in a process
started for it while this process traces the user's: on two cores the three records take the time of about two.

Each process is spawned (a fresh interpreter: no thread pool or autograd state inherited from this one, issue #47)
and gets only what pickles: the spec's maker (``load_model_spec`` with its options), the length, the request and the
levers. Every wait has a deadline (``LengthDeadline``); a process past it, or one that dies or fails, is stopped and
its length traced here, as without workers, in one line of progress that says so.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from autofit.planning.memory.workers import trace_workers
from autofit.progress import QUIET, Progress


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthDeadline:
    """How long a length's process is given, from its start, before its length is traced here instead."""

    floor_s: float = 120.0
    """The least it is given: starting the interpreter and PyTorch alone takes seconds, more on a busy machine."""
    times: float = 4.0
    """It is given this many times what this process took for the user's length (the same model's record: the
    other lengths make the same steps over other shapes; several processes share the cores)."""

    def seconds(self, own_s: float) -> float:
        return max(self.floor_s, self.times * own_s)


DEADLINE = LengthDeadline()
_EXIT_S = 5.0
"""How long a process told to stop is given to exit before it is killed."""


def trace_length(conn: Connection, spec_at: Callable, length: int, request, levers) -> None:
    """A length's process: the record at ``length`` (``capacity.traced_record``), pickled to ``conn``; an error
    as its one line. Its output goes nowhere: this process's progress says what it does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        from autofit.planning.capacity import traced_record

        record, _ = traced_record(spec_at(seq_len=length), request, levers=levers)
        conn.send_bytes(pickle.dumps(("record", record)))
    except BaseException as error:  # said by this process's caller in one line, and traced there again
        first = (str(error).strip().splitlines() or [""])[0]
        conn.send_bytes(pickle.dumps(("error", f"{type(error).__name__}: {first}")))
    finally:
        conn.close()


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    started_s: float


class LengthWorkers:
    """The processes tracing the other lengths (none where the cores are not free); ``record`` waits for one."""

    def __init__(
        self, spec_at: Callable, lengths: list[int], request, levers, *, target: Callable = trace_length,
        deadline: LengthDeadline = DEADLINE, progress: Progress = QUIET,
    ) -> None:
        """Start a process per length in ``lengths`` where ``trace_workers()`` is at least 2 (else none: each is
        traced here when asked). ``target`` is what each runs (a module's function: it goes by name)."""
        self.deadline, self.progress = deadline, progress
        self._workers: dict[int, _Worker] = {}
        if trace_workers() < 2:
            return
        context = multiprocessing.get_context("spawn")
        for length in lengths:
            mine, its = context.Pipe(duplex=False)
            try:
                # Not a daemon: its own trace workers (``TracePool``, where it finds cores free) are its children.
                process = context.Process(target=target, args=(its, spec_at, length, request, levers), daemon=False)
                process.start()
            except (OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError):  # no process to be had: traced here
                mine.close()
                its.close()
                break
            its.close()
            self._workers[length] = _Worker(process=process, conn=mine, started_s=time.monotonic())

    @property
    def lengths(self) -> list[int]:
        """The lengths being traced in processes of their own."""
        return sorted(self._workers)

    def record(self, length: int, *, own_s: float):
        """The record its process traced at ``length``; None where there is none to wait for, or it passed its
        deadline (``own_s``: what the user's length took here), died or failed: then trace it here (the line said).
        """
        worker = self._workers.pop(length, None)
        if worker is None:
            return None
        given_s = self.deadline.seconds(own_s)
        with self.progress.doing(f"waiting for the costs at {length} tokens a sequence (--longest), traced in a process of its own"):
            ready = wait([worker.conn, worker.process.sentinel], timeout=max(0.0, worker.started_s + given_s - time.monotonic()))
        why = _outcome(worker, ready, given_s=given_s)
        if isinstance(why, str):
            self.progress(f"--longest: the process tracing {length} tokens {why}; traced here instead")
            return None
        return why[1]

    def close(self) -> None:
        """Stop every process not waited for yet."""
        for worker in self._workers.values():
            _stop(worker)
        self._workers.clear()


def _outcome(worker: _Worker, ready: list, *, given_s: float):
    """("record", it) from a worker that answered, else why it did not (it is stopped either way)."""
    try:
        if worker.conn.poll():  # its answer, or the end of a pipe whose process died
            try:
                kind, value = pickle.loads(worker.conn.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                worker.process.join(timeout=_EXIT_S)
                return f"died (exit code {worker.process.exitcode})"
            return (kind, value) if kind == "record" else f"failed ({value})"
        if worker.process.sentinel in ready:
            return f"died (exit code {worker.process.exitcode})"
        return f"passed its deadline of {given_s:.0f} s"
    finally:
        _stop(worker)


def _stop(worker: _Worker) -> None:
    worker.conn.close()
    if worker.process.is_alive():
        worker.process.terminate()
        worker.process.join(timeout=_EXIT_S)
        if worker.process.is_alive():
            worker.process.kill()
    worker.process.join(timeout=_EXIT_S)
