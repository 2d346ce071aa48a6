"""The before/after table: what each memory technique costs and saves on one model.

Every configuration keeps the same global batch and is measured by the same
probe in the same run, so the ratios against fp32 are side by side:

- fp32 (the baseline), AMP with bf16 and fp16 where the device runs them,
- checkpointing every block (fp32, then with each AMP),
- autofit's own plan at a budget (when one is given).

With data, each configuration also trains ``train_steps`` optimizer steps from
the same seed on the same batches, and the loss and accuracy it reached are
reported: checkpointing must not change them, precision may.

The run is in pieces: which rows (``contenders_of``: the AMP precisions the planner's precision check would leave
out are left out, ``left_out_precisions``), each measured in turn (``_measure_rows``), and timed (``_Timing``).
A row's memory (and training) is measured row by row, its first training step timed as soon as it is, and each
finished row is handed to ``on_update`` (the command writes its files then), so an interrupted compare keeps every
finished row with its speed and ``resume`` goes on from them. The other rounds are timed afterwards, interleaved,
as the planner times its candidates (``autofit.planning.speed.timing``): each round times one training step of
every row, so a burst of other work slows one step of each rather than every step of one; the fastest round is a
row's speed and how well it repeats its noise. On a busy machine every step (the first look's too) uses the
planner's thread count and clock, and says so. Speeds within the noise of fp32's are marked as such.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.device import check_device
from autofit.measure.meters import release_device_memory
from autofit.model_io import call_model, logits_of
from autofit.planning.context import meta_model_of
from autofit.planning.context import intra_op_threads
from autofit.planning.policy import POLICY
from autofit.planning.speed.measured import StepTimer
from autofit.planning.speed.timing import Samples
from autofit.progress import Progress, as_progress
from autofit.spec import ModelSpec
from autofit.tools.evaluate import evaluate
from strategies import DEFAULT_LOSS_CHUNKS, chunkable
from autofit.step import train_step
from strategies import precision_dtype

AMP_PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True, kw_only=True, slots=True)
class Contender:
    """One row to measure: a configuration (the comparison's global batch) and its name in the table."""

    name: str
    config: TrainingConfig


@dataclass(kw_only=True, slots=True)
class Row:
    """One configuration, measured."""

    name: str
    precision: str
    checkpoint_blocks: int
    micro_batch_size: int
    grad_accum_steps: int
    peak_bytes: int | None = None
    activation_bytes: int | None = None
    """The activations' share of the peak (the part these techniques shrink)."""
    samples_per_s: float | None = None
    """The global batch over the fastest timed step."""
    seconds: list[float] = field(default_factory=list)
    """Each timing round's seconds of one training step of the global batch."""
    noise: float | None = None
    """How well the fastest round repeated (second fastest / fastest - 1); None when timed once."""
    within_noise: bool | None = None
    """Whether this row's speed is fp32's within the noise of the two."""
    config: dict | None = None
    """The configuration measured (``TrainingConfig``'s fields), so that a resumed compare measures the same rows."""
    memory_done: bool = False
    """The peak (and, with data, the training) was measured, or failed with a note: a resumed compare keeps it."""
    memory_ratio: float | None = None
    """peak_bytes / fp32's peak_bytes."""
    speed_ratio: float | None = None
    """samples_per_s / fp32's samples_per_s."""
    fits_budget: bool | None = None
    train_loss: float | None = None
    """Mean training loss over the last (up to 10) steps."""
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    skipped_steps: int | None = None
    """Steps fp16's GradScaler skipped (inf/nan gradients) while it found its scale."""
    note: str = ""
    """Why a number is missing (e.g. the configuration ran out of memory)."""


@dataclass(kw_only=True, slots=True)
class Comparison:
    model: str
    device: str
    global_batch_size: int
    budget_bytes: int | None = None
    data: str | None = None
    eval_data: str | None = None
    """The folder the accuracy was measured on."""
    train_steps: int = 0
    rounds: int = 0
    """Timing rounds each row was meant to get (a row far slower than fp32 gets one)."""
    threads_note: str = ""
    """The planner's busy-machine line, when the rounds timed with fewer threads than PyTorch's."""
    rows: list[Row] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Comparison":
        known = {f for f in Row.__dataclass_fields__}
        rows = [Row(**{k: v for k, v in row.items() if k in known}) for row in data.get("rows", [])]
        fields_ = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "rows"}
        return cls(**fields_, rows=rows)


def runnable_amp_precisions(device: str) -> list[str]:
    """The AMP precisions this device runs: a tiny forward and backward under each autocast."""
    runnable = []
    for precision in AMP_PRECISIONS:
        try:
            check_device(device, precision=precision)
            layer = torch.nn.Linear(4, 4).to(device)
            with torch.autocast(device_type=device, dtype=precision_dtype(precision)):
                out = layer(torch.ones(2, 4, device=device))
            out.float().sum().backward()
        except (UserError, RuntimeError):
            continue
        runnable.append(precision)
    return runnable


