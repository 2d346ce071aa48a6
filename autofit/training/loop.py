"""The shared training loop behind ``autofit train`` and ``autofit.fit()``.

Read ``train`` top to bottom: apply the plan, build the optimizer and the
schedule, maybe resume, then epochs of steps, each step being
``autofit.training.step.train_step`` (the step the probe measures) over one global
batch, then validation and checkpoints. Strategies live in ``apply_plan``;
the loop never asks which precision or split it runs.

Files in the log dir: ``metrics.jsonl`` (one JSON object per line, kind
"step", "epoch" or "oom"), TensorBoard event files, ``plan.json`` (the plan
this run trains with, rewritten when it changes), ``last.pt`` (everything
``--resume`` needs) and ``best.pt`` (best validation accuracy so far).

A plan for several processes runs this same loop in each process torchrun
starts: ``apply_plan`` shards the model and gives each rank its share of every
global batch; the logged loss is the mean over the ranks; only rank 0 writes
the log files and prints; the model and optimizer are saved by every rank
with torch.distributed.checkpoint into ``last_sharded/`` (what ``--resume``
reads), and rank 0 writes last.pt and best.pt with whole weights.
"""
from __future__ import annotations

import json
import math
import queue
import random
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from autofit.apply import AppliedPlan, apply_plan
from autofit.model_io import Scores, batch_size_of, call_model
from autofit.training.data import TrainData, collate_pairs, epoch_order, make_loader
from autofit.training.distributed import any_rank, is_rank0, mean_across_ranks, sum_across_ranks
from autofit.training.sharded_checkpoints import (
    full_model_state_dict,
    load_rank_extra,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from strategies import micro_batch_count, rank_slice
from autofit.errors import UserError
from autofit.measure.meters import release_device_memory
from autofit.plan_file import Plan, plan_from_dict, save_plan
from autofit.spec import model_fingerprint
from autofit.training.step import StepResult, to_device, train_step
from autofit.units import format_bytes
from autofit.training.weights import load_checkpoint, save_checkpoint


@dataclass(kw_only=True, slots=True)
class TrainSettings:
    """How long and where to train; everything about memory comes from the plan."""

    epochs: int
    """Passes over the training data (in total, counting those before a resume)."""
    log_dir: Path
    """metrics.jsonl, TensorBoard events, plan.json, last.pt and best.pt go here."""
    lr: float | None = None
    """Peak learning rate; None keeps the optimizer's. It decays by a cosine to a tenth over the run."""
    resume: bool = False
    """Continue from log_dir/last.pt: weights, optimizer, scaler, schedule, RNG and data position."""
    seed: int = 0
    """Fixes the data order of every epoch and the RNG (dropout)."""
    num_workers: int = 0
    """DataLoader worker processes; 0 loads in the training process."""
    save_every_steps: int = 0
    """Also save last.pt every this many steps; 0 saves at each epoch end (and on Ctrl-C)."""
    max_steps: int | None = None
    """Stop (after saving last.pt) once this many optimizer steps are done in total."""
    max_nonfinite_steps: int = 5
    """Stop after this many steps in a row whose loss is inf or nan."""
    verbose: bool = True
    """Show the progress bar and print a line per epoch."""

    def __post_init__(self) -> None:
        self.log_dir = Path(self.log_dir)
        if self.epochs < 1:
            raise UserError(f"--epochs {self.epochs} must be at least 1")
        if self.lr is not None and not self.lr > 0:
            raise UserError(f"--lr {self.lr} must be a positive number, e.g. 1e-3")
        if self.num_workers < 0:
            raise UserError(f"--workers {self.num_workers} must be 0 or more")
        if self.save_every_steps < 0:
            raise UserError(f"--save-every {self.save_every_steps} must be 0 (each epoch) or a number of steps")


@dataclass(kw_only=True, slots=True)
class TrainResult:
    plan: Plan
    """The plan the run ended with (its history lists changes made while training)."""
    history: list[dict]
    """One record per finished epoch: train_loss, val_loss, val_accuracy, ..."""
    best_path: Path | None
    """best.pt; None when no epoch finished."""
    last_path: Path
    log_dir: Path
    finished: bool
    """False when max_steps stopped the run before its last epoch ended."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after a step; last.pt holds everything to resume."""

    def __init__(self, *, last_path: Path, epoch: int, step: int) -> None:
        super().__init__(f"interrupted at epoch {epoch}, step {step}; saved {last_path}")
        self.last_path, self.epoch, self.step = last_path, epoch, step


@dataclass(kw_only=True, slots=True)
class Position:
    """Where the run is; saved in last.pt so a resumed run continues at the same batch."""

    epoch: int = 0
    """Epochs finished."""
    step_in_epoch: int = 0
    """Global batches done in the current epoch."""
    global_step: int = 0
    """Optimizer steps done in the whole run."""
    epoch_loss_sum: float = 0.0
    """Sum of per-sample loss over the current epoch's finite steps."""
    epoch_samples: int = 0
    epoch_seconds: float = 0.0


def train(
    model: nn.Module,
    *,
    plan: Plan,
    data: TrainData,
    loss_fn: Callable,
    build_optimizer: Callable,
    model_source: dict,
    settings: TrainSettings,
) -> TrainResult:
    """Train ``model`` with ``plan`` on ``data``; see the module docstring for what is written.

    Args:
        model: the model the plan was made for (trained in place).
        plan: the plan; on resume, the plan saved in last.pt is used instead.
        data: train (and val) datasets yielding (input, target).
        loss_fn: (output, target) -> mean loss.
        build_optimizer: params -> Optimizer.
        model_source: {"source", "input_shape", "num_classes"}, saved with the
            weights so ``weights.model_from_checkpoint`` can rebuild the model.
        settings: epochs, log dir, resume, ...

    Returns:
        The final plan, the epoch records and the paths of best.pt and last.pt.

    Raises:
        UserError: a plan for another model, a log dir that already holds a run
            (without resume), repeated non-finite loss, out of memory at a
            micro-batch of 1.
        TrainingInterrupted: Ctrl-C; last.pt was saved first.
    """
    log_dir = settings.log_dir
    last_path = log_dir / "last.pt"
    _check_classes(plan, data)
    fingerprint = model_fingerprint(model)
    saved = _load_resume_state(last_path, model) if settings.resume else _check_fresh(last_path)
    if saved is not None:
        plan = plan_from_dict(saved["plan"], where=f"the plan saved in {last_path}")
    applied = apply_plan(model, plan)
    model = applied.model
    files = checkpoint_files(log_dir, world_size=applied.env.world_size)
    optimizer = build_optimizer(model.parameters())
    for group in optimizer.param_groups:
        group["lr"] = settings.lr or group["lr"]
    global_batch_size = plan.global_batch_size
    steps_per_epoch = math.ceil(len(data.train) / global_batch_size)
    scheduler = cosine_schedule(optimizer, total_steps=steps_per_epoch * settings.epochs)
    position, history, best_score = Position(), [], None
    # Each rank draws its own dropout masks; rank 0 (the only one on one device) those of the seed.
    torch.manual_seed(settings.seed + applied.env.rank)
    if saved is not None:
        training = files.restore(saved, model=model, optimizer=optimizer)
        position, history, best_score = _restore(training, applied=applied, scheduler=scheduler)
    # Rank 0 writes the log and prints; other ranks get a log that writes nothing and a quiet console.
    writes_log = applied.env.rank == 0
    gauge = memory_gauge(applied.device)
    log = open_run_log(log_dir, keep_until_step=position.global_step, keep_until_epoch=position.epoch, writes=writes_log)
    log.save_plan(plan)
    console, progress = _console_and_progress(verbose=settings.verbose and writes_log, budget_bytes=plan.budget_bytes)
    console.print(_header(plan, data, applied, gauge, log_dir), markup=False, highlight=False)
    if saved is not None:
        console.print(f"resuming from {last_path}: epoch {position.epoch + 1}, after step {position.global_step}", markup=False, highlight=False)

    def checkpoint() -> dict:
        """What last.pt holds besides weights, optimizer and RNG state (``files`` adds those); built when saved."""
        return {
            "model_source": model_source,
            "fingerprint": fingerprint,
            "classes": data.classes,
            "plan": plan.to_dict(),
            "training": {
                "scaler": applied.scaler.state_dict(),
                "scheduler": scheduler.state_dict(),
                "position": asdict(position),
                "history": history,
                "best_score": best_score,
                "seed": settings.seed,
            },
        }

    nonfinite_streak = 0
    with log, progress, _interrupt_flag() as interrupt:
        for epoch in range(position.epoch, settings.epochs):
            model.train()
            order = epoch_order(len(data.train), seed=settings.seed, epoch=epoch)
            loader = make_loader(
                data.train, batch_size=global_batch_size, order=order[position.step_in_epoch * global_batch_size:],
                num_workers=settings.num_workers,
            )
            bar = progress.add_task(
                f"epoch {epoch + 1}/{settings.epochs}", total=steps_per_epoch, completed=position.step_in_epoch,
                loss=math.nan, samples_per_s=0.0, memory="-", peak="-",
            )
            last_time = time.perf_counter()
            for inputs, targets in loader:
                batch_size = batch_size_of(inputs, targets)
                result, ooms = _train_global_batch(model, inputs, targets, applied=applied, loss_fn=loss_fn, optimizer=optimizer)
                loss = mean_across_ranks(result.loss).item()  # the global batch's mean loss; waits for the step
                lr = optimizer.param_groups[0]["lr"]
                if result.stepped:  # a step fp16's scaler skipped does not advance the schedule
                    scheduler.step()
                now = time.perf_counter()
                step_seconds, last_time = now - last_time, now
                position.step_in_epoch += 1
                position.global_step += 1
                position.epoch_seconds += step_seconds
                position.epoch_samples += batch_size
                nonfinite_streak = 0 if math.isfinite(loss) else nonfinite_streak + 1
                position.epoch_loss_sum += loss * batch_size if math.isfinite(loss) else 0.0
                for oom in ooms:
                    _record_oom(oom, plan=plan, log=log, console=console, epoch=epoch + 1, step=position.global_step)
                memory_bytes, peak_bytes = gauge.read()
                log.step({
                    "kind": "step", "epoch": epoch + 1, "step": position.global_step, "loss": loss, "lr": lr,
                    "samples_per_s": batch_size / step_seconds, "memory_bytes": memory_bytes, "peak_bytes": peak_bytes,
                    "budget_bytes": plan.budget_bytes, "stepped": result.stepped,
                })
                progress.update(
                    bar, advance=1, loss=loss, samples_per_s=batch_size / step_seconds,
                    memory=format_bytes(memory_bytes), peak=format_bytes(peak_bytes),
                )
                if nonfinite_streak >= settings.max_nonfinite_steps:
                    raise UserError(
                        f"the loss was not finite for {nonfinite_streak} steps in a row (epoch {epoch + 1}, step "
                        f"{position.global_step}, precision {plan.precision}); re-plan with bf16 or fp32 precision, "
                        f"or lower --lr (last.pt keeps the last good save)"
                    )
                interrupted = any_rank(interrupt.is_set(), device=applied.device)  # every rank stops at the same step
                if interrupted or position.global_step == settings.max_steps:
                    files.save_last(checkpoint(), model=model, optimizer=optimizer)
                    log.flush()
                    if interrupted:
                        raise TrainingInterrupted(last_path=last_path, epoch=epoch + 1, step=position.global_step)
                    return TrainResult(plan=plan, history=history, best_path=_existing(files.best_path), last_path=last_path,
                                       log_dir=log_dir, finished=False)
                if settings.save_every_steps and position.global_step % settings.save_every_steps == 0:
                    files.save_last(checkpoint(), model=model, optimizer=optimizer)
                    last_time = time.perf_counter()  # the pause for saving is not training time

            val = evaluate(model, data.val, loss_fn=loss_fn, applied=applied, num_workers=settings.num_workers)
            train_loss = position.epoch_loss_sum / position.epoch_samples if position.epoch_samples else math.nan
            record = {
                "kind": "epoch", "epoch": epoch + 1, "step": position.global_step, "loss": train_loss,
                "lr": optimizer.param_groups[0]["lr"],
                "samples_per_s": position.epoch_samples / position.epoch_seconds if position.epoch_seconds else 0.0,
                "memory_bytes": gauge.now_bytes(), "peak_bytes": gauge.peak_bytes(), "budget_bytes": plan.budget_bytes,
                "train_loss": train_loss, "val_loss": val.loss, "val_accuracy": val.accuracy,
                "val_perplexity": val.perplexity,
            }
            history.append(record)
            log.epoch(record)
            console.print(_epoch_line(record, epochs=settings.epochs), markup=False, highlight=False)
            position = Position(epoch=epoch + 1, global_step=position.global_step)
            score = _score(record)
            improved = best_score is None or score > best_score
            best_score = score if improved else best_score
            saved_now = files.save_last(checkpoint(), model=model, optimizer=optimizer)
            if improved:
                # best.pt is for using the weights: no optimizer state, no RNG.
                files.save_best({**saved_now, "training": {"epoch": epoch + 1, "metrics": record}})
            if any_rank(interrupt.is_set(), device=applied.device):  # Ctrl-C during validation
                raise TrainingInterrupted(last_path=last_path, epoch=epoch + 1, step=position.global_step)

    best = max(history, key=_score) if history else None
    if best is not None:
        console.print(_final_line(best, files.best_path), markup=False, highlight=False)
    return TrainResult(plan=plan, history=history, best_path=_existing(files.best_path), last_path=last_path,
                       log_dir=log_dir, finished=True)


def _record_oom(oom: dict, *, plan: Plan, log: RunLog | SilentRunLog, console, epoch: int, step: int) -> None:
    """Keep the run's plan true to what it trains with (plan.json now, last.pt at its next save), and say so."""
    plan.micro_batch_size, plan.grad_accum_steps = oom["micro_batch_size"], oom["grad_accum_steps"]
    plan.history.append({**oom, "epoch": epoch, "step": step})
    log.save_plan(plan)
    log.write({"kind": "oom", "epoch": epoch, "step": step, **oom})
    console.print(
        f"out of memory at micro-batch {oom['previous_micro_batch_size']}: now {oom['micro_batch_size']} "
        f"x {oom['grad_accum_steps']} (global batch {oom['global_batch_size']} unchanged)",
        markup=False, highlight=False,
    )


def default_log_dir(root: str | Path = "runs") -> Path:
    """runs/<date>-<time>, with a suffix when that folder already exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = Path(root) / stamp, 1
    while candidate.exists():
        n += 1
        candidate = Path(root) / f"{stamp}-{n}"
    return candidate


def _train_global_batch(model, inputs, targets, *, applied: AppliedPlan, loss_fn, optimizer) -> tuple[StepResult, list[dict]]:
    """One optimizer step over a global batch, redone with half the micro-batch after an out-of-memory error.

    Returns:
        The step's result, and one record per micro-batch change made.
    """
    ooms = []
    while True:
        try:
            result = train_step(applied, inputs, targets, loss_fn=loss_fn, optimizer=optimizer)
            return result, ooms
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            message = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        # Here, outside the except block, the failed step's frames and tensors are gone.
        optimizer.zero_grad(set_to_none=True)  # drop the partial gradients of the failed step
        release_device_memory(applied.device.type)
        previous = applied.micro_batch_size
        applied.halve_micro_batch()
        ooms.append({
            "event": "out_of_memory", "error": message, "previous_micro_batch_size": previous,
            "micro_batch_size": applied.micro_batch_size, "grad_accum_steps": applied.grad_accum_steps,
            "global_batch_size": applied.split.config.global_batch_size,
        })


def is_out_of_memory(error: BaseException) -> bool:
    """True for torch.OutOfMemoryError and RuntimeErrors that say "out of memory"."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


@torch.no_grad()
def evaluate(model: nn.Module, dataset, *, loss_fn, applied: AppliedPlan, num_workers: int) -> Scores:
    """Mean loss (over the items the loss counts), and accuracy or perplexity, over ``dataset`` in micro-batches.

    On several processes each rank evaluates its contiguous share and the sums
    are added over the ranks. Every rank runs as many forwards (FSDP gathers
    parameters in each, a collective): a rank one batch short runs one on a
    sample it does not count.

    Accuracy is None unless the output (or its ``.logits``) is (B, classes) and
    the labels (B,); perplexity is set for a language model's loss. Without a
    dataset all three are None.
    """
    scores = Scores(loss_fn)
    if dataset is None:
        return scores
    model.eval()
    env = applied.env
    share = rank_slice(len(dataset), rank=env.rank, world_size=env.world_size)
    batches = micro_batch_count(len(dataset), world_size=env.world_size, micro_batch_size=applied.micro_batch_size)
    loader = make_loader(dataset, batch_size=applied.micro_batch_size, order=range(share.start, share.stop), num_workers=num_workers)
    for inputs, targets, counted in _padded_batches(loader, batches=batches, dataset=dataset):
        inputs, targets = to_device(inputs, applied.device), to_device(targets, applied.device)
        with applied.forward_context():
            scores.add(call_model(model, inputs), inputs, targets, counted=counted)
    model.train()
    totals = torch.tensor(scores.totals(), dtype=torch.float64, device=applied.device)
    scores.set_totals(sum_across_ranks(totals).tolist())
    return scores


def _padded_batches(loader, *, batches: int, dataset):
    """Yield (inputs, targets, 1) per batch of ``loader``, then (the dataset's first sample, 0) up to ``batches``."""
    done = 0
    for inputs, targets in loader:
        yield inputs, targets, 1
        done += 1
    if done < batches:
        inputs, targets = collate_pairs([dataset[0]])
        for _ in range(batches - done):
            yield inputs, targets, 0


def cosine_schedule(optimizer: torch.optim.Optimizer, *, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate falls from its peak to a tenth of it along half a cosine over ``total_steps``."""

    def factor(step: int) -> float:
        progress = min(step, total_steps) / max(total_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
        path.write_text("".join(kept))
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


class LocalCheckpoints:
    """last.pt and best.pt of a run in one process: last.pt holds the weights and everything ``--resume`` needs."""

    def __init__(self, log_dir: Path) -> None:
        self.last_path, self.best_path = log_dir / "last.pt", log_dir / "best.pt"

    def save_last(self, checkpoint: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Add weights, optimizer and RNG state to ``checkpoint`` and save it as last.pt.

        Returns:
            The checkpoint with its weights (best.pt reuses them).
        """
        training = {**checkpoint["training"], "optimizer": optimizer.state_dict(), "rng": _rng_state()}
        checkpoint = {**checkpoint, "model_state": model.state_dict(), "training": training}
        save_checkpoint(self.last_path, checkpoint)
        return checkpoint

    def save_best(self, checkpoint: dict) -> None:
        save_checkpoint(self.best_path, checkpoint)

    def restore(self, saved: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Load weights and optimizer state from ``saved`` (last.pt as read); returns its training state."""
        model.load_state_dict(saved["model_state"])
        optimizer.load_state_dict(saved["training"]["optimizer"])
        return saved["training"]


class ShardedCheckpoints(LocalCheckpoints):
    """Checkpoints of a run on several processes (each method is a collective: every rank calls it).

    ``last_sharded/`` is what ``--resume`` reads: model and optimizer saved
    with torch.distributed.checkpoint (each rank its shards), rank 0's
    training state and each rank's RNG state; it is replaced only once
    complete. Rank 0 then writes last.pt and best.pt with whole weights, as
    one process does, so ``autofit val`` and ``export`` read them (last.pt's
    optimizer state stays in ``last_sharded/``).
    """

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.sharded_dir = log_dir / "last_sharded"

    def save_last(self, checkpoint: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        rng = _rng_state()
        save_sharded_checkpoint(self.sharded_dir, model=model, optimizer=optimizer, extra=checkpoint["training"], rank_extra={"rng": rng})
        training = {**checkpoint["training"], "rng": rng, "optimizer": f"in {self.sharded_dir.name}/"}
        checkpoint = {**checkpoint, "model_state": full_model_state_dict(model), "training": training}
        if is_rank0():
            save_checkpoint(self.last_path, checkpoint)
        return checkpoint

    def save_best(self, checkpoint: dict) -> None:
        if is_rank0():
            save_checkpoint(self.best_path, checkpoint)

    def restore(self, saved: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        training = load_sharded_checkpoint(self.sharded_dir, model=model, optimizer=optimizer)
        return {**training, **load_rank_extra(self.sharded_dir)}


def checkpoint_files(log_dir: Path, *, world_size: int) -> LocalCheckpoints:
    """How a run on ``world_size`` processes saves and resumes."""
    return ShardedCheckpoints(log_dir) if world_size > 1 else LocalCheckpoints(log_dir)


class MemoryGauge:
    """Memory now and at its peak, cheap enough to read every step.

    ``read`` asks the device at most every ``interval_s`` and otherwise
    returns the last reading (on CUDA one reading builds the allocator's whole
    statistics dict); the peak is a running maximum, so none is missed.
    """

    note = ""
    interval_s = 0.5

    def __init__(self) -> None:
        self._read_at = -math.inf
        self._reading = (0, 0)

    def read(self) -> tuple[int, int]:
        """(now_bytes, peak_bytes), at most ``interval_s`` old."""
        now = time.perf_counter()
        if now - self._read_at >= self.interval_s:
            self._reading, self._read_at = (self.now_bytes(), self.peak_bytes()), now
        return self._reading

    def now_bytes(self) -> int:
        raise NotImplementedError

    def peak_bytes(self) -> int:
        raise NotImplementedError


class ProcessMemory(MemoryGauge):
    """CPU: the process's resident set (no tensor tracking while training: it would slow every step).

    It counts the interpreter and libraries too, so it reads above the plan's
    budget, which counts tensor bytes only (the cpu-tracked meter).
    """

    note = "memory is the process's resident set (interpreter included); the budget counts tensor bytes"

    def __init__(self) -> None:
        super().__init__()
        self._page_bytes = resource.getpagesize()

    def now_bytes(self) -> int:
        try:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * self._page_bytes
        except OSError:
            return self.peak_bytes()

    def peak_bytes(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class CudaMemory(MemoryGauge):
    """CUDA: bytes allocated now, and the allocator's peak reserved bytes since training began."""

    note = "memory is allocated now and peak reserved by the CUDA allocator"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)

    def now_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


def memory_gauge(device: torch.device) -> MemoryGauge:
    return CudaMemory(device) if device.type == "cuda" else ProcessMemory()


@contextmanager
def _interrupt_flag():
    """The first Ctrl-C sets the flag (the loop saves after its step and stops); a second one aborts."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signals reach only the main thread
        return

    def request_stop(signum, frame) -> None:
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()

    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_classes(plan: Plan, data: TrainData) -> None:
    planned = plan.model.get("num_classes")
    if planned and data.classes and len(data.classes) != planned:
        raise UserError(
            f"the data in {data.source} has {len(data.classes)} classes but the plan's model has {planned} outputs; "
            "train on data with those classes or re-plan a model with as many outputs"
        )


def _check_fresh(last_path: Path) -> None:
    if last_path.exists():
        raise UserError(
            f"{last_path.parent} already holds a run ({last_path.name}); continue it with --resume "
            "or choose another --log-dir"
        )
    return None


def _load_resume_state(last_path: Path, model: nn.Module) -> dict:
    if not last_path.exists():
        raise UserError(f"--resume: {last_path} does not exist; give the --log-dir of a run that saved last.pt")
    saved = load_checkpoint(last_path)
    if "training" not in saved or "position" not in saved["training"]:
        raise UserError(f"--resume: {last_path} holds no training state; is it a best.pt copied over?")
    if saved.get("fingerprint") != model_fingerprint(model):
        raise UserError(
            f"--resume: {last_path} was saved from another model (parameter names or shapes differ); "
            "resume with the model file it was trained with"
        )
    return saved


def _restore(training: dict, *, applied: AppliedPlan, scheduler) -> tuple[Position, list[dict], float | None]:
    applied.scaler.load_state_dict(training["scaler"])
    scheduler.load_state_dict(training["scheduler"])
    _set_rng_state(training["rng"])
    return Position(**training["position"]), list(training["history"]), training["best_score"]


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _score(record: dict) -> float:
    """Higher is better: validation accuracy, else minus the validation loss, else minus the training loss."""
    if record["val_accuracy"] is not None:
        return record["val_accuracy"]
    loss = record["val_loss"] if record["val_loss"] is not None else record["train_loss"]
    return -loss if math.isfinite(loss) else -math.inf


def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


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


def _console_and_progress(*, verbose: bool, budget_bytes: int):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(quiet=not verbose, highlight=False, soft_wrap=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[samples_per_s]:.0f} samples/s"),
        TextColumn(f"mem {{task.fields[memory]}} peak {{task.fields[peak]}} / budget {format_bytes(budget_bytes)}"),
        TimeRemainingColumn(),
        console=console,
        # A bar is for a terminal; in a log file the per-epoch lines say it all.
        disable=not (verbose and console.is_terminal),
    )
    return console, progress


def _header(plan: Plan, data: TrainData, applied: AppliedPlan, gauge, log_dir: Path) -> str:
    classes = f", {len(data.classes)} classes" if data.classes else ""
    val = f" / {len(data.val)} val" if data.val is not None else " (no validation data)"
    skipped = f"; skipped {data.skipped_images} unreadable image(s)" if data.skipped_images else ""
    blocks = f"checkpoint {len(plan.checkpoint)} block(s)"
    world_size = applied.env.world_size
    ranks = f"{world_size} processes ({plan.sharding}) x " if world_size > 1 else ""
    where = f"{applied.device.type} per process; rank 0's " if world_size > 1 else f"{applied.device}; "
    return (
        f"data {data.source}: {len(data.train)} train{val} samples{classes}{skipped}\n"
        f"plan: batch {plan.global_batch_size} = {ranks}micro-batch {applied.micro_batch_size} x {applied.grad_accum_steps}, "
        f"{plan.precision}, {blocks}, budget {format_bytes(plan.budget_bytes)} on {where}{gauge.note}\n"
        f"logs and weights: {log_dir}"
    )


def _epoch_line(record: dict, *, epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f}"]
    if record["val_loss"] is not None:
        parts.append(f"val loss {record['val_loss']:.4f}")
    if record["val_accuracy"] is not None:
        parts.append(f"val accuracy {record['val_accuracy']:.4f}")
    if record.get("val_perplexity") is not None:
        parts.append(f"val perplexity {record['val_perplexity']:.2f}")
    return ", ".join(parts) + f" ({record['samples_per_s']:.0f} samples/s)"


def _final_line(best: dict, best_path: Path) -> str:
    if best["val_accuracy"] is not None:
        return f"validation accuracy {best['val_accuracy']:.4f} (best, epoch {best['epoch']}); weights: {best_path}"
    return f"best epoch {best['epoch']} (loss {best['val_loss'] if best['val_loss'] is not None else best['train_loss']:.4f}); weights: {best_path}"
