"""The run's log in its log dir: metrics.jsonl and TensorBoard events, written by rank 0 only."""
from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

from autofit.atomic import write_atomic
from autofit.plan_file import Plan, save_plan
from autofit.training.rundir import RUN_PLAN


class RunLog:
    """metrics.jsonl (one JSON object per line) and TensorBoard events in the log dir.

    The JSON line is written at once, for every step. TensorBoard gets a
    step's scalars at most every ``tensorboard_interval_s`` (each step when
    steps are slower; the last step before an epoch record or a flush
    always): building its events costs 0.1-0.25 ms a step, and on a
    background thread it still holds the interpreter lock the training
    thread needs to launch kernels (bench/RESULTS.md, "Loop overhead"). On
    resume, records after the saved position (steps a killed run did but
    never saved) are dropped, so the log matches what the weights have seen,
    and so are lines that are no record (a line cut short by a kill, bytes
    that are not UTF-8, a bare number or list), counted in ``skipped_lines``.
    ``sync`` puts every record written so far on disk (flushed and fsynced):
    the loop calls it before each save of last.pt, so a record the weights
    have seen is never lost to a kill.
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
        records, self.skipped_lines = _read_records(path)
        kept = [line for line, record in records if _keep(record, keep_until_step, keep_until_epoch)]
        write_atomic(path, "".join(kept))
        self.metrics = path.open("a", encoding="utf-8")
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
        """run_plan.json: the plan this run trains with (``rundir.RUN_PLAN``, never the folder's plan.json)."""
        save_plan(plan, self.log_dir / RUN_PLAN)

    def sync(self) -> None:
        """Every record written so far is in metrics.jsonl on disk (flushed and fsynced) when this returns."""
        self.metrics.flush()
        os.fsync(self.metrics.fileno())

    def flush(self) -> None:
        """Everything logged so far, TensorBoard events too, is written out when this returns."""
        self.sync()
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
            try:
                writer.close()
            except Exception as error:  # a full disk at the last flush: said once at exit, as any other
                self.tensorboard_error = self.tensorboard_error or error

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.metrics.close()
        except OSError:
            if exc[0] is None:
                raise
            # Already failing (a full disk, most likely): that error is the one to report.
        finally:
            self._send_held_step()
            self._events.put(None)
            self._tensorboard_thread.join()
        if self.tensorboard_error is not None:
            print(f"autofit: TensorBoard events were not all written ({self.tensorboard_error!r}); metrics.jsonl is complete", file=sys.stderr)


class SilentRunLog:
    """``RunLog``'s interface, writing nothing: the log of a rank other than 0 (rank 0 logs the run)."""

    skipped_lines = 0

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

    def sync(self) -> None:
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


def _read_records(path: Path) -> tuple[list[tuple[str, dict]], int]:
    """metrics.jsonl's lines with their records, and how many lines hold none (garbage is skipped, not fatal)."""
    if not path.exists():
        return [], 0
    records, skipped = [], 0
    # What follows the last newline is a line cut short by a kill: never a record, not worth a word.
    for raw in path.read_bytes().split(b"\n")[:-1]:
        try:
            line = raw.decode("utf-8") + "\n"
            record = json.loads(line)
        except ValueError:  # not UTF-8 (UnicodeDecodeError) or not JSON
            skipped += raw.strip() != b""
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int) or not isinstance(record.get("epoch", 0), int):
            skipped += 1
            continue
        records.append((line, record))
    return records, skipped


def _keep(record: dict, until_step: int, until_epoch: int) -> bool:
    if record.get("kind") == "epoch":
        return record.get("epoch", 0) <= until_epoch
    return record.get("step", 0) <= until_step