def configurations(
    *, global_batch_size: int, amp_precisions: list[str], device: str = "cpu", loss_chunks: int = 1,
) -> list[Contender]:
    """fp32, each AMP, checkpointing every block, and each AMP with it (the recipe's rows), then the
    levers beyond it, each alone in fp32: selective checkpointing of every block, the optimizer step
    in backward, for a causal LM the output layer and loss in ``loss_chunks`` chunks (when more than 1),
    and on a GPU activation offload of every block and the optimizer state on the host.
    All at the full batch. (8-bit optimizer state changes the arithmetic: it is a plan's declared
    choice, not a row here.)"""
    def row(name: str, **choices) -> Contender:
        config = TrainingConfig(global_batch_size=global_batch_size, micro_batch_size=global_batch_size, **choices)
        return Contender(name=name, config=config)

    configs = [row("fp32")]
    configs += [row(f"{p} AMP", precision=p) for p in amp_precisions]
    configs.append(row("checkpoint all", checkpoint="all"))
    configs += [row(f"{p} AMP + checkpoint all", precision=p, checkpoint="all") for p in amp_precisions]
    configs.append(row("selective checkpoint all", selective_checkpoint="all"))
    configs.append(row("optimizer step in backward", optimizer_in_backward=True))
    if loss_chunks > 1:
        configs.append(row(f"loss in {loss_chunks} chunks", loss_chunks=loss_chunks))
    if device == "cuda":
        configs.append(row("offload all", offload="all"))
        configs.append(row("optimizer state on the host", optimizer_state="host"))
    return configs


def plan_configuration(
    spec: ModelSpec, *, budget_bytes: int, global_batch_size: int, device: str, log: Callable[[str], None] | None = None,
    left_out: list[str] | None = None,
) -> Contender:
    """autofit's own choice at the budget, from the planner; ``left_out``: precisions a first look already found far
    slower than the fastest, which the planner would time only to find the same (and so cannot choose)."""
    from autofit.planning.context import usable_precisions
    from autofit.planning.planner import make_plan
    from autofit.planning.request import PlanRequest

    precisions = None
    if left_out:
        precisions = tuple(p for p in usable_precisions(device, simulate=False, wanted=None)[0] if p not in left_out) or None
    request = PlanRequest(budget=budget_bytes, batch_size=global_batch_size, device=device, precisions=precisions)
    config = make_plan(spec, request, log=log).config
    blocks = config.checkpoint
    checkpointed = f" + checkpoint {len(blocks)} block{'s' if len(blocks) != 1 else ''}" if blocks else ""
    levers = [
        f"selective {len(config.selective_checkpoint)}" if config.selective_checkpoint else "",
        f"offload {len(config.offload)}" if config.offload else "",
        "step in backward" if config.optimizer_in_backward else "",
        f"{config.optimizer_state} optimizer state" if config.optimizer_state != "device" else "",
        f"loss in {config.loss_chunks} chunks" if config.loss_chunks != 1 else "",
    ]
    name = f"autofit plan: {config.precision}{checkpointed}" + "".join(f" + {lever}" for lever in levers if lever)
    return Contender(name=name, config=config)


DEFAULT_ROUNDS = 3
"""Timing rounds per row: enough for a fastest round and the noise of it (the planner races with as many)."""
SLOW_FACTOR = 3.0
"""A row this many times slower than fp32 in the first round is timed once (fp16 autocast on a CPU): more rounds
would not change what it shows, and would take most of the run."""
FIRST_LOOK_ROUNDS = 4
"""Rounds at most of the first look at the AMP precisions: it stops as soon as the noise cannot change a verdict."""


