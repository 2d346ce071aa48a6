"""What one planning run measured, by configuration: exact peaks, real probes and timings (``Measurements``).

Peaks by the simulated meter (equal to the CPU meter, no arithmetic), real
probes with the device's meter, timings of plain training steps in
interleaved rounds (``timing``), the budget's headroom as measured so far,
and what a store of an earlier run with the same model, device and batch
holds of them. ``verify`` chooses with them; the floor, the levers' ladder
and the multi-process plans measure through them too.
"""
from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import replace

import torch

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.measure.meters import release_device_memory, simulated_meter
from autofit.measure.optimizer_state import create_optimizer_state
from autofit.measure.probe import measure
from autofit.planning.context import PlanContext
from autofit.units import format_bytes
from autofit.planning.speed.measured import StepTimer
from autofit.planning.memory.headroom import Headroom, persistent_bytes
from autofit.planning.policy import POLICY, timing_policy
from autofit.planning.speed.timing import Race, Samples, interleaved_rounds
from autofit.planning.records import Measurement, VerifiedPoint
from strategies import MASTER_WEIGHTS, PRECISIONS, PURE_BF16, nf4_weights
from strategies.optimizer_state import held_weight_bytes


class Measurements:
    """Every measurement of one planning run, by configuration, counted for the report.

    Two micro-batches stand for all of them in a memory probe (later
    micro-steps repeat the second); the samples not traced are added as the
    host's copy of the global batch where the meter counts it.

    Args:
        stored: ``to_store()`` of an earlier run with the same model, device and
            batch (from the study): peaks are reused, timings only where every
            configuration compared was timed in one earlier run.
        nf4: frozen linear weights may be held in NF4 (``--allow-lossy-base``): ``weight_bytes`` counts them at
            NF4's size.
    """

    def __init__(self, context: PlanContext, *, host_sample_bytes: int, stored: dict | None = None, nf4: bool = False) -> None:
        self.context = context
        self.nf4 = nf4
        self.host_sample_bytes = host_sample_bytes
        if stored and not _readable(stored):  # a damaged cache: measured again, and said so
            context.log("the stored measurements could not be read: measuring again")
            stored = None
        stored = stored or {}
        self.peaks: dict[str, dict] = dict(stored.get("peaks", {}))
        """Configuration key -> the meter's peak ("peak_bytes", "breakdown", "context_bytes"; "oom" when it ran out)."""
        self.timings: dict[str, dict] = dict(stored.get("timings", {}))
        """Configuration key -> {"session": the run that timed it, "threads": with how many, "seconds": one step of
        the global batch per round}."""
        self.session = uuid.uuid4().hex[:12]
        self.fresh: set[str] = set()
        """Keys whose peak was measured in this run."""
        self.simulated_checks = 0
        self.memory_probes = 0
        self.real_probes = 0
        """Configurations timed in this run."""
        self.rejected: list[dict] = []
        """Configurations ruled out, with why."""
        self.timing: dict = {}
        """What the verification's timing saw: rounds, noise, and the configurations within it of the fastest."""
        self.learned: dict[str, float] = {}
        """Precision -> measured / predicted peak, where a probe showed the model optimistic (``scale``)."""
        self.ladder_samples_per_s: float | None = None
        """The floor configuration with the levers, timed (``below_floor.timed_ladder``); None until it is."""
        self.model_error: float | None = None
        """The largest relative difference of a probe's peak from the memory model's (``compared``; a byte counted
        beside it); None before any probe was compared."""
        self.floor_said: int | None = None
        """The floor the log last stated (``check_floor`` runs again as precisions are traced: the same floor once)."""
        self.predicted: dict[str, float] = {}
        """Configuration key -> the cost model's peak, for keeping timers within memory (set by ``verify``)."""
        self._exact: dict[str, tuple[int, dict, int]] = {}
        self._measured_context_bytes: int | None = None
        self._resident_bytes: int | None = stored.get("resident_bytes")
        self._weight_bytes: dict[bool, int] = {}
        """Whether the precision casts the weights to bf16 -> ``weight_bytes``."""
        self.compiled: dict[str, dict] = dict(stored.get("compiled", {}))
        """Chosen configuration's key -> what compiling it was found to do ({"on": bool, "note": str}), kept so that
        a plan made again decides without compiling again (``verify.compiled``)."""

    @property
    def headroom(self) -> Headroom:
        """The budget's headroom as measured so far: on a real GPU the first probe replaces the assumed context."""
        return self.context.headroom(context_bytes=self._measured_context_bytes)

    @property
    def resident_bytes(self) -> int:
        """Parameters (with buffers) and optimizer state: on the device through every step of every configuration the
        search scores, so a lower bound of the persistent bytes at any of their peaks (for the headroom of a peak
        that is only predicted).

        Counted (one model built and its optimizer state made, over fake tensors) only where the headroom
        depends on it (``Headroom.depends_on_persistent``: planning for a GPU that is not here); 0 elsewhere.
        Kept with the measurements (the study's key holds the model, device and batch).
        """
        if self._resident_bytes is None:
            self._resident_bytes = _resident_bytes(self.context) if self.headroom.depends_on_persistent else 0
        return self._resident_bytes

    def usable_bytes(self, precision: str | None = None) -> float:
        """The largest predicted peak the budget's headroom leaves (``Headroom.usable_bytes``, with ``resident_bytes``);
        with ``precision``, for its configurations (``resident_for``)."""
        return self.headroom.usable_bytes(persistent_bytes=self.resident_for(precision))

    def usable_by_precision(self) -> dict[str, float]:
        """``usable_bytes`` for every precision a configuration may have (the levers below the floor add bf16-master
        to a plan that did not search it)."""
        return {precision: self.usable_bytes(precision) for precision in PRECISIONS}

    def resident_for(self, precision: str | None) -> int:
        """``resident_bytes`` for ``precision``'s configurations: bf16-master and bf16-pure hold the weights in bf16
        (and bf16-master its optimizer state on the host), less than the fp32 parameters and state counted there;
        a bound above what they hold would leave their peaks too little fragmentation allowance."""
        if precision not in (MASTER_WEIGHTS, PURE_BF16) or not self.resident_bytes:
            return self.resident_bytes
        meta = self.context.meta_model
        return min(self.resident_bytes, held_weight_bytes(meta, cast=True) + sum(b.numel() * b.element_size() for b in meta.buffers()))

    def weight_bytes(self, precision: str) -> int:
        """The weights' bytes ``precision`` keeps on the device (``held_weight_bytes``: bf16 where bf16-master and
        bf16-pure cast them; frozen ones NF4 may hold at its size). Every configuration of one process keeps them
        there, whatever its levers (they move activations and optimizer state)."""
        cast = precision in (MASTER_WEIGHTS, PURE_BF16)
        if cast not in self._weight_bytes:
            meta = self.context.meta_model
            nf4 = [layer.weight for layer in nf4_weights(meta)] if self.nf4 else ()
            self._weight_bytes[cast] = held_weight_bytes(meta, cast=cast, nf4=nf4)
        return self._weight_bytes[cast]

    def weights_over_budget(self, precision: str) -> int | None:
        """``weight_bytes`` where they alone are more than any of the precision's peaks may be (``usable_bytes``,
        with the ``slack`` a prediction may have and still be probed): it has no configuration that fits; else None."""
        weights = self.weight_bytes(precision)
        return weights if weights > self.usable_bytes(precision) * (1 + self.slack) else None

    def weights_budget(self, precision: str) -> int:
        """The least budget ``weight_bytes`` alone would need with their headroom: every configuration of the
        precision needs at least this (a floor at or below it is not lowered by tracing the precision)."""
        weights = self.weight_bytes(precision)
        return self.headroom.smallest_budget(weights, persistent_bytes=weights)

    def fits_peak(self, peak_bytes: float, breakdown: dict[str, int]) -> bool:
        """Whether a measured peak and its headroom fit the budget (the breakdown says what of it is persistent)."""
        return self.headroom.fits(peak_bytes, persistent_bytes=persistent_bytes(breakdown))

    def over_budget(self, peak_bytes: float, breakdown: dict[str, int]) -> str:
        """Why a measured peak does not fit, as a sum: the peak, each cause of its headroom, what they need, the budget."""
        return self.headroom.needed_text(peak_bytes, persistent_bytes=persistent_bytes(breakdown))

    @property
    def model_is_exact(self) -> bool:
        """Whether the memory model stands for the meter with the last word (to within ``POLICY.model_slack_share``).

        It is built from the simulated meter, which equals the CPU meter; a real
        GPU's allocator it only approaches through ``CostModel.memory_scale``.
        """
        return self.context.simulate or self.context.device == "cpu"

    @property
    def slack(self) -> float:
        """How far over the usable bytes a prediction may be and still be worth a probe.

        Where the model is the meter's twin it is exact or optimistic: ``POLICY.exact_slack_share`` at most, and once
        probes were compared with it (``model_error``), twice the most they differed. A point predicted further over
        cannot fit (the ResNet-18 of #47 probed a checkpoint set predicted 0.06% over, the model 4 bytes off)."""
        if not self.model_is_exact:
            return POLICY.model_slack_share
        return POLICY.exact_slack_share if self.model_error is None else min(POLICY.exact_slack_share, 2 * self.model_error)

    def compared(self, *, measured: float, predicted: float) -> None:
        """A probe's peak beside the memory model's prediction of it: how far the model may be off (``slack``)."""
        if predicted > 0:
            error = (abs(measured - predicted) + 1) / predicted
            self.model_error = error if self.model_error is None else max(self.model_error, error)

    def scale(self, precision: str) -> float:
        """Measured over predicted peak, the largest seen for this precision in this run (at least 1).

        Where the model is exact this stays 1; where it turns out optimistic for a
        precision, the next candidates of that precision are judged by what the
        probes showed, not probed one by one into the same miss.
        """
        return self.learned.get(precision, 1.0)

    def learn(self, precision: str, *, measured: float, predicted: float) -> None:
        self.compared(measured=measured, predicted=predicted)
        if predicted > 0 and measured > predicted:
            self.learned[precision] = max(self.scale(precision), measured / predicted)

    def reject(self, config: TrainingConfig, why: str) -> None:
        self.rejected.append({"config": config.key(), "why": why})

    def has_peak(self, config: TrainingConfig) -> bool:
        """Whether ``checked_peak`` already knows this configuration's peak (measured in this run or stored)."""
        return config.key() in self.peaks

    def checked_peak(self, config: TrainingConfig, *, fresh: bool = False) -> tuple[int, dict]:
        """A configuration's peak by the meter that has the last word: the device's, or the simulated one when simulating.

        Args:
            fresh: measure it in this run even if an earlier run stored it (what is chosen always is).
        """
        key = config.key()
        if key not in self.peaks or (fresh and key not in self.fresh):
            if self.context.simulate:
                peak, breakdown = self.exact_peak(config)
                self.peaks[key] = {"peak_bytes": peak, "breakdown": breakdown, "host_peak_bytes": self._exact[key][2]}
            else:
                self._real_peak(config)
            self.fresh.add(key)
        entry = self.peaks[key]
        if entry.get("oom"):
            return self.context.info.total_bytes, {}
        if entry.get("context_bytes") is not None and self.context.device == "cuda" and not self.context.simulate:
            self._measured_context_bytes = max(self._measured_context_bytes or 0, entry["context_bytes"])
        return entry["peak_bytes"], dict(entry["breakdown"])

    def exact_peak(self, config: TrainingConfig) -> tuple[int, dict]:
        """The simulated meter's peak of a configuration and its breakdown: equal to the CPU meter, no arithmetic."""
        key = config.key()
        if key not in self._exact:
            context, m = self.context, config.micro_batch_size
            traced = min(context.global_batch_size, 2 * m)
            with context.progress.doing(f"measuring {_words(config)} (simulated meter)"):
                result = measure(
                    context.sim_spec, replace(config, global_batch_size=traced), device=context.device, simulate=True, steps=2,
                    progress=context.progress,
                )
            host = (context.global_batch_size - traced) * self.host_sample_bytes
            breakdown = dict(result.breakdown)
            breakdown["activations"] = breakdown.get("activations", 0) + host
            self._exact[key] = (result.peak_bytes + host, breakdown, result.host_peak_bytes)
            self.simulated_checks += 1
        peak, breakdown, _ = self._exact[key]
        return peak, breakdown

    def _real_peak(self, config: TrainingConfig) -> None:
        """Probe a configuration with the device's meter; its peak less the GPU context goes into ``peaks``."""
        context, m = self.context, config.micro_batch_size
        traced = min(context.global_batch_size, 2 * m)
        try:
            with context.progress.doing(f"measuring {_words(config)} ({context.device} meter)"):
                result = measure(
                    context.spec, replace(config, global_batch_size=traced), device=context.device, steps=2, progress=context.progress,
                )
        except torch.OutOfMemoryError:
            release_device_memory(context.device)
            self.reject(config, "out of memory on the device")
            self.peaks[config.key()] = {"oom": True}
            return
        on_gpu = context.device == "cuda"
        breakdown = dict(result.breakdown)
        context_bytes = breakdown.pop("context", 0) if on_gpu else 0
        # The CPU meter counts the host's global batch too; the GPU meter does not see it.
        host = 0 if on_gpu else (context.global_batch_size - traced) * self.host_sample_bytes
        breakdown["activations"] = breakdown.get("activations", 0) + host
        self.peaks[config.key()] = {
            "peak_bytes": result.peak_bytes - context_bytes + host, "breakdown": breakdown, "context_bytes": context_bytes,
            "host_peak_bytes": result.host_peak_bytes,
        }
        self.memory_probes += 1

    def fits(self, config: TrainingConfig) -> bool:
        """Whether the measured peak (``checked_peak``) plus headroom fits the budget, and what it keeps in host
        memory fits the host's (``fits_host``)."""
        peak, breakdown = self.checked_peak(config)
        entry = self.peaks[config.key()]
        return not entry.get("oom") and self.fits_peak(peak, breakdown) and self.fits_host(entry.get("host_peak_bytes", 0))

    def fits_host(self, host_peak_bytes: int) -> bool:
        """Whether a configuration's host bytes (host state, bf16 weights' masters, offloaded activations) fit the host
        memory the plan may spend (always, where there is no such limit: on the CPU)."""
        limit = self.context.host_budget_bytes
        return limit is None or host_peak_bytes <= limit

    def host_excess(self, host_peak_bytes: int) -> str | None:
        """"keeps 1.00 GiB in host memory, more than the host's 512.00 MiB" where those bytes do not fit the host's
        memory (``fits_host``); None where they do."""
        if self.fits_host(host_peak_bytes):
            return None
        return f"keeps {format_bytes(host_peak_bytes)} in host memory, more than the host's {format_bytes(self.context.host_budget_bytes)}"

    def host_peak(self, config: TrainingConfig) -> int:
        """The host bytes a measured configuration kept at most (0 where it kept none, or was not measured)."""
        return self.peaks.get(config.key(), {}).get("host_peak_bytes", 0)

    def host_refusal(self) -> str | None:
        """Where configurations fit the device but not the host: what the least of them needs there, as the rest of a
        sentence naming ``--host-memory``; None when none was turned away for the host."""
        needs = [
            entry["host_peak_bytes"] for entry in self.peaks.values()
            if not entry.get("oom") and not self.fits_host(entry.get("host_peak_bytes", 0))
            and self.fits_peak(entry["peak_bytes"], entry["breakdown"])
        ]
        if not needs:
            return None
        return (
            f"the configurations that fit the device need {format_bytes(min(needs))} of host memory at least (the fp32 "
            f"masters, gradients and optimizer state kept there), and the host has {format_bytes(self.context.host_budget_bytes)} "
            f"({self.context.host_budget_note}); give --host-memory for the machine that trains, or raise --budget"
        )

    def samples_per_s(self, config: TrainingConfig) -> float | None:
        """Measured samples/s of plain training steps: the global batch over the median round (None if never timed).

        The fastest round ranks configurations (``Samples.best``: other work
        only slows a step down); the median is what the plan promises, since
        training too reports its median step. On 2 quiet cores the quick
        start's fastest round was 7% under its median (bench/RESULTS.md,
        "Training against its plan").
        """
        return self._median_speed(config.key())

    def _median_speed(self, key: str) -> float | None:
        """The global batch over the median timed round of a configuration's key (None if never timed)."""
        entry = self.timings.get(key)
        if not entry or not entry["seconds"]:
            return None
        return self.context.global_batch_size / statistics.median(entry["seconds"])

    def noise(self, config: TrainingConfig) -> float | None:
        """How well the configuration's fastest round repeated (``Samples.spread``); None when timed fewer than twice."""
        entry = self.timings.get(config.key())
        if not entry or len(entry["seconds"]) < 2:
            return None
        return Samples(seconds=list(entry["seconds"])).spread

    def race(self, contenders: list[TrainingConfig], *, reference: TrainingConfig | None = None) -> list[TrainingConfig]:
        """Time the contenders side by side; the fastest first, the simplest winning within the noise.

        The contenders (and ``reference``, timed in the timing policy's first ``min_rounds`` rounds
        for the speed ratio) take turns, one training step of the global batch
        each per round, at least ``min_rounds`` rounds after a warm-up (one when
        there is a single contender: nothing to decide), and more while a
        contender that could still win is within the noise of the leader, up
        to ``max_rounds`` (``timing.Race``). Timings of an earlier run are used
        instead only when that run timed all of them and they decide.

        Returns:
            The contenders, the chosen one first, then the rest fastest first.
        """
        keys = [c.key() for c in contenders]
        configs = {c.key(): c for c in contenders}
        if reference is not None:
            configs.setdefault(reference.key(), reference)
        race = Race(contenders=keys, simplicity=lambda k: configs[k].simplicity(), tie=self.context.tie)
        samples = self._stored_samples(list(configs), race)
        if samples is None:
            samples = self._time_now(configs, race)
        leader = race.leader(samples)
        tied = race.within_noise(samples)
        chosen = race.chosen(samples)
        # The chosen one was timed alone a few more times (the timing policy's ``promise_rounds``): the others' count the interleaved rounds.
        others = [len(samples[k].seconds) for k in configs if k != chosen]
        spreads = sorted(samples[k].spread for k in keys if len(samples[k].seconds) >= 2)
        self.timing = {
            "rounds": max(others) if others else len(samples[keys[0]].seconds),
            "noise": spreads[len(spreads) // 2] if spreads else 0.0,
            "worst_noise": spreads[-1] if spreads else 0.0,
            "within_noise": [k for k in tied if k != chosen],
            "behind": {k: v for k, v in race.behind(samples).items() if k != chosen},
            "fastest": leader,
            "reused": all(self.timings[k]["session"] != self.session for k in keys),
            "tie": race.tie,
        }
        rest = sorted((k for k in keys if k != chosen), key=lambda k: samples[k].best)
        return [configs[k] for k in [chosen, *rest]]

    def _stored_samples(self, keys: list[str], race: Race) -> dict[str, Samples] | None:
        """Samples of one earlier run that raced exactly these keys (it decided as this run would); else None.

        Timings of different runs are never compared: the load on the machine differs between them.
        """
        sessions = {(self.timings[k]["session"], self.timings[k].get("threads")) for k in keys if k in self.timings}
        if len(sessions) != 1 or any(k not in self.timings for k in keys) or next(iter(sessions))[1] != self.context.threads:
            return None
        samples = {k: Samples(seconds=list(self.timings[k]["seconds"])) for k in keys}
        required = timing_policy().min_rounds if len(race.contenders) > 1 else 1
        if any(len(s.seconds) < required for k, s in samples.items() if k in race.contenders):
            return None
        return samples

    def _time_now(self, configs: dict[str, TrainingConfig], race: Race) -> dict[str, Samples]:
        """Interleaved rounds of the configurations in this run (``StepTimer``s kept between rounds where memory allows).

        With the threads the machine leaves free now (``PlanContext.recheck_threads``); where several repeat worse
        than ``POLICY.threads_noise_share`` after ``min_rounds``, the rounds are dropped and timed again with one
        thread (as the speed model's are: ``modelling._timed_speeds``)."""
        self.context.recheck_threads()
        may_cut, threads = self.context.thread_choice.may_cut(self.context.device), self.context.threads
        timers: dict[str, StepTimer] = {}
        keys = list(configs)
        on_gpu = self.context.device == "cuda"
        progress = self.context.progress
        allowance = POLICY.keep_timers_memory_share * self.context.info.total_bytes

        def measure(key: str):
            def run() -> float:
                if key not in timers:
                    kept = sum(self._peak_or_predicted(configs[k]) for k in timers)
                    if on_gpu or kept + self._peak_or_predicted(configs[key]) > allowance:
                        for other in list(timers):
                            timers.pop(other).close()
                    timers[key] = StepTimer(
                        self.context.spec, configs[key], device=self.context.device, clock=self.context.clock,
                        set_up=self._probed_here(configs[key]),
                    )
                return timers[key].step_seconds()
            return run

        def active(current: dict[str, Samples]) -> list[str]:
            # The reference is only for the speed ratio: ``min_rounds`` rounds beside the contenders.
            reference = [k for k in keys if k not in race.contenders and len(current[k].seconds) < timing_policy().min_rounds]
            return race.running(current) + reference

        started = time.perf_counter()
        before = started - self.context.started

        def settled(current: dict[str, Samples]) -> bool:
            if may_cut and race.median_spread(current) > POLICY.threads_noise_share:
                return True  # dropped: timed again with one thread
            # Past ``max_rounds`` only a noisy race goes on, while it has taken less than ``noisy_race_time_share`` of the plan before it.
            return race.done(current, may_go_on=time.perf_counter() - started < timing_policy().noisy_race_time_share * before)

        try:
            # One candidate has nothing to be compared with: one round gives its speed (and the ratio's).
            rounds = timing_policy().min_rounds if len(race.contenders) > 1 else 1
            with progress.doing(f"timing {len(keys)} configuration(s) side by side"):
                samples = interleaved_rounds(
                    {k: measure(k) for k in keys}, settled=settled, active=active, min_rounds=rounds,
                    max_rounds=timing_policy().max_noisy_rounds, progress=progress,
                )
            noise = race.median_spread(samples)
            if may_cut and noise > POLICY.threads_noise_share:
                for timer in timers.values():
                    timer.close()
                timers.clear()
                self.context.cut_threads(1, (
                    f"the candidates' steps on {threads} threads repeated within {noise:.0%} (more than "
                    f"{POLICY.threads_noise_share:.0%}): timed again with 1 thread, by its CPU time"
                ))
                race.tie = self.context.tie  # the run's tie from here on (``PlanContext.tie``: a cut run's wider one)
                return self._time_now(configs, race)
            # The chosen one's median round is what the plan promises: a few more rounds of it alone, deciding nothing.
            chosen = race.chosen(samples)
            once_more = measure(chosen)
            with progress.doing("timing the chosen configuration alone"):
                while (
                    len(samples[chosen].seconds) < timing_policy().promise_rounds
                    and time.perf_counter() - started < timing_policy().noisy_race_time_share * before
                ):
                    samples[chosen].seconds.append(once_more())
        finally:
            for timer in timers.values():
                timer.close()
        for key in keys:
            self.timings[key] = {"session": self.session, "threads": self.context.threads, "seconds": samples[key].seconds}
        self.real_probes += len(keys)
        return samples

    def _probed_here(self, config: TrainingConfig) -> bool:
        """Whether this run probed ``config`` on the CPU, every micro-batch of one size: its kernels are set up in this
        process (``StepTimer``'s ``set_up``)."""
        return (
            self.context.device == "cpu" and not self.context.simulate and config.key() in self.fresh
            and config.global_batch_size % config.micro_batch_size == 0
        )

    def _peak_or_predicted(self, config: TrainingConfig) -> float:
        entry = self.peaks.get(config.key())
        return entry["peak_bytes"] if entry and not entry.get("oom") else self.predicted.get(config.key(), 0.0)

    def result(self, config: TrainingConfig) -> Measurement:
        """What was measured of a configuration, for the plan."""
        entry = self.peaks[config.key()]
        peak = entry["peak_bytes"]
        return Measurement(
            peak_bytes=peak, samples_per_s=None if self.context.simulate else self.samples_per_s(config),
            meter="simulated" if self.context.simulate else self.context.device, breakdown=dict(entry["breakdown"]),
            noise=None if self.context.simulate else self.noise(config),
            context_bytes=entry.get("context_bytes", 0),
            host_peak_bytes=entry.get("host_peak_bytes", 0),
            headroom=self.headroom.for_peak(peak, persistent_bytes=persistent_bytes(entry["breakdown"])),
        )

    @property
    def verified(self) -> dict[str, VerifiedPoint]:
        """Configuration key -> what was measured of it, for the alternatives of the plan."""
        why: dict[str, str] = {}
        for rejection in self.rejected:
            why.setdefault(rejection["config"], rejection["why"])
        found = {}
        for key, entry in self.peaks.items():
            if entry.get("oom"):
                found[key] = VerifiedPoint(fits=False, rejected=why.get(key, "out of memory on the device"))
                continue
            found[key] = VerifiedPoint(
                fits=self.fits_peak(entry["peak_bytes"], entry["breakdown"]), measured_peak_bytes=entry["peak_bytes"],
                measured_samples_per_s=self._median_speed(key), rejected=why.get(key),
            )
        return found

    def to_store(self) -> dict:
        kept = {"resident_bytes": self._resident_bytes} if self._resident_bytes else {}
        kept |= {"compiled": self.compiled} if self.compiled else {}
        return {"peaks": self.peaks, "timings": self.timings, **kept}


def _resident_bytes(context: PlanContext) -> int:
    """The model's parameters, buffers and optimizer state on the device, made under the simulated meter (no step runs)."""
    spec = context.sim_spec
    meter = simulated_meter(spec, for_device=context.device)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        applied = apply_config(model, TrainingConfig(global_batch_size=1, micro_batch_size=1), device=meter.device, use_scaler=False)
        optimizer = applied.build_optimizer(spec.build_optimizer)
        create_optimizer_state(applied.model, optimizer, at_once=True)  # the state's bytes only
        state = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
        tensors = [*applied.model.parameters(), *applied.model.buffers(), *state]
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
    return sum(storages.values())


def _readable(stored) -> bool:
    """Whether a stored ``to_store()`` has its shape: peaks and timings by configuration key, each an object."""
    if not isinstance(stored, dict):
        return False
    tables = [stored.get("peaks", {}), stored.get("timings", {}), stored.get("compiled", {})]
    resident = stored.get("resident_bytes")
    return (
        all(isinstance(table, dict) and all(isinstance(v, dict) for v in table.values()) for table in tables)
        and (resident is None or isinstance(resident, int))
    )


def _words(config: TrainingConfig) -> str:
    """A configuration as the progress lines name what is measured: "bf16, micro-batch 4 x 2, 3 blocks checkpointed"."""
    blocks = len(config.checkpoint) + len(config.selective_checkpoint)
    return f"{config.precision}, micro-batch {config.micro_batch_size} x {config.grad_accum_steps}" + (
        f", {blocks} block(s) checkpointed" if blocks else ""
    )
