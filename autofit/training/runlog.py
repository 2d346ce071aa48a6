"""The run's log in its log dir: metrics.jsonl and TensorBoard events, written by rank 0 only."""
from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time
from pathlib import Path

from autofit.atomic import write_atomic
from autofit.plan_file import Plan, save_plan


class RunLog:
    """metrics.jsonl (one JSON object per line) and TensorBoard events in the log dir.

    The JSON line is written at once, for every step. TensorBoard gets a
    step's scalars at most every ``tensorboard_interval_s`` (each step when
    steps are slower; the last step before an epoch record or a flush
    always): building its events costs 0.1-0.25 ms a step, and on a
    background thread it still holds the interpreter lock the training
    thread needs to launch kernels (bench/RESULTS.md, "Loop overhead"). On
    resume, records after the saved position (steps a killed run did but
    never saved) are dropped, so the log matches what the weights have seen.
    """

    tensorboard_interval_s = 0.2

    _SCALARS = {
        "step": ("loss", "lr", "samples_per_s", "memory_bytes"),
        "epoch": ("train_loss", "val_loss", "val_accuracy", "val_perplexity", "samples_per_s", "peak_bytes"),
    }

    def __init__(self, log_dir: Path, *, keep_until_step: int, keep_until_epoch: int) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "metrics.jsonl"
        kept = [line for line in _read_lines(path) if _keep(line, keep_until_step, keep_until_epoch)]
        write_atomic(path, "".join(kept))
        self.metrics = path.open("a")
        self.tensorboard_error: Exception | None = None
        self._events: queue.Queue = queue.Queue()
        self._held_step: dict | None = None
        """The latest step record not sent to TensorBoard yet (too soon after the one before)."""
        self._sent_at = -math.inf
        self._tensorboard_thread = threading.Thread(
            target=self._write_events, args=(str(log_dir), keep_until_step + 1 if keep_until_step else None),
            name="autofit-tensorboard", daemon=True,
        )
        self._tensorboard_thread.start()

    def step(self, record: dict) -> None:
        self.write(record)
        now = time.perf_counter()
        if now - self._sent_at >= self.tensorboard_interval_s:
            self._events.put(record)
            self._held_step, self._sent_at = None, now
        else:
            self._held_step = record

    def epoch(self, record: dict) -> None:
        self.write(record)
        self._send_held_step()
        self._events.put(record)
        self.flush()

    def _send_held_step(self) -> None:
        if self._held_step is not None:
            self._events.put(self._held_step)
            self._held_step = None

    def write(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")

    def save_plan(self, plan: Plan) -> None:
        """plan.json: the plan this run trains with."""
        save_plan(plan, self.log_dir / "plan.json")

    def flush(self) -> None:
        """Everything logged so far is on disk when this returns."""
        self.metrics.flush()
        self._send_held_step()
        self._events.put("flush")
        self._events.join()

    def _write_events(self, log_dir: str, purge_step: int | None) -> None:
        writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir, purge_step=purge_step)
        except Exception as error:  # TensorBoard is a view: training and metrics.jsonl go on without it
            self.tensorboard_error = error
        while True:
            record = self._events.get()
            try:
                if record is None:
                    break
                if writer is None:
                    continue
                if record == "flush":
                    writer.flush()
                    continue
                for name in self._SCALARS[record["kind"]]:
                    if record[name] is not None:
                        writer.add_scalar(f"{record['kind']}/{name}", record[name], record["step"])
            except Exception as error:
                self.tensorboard_error = self.tensorboard_error or error
            finally:
                self._events.task_done()
        if writer is not None:
            writer.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.metrics.close()
        self._send_held_step()
        self._events.put(None)
        self._tensorboard_thread.join()
        if self.tensorboard_error is not None:
            print(f"autofit: TensorBoard events were not all written ({self.tensorboard_error!r}); metrics.jsonl is complete", file=sys.stderr)


class SilentRunLog:
    """``RunLog``'s interface, writing nothing: the log of a rank other than 0 (rank 0 logs the run)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def step(self, record: dict) -> None:
        pass

    def epoch(self, record: dict) -> None:
        pass

    def write(self, record: dict) -> None:
        pass

    def save_plan(self, plan: Plan) -> None:
        pass

    def flush(self) -> None:
        pass

    def __enter__(self) -> SilentRunLog:
        return self

    def __exit__(self, *exc) -> None:
        pass


def open_run_log(log_dir: Path, *, keep_until_step: int, keep_until_epoch: int, writes: bool) -> RunLog | SilentRunLog:
    """The run's log: a ``RunLog`` in the one process that ``writes``, a silent one elsewhere."""
    if not writes:
        return SilentRunLog(log_dir)
    return RunLog(log_dir, keep_until_step=keep_until_step, keep_until_epoch=keep_until_epoch)


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def _keep(line: str, until_step: int, until_epoch: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False  # a line cut short by a kill
    if record.get("kind") == "epoch":
        return record["epoch"] <= until_epoch
    return record.get("step", 0) <= until_step