def compare(
    spec: ModelSpec,
    *,
    global_batch_size: int,
    device: str = "cpu",
    budget_bytes: int | None = None,
    data: str | Path | None = None,
    train_steps: int = 0,
    probe_steps: int = 2,
    rounds: int = DEFAULT_ROUNDS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    on_update: Callable[[Comparison], None] = lambda comparison: None,
    resume: Comparison | None = None,
    all_rows: bool = False,
) -> Comparison:
    """Measure every configuration on ``spec`` and, with data, train each for ``train_steps``; time each as it is
    measured, then in interleaved rounds.

    Args:
        spec: the model.
        global_batch_size: samples per optimizer step, the same for every row.
        device: "cpu" or "cuda".
        budget_bytes: when given, adds autofit's plan at this budget and marks
            which rows fit it.
        data: an image folder (with train/ and val/ inside, or class folders
            directly); requires ``train_steps`` >= 1.
        train_steps: optimizer steps each configuration trains on ``data``.
        probe_steps: probe steps per configuration for its peak (the first is a warm-up).
        rounds: timing rounds; the first times a row as soon as its peak is measured (so a finished row has its
            speed), each later one times one step of the global batch of every row.
        seed: the same model initialisation and batch order for every row.
        progress: called with a line as each row starts ("row k of N: name") and after each timing round, and
            (from a thread) whenever none came for ``autofit.progress.INTERVAL_S``: what is still running.
        on_update: called with the comparison so far after each row and each round (the command writes its files).
        all_rows: also the rows of an AMP precision that the planner's precision check would leave out
            (``left_out_precisions``: far slower than the fastest precision, fp16 on a CPU).
        resume: an earlier, interrupted comparison of the same model and settings: its measured rows are kept, not
            measured again. Its speeds are kept only when all its rounds were done (timings of different runs are
            never compared: the load on the machine differs between them).

    Raises:
        UserError: a bad setting, a missing data folder, data the model cannot take, or a ``resume`` of other settings.
    """
    if global_batch_size < 1:
        raise UserError(f"--batch-size {global_batch_size} must be at least 1")
    if data is not None and train_steps < 1:
        raise UserError(f"--train-steps {train_steps} must be at least 1 when --data is given")
    if probe_steps < 2:
        raise UserError(f"--steps {probe_steps} must be at least 2 (the first is a warm-up)")
    if rounds < 1:
        raise UserError(f"--rounds {rounds} must be at least 1")
    progress = as_progress(progress)  # its lines, and a heartbeat between them
    with progress.beating():
        comparison = Comparison(
            model=spec.source, device=device, global_batch_size=global_batch_size, budget_bytes=budget_bytes,
            data=None if data is None else str(data), train_steps=train_steps if data is not None else 0, rounds=rounds,
        )
        kept = _resumable(resume, comparison)
        training = TrainingData.load(spec, data, global_batch_size=global_batch_size, steps=train_steps, seed=seed) if data is not None else None
        if training is not None:
            comparison.eval_data = training.eval_dir
        # The pieces in order: which rows, each measured (and timed once) as it comes, then the further rounds; all
        # with the threads the timing decided on (on a busy CPU fewer: every step, the first look's too, goes faster).
        timing = _Timing(spec, comparison, device=device, rounds=rounds, seed=seed, progress=progress)
        with timing, intra_op_threads(timing.threads):
            contenders, notes = contenders_of(
                spec, comparison, kept, device=device, seed=seed, all_rows=all_rows, clock=timing.clock, progress=progress,
            )
            _measure_rows(
                spec, comparison, contenders, kept, device=device, probe_steps=probe_steps, seed=seed, training=training,
                timing=timing, progress=progress, on_update=on_update,
            )
            comparison.rows += notes
            timing.rounds(on_update=on_update)
        fill_ratios(comparison)
        on_update(comparison)
        return comparison


def contenders_of(
    spec: ModelSpec, comparison: Comparison, kept: dict[str, Row], *, device: str, seed: int, all_rows: bool, progress: Progress,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[Contender], list[Row]]:
    """The rows to measure, and the rows that only say why they were not (a precision left out, no plan at the
    budget): the recipe's and the levers' rows, then autofit's plan at the budget (planned here, or the plan an
    interrupted run made)."""
    amp = runnable_amp_precisions(device)
    with progress.doing("timing a step of each precision at micro-batch 1 (a first look)"):
        left_out = {} if all_rows else left_out_precisions(spec, amp, device=device, seed=seed, clock=clock)
    if left_out:
        said = ", ".join(f"{p} AMP ({ratio:.1f}x {reference}'s)" for p, (ratio, reference) in left_out.items())
        progress(
            f"left out, as the planner's precision check leaves out a precision over {POLICY.slow_precision_ratio:g}x the "
            f"fastest: {said} at micro-batch 1 (--all-rows keeps them)"
        )
    notes = [
        Row(
            name=f"{precision} AMP", precision=precision, checkpoint_blocks=0, micro_batch_size=0, grad_accum_steps=0,
            note=f"left out: a step at micro-batch 1 took {ratio:.1f}x {reference}'s on this device (--all-rows measures it)",
            memory_done=True,
        )
        for precision, (ratio, reference) in left_out.items()
    ]
    contenders = configurations(
        global_batch_size=comparison.global_batch_size, amp_precisions=[p for p in amp if p not in left_out], device=device,
        loss_chunks=DEFAULT_LOSS_CHUNKS if chunkable(meta_model_of(spec)) is None else 1,
    )
    if comparison.budget_bytes is None:
        return contenders, notes
    planned = next((row for name, row in kept.items() if name.startswith("autofit plan") and row.config), None)
    if planned is not None:  # the plan an interrupted run made: the same row, not a second planning
        return [*contenders, Contender(name=planned.name, config=TrainingConfig(**planned.config))], notes
    if "autofit plan" in kept:  # no plan fitted then: nor will it now
        return contenders, [*notes, kept["autofit plan"]]
    progress("planning at the budget")
    try:
        with progress.paused():  # the plan's own heartbeat speaks for it
            contenders.append(plan_configuration(
                spec, budget_bytes=comparison.budget_bytes, global_batch_size=comparison.global_batch_size, device=device,
                log=lambda line: progress(f"  plan: {line}"), left_out=list(left_out),
            ))
    except UserError as error:  # no plan fits: the other rows still stand
        notes.append(Row(
            name="autofit plan", precision="-", checkpoint_blocks=0, micro_batch_size=0, grad_accum_steps=0,
            note=f"no plan: {error}", memory_done=True,
        ))
    return contenders, notes


