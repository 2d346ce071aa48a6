"""The shared training loop behind ``autofit train`` and ``autofit.fit()``.

Read ``train`` top to bottom: hold the log dir, start or resume, apply the
plan, build the optimizer and the schedule, open the log; then
``_train_epochs``: epochs of steps, each step being
``autofit.step.train_step`` (the step the probe measures) over one
global batch, redone exactly with half the micro-batch if it runs out of
memory, then validation and checkpoints. Strategies live in ``apply_plan``;
the loop never asks which precision or split it runs. What happens around a
step lives beside it: ``rundir`` (the lock, never erasing a run), ``resume``
(the run's own settings), ``state`` (position, history, the watch on
non-finite losses and weights: none is ever saved), ``recovery`` (out of
memory), ``checkpoints`` (last.pt, best.pt), ``runlog`` (metrics.jsonl,
TensorBoard), ``console`` (lines and progress bar), ``gauges`` (memory, the
budget watch) and ``validation``.

Files in the log dir: ``metrics.jsonl`` (one JSON object per line, kind
"step", "epoch", "oom", "unreadable" or "memory"), TensorBoard event files,
``run_plan.json`` (the plan this run trains with, rewritten when it changes),
``last.pt`` (everything ``--resume`` needs, settings included), ``best.pt``
(best validation accuracy so far) and ``.autofit.lock``. SIGINT, SIGTERM and
SIGHUP stop the run after its step with last.pt saved (``TrainingInterrupted``).

A plan for several processes runs this same loop in each process torchrun
starts: ``apply_plan`` shards the model and gives each rank its share of every
global batch; the logged loss is the mean over the ranks; only rank 0 writes
the log files and prints; the model and optimizer are saved by every rank
with torch.distributed.checkpoint into ``last_sharded/`` (what ``--resume``
reads), and rank 0 writes last.pt and best.pt with whole weights.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from autofit.apply import AppliedPlan, apply_plan
from autofit.errors import UserError, user_frame
from autofit.keywords import as_flags
from autofit.model_io import batch_size_of
from autofit.plan_file import Plan, plan_from_dict
from autofit.spec import model_fingerprint
from autofit.training.checkpoints import RunCheckpoints, checkpoint_files, load_resume_state
from autofit.training.speed import StepSpeed
from autofit.training.console import RunConsole, epoch_line, final_line, header, oom_line
from autofit.training.data import TrainData, epoch_order, make_loader
from autofit.training.first_batch import check_data_batches
from autofit.distributed import any_rank, is_rank0, mean_across_ranks
from autofit.training.gauges import BudgetWatch, MemoryGauge, memory_gauge
from autofit.training.images import Unreadable
from autofit.training.stops import StopRequest, disk_full_line, stop_on_signals, user_code_line
from autofit.training.recovery import MicroBatchChange, StepUndo, step_with_recovery
from autofit.training.resume import check_same_data, check_same_plan, data_fingerprint, finished_run, resumed_value
from autofit.training.rundir import discard_previous_run, hold_run_directory, log_dir_path, restore_previous_run, start_fresh
from autofit.training.runlog import RunLog, SilentRunLog, open_run_log
from autofit.training.schedule import check_schedule, lr_schedule
from autofit.training.state import NonFiniteWatch, RunState
from autofit.training.validation import evaluate


MAX_SEED = 2**32 - 1
"""The largest seed: 32 bits, as numpy's generators take; what a run derives from it (``epoch_order``'s
seed * 100003 + epoch, the rank added) stays well inside torch's 64."""


