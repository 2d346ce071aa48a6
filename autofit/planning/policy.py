"""The planner's thresholds, each with why it is what it is.

Every tuning choice the planner's decisions rest on (margins, shares, round
counts, how many candidates to verify) is a field of ``PlanPolicy``, and the
planner reads the default instance, ``POLICY``. Facts are not here: the GPU
table and the roofline calibration of the speed estimate
(``speed.estimated``), byte sizes, the plan file's bounds; nor the sizes of
the measurements in ``autofit.measure``, which sits below the planner.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from autofit.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanPolicy:
    """The planner's thresholds (a share is a fraction: 0.05 is 5%)."""

    # Memory: the headroom kept beyond a peak (memory/headroom.py, whose module docstring holds the calibration).
    safety_margin_share: float = 0.02
    """Share of the budget kept free on every device: the meters are exact, the data may not be."""
    cuda_fragmentation_share: float = 0.05
    """Share of the allocator's peak (the whole of it) kept for fragmentation growth over a long run on a GPU."""
    estimated_cuda_fragmentation_share: float = 0.10
    """Planning for a GPU that is not here: share of the simulated peak less its persistent bytes, kept for the
    meter's under-count and the allocator's cache growing with the activations (7.9% is the least that covered
    the 24 calibration cases)."""
    estimated_cuda_allocator_reserve_bytes: int = 5 * 2**28
    """Fixed part of the allocator's cache and the meter's under-count when estimated: 1.25 GiB, what the
    calibration cases needed beyond the simulated peak whatever their activations."""
    estimated_cuda_expandable_reserve_bytes: int = 2**29
    """The same with expandable segments (the plans' default on a GPU): 0.5 GiB. On an H200 (bench/gpu_allocator.py,
    bench/RESULTS.md "The CUDA allocator both ways") the allocator's cache with them was 0.05-0.16 GiB where the
    default segments kept 0.35-1.25 GiB; 0.18 GiB (with the 10% share) covered the 12 calibration cases, and 0.5
    also covers the 0.25 GiB the simulated meter missed on the 0.94B decoder's bf16-master floor."""
    estimated_cuda_context_bytes: int = 768 * 2**20
    """CUDA context and library workspaces assumed when planning for a GPU that is not here: the calibration
    cases' process held 0.74-0.75 GiB outside the allocator in every case."""
    ladder_untimed_share: float = 0.25
    """Below the floor, the floor configuration with the levers (the ladder) is not timed where the search's
    configuration, measured, beats its predicted speed by this share: the timing could not reverse that (the speed
    model's noise falls back on one thread above 25%, ``threads_noise_share``), and it cost a ResNet-18 plan a second."""
    real_trace_steps: float = 8.0
    """On the CPU a run is traced on real tensors where this many of its micro-steps (as timed, per thread) take no
    longer than a run over fake tensors: a traced run is two micro-steps and a step, plus the tracker's Python per op,
    about a quarter of fake tensors' (bench/RESULTS.md, "Traces on real tensors"); 8 leaves room for the recomputing runs' second forward."""
    real_trace_memory_share: float = 0.25
    """A run is traced on real tensors only where its activations (the floor's trace, scaled) fit in this share of
    this machine's free memory, split between the runs traced at once."""
    max_trace_workers: int = 8
    """Most worker processes tracing at once: a plan makes up to nine traced runs per precision (three sizes,
    plain, all-checkpointed and all-selective), so more workers would mostly wait."""

    # Search (search/space.py, search/knapsack.py).
    brute_force_max_points: int = 256
    """Outer spaces up to this many (precision, micro-batch) points are enumerated; larger ones use TPE: scoring
    a point is a knapsack solve, cheap enough to do them all up to here."""
    tpe_trials: int = 96
    """Points TPE scores in a larger space: a bounded search cost whatever the space's size; the verification
    measures what it picks."""
    model_slack_share: float = 0.01
    """The memory model may be this pessimistic; candidates within it are checked exactly rather than dropped."""
    exact_slack_share: float = 0.001
    """The same where the model is the meter's twin (the CPU, the simulated meter): it is exact there, or optimistic
    (which the verification's probes catch), so a candidate predicted further over the limit would fail its probe."""
    enumerate_max_choices_log2: int = 16
    """A checkpoint problem of unusual shape is solved by enumerating every choice while there are at most
    2 ** this many of them (16 blocks of two modes, 10 of three): a table that size is scored at once
    (vectorised); beyond it the greedy solution."""
    offload_refit_attempts: int = 4
    """Times a knapsack choice with offload, over the limit by the model's whole prediction, is solved again under
    a limit lowered by the excess before the point is given up: each try narrows the miss to what the segments
    leave out."""

    # Speed: ties on a shared machine (speed/timing.py); the rounds and limits are ``TimingPolicy``'s.
    tie_share: float = 0.03
    """Speeds this close are a tie even on a quiet machine."""
    max_tie_share: float = 0.05
    """The widest a tie gets under noise on a quiet machine: beyond it the faster minimum wins, noise or not (so a
    tie never costs more than 5% of speed there)."""
    busy_tie_share: float = 0.10
    """Speeds this close are a tie where other work keeps the machine busy (the run measures with fewer threads,
    ``context.timing_threads``). Each run's fastest rounds then repeat within a few percent, yet whole runs under
    the same load rank configurations differently: bench/plan_speed.py's load test saw three digits configurations
    within 2-20% of each other trade first place from run to run while each run reported 2-19% noise. Within this,
    the simpler configuration wins, as in any tie."""

    threads_noise_share: float = 0.25
    """Where a size of the speed model, timed with several intra-op threads on the CPU, repeats worse than this (its
    rounds' ``noise_of``; for the verification's race, its median spread), the timing is dropped and done again with
    one thread (``modelling._timed_speeds``, ``verify.measurements``).
    With one thread the first sizes of bench/models47's models repeated within 1-5% and the busiest one-thread runs
    within 19% (``busy_tie_share``); with two, a loop of small ops (the Mamba-like model) repeated within 31-48% and
    its rounds ran to their limits at several times the CPU time (bench/RESULTS.md, "Noisy threads")."""

    # Speed: the timed cost model (speed/measured.py, modelling.py).
    timing_sizes_apart: int = 4
    """Micro-batch sizes timed are about this many times apart: step time is close to linear in the size, so a
    few sizes spread geometrically fit the curve and the rest are interpolated."""
    timing_sizes_apart_tolerance: float = 1.01
    """A size counts as ``timing_sizes_apart`` below the last one timed within this factor: sizes are
    ceil(batch / steps), so a quarter of one lands a little above it."""
    slow_precision_ratio: float = 3.0
    """A precision this many times slower than the fastest at the same micro-batch is timed at one size only: it
    cannot win, and it costs seconds to learn that fp16 on a CPU is slow, not minutes."""
    shortest_measurement_s: float = 0.02
    """A micro-step shorter than this is repeated within one measurement (the fastest repeat counts)."""
    max_repeats_per_measurement: int = 16
    """Repeats at most of a short micro-step within one measurement: a step that stays under
    ``shortest_measurement_s`` even so costs nothing the plan would notice."""
    recompute_factor_range: tuple[float, float] = (0.5, 3.0)
    """Bounds of the measured full recompute factor (recomputing over a plain forward): one disturbed round can
    price recomputation at nothing or many times over; the verification times the choice for real."""
    selective_factor_range: tuple[float, float] = (0.25, 20.0)
    """Bounds of the measured selective recompute factor. The share it prices is an estimate (FLOPs and bytes
    moved) that the CPU's slower transcendental ops and the policy's per-op Python dispatch can exceed several
    times (6.7 and 10 measured for a chain of tanh on 2 shared cores); the lower bound keeps one noisy round from
    pricing it at nothing."""

    # Verification: candidates timed and probed on the device (verify/).
    verify_within_share: float = 0.75
    """Only candidates predicted at least this fraction of the best candidate's speed are worth timing: one further
    behind wins only where the cost model is off by more than a third (1 / 0.75), and timing it costs rounds of
    real steps."""
    verify_top_candidates: int = 3
    """Candidates timed on the device: the cost model's ranking is close but not exact, and each one timed costs
    its rounds of real steps."""
    verify_attempts: int = 5
    """Checkpoint sets measured per (precision, micro-batch) before it is given up: each miss teaches the model
    the scale it was optimistic by, so the sets after it are predicted smaller."""
    decided_margin_share: float = 0.02
    """Where the memory model is the meter's twin (the CPU, the simulated meter), a candidate predicted at least
    this far under the usable bytes is timed before its peak is measured: the model decides that it fits, and
    the one chosen is measured anyway."""
    floor_decided_margin_share: float = 0.05
    """Where the memory model is the meter's twin (the CPU, the simulated meter), a budget this far above the
    floor it predicts needs no probe to be known possible (a candidate that misses falls back to it, measured)."""
    floor_measured_margin_share: float = 0.05
    """The floor measures, beside the configuration predicted least, every other predicted within this share above
    the least measured so far: the memory model's error can order two near configurations wrongly (DeepLabV3's
    fp32 floor measured 187.84 MiB, above a bf16 configuration that measured 186.65 MiB)."""
    timed_reference_max_memory_share: float = 0.9
    """On a GPU the unconstrained configuration is timed beside the candidates (for the speed ratio) only when
    its predicted peak is under this share of the card: nearer the whole card it could run out of memory."""
    keep_timers_memory_share: float = 0.25
    """On the CPU the timed candidates stay built between rounds while their peaks add up to at most this share of
    the machine's memory; on a GPU one is built at a time (its memory is the budget's)."""
    floor_advice_max_gpus: int = 1024
    """The most GPUs the floor's advice considers: it bounds the advice's loop (an FSDP layout per GPU count)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingPolicy:
    """How long the planner times real steps: its rounds and limits, read through ``timing_policy()``.

    The memory figures never depend on it (the meters are exact); only how
    surely speeds are ranked and how long that takes.
    """

    min_rounds: int = 2
    """Timed rounds before any decision: one disturbed step can never decide alone."""
    max_rounds: int = 4
    """Rounds at most while a comparison stays within the noise (then it is a tie, or the faster minimum wins)."""
    max_noisy_rounds: int = 8
    """Rounds at most when the fastest rounds repeat worse than ``max_tie_share`` (a busy machine): more rounds
    bring each minimum nearer a quiet machine's, so the faster minimum wins on speed rather than on which rounds
    other work disturbed (``Race.noisy``)."""
    promise_rounds: int = 5
    """Rounds the chosen configuration gets at least (more steps of it alone, after the race), so that the speed a
    plan promises, the median round, is not one disturbed round of two (bench/train_vs_plan.py once saw timm's
    plan promise 1611 samples/s from two rounds, where its training ran at 3487 and a plan of it minutes later
    measured 4210). Off the race: they decide nothing, only the median. At most ``noisy_race_time_share`` of the plan's time."""
    precision_timing_limit_s: float = 20.0
    """A precision whose next size would take its timing past this stops there, its larger sizes extrapolated:
    the verification times whatever is chosen for real."""
    optimizer_step_timings: int = 3
    """Optimizer steps run to time it: the first creates the optimizer state and is not counted, the fastest of
    the rest is."""
    noisy_race_time_share: float = 0.5
    """A noisy race goes on past ``max_rounds`` only while it has taken less than this share of the time the plan
    took before it: a busy machine may lengthen the plan by half, not more."""


TIMING_VARIABLE = "AUTOFIT_TIMING"
"""Environment variable naming the timing policy: ``full`` (the default) or ``short``."""

TIMING_POLICIES = {
    "full": TimingPolicy(),
    "short": TimingPolicy(max_rounds=2, max_noisy_rounds=2, promise_rounds=2, optimizer_step_timings=2, precision_timing_limit_s=5.0),
}
"""``short`` times each decision in the fewest rounds that still compare two of them (a test suite's plans: the
memory figures are the same, speeds within each other's noise may rank the other way)."""


def timing_policy() -> TimingPolicy:
    """The timing policy this process plans with: ``TIMING_POLICIES[$AUTOFIT_TIMING]``, ``full`` where unset.

    Raises:
        UserError: the variable names no policy.
    """
    name = os.environ.get(TIMING_VARIABLE, "").strip() or "full"
    if name not in TIMING_POLICIES:
        raise UserError(f"{TIMING_VARIABLE}={name!r} names no timing policy: use one of {', '.join(TIMING_POLICIES)}, or unset it")
    return TIMING_POLICIES[name]


POLICY = PlanPolicy()
"""The policy the planner runs with."""