def _measure_rows(
    spec: ModelSpec, comparison: Comparison, contenders: list[Contender], kept: dict[str, Row], *, device: str,
    probe_steps: int, seed: int, training: "TrainingData | None", timing: "_Timing", progress: Progress,
    on_update: Callable[[Comparison], None],
) -> None:
    """Each row in turn: its peak, with data its training, and its first timed step; handed to ``on_update`` when
    done, so that a compare stopped part way keeps every finished row with its speed."""
    from autofit.measure.probe import measure

    total = len(contenders)
    for number, contender in enumerate(contenders, start=1):
        config = contender.config
        row = kept.get(contender.name)
        if row is not None and row.memory_done:
            progress(f"row {number} of {total}: {contender.name} (kept from the earlier run)")
            comparison.rows.append(row)
            continue
        progress(f"row {number} of {total}: {contender.name}")
        row = Row(
            name=contender.name, precision=config.precision, checkpoint_blocks=0,
            micro_batch_size=config.micro_batch_size, grad_accum_steps=config.grad_accum_steps, config=_config_dict(config),
        )
        try:
            with progress.doing(f"row {number} of {total}, {contender.name}: measuring its peak"):
                result = measure(spec, config, device=device, steps=probe_steps, seed=seed, progress=progress)
        except RuntimeError as error:  # out of memory, or an op this precision lacks on this device
            row.note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            release_device_memory(device)
        else:
            row.peak_bytes, row.checkpoint_blocks = result.peak_bytes, len(result.checkpoint)
            row.activation_bytes = result.breakdown.get("activations")
            if training is not None:
                progress(f"  training {contender.name} for {comparison.train_steps} steps")
                with progress.doing(f"row {number} of {total}, {contender.name}: training {comparison.train_steps} steps"):
                    outcome = training.train_and_score(spec, config, device=device, seed=seed)
                row.train_loss, row.eval_loss, row.eval_accuracy = outcome.train_loss, outcome.eval_loss, outcome.eval_accuracy
                row.skipped_steps = outcome.skipped_steps
                if outcome.skipped_steps:
                    row.note = f"GradScaler skipped {outcome.skipped_steps} of {comparison.train_steps} steps (inf/nan gradients) while finding its scale"
            with progress.doing(f"row {number} of {total}, {contender.name}: timing a step"):
                timing.time_once(row)
        row.memory_done = True
        comparison.rows.append(row)
        fill_ratios(comparison)
        on_update(comparison)


def left_out_precisions(
    spec: ModelSpec, precisions: list[str], *, device: str, seed: int, clock: Callable[[], float] = time.perf_counter,
) -> dict[str, tuple[float, str]]:
    """The AMP precisions the planner's precision check would leave out, each with its ratio and the precision it
    is that much slower than: a training step at micro-batch 1 more than ``POLICY.slow_precision_ratio`` times the
    fastest precision's, by a margin the noise of both cannot explain (``autofit.planning.speed.timing.compare``).
    fp16 autocast on a CPU, 20-60x: its rows would take most of a compare's time to show what this look shows.

    fp32 and the precisions are timed in interleaved rounds after a warm-up each, until no verdict is unsure or
    ``FIRST_LOOK_ROUNDS`` rounds were timed; a precision still unsure then is kept (measured, as the planner would).
    """
    from autofit.planning.speed.measured import StepTimer
    from autofit.planning.speed.timing import compare as slower_than
    from autofit.planning.speed.timing import interleaved_rounds

    if not precisions:
        return {}
    names = ["fp32", *precisions]
    timers: dict[str, StepTimer] = {}

    def verdicts(samples: dict) -> dict[str, str]:
        fastest = min(names, key=lambda name: samples[name].best)
        return {
            name: slower_than(samples[fastest], samples[name], factor=POLICY.slow_precision_ratio)
            for name in precisions if name != fastest
        }

    try:
        for name in names:
            config = TrainingConfig(global_batch_size=1, micro_batch_size=1, precision=name)
            timers[name] = StepTimer(spec, config, device=device, seed=seed, clock=clock)
        samples = interleaved_rounds(
            {name: timer.step_seconds for name, timer in timers.items()},
            settled=lambda current: "unsure" not in verdicts(current).values(), min_rounds=2, max_rounds=FIRST_LOOK_ROUNDS,
        )
    except (RuntimeError, ValueError):  # a model that cannot train one sample (BatchNorm over 1x1 maps): no first look,
        return {}  # every row is measured, as with --all-rows
    finally:
        for timer in timers.values():
            timer.close()
    fastest = min(names, key=lambda name: samples[name].best)
    return {
        name: (samples[name].best / samples[fastest].best, fastest)
        for name, verdict in verdicts(samples).items() if verdict == "yes"
    }


