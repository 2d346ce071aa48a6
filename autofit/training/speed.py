"""The run's speed beside the plan's: what training measured, what the plan measured, and what bounded it.

Each step's wall time is split in two: waiting for the DataLoader's next batch
and the step itself. The first step of each epoch is left out (worker start-up,
first-call allocations), as the plan's timing leaves its warm-up out. The
median step is the run's speed, as the plan's is its fastest round: a burst of
other work then moves neither much.

One clock times every figure a run prints (the step lines' and the progress
bar's, each epoch's, the last line's, metrics.jsonl's): the plan's
(``autofit.planning.context.step_clock``). A plan timed with one thread on a
busy CPU timed its steps by their CPU time (the time the other work takes off
the core is not the configuration's), so the run's steps are then timed by
the main thread's CPU time (from one step's end to the next: the batch it read
included); otherwise by the wall clock, the wait for data included
(``by_cpu``, ``clock_words``). An epoch's figure and the run's are the median
step's samples/s of the same steps by that clock: a run of one epoch prints
one figure twice.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator

from autofit.plan_file import Plan

DEFAULT_TOLERANCE = 0.10
"""Speeds this close agree, whatever noise the plan reports: the plan times the step alone, training also reads
each batch and logs (the bundled examples on 2 quiet cores trained at 0.90-0.98x their plans' medians,
bench/RESULTS.md "Training against its plan"); a plan's few rounds of one configuration often repeat within 1%."""
DATA_BOUND_SHARE = 0.20
"""Waiting on the DataLoader for more than this share of the time is worth a line."""


class StepSpeed:
    """Times the steps of a run: ``start`` where timing (re)starts, the loader's batches through ``timed`` (or
    ``batch_ready`` when one arrived), ``step_done`` when its step ended."""

    def __init__(self, clock=time.perf_counter, cpu_clock=time.thread_time, *, by_cpu: bool = False) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self.by_cpu = by_cpu
        """Every figure by the main thread's CPU time (the plan's clock: one thread on a busy CPU), else the wall clock."""
        self._mark = clock()
        self._cpu_mark = cpu_clock()
        self._ready = self._mark
        self._requested: float | None = None
        self._warm_up = True
        self.wait_seconds: list[float] = []
        self.step_seconds: list[float] = []
        self.samples: list[int] = []
        self.total_seconds: list[float] = []
        """From the previous step's end to this one's: the wait, the step and the loop's own work."""
        self.cpu_seconds: list[float] = []
        """The main thread's CPU time from the previous step's end to this one's."""

    @classmethod
    def for_plan(cls, plan: Plan) -> "StepSpeed":
        """Timing by the plan's clock: CPU time where it timed with one thread on the CPU (``step_clock``)."""
        return cls(by_cpu=plan.device.type == "cpu" and plan.measured is not None and plan.measured.threads == 1)

    @property
    def clock_words(self) -> str:
        """How every figure of the run was timed, for its lines."""
        if self.by_cpu:
            return "by the step's CPU time, as the plan timed it (one thread), reading the batch included"
        return "by the wall clock, the wait for data included"

    def start(self, *, warm_up: bool = False) -> None:
        """Timing starts now (an epoch's start, ``warm_up``: its first step is not counted; or after a pause for saving)."""
        self._mark, self._cpu_mark = self._clock(), self._cpu_clock()
        self._warm_up = self._warm_up or warm_up

    def timed(self, loader: Iterable) -> Iterator:
        """The loader's items, the wait for each measured from asking for it to having it (not the loop's own work
        between steps: logging, the gauge)."""
        items = iter(loader)
        while True:
            self._requested = self._clock()
            try:
                item = next(items)
            except StopIteration:
                return
            self.batch_ready()
            yield item

    def batch_ready(self) -> None:
        self._ready = self._clock()

    def step_done(self, samples: int, *, counted: bool = True) -> float:
        """The step has ended: count it (unless it warms up, or not ``counted``: a step the budget watch tracked), and
        return its seconds since the last mark (the previous step's end, or ``start``) by the run's clock, reading its
        batch included: the loop's per-step speed."""
        now, cpu_now = self._clock(), self._cpu_clock()
        seconds = cpu_now - self._cpu_mark if self.by_cpu else now - self._mark
        if self._warm_up:
            self._warm_up = False
        elif counted:
            requested = self._requested if self._requested is not None else self._mark
            self.wait_seconds.append(max(self._ready - max(requested, self._mark), 0.0))
            self.total_seconds.append(now - self._mark)
            self.step_seconds.append(now - self._ready)
            self.cpu_seconds.append(cpu_now - self._cpu_mark)
            self.samples.append(samples)
        self._mark, self._cpu_mark, self._requested = now, cpu_now, None
        return seconds

    def samples_per_s(self, *, since: int = 0) -> float | None:
        """The median step's samples/s by the run's clock, over the steps counted from the ``since``-th on (``counted``
        before an epoch began: that epoch's); None before a step was counted there."""
        seconds = (self.cpu_seconds if self.by_cpu else self.total_seconds)[since:]
        if not seconds:
            return None
        return statistics.median(n / max(t, 1e-12) for n, t in zip(self.samples[since:], seconds))

    @property
    def counted(self) -> int:
        """Steps counted so far."""
        return len(self.samples)

    def lines(self, plan: Plan) -> list[str]:
        """The summary: training's speed beside the plan's, a warning when they differ by more than the plan's noise,
        and a line when waiting on the DataLoader bounds the speed. Empty before a step was counted."""
        speed = self.samples_per_s()
        if speed is None:
            return []
        seq_len = plan.model.seq_len

        def rate(samples_per_s: float) -> str:
            """In the epoch lines' unit, samples/s; a text model's tokens/s beside it, as the plan's summary writes it."""
            return f"{samples_per_s:.1f} samples/s" + (f" ({samples_per_s * seq_len:.1f} tokens/s)" if seq_len else "")

        counted = f"median of {len(self.samples)} step(s) {self.clock_words}"
        measured = plan.measured.samples_per_s if plan.measured is not None else None
        if not measured:
            lines = [f"speed: training {rate(speed)} ({counted}); the plan has no measured speed to compare with"]
        else:
            noise = plan.measured.noise
            tolerance = max(noise or 0.0, DEFAULT_TOLERANCE)
            ratio = speed / measured
            said = f"noise {noise:.0%}" if noise is not None else "no noise reported"
            lines = [f"speed: training {rate(speed)} ({counted}), the plan measured {rate(measured)} ({said}): {ratio:.2f}x"]
            if abs(ratio - 1.0) > tolerance:
                way = "slower" if ratio < 1 else "faster"
                lines.append(
                    f"warning: training ran {way} than the plan measured, by more than the plan's noise and the "
                    f"loop's own work allow ({abs(ratio - 1.0):.0%} > {tolerance:.0%}); other work on the machine, a different thread "
                    f"count or the data path can do that"
                )
        waited, stepped, total = sum(self.wait_seconds), sum(self.step_seconds), sum(self.total_seconds)
        if waited > DATA_BOUND_SHARE * total:
            lines.append(
                f"data loading bounds the speed: {waited:.1f} s waiting on the DataLoader vs {stepped:.1f} s in the "
                f"steps ({waited / total:.0%} of the time); try more --workers"
            )
        return lines