@dataclass(kw_only=True, slots=True)
class TrainSettings:
    """How long and where to train; everything about memory comes from the plan.

    A setting left None takes its default in a new run and the run's own
    (recorded in last.pt) on resume; see ``autofit.training.resume``.
    """

    epochs: int | None = None
    """Passes over the training data (in total, counting those before a resume). None: 1, or the run's own."""
    log_dir: Path | None = None
    """metrics.jsonl, TensorBoard events, run_plan.json, last.pt and best.pt go here. None:
    runs/<date>-<time>, which ``autofit.training.run.run_training`` picks (``train`` needs a folder)."""
    lr: float | None = None
    """Peak learning rate; None keeps the optimizer's (or the run's own). It follows ``schedule`` over the run."""
    schedule: str | None = None
    """After the warm-up: "cosine" or "linear" to a tenth of the peak, or "constant" (``training.schedule``). None:
    cosine, or the run's own."""
    warmup_steps: int | None = None
    """Optimizer steps of linear warm-up from 0 to the peak rate. None: 0, or the run's own."""
    resume: bool = False
    """Continue from log_dir/last.pt: weights, optimizer, scaler, schedule, RNG, data position and these settings."""
    overwrite: bool = False
    """A new run in a log dir that holds a run's files moves them aside and deletes them once it has saved its first
    checkpoint (``rundir.start_fresh``); without it such a start is refused."""
    seed: int | None = None
    """Fixes the data order of every epoch and the RNG (dropout). None: 0, or the run's own."""
    num_workers: int | None = 0
    """DataLoader worker processes; 0 loads in the training process; None: decided at the start by
    ``training.threads.default_workers`` (the cores the step's threads leave free, on the CPU)."""
    save_every_steps: int | None = None
    """Also save last.pt every this many steps; 0 saves at each epoch end (and when stopped). None: 0, or the run's own."""
    max_steps: int | None = None
    """Stop (after saving last.pt) once this many optimizer steps are done in total. On resume, None keeps
    the run's own limit while it is not reached (an interrupted run goes on to where it was going)."""
    max_nonfinite_steps: int = 5
    """Stop after this many steps in a row whose loss is inf or nan."""
    verbose: bool = True
    """Show the progress bar and print a line per epoch."""
    merge: bool | None = None
    """LoRA adapters are also saved merged into the base (``hf/merged``) when the run ends. None: no, or the run's
    own (a resumed run that merged merges again, so its hf/merged is never left behind its adapter)."""
    data_changed: bool = False
    """On resume: go on although the data is not what the run began with (``resume.check_same_data``); without it,
    such a resume is refused."""
    sources: dict = field(default_factory=dict)
    """Where the front end read the data and the model: {"data": folder, "model": file}, absolute paths or
    None; saved in last.pt so that a resume finds them again."""
    spell: Callable[[str], str] = as_flags
    """How the lines the run prints name a setting: the command line's flags, or ``keywords.in_python`` for a
    caller of ``autofit.fit`` (``num_workers``, not ``--workers``)."""

    def __post_init__(self) -> None:
        # Types first: a caller of fit() passes Python objects (lr="fast", log_dir=123), which would fail deep inside.
        if self.log_dir is not None and not isinstance(self.log_dir, (str, Path)):
            raise UserError(f"--log-dir {self.log_dir!r} is not a path ({type(self.log_dir).__name__}); give a folder's path, e.g. 'runs/NAME'")
        for flag, value in (("--epochs", self.epochs), ("--seed", self.seed), ("--workers", self.num_workers),
                            ("--save-every", self.save_every_steps), ("--max-steps", self.max_steps),
                            ("--warmup-steps", self.warmup_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise UserError(f"{flag} {value!r} is not a whole number ({type(value).__name__}); give one, e.g. 2")
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float))):
            raise UserError(f"--lr {self.lr!r} is not a number ({type(self.lr).__name__}); give a positive finite number, e.g. 1e-3")
        self.log_dir = log_dir_path(self.log_dir)
        if self.epochs is not None and self.epochs < 1:
            raise UserError(f"--epochs {self.epochs} must be at least 1")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"--lr {self.lr} must be a positive finite number, e.g. 1e-3")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed {self.seed} must be a whole number from 0 to {MAX_SEED}")
        if self.num_workers is not None and self.num_workers < 0:
            raise UserError(f"--workers {self.num_workers} must be 0 or more")
        if self.save_every_steps is not None and self.save_every_steps < 0:
            raise UserError(f"--save-every {self.save_every_steps} must be 0 (each epoch) or a number of steps")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps {self.max_steps} must be at least 1 (or left out: train every epoch)")
        check_schedule(self.schedule or "cosine", self.warmup_steps or 0)
        if self.resume and self.overwrite:
            raise UserError("--overwrite deletes the run that --resume would continue; give one of them")

    def for_new_run(self) -> TrainSettings:
        """These settings with every default filled in."""
        return dataclasses.replace(
            self, epochs=self.epochs or 1, seed=self.seed or 0, save_every_steps=self.save_every_steps or 0,
            schedule=self.schedule or "cosine", warmup_steps=self.warmup_steps or 0, merge=bool(self.merge),
        )

    def for_resume(self, recorded: dict, *, global_step: int) -> TrainSettings:
        """These settings completed from the run's ``recorded`` ones (last.pt's); see ``autofit.training.resume``.

        Raises:
            UserError: lr, seed or the data folder given differs from the run's, or ``max_steps`` is already
                reached.
        """
        where = self.log_dir
        if self.max_steps is not None and self.max_steps <= global_step:
            raise UserError(
                f"--max-steps {self.max_steps} is already reached: the run in {where} is at step {global_step}; "
                "give a larger --max-steps (it counts the run's steps from its start), or leave it out"
            )
        sources = dict(recorded.get("sources") or {})
        sources["data"] = resumed_value("data", self.sources.get("data"), sources.get("data"), where=where)
        sources["model"] = self.sources.get("model") or sources.get("model")  # where the file is now; its fingerprint is checked
        max_steps = self.max_steps
        if max_steps is None and (recorded.get("max_steps") or 0) > global_step:
            max_steps = recorded["max_steps"]
        return dataclasses.replace(
            self,
            epochs=self.epochs or recorded.get("epochs") or 1,
            lr=resumed_value("lr", self.lr, recorded.get("lr"), where=where) if "lr" in recorded else self.lr,
            seed=resumed_value("seed", self.seed, recorded.get("seed", 0), where=where),
            # A run from before these settings scheduled a cosine without warm-up.
            schedule=resumed_value("schedule", self.schedule, recorded.get("schedule", "cosine"), where=where),
            warmup_steps=resumed_value("warmup_steps", self.warmup_steps, recorded.get("warmup_steps", 0), where=where),
            save_every_steps=self.save_every_steps if self.save_every_steps is not None else recorded.get("save_every_steps", 0),
            max_steps=max_steps,
            sources=sources,
            merge=bool(self.merge or recorded.get("merge")),
        )

    def record(self) -> dict:
        """What last.pt keeps of these settings (``for_resume`` reads it back)."""
        return {
            "epochs": self.epochs, "lr": self.lr, "seed": self.seed, "save_every_steps": self.save_every_steps,
            "schedule": self.schedule, "warmup_steps": self.warmup_steps,
            "max_steps": self.max_steps, "sources": dict(self.sources), "merge": self.merge,
        }


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
    trained: bool = True
    """False for a resume of a run that had finished already: nothing was trained or written."""
    merge: bool = False
    """hf/ gets the adapters merged into the base too (``TrainSettings.merge``, the run's own on resume)."""


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

    The run holds its log dir (``autofit.training.rundir``): a second run
    there is refused while this one trains, and a new run never writes over
    an earlier one's files (``settings.overwrite`` deletes them first).

    Args:
        model: the model the plan was made for (trained in place).
        plan: the plan; on resume it must train as the plan saved in last.pt, which is used.
        data: train (and val) datasets yielding (input, target).
        loss_fn: (output, target) -> mean loss.
        build_optimizer: params -> Optimizer.
        model_source: {"source", "input_shape", "num_classes"}, saved with the
            weights so ``weights.model_from_checkpoint`` can rebuild the model.
        settings: epochs, log dir, resume, ...

    Returns:
        The final plan, the epoch records and the paths of best.pt and last.pt.

    Raises:
        UserError: a plan for another model; a log dir that another run holds,
            or that holds a run (without resume or overwrite); settings or a plan
            that differ from the resumed run's; repeated non-finite loss; weights
            no longer finite at a save (nothing is saved from them); out of
            memory at a micro-batch of 1 or where a step cannot be redone
            exactly; a full disk (last.pt keeps the last save).
        TrainingInterrupted: SIGINT (Ctrl-C), SIGTERM or SIGHUP; last.pt was saved first.
    """
    log_dir = settings.log_dir
    if log_dir is None:
        raise ValueError("settings.log_dir is None: give a folder (autofit.training.run.run_training picks runs/<date>-<time>)")
    _check_classes(plan, data)
    finished = finished_result(settings)
    if finished is not None:
        return finished
    with hold_run_directory(log_dir, holder=is_rank0()):
        try:
            try:
                return _train_run(
                    model, plan=plan, data=data, loss_fn=loss_fn, build_optimizer=build_optimizer, model_source=model_source,
                    settings=settings,
                )
            except OSError as error:
                if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise UserError(disk_full_line(error, log_dir)) from None
            except UserError:
                raise
            except Exception as error:
                frame = user_frame(error)
                if frame is None:  # autofit's or a library's own failure: its traceback is the report
                    raise
                raise UserError(user_code_line(error, frame, log_dir)) from error
        except BaseException:
            if is_rank0():
                restore_previous_run(log_dir)  # an --overwrite run that never saved gives the folder back
            raise


def finished_result(settings: TrainSettings) -> TrainResult | None:
    """For a resume of a run that has nothing left to do (``resume.finished_run``): its line printed, and its result
    as last.pt records it (``trained`` False: nothing was trained or written). None for any other start."""
    done = finished_run(settings.log_dir, epochs=settings.epochs, merge=settings.merge) if settings.resume else None
    if done is None:
        return None
    line, saved = done
    if settings.verbose and is_rank0():
        print(settings.spell(line), flush=True)
    plan = plan_from_dict(saved["plan"], where=f"the plan saved in {settings.log_dir / 'last.pt'}")
    files = checkpoint_files(settings.log_dir, world_size=plan.config.world_size)
    return TrainResult(
        plan=plan, history=saved["history"], best_path=files.best_path, last_path=files.last_path,
        log_dir=settings.log_dir, finished=True, trained=False,
    )


def _train_run(
    model: nn.Module, *, plan: Plan, data: TrainData, loss_fn: Callable, build_optimizer: Callable, model_source: dict,
    settings: TrainSettings,
) -> TrainResult:
    """``train`` in its held log dir: start or resume, apply the plan, open the log, train the epochs."""
    log_dir = settings.log_dir
    fingerprint = model_fingerprint(model)  # of the model as built: apply_plan may wrap it
    start = _start_or_resume(model, plan, data=data, settings=settings)
    plan, saved, settings = start.plan, start.saved, start.settings
    applied = apply_plan(model, plan)
    check_data_batches(applied, data, loss_fn=loss_fn)  # before step 1: data the model cannot take is one line
    optimizer = applied.build_optimizer(build_optimizer)
    scheduler = _schedule(optimizer, settings, steps_per_epoch=math.ceil(len(data.train) / plan.config.global_batch_size))
    # Each rank draws its own dropout masks; rank 0 (the only one on one device) those of the seed.
    torch.manual_seed(settings.seed + applied.env.rank)
    checkpoints = RunCheckpoints(
        log_dir, world_size=applied.env.world_size, model=applied.model, optimizer=optimizer, scheduler=scheduler,
        scaler=applied.scaler, about={"model_source": model_source, "fingerprint": fingerprint, "classes": data.classes},
        settings=settings.record(), seed=settings.seed,
    )
    state = checkpoints.restore(saved) if saved is not None else RunState()
    if saved is not None:
        checkpoints.repair_best(saved, state)
    # Rank 0 writes the log and prints; other ranks get a log that writes nothing and a quiet console.
    writes_log = applied.env.rank == 0
    gauge = memory_gauge(applied.device)
    log = open_run_log(log_dir, keep_until_step=state.position.global_step, keep_until_epoch=state.position.epoch, writes=writes_log)
    log.save_plan(plan)
    console = RunConsole(verbose=settings.verbose and writes_log, budget_bytes=plan.budget_bytes, spell=settings.spell)
    console.print(header(plan, data, applied, memory_note=gauge.note, log_dir=log_dir))
    if log.skipped_lines:
        console.print(f"metrics.jsonl: skipped {log.skipped_lines} unreadable line(s) of the earlier run")
    if saved is not None:
        console.print(f"resuming from {checkpoints.last_path}: epoch {state.position.epoch + 1}, after step {state.position.global_step}")

    speed = StepSpeed.for_plan(plan)  # one clock for every figure the run prints (``training.speed``)
    console.print(f"speed: every samples/s below is the median step {speed.clock_words} (each epoch's first step left out)")
    with log, console, BudgetWatch(plan, device=applied.device) as watch, stop_on_signals() as stop:
        finished, plan = _train_epochs(
            applied, data=data, loss_fn=loss_fn, optimizer=optimizer, scheduler=scheduler, plan=plan, state=state,
            checkpoints=checkpoints, log=log, console=console, gauge=gauge, watch=watch, stop=stop, settings=settings,
            speed=speed,
        )
    for line in speed.lines(plan):  # training's speed beside the plan's (``training.speed``)
        console.print(line)
    best = state.best_record() or state.stopped  # --max-steps before any epoch ended: best.pt holds the stop's weights
    if best is not None:
        console.print(final_line(best, checkpoints.best_path_if_saved(), held_epoch=checkpoints.best_epoch()))
    return TrainResult(
        plan=plan, history=state.history, best_path=checkpoints.best_path_if_saved(), last_path=checkpoints.last_path,
        log_dir=log_dir, finished=finished, merge=settings.merge,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _RunStart:
    """Where a run starts: its plan (a resumed run's own), its last.pt's state (None: a new run), its settings."""

    plan: Plan
    saved: dict | None
    settings: TrainSettings


def _start_or_resume(model: nn.Module, plan: Plan, *, data: TrainData, settings: TrainSettings) -> _RunStart:
    """A resumed run's state, plan and settings, checked against what was asked; or a fresh log dir.

    Raises:
        UserError: the plan or the data differ from the run's (as ``check_same_plan`` and ``check_same_data``).
    """
    log_dir = settings.log_dir
    fingerprint_now = data_fingerprint(
        settings.sources.get("data"), samples={"train": len(data.train), "val": len(data.val) if data.val is not None else 0},
        log_dir=log_dir,
    )
    if settings.resume:
        saved = load_resume_state(log_dir / "last.pt", model)
        position = saved["training"]["position"]
        saved_plan = plan_from_dict(saved["plan"], where=f"the plan saved in {log_dir / 'last.pt'}")
        settings = settings.for_resume(saved.get("settings") or {}, global_step=position["global_step"])
        check_same_plan(plan, saved_plan, where=log_dir)
        plan = saved_plan
        changed = check_same_data(
            settings.sources.get("data_fingerprint"), fingerprint_now, changed_ok=settings.data_changed, where=log_dir,
            data=settings.sources.get("data"),
        )
        if changed is not None and settings.verbose and is_rank0():
            print(settings.spell(changed), flush=True)
    else:
        if is_rank0():
            start_fresh(log_dir, overwrite=settings.overwrite)
        saved, settings = None, settings.for_new_run()
    # The data as this run (from now on) trains on it: what a later resume compares with.
    settings = dataclasses.replace(settings, sources={**settings.sources, "data_fingerprint": fingerprint_now})
    return _RunStart(plan=plan, saved=saved, settings=settings)


def _schedule(optimizer: torch.optim.Optimizer, settings: TrainSettings, *, steps_per_epoch: int):
    """The learning rate ``settings`` ask for (``--lr`` over the optimizer's own), and its schedule over the run."""
    if settings.lr:
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's 8-bit AdamW keeps it as a tensor
                group["lr"].fill_(settings.lr)
            else:
                group["lr"] = settings.lr
    return lr_schedule(
        optimizer, kind=settings.schedule, warmup_steps=settings.warmup_steps, total_steps=steps_per_epoch * settings.epochs,
    )


def _train_epochs(
    applied: AppliedPlan, *, data: TrainData, loss_fn: Callable, optimizer: torch.optim.Optimizer, scheduler, plan: Plan,
    state: RunState, checkpoints: RunCheckpoints, log: RunLog | SilentRunLog, console: RunConsole, gauge: MemoryGauge,
    watch: BudgetWatch, stop: StopRequest, settings: TrainSettings, speed: StepSpeed,
) -> tuple[bool, Plan]:
    """The epochs from ``state``'s position on: steps over global batches, then validation and last.pt (best.pt).

    Longer than the package's other functions on purpose: it is the training loop, read top to bottom as one ordered
    story (an epoch's loader, each step and what follows it, then the epoch's end), as nanoGPT's and torchtune's are.

    Returns:
        True when the last epoch ended, False when ``settings.max_steps`` stopped the run first; and the plan the
        run ended with (a new one after each out-of-memory error: ``Plan.changed``).
    """
    model, global_batch_size = applied.model, plan.config.global_batch_size
    steps_per_epoch = math.ceil(len(data.train) / global_batch_size)
    nonfinite = NonFiniteWatch(
        limit=settings.max_nonfinite_steps, precision=plan.config.precision,
        peak_lr=float(optimizer.param_groups[0]["initial_lr"]),  # the schedule's peak (LambdaLR keeps it)
    )
    undo = StepUndo(model, optimizer=optimizer, scaler=applied.scaler, device=applied.device)  # redoes a step after OOM
    for epoch in range(state.position.epoch, settings.epochs):
        position = state.position  # this epoch's: where it starts (mid-epoch on resume) and what it has done
        model.train()
        order = epoch_order(len(data.train), seed=settings.seed, epoch=epoch)
        loader = make_loader(
            data.train, batch_size=global_batch_size, order=order[position.step_in_epoch * global_batch_size:],
            num_workers=settings.num_workers, collate=data.collate,
        )
        console.start_epoch(epoch + 1, epochs=settings.epochs, steps=steps_per_epoch, done=position.step_in_epoch)
        speed.start(warm_up=True)
        epoch_began = speed.counted  # the epoch's figure: the median of its own steps
        for inputs, targets, unreadable in speed.timed(loader):  # the wait for each batch measured
            for sample in unreadable:
                position.skipped_images += 1
                _record_unreadable(sample, log=log, console=console, epoch=epoch + 1, step=position.global_step + 1)
            if inputs is None:
                position.skip_batch()
                continue
            batch_size = batch_size_of(inputs, targets)
            with watch.measuring(model, optimizer), nonfinite.overflow(step=position.global_step + 1):
                result, ooms = step_with_recovery(
                    applied, inputs, targets, loss_fn=loss_fn, optimizer=optimizer, undo=undo,
                    smallest_micro_batch=plan.model.min_micro_batch_size or 1,
                )
            loss = mean_across_ranks(result.loss).item()  # the global batch's mean loss; waits for the step
            lr = float(optimizer.param_groups[0]["lr"])
            if result.stepped:  # a step fp16's scaler skipped does not advance the schedule
                scheduler.step()
            step_seconds = speed.step_done(batch_size, counted=not watch.tracked_last)
            position.advance(samples=batch_size, loss=loss, seconds=step_seconds)
            for oom in ooms:
                plan = _record_oom(oom, plan=plan, log=log, console=console, epoch=epoch + 1, step=position.global_step)
                watch.micro_batch_changed()
            memory_bytes, peak_bytes = gauge.read()
            record = {
                "kind": "step", "epoch": epoch + 1, "step": position.global_step, "loss": loss, "lr": lr,
                "samples_per_s": batch_size / max(step_seconds, 1e-12), "memory_bytes": memory_bytes, "peak_bytes": peak_bytes,
                "budget_bytes": plan.budget_bytes, "stepped": result.stepped,
                # On the CPU the gauge is the process's resident set; the budget counts live tensors, as this does.
                "tensor_peak_bytes": watch.tracked_peak_bytes,
            }
            log.step(record)
            console.step(record)
            warning = watch.warning(peak_bytes)
            if warning:
                log.write({"kind": "memory", "epoch": epoch + 1, "step": position.global_step, "warning": warning})
                console.print(warning)
            nonfinite.check(loss, epoch=epoch + 1, step=position.global_step)
            interrupted = any_rank(stop.is_set(), device=applied.device)  # every rank stops at the same step
            if interrupted:
                _save_last(checkpoints, log, plan=plan, state=state, nonfinite=nonfinite, device=applied.device)
                log.flush()
                raise stop.interrupted(last_path=checkpoints.last_path, epoch=epoch + 1, step=position.global_step)
            if position.global_step == settings.max_steps:  # ends as an epoch does, mid-epoch: --resume continues it
                # last.pt first: it keeps the RNG as the step left it (validation's loader draws a seed from it).
                saved = _save_last(checkpoints, log, plan=plan, state=state, nonfinite=nonfinite, device=applied.device)
                record = _validated_record(
                    applied, "stop", data=data, loss_fn=loss_fn, optimizer=optimizer, plan=plan, position=position,
                    gauge=gauge, log=log, console=console, settings=settings, epoch=epoch,
                    samples_per_s=speed.samples_per_s(since=epoch_began),
                )
                log.write(record)
                console.print(
                    f"stopped at --max-steps {settings.max_steps}, step {position.step_in_epoch} of {steps_per_epoch} in "
                    + epoch_line(record, epochs=settings.epochs)
                )
                if not state.history:  # no epoch has finished: the weights at the stop are the run's best so far
                    checkpoints.save_best(saved, record=record)
                state.stopped = record
                log.flush()
                return False, plan
            if settings.save_every_steps and position.global_step % settings.save_every_steps == 0:
                _save_last(checkpoints, log, plan=plan, state=state, nonfinite=nonfinite, device=applied.device)
                speed.start()  # the pause for saving is not training time

        record = _validated_record(
            applied, "epoch", data=data, loss_fn=loss_fn, optimizer=optimizer, plan=plan, position=position, gauge=gauge,
            log=log, console=console, settings=settings, epoch=epoch, samples_per_s=speed.samples_per_s(since=epoch_began),
        )
        log.epoch(record)
        console.print(epoch_line(record, epochs=settings.epochs))
        improved = state.end_epoch(record)  # into the history; the next epoch's position
        saved = _save_last(checkpoints, log, plan=plan, state=state, nonfinite=nonfinite, device=applied.device)
        if improved:
            checkpoints.save_best(saved, record=record)
        if any_rank(stop.is_set(), device=applied.device):  # a signal during validation
            raise stop.interrupted(last_path=checkpoints.last_path, epoch=epoch + 1, step=position.global_step)
    return True, plan


def _validated_record(
    applied: AppliedPlan, kind: str, *, data: TrainData, loss_fn: Callable, optimizer: torch.optim.Optimizer, plan: Plan,
    position, gauge: MemoryGauge, log: RunLog | SilentRunLog, console: RunConsole, settings: TrainSettings, epoch: int,
    samples_per_s: float | None,
) -> dict:
    """Validation now, and the record of the epoch so far: an epoch's end ("epoch"), or --max-steps's stop ("stop").

    Args:
        samples_per_s: the epoch's median step by the run's clock (``StepSpeed``); None where none of its steps was
            counted (its one step warmed up): then its samples over its steps' seconds, by the same clock.
    """
    val = evaluate(
        applied.model, data.val, loss_fn=loss_fn, applied=applied, num_workers=settings.num_workers, collate=data.collate,
        on_unreadable=lambda sample: _record_unreadable(sample, log=log, console=console, epoch=epoch + 1, step=position.global_step),
    )
    return {
        "kind": kind, "epoch": epoch + 1, "step": position.global_step, "loss": position.train_loss,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "samples_per_s": samples_per_s if samples_per_s is not None else position.samples_per_s,
        "memory_bytes": gauge.now_bytes(), "peak_bytes": gauge.peak_bytes(), "budget_bytes": plan.budget_bytes,
        "train_loss": position.train_loss, "val_loss": val.loss, "val_accuracy": val.accuracy,
        "val_perplexity": val.perplexity,
        "skipped_images": position.skipped_images,
    }


def _save_last(
    checkpoints: RunCheckpoints, log: RunLog | SilentRunLog, *, plan: Plan, state: RunState, nonfinite: NonFiniteWatch,
    device: torch.device,
) -> dict:
    """Save last.pt once every record up to it is on disk (a run killed later loses no step it saved).

    Raises:
        UserError: the weights are no longer finite: no file is written from them (``NonFiniteWatch.check_weights``).
    """
    # Every save of last.pt, best.pt (its weights are last.pt's) and hf/ (written after the last one) passes here.
    nonfinite.check_weights(checkpoints.model, step=state.position.global_step, device=device)
    log.sync()
    saved = checkpoints.save_last(plan=plan, state=state)
    if is_rank0():
        discard_previous_run(checkpoints.last_path.parent)  # an --overwrite run's first save: the earlier run's files go
    return saved


def _record_oom(oom: MicroBatchChange, *, plan: Plan, log: RunLog | SilentRunLog, console: RunConsole, epoch: int, step: int) -> Plan:
    """The run's plan from now on, true to what it trains with (run_plan.json now, last.pt at its next save); says so."""
    plan = plan.changed(oom.config, event={**oom.record, "epoch": epoch, "step": step})
    log.save_plan(plan)
    log.write({"kind": "oom", "epoch": epoch, "step": step, **oom.record})
    console.print(oom_line(oom.record))
    return plan


def _record_unreadable(sample: Unreadable, *, log: RunLog | SilentRunLog, console: RunConsole, epoch: int, step: int) -> None:
    """An image that failed to decode: left out of its batch, named in metrics.jsonl and on the console."""
    log.write({"kind": "unreadable", "epoch": epoch, "step": step, "file": sample.path, "error": sample.reason})
    console.print(f"skipped an image that cannot be read: {sample.path} ({sample.reason})")


def default_log_dir(root: str | Path = "runs") -> Path:
    """runs/<date>-<time>, with a suffix when that folder already exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = Path(root) / stamp, 1
    while candidate.exists():
        n += 1
        candidate = Path(root) / f"{stamp}-{n}"
    return candidate


def _check_classes(plan: Plan, data: TrainData) -> None:
    planned = plan.model.num_classes
    if planned and data.classes and len(data.classes) != planned:
        raise UserError(
            f"the data in {data.source} has {len(data.classes)} classes but the plan's model has {planned} outputs; "
            "train on data with those classes or re-plan a model with as many outputs"
        )