def _config_dict(config: TrainingConfig) -> dict:
    return {f.name: list(v) if isinstance(v := getattr(config, f.name), tuple) else v for f in fields(config)}


def _resumable(resume: Comparison | None, comparison: Comparison) -> dict[str, Row]:
    """The rows of ``resume`` to keep, by name ({} without one); its speeds only when every round was done."""
    if resume is None:
        return {}
    for name in ("model", "device", "global_batch_size", "budget_bytes", "data", "train_steps"):
        if getattr(resume, name) != getattr(comparison, name):
            raise UserError(
                f"--resume: the earlier compare ran with {name} {getattr(resume, name)!r}, this one {getattr(comparison, name)!r}; "
                "give the same settings, or a new --out-dir"
            )
    timed = resume.rounds == comparison.rounds and all(
        row.samples_per_s is not None for row in resume.rows if row.config and row.peak_bytes is not None
    ) and any(row.samples_per_s is not None for row in resume.rows)
    kept = {}
    for row in resume.rows:
        if not row.memory_done:
            continue
        if not timed:
            row.seconds, row.samples_per_s, row.noise, row.within_noise, row.speed_ratio = [], None, None, None, None
        kept[row.name] = row
    return kept


class _Timing:
    """The speed of every measured row: one step timed as the row is measured (``time_once``), then ``rounds``
    more in a rotating order, as the planner times its candidates: a burst of other work slows one step of each
    rather than every step of one; the fastest round is a row's speed and how well it repeats its noise.

    On a busy CPU the steps use the planner's thread count (``timing_threads``) and its clock, and the comparison
    keeps the planner's line. A row far slower than fp32 after its first round (``SLOW_FACTOR``) is timed once.
    Each row's model stays built between its rounds where the CPU has room for all of them (half its memory).
    """

    def __init__(self, spec: ModelSpec, comparison: Comparison, *, device: str, rounds: int, seed: int, progress: Progress) -> None:
        from autofit.planning.context import step_clock, timing_threads

        self.spec, self.comparison, self.device, self.rounds_wanted, self.seed = spec, comparison, device, rounds, seed
        self.progress = progress
        self.timers: dict[str, StepTimer] = {}
        self.threads, note = timing_threads(device)
        """The intra-op threads every step is timed with (the planner's rule: fewer on a busy CPU)."""
        self.clock = step_clock(device, self.threads)
        """The planner's clock for those threads (a step's CPU time with one thread)."""
        comparison.threads_note = note
        if note:
            progress(note)

    def __enter__(self) -> "_Timing":
        return self

    def __exit__(self, *exc_info) -> None:
        for timer in self.timers.values():
            timer.close()
        self.timers.clear()

    def _step_seconds(self, row: Row) -> float:
        """Seconds of one more training step of ``row``'s global batch (after a warm-up step the first time)."""
        timer = self.timers.get(row.name) or StepTimer(
            self.spec, TrainingConfig(**row.config), device=self.device, seed=self.seed, clock=self.clock,
        )
        try:
            return timer.step_seconds()
        finally:
            if self._keep(row):
                self.timers[row.name] = timer
            else:
                self.timers.pop(row.name, None)
                timer.close()

    def _keep(self, row: Row) -> bool:
        if self.device != "cpu":
            return False
        held = sum(r.peak_bytes for r in self.comparison.rows if r.name in self.timers and r.peak_bytes) + (row.peak_bytes or 0)
        return held < 0.5 * (_device_total_bytes(self.device) or 0)

    def _record(self, row: Row, seconds: float) -> None:
        row.seconds.append(seconds)
        row.samples_per_s = self.comparison.global_batch_size / Samples(seconds=row.seconds).best
        row.noise = Samples(seconds=row.seconds).spread if len(row.seconds) >= 2 else None

    def time_once(self, row: Row) -> None:
        """The first round of a row just measured: its speed from one step."""
        if row.config and row.peak_bytes is not None and not row.seconds:
            self._record(row, self._step_seconds(row))

    def rounds(self, *, on_update: Callable[[Comparison], None]) -> None:
        """The rounds after each row's first, each one step of every measured row (kept rows of an earlier run
        that lost their speeds get their first here)."""
        rows = [row for row in self.comparison.rows if row.config and row.peak_bytes is not None]
        for round_ in range(self.rounds_wanted):
            base = next((r for r in rows if r.name == "fp32" and r.seconds), None)
            running = [
                r for r in rows
                if len(r.seconds) <= round_
                and not (round_ > 0 and base is not None and r is not base and min(r.seconds) > SLOW_FACTOR * min(base.seconds))
            ]
            if not running:
                continue
            self.progress(f"speed: round {round_ + 1} of {self.rounds_wanted}, one step of each of {len(running)} row(s)")
            shift = round_ % len(running)
            for number, row in enumerate(running[shift:] + running[:shift], start=1):  # rotate: no row is always first after a pause
                with self.progress.doing(f"speed round {round_ + 1} of {self.rounds_wanted}, {row.name}", step=number, of=len(running)):
                    self._record(row, self._step_seconds(row))
            fill_ratios(self.comparison)
            on_update(self.comparison)


