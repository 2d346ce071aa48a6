"""Other work on this machine: how many cores it holds now, read where the planner chooses its threads and workers.

Both choices follow the same reading (``other_work``): the tasks the kernel
counts running now, and only where that cannot be read the load average's
last minute, which lags both ways. It saw two busy processes started 5 s
before a plan as load 1.2 on 2 cores, and still read 2.5 a minute after they
had ended.
"""
from __future__ import annotations

import os
import time


def other_runnable(readings: int = 20, gap_s: float = 0.005) -> float | None:
    """Tasks other than this thread running or waiting for a core now: the kernel's count of runnable tasks
    (``/proc/loadavg``'s fourth field, this thread included) averaged over ``readings`` 5 ms apart, less this
    one; None where it cannot be read (not Linux)."""
    counts = []
    try:
        for _ in range(readings):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]))
            time.sleep(gap_s)
    except (OSError, ValueError, IndexError):
        return None
    return max(sum(counts) / len(counts) - 1.0, 0.0)


def other_work() -> tuple[float, str] | None:
    """Cores other work holds now, and how that was seen ("2.0 other tasks running", "load average 3.0"):
    ``other_runnable``, else the load average less this process; None where neither can be read."""
    others = other_runnable()
    if others is not None:
        return others, f"{others:.1f} other tasks running"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average here (Windows)
        return None
    return max(load - 1.0, 0.0), f"load average {load:.1f}"  # this process is one of the runnable tasks counted


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
