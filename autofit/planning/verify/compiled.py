"""After the verification: the chosen configuration compiled (``torch.compile``), kept only where measured to fit and faster.

The compiled configuration is probed with the device's meter (on the CPU
the tracker's eager count corrected by the allocator's own, in
``measure.meters.compiled_step_on_cpu``) and timed side by side with the
chosen one in interleaved rounds (``Measurements.race``); compiled counts as
the less simple of the two, so a tie keeps the model uncompiled. The time it
all took, compiling included, is said in the plan's notes: it is part of
planning. A model Inductor cannot compile stays uncompiled, with one note.

Measured on the device only: when simulating nothing runs, so nothing says
that compiling pays.
"""
from __future__ import annotations

import time
from dataclasses import replace

from autofit._torch_private import compile_failures
from autofit.config import TrainingConfig
from autofit.planning.context import PlanContext
from autofit.planning.verify.measurements import Measurements
from autofit.planning.records import Verified
from autofit.units import format_bytes

KEPT = "found by an earlier run of this plan, kept in the cost cache"
"""Said after a finding an earlier run made (``Measurements.compiled``)."""


def with_compile(context: PlanContext, chosen: Verified, measurements: Measurements) -> tuple[Verified, str]:
    """The chosen configuration, compiled where that was measured to fit and to be faster; and a note saying what was found.

    Args:
        chosen: ``verify``'s result. Compiled, its speed ratio to the unconstrained
            configuration compares the compile race's median with the verification race's.
    """
    config = chosen.config
    compiled = replace(config, compile=True)
    known = measurements.compiled.get(config.key())
    # An earlier run of this plan (same model, device, batch; another budget perhaps) found it: kept in the cost
    # cache, not compiled again; whether the compiled peak fits is this budget's question.
    if known is not None and known["on"] and measurements.has_peak(compiled) and measurements.samples_per_s(compiled):
        if measurements.fits(compiled):
            return chosen.with_config(compiled, measurements.result(compiled)), f"{known['note']} ({KEPT})"
    elif known is not None and not known["on"]:
        return chosen, f"{known['note']} ({KEPT})"
    chosen, note, any_budget = _measured(context, chosen, compiled, measurements)
    if any_budget:
        measurements.compiled[config.key()] = {"on": chosen.config.compile, "note": note}
    return chosen, note


def _measured(
    context: PlanContext, chosen: Verified, compiled: TrainingConfig, measurements: Measurements,
) -> tuple[Verified, str, bool]:
    """``with_compile`` measured in this run; the last value says whether the finding holds under any budget (it is
    kept then): failing to compile, being slower or faster do, not fitting does not."""
    config = chosen.config
    started = time.perf_counter()
    context.log("compile: measuring the chosen configuration under torch.compile (its first steps compile)")
    try:
        peak, breakdown = measurements.checked_peak(compiled, fresh=True)
    except compile_failures() as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return chosen, f"torch.compile left off: the model did not compile ({type(error).__name__}: {first[:200]})", True
    if not measurements.fits(compiled):
        measurements.reject(compiled, f"compiled: {measurements.over_budget(peak, breakdown)}")
        return chosen, (
            f"torch.compile left off: compiled, the peak is {format_bytes(peak)}, which with its headroom does not fit "
            f"(uncompiled {format_bytes(chosen.measurement.peak_bytes)}); measured in {time.perf_counter() - started:.0f} s"
        ), False
    # This race times the chosen one again: its entry goes back to the verification's race after it, so that a plan
    # made again from the cost cache finds that race whole (and chooses as this run did).
    kept, verification_timing = measurements.timings.get(config.key()), measurements.timing
    order = measurements.race([config, compiled])
    seconds = time.perf_counter() - started
    plain_speed, compiled_speed = measurements.samples_per_s(config), measurements.samples_per_s(compiled)
    if kept is not None:
        measurements.timings[config.key()] = kept
    speeds = f"{compiled_speed:.1f} samples/s compiled, {plain_speed:.1f} not (medians of the rounds)"
    memory = f"peak {format_bytes(peak)} compiled, {format_bytes(chosen.measurement.peak_bytes)} not"
    if order[0].key() != compiled.key():
        measurements.timing = verification_timing  # the summary's timing lines: the race that chose
        return chosen, f"torch.compile left off: not faster beyond the noise ({speeds}; {memory}); compiling and measuring took {seconds:.0f} s", True
    return chosen.with_config(compiled, measurements.result(compiled)), (
        f"torch.compile on: measured to fit and to be faster ({speeds}; {memory}); compiling and measuring took "
        f"{seconds:.0f} s of this plan, and training compiles again at its first steps"
    ), True