def _device_total_bytes(device: str) -> int | None:
    from autofit.device import device_info

    return device_info(device).total_bytes


def fill_ratios(comparison: Comparison) -> None:
    base = next((r for r in comparison.rows if r.name == "fp32"), None)
    for row in comparison.rows:
        if row.peak_bytes is None:
            continue
        if comparison.budget_bytes is not None:
            row.fits_budget = row.peak_bytes <= comparison.budget_bytes
        if base is None or base.peak_bytes is None:
            continue
        row.memory_ratio = row.peak_bytes / base.peak_bytes
        if row.samples_per_s and base.samples_per_s:
            row.speed_ratio = row.samples_per_s / base.samples_per_s
            # Within the noise: the ratio of the fastest rounds is no further from 1 than the worse repeat of the two.
            # Unknown (None) where either was timed once.
            if row is not base and row.noise is not None and base.noise is not None:
                row.within_noise = abs(row.speed_ratio - 1.0) <= max(row.noise, base.noise)


@dataclass(kw_only=True, slots=True)
class TrainingOutcome:
    train_loss: float
    """Mean training loss over the last (up to 10) steps."""
    eval_loss: float | None
    eval_accuracy: float
    skipped_steps: int
    """Optimizer steps fp16's GradScaler skipped."""


class TrainingData:
    """The batches every configuration trains on, decoded once, and the set it is scored on."""

    def __init__(self, *, batches: list[tuple[torch.Tensor, torch.Tensor]], eval_set, classes: list[str], eval_dir: str) -> None:
        self.batches = batches
        self.eval_set = eval_set
        self.classes = classes
        self.eval_dir = eval_dir

    @classmethod
    def load(cls, spec: ModelSpec, data: str | Path, *, global_batch_size: int, steps: int, seed: int) -> "TrainingData":
        from autofit.tools.evaluate import input_shape_of
        from autofit.training.images import image_folder

        root = Path(data)
        if not root.is_dir():
            raise UserError(f"--data {str(data)!r} is not a directory; give an image folder (with train/ and val/ inside, or class folders)")
        train_dir = root / "train" if (root / "train").is_dir() else root
        eval_dir = root / "val" if (root / "val").is_dir() else train_dir
        shape = input_shape_of(None, spec)
        train_set = image_folder(train_dir, input_shape=shape)
        eval_set = image_folder(eval_dir, input_shape=shape, classes=train_set.classes) if eval_dir != train_dir else train_set
        # The same batch order for every configuration: seeded permutations, epoch after epoch.
        generator = torch.Generator().manual_seed(seed)
        size = min(global_batch_size, len(train_set))
        order: list[list[int]] = []
        while len(order) < steps:
            permutation = torch.randperm(len(train_set), generator=generator).tolist()
            order += [permutation[i:i + size] for i in range(0, len(permutation) - size + 1, size)]
        order = order[:steps]
        cache = {i: train_set[i] for i in sorted({i for batch in order for i in batch})}
        batches = [
            (torch.stack([cache[i][0] for i in batch]), torch.tensor([cache[i][1] for i in batch])) for batch in order
        ]
        images, targets = zip(*(eval_set[i] for i in range(len(eval_set))))
        eval_tensors = torch.utils.data.TensorDataset(torch.stack(images), torch.tensor(targets))
        _check_outputs(spec, batches[0][0][:1], num_classes=len(train_set.classes), data=train_dir)
        return cls(batches=batches, eval_set=eval_tensors, classes=list(train_set.classes), eval_dir=str(eval_dir))

    def train_and_score(self, spec: ModelSpec, config: TrainingConfig, *, device: str, seed: int) -> TrainingOutcome:
        """Train a fresh model (same seed) on the prepared batches as `autofit train` would; score it in fp32 eval mode."""
        torch.manual_seed(seed)
        model = spec.build_model()
        model.train()
        global_batch_size = len(self.batches[0][1])
        config = replace(config, global_batch_size=global_batch_size, micro_batch_size=min(config.micro_batch_size, global_batch_size))
        applied = apply_config(model, config, device=device)
        model = applied.model
        optimizer = applied.build_optimizer(spec.build_optimizer)
        losses, skipped = [], 0
        for inputs, targets in self.batches:
            result = train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)
            losses.append(result.loss)
            skipped += not result.stepped
        model.eval()
        scored = evaluate(model, self.eval_set, classes=self.classes, device=device, loss_fn=spec.loss_fn)
        tail = torch.stack(losses[-10:]).float().cpu()
        del model, optimizer
        release_device_memory(device)
        return TrainingOutcome(train_loss=float(tail.mean()), eval_loss=scored.loss, eval_accuracy=scored.accuracy, skipped_steps=skipped)


def _check_outputs(spec: ModelSpec, inputs: torch.Tensor, *, num_classes: int, data: Path) -> None:
    """Fail before any training when the model cannot classify this data."""
    model = spec.build_model().eval()
    try:
        with torch.no_grad():
            logits = logits_of(call_model(model, inputs))
    except RuntimeError as error:
        raise UserError(f"{spec.source} cannot take the images of {str(data)!r} (shape {tuple(inputs.shape[1:])}): {str(error).splitlines()[0]}") from error
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[1] < num_classes:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise UserError(
            f"{spec.source} gives outputs of shape {shape} but {str(data)!r} has {num_classes} classes; "
            "use a model with that many outputs (torchvision: --num-classes)"
        )


# ---- output: a printed table, markdown and a bar chart ----------------------------------------

def _columns(comparison: Comparison) -> list[tuple[str, Callable[[Row], str]]]:
    from autofit.units import format_bytes

    def ratio(value: float | None, text: str) -> str:
        return "-" if value is None else text.format(value)

    columns: list[tuple[str, Callable[[Row], str]]] = [
        ("configuration", lambda r: r.name),
        ("micro-batch", lambda r: f"{r.micro_batch_size} x {r.grad_accum_steps}" if r.micro_batch_size else "-"),
        ("peak memory", lambda r: "-" if r.peak_bytes is None else format_bytes(r.peak_bytes)),
        ("% of fp32", lambda r: ratio(r.memory_ratio and 100 * r.memory_ratio, "{:.0f}%")),
        ("activations", lambda r: "-" if r.activation_bytes is None else format_bytes(r.activation_bytes)),
        ("samples/s", lambda r: ratio(r.samples_per_s, "{:.1f}")),
        ("noise", lambda r: "-" if r.noise is None else f"±{100 * r.noise:.0f}%"),
        ("vs fp32", versus),
    ]
    if comparison.budget_bytes is not None:
        columns.append((f"fits {format_bytes(comparison.budget_bytes)}", lambda r: "-" if r.fits_budget is None else ("yes" if r.fits_budget else "no")))
    if comparison.data is not None:
        columns += [
            (f"loss @{comparison.train_steps}", lambda r: ratio(r.eval_loss, "{:.4f}")),
            (f"accuracy @{comparison.train_steps}", lambda r: ratio(r.eval_accuracy, "{:.2%}")),
        ]
    return columns


def versus(row: Row) -> str:
    """The speed ratio, "~" before it where it is fp32's within the noise (no difference shown), "(1 round)" where
    timed once (no noise known)."""
    if row.speed_ratio is None:
        return "-"
    if row.within_noise:
        return f"~{row.speed_ratio:.2f}x"
    return f"{row.speed_ratio:.2f}x" + (" (1 round)" if len(row.seconds) == 1 else "")


def _cells(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    columns = _columns(comparison)
    return [name for name, _ in columns], [[cell(row) for _, cell in columns] for row in comparison.rows]


def _caption(comparison: Comparison) -> str:
    from autofit.units import format_bytes

    text = f"{comparison.model} on {comparison.device}, global batch {comparison.global_batch_size}"
    if comparison.budget_bytes is not None:
        text += f", budget {format_bytes(comparison.budget_bytes)}"
    if comparison.data is not None:
        text += f"; loss and accuracy on {comparison.eval_data} after {comparison.train_steps} training steps from the same seed"
    timed = max((len(r.seconds) for r in comparison.rows), default=0)
    if timed:
        text += (
            f"; speed: the fastest of {timed} interleaved round(s), noise = how well it repeated, "
            "~ = fp32's speed within the noise"
        )
    if comparison.threads_note:
        text += f"; {comparison.threads_note}"
    return text


def _notes(comparison: Comparison) -> list[str]:
    return [f"{row.name}: {row.note}" for row in comparison.rows if row.note]


def format_table(comparison: Comparison) -> str:
    """The comparison as an aligned text table with a caption."""
    header, body = _cells(comparison)
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    align = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    lines = [_caption(comparison), "", align(header), "  ".join("-" * w for w in widths)]
    lines += [align(cells) for cells in body]
    if _notes(comparison):
        lines += [""] + _notes(comparison)
    return "\n".join(lines)


def to_markdown(comparison: Comparison) -> str:
    """The comparison as a markdown table with a caption."""
    header, body = _cells(comparison)
    lines = [_caption(comparison), "", "| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    if _notes(comparison):
        lines += [""] + [f"- {note}" for note in _notes(comparison)]
    return "\n".join(lines) + "\n"


def plot_comparison(comparison: Comparison, out: str | Path) -> Path:
    """Bar charts: peak memory (with the budget), samples/s against fp32, and accuracy when trained."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = [r for r in comparison.rows if r.peak_bytes is not None]
    names = [r.name for r in rows]
    panels = 3 if comparison.data is not None else 2
    figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 5.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bar_colours = [colours[i % len(colours)] for i in range(len(rows))]
    positions = list(range(len(rows)))
    mib = [r.peak_bytes / 2**20 for r in rows]
    bars = axes[0].bar(positions, mib, color=bar_colours)
    axes[0].bar_label(bars, labels=[f"{100 * (r.memory_ratio or 0):.0f}%" if r.memory_ratio else "" for r in rows], fontsize=8)
    axes[0].set_ylabel("peak memory (MiB)")
    axes[0].set_title("peak memory")
    if comparison.budget_bytes is not None:
        axes[0].axhline(comparison.budget_bytes / 2**20, color="black", linestyle="--", label="budget")
        axes[0].legend()
    bars = axes[1].bar(positions, [r.speed_ratio or 0.0 for r in rows], color=bar_colours)
    for bar, row in zip(bars, rows):  # no difference shown: hatched, and its noise as an error bar
        if row.within_noise:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        if row.speed_ratio and row.noise is not None:
            axes[1].errorbar(bar.get_x() + bar.get_width() / 2, row.speed_ratio, yerr=row.noise * row.speed_ratio, color="black", capsize=3)
    axes[1].bar_label(bars, labels=[versus(r) if r.speed_ratio else "" for r in rows], fontsize=8)
    axes[1].axhline(1.0, color="grey", linewidth=1)
    axes[1].set_ylabel("samples/s relative to fp32")
    axes[1].set_title("speed (hatched: fp32's within the noise)")
    if comparison.data is not None:
        bars = axes[2].bar(positions, [100 * (r.eval_accuracy or 0.0) for r in rows], color=bar_colours)
        axes[2].bar_label(bars, labels=[f"{100 * r.eval_accuracy:.1f}" if r.eval_accuracy is not None else "" for r in rows], fontsize=8)
        axes[2].set_ylabel("accuracy (%)")
        axes[2].set_title(f"accuracy after {comparison.train_steps} steps")
    for ax in axes:
        ax.set_xticks(positions)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    figure.suptitle(_caption(comparison), fontsize=9)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def save_comparison(comparison: Comparison, out_dir: str | Path, *, chart: bool = True) -> dict[str, Path]:
    """Write compare.md, compare.json and (``chart``) compare.png into ``out_dir``."""
    import json

    from autofit.atomic import write_atomic

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "compare.md", "json": folder / "compare.json", "png": folder / "compare.png"}
    write_atomic(paths["markdown"], to_markdown(comparison))
    write_atomic(paths["json"], json.dumps(comparison.to_dict(), indent=2) + "\n")
    if chart:
        plot_comparison(comparison, paths["png"])
    return paths


def load_comparison(out_dir: str | Path) -> Comparison | None:
    """The comparison an earlier compare wrote into ``out_dir`` (None when there is none).

    Raises:
        UserError: compare.json is there but unreadable.
    """
    import json

    path = Path(out_dir) / "compare.json"
    if not path.is_file():
        return None
    try:
        return Comparison.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as error:
        raise UserError(f"--resume: {str(path)!r} is not a compare's output ({error}); start again without --resume") from error
