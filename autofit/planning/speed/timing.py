"""Timing on a shared machine: interleaved rounds, minima, and the noise they show.

Other work on the machine only ever slows a step down, so the fastest of
several rounds is the estimate of a configuration's time, and how well that
fastest round repeats (the second fastest over the fastest) is the noise of
the estimate. Rounds interleave the configurations, so that a burst of other
work slows one round of each rather than every round of one. A comparison
whose ratio lies within the noise is timed again, up to the timing policy's ``max_rounds``; one
that stays there is a tie, reported with the noise, and won by the simpler
configuration.

Nothing here runs a model: ``measure`` callables do, and tests pass a noisy
clock instead.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from autofit.planning.policy import POLICY, timing_policy
from autofit.progress import QUIET, Progress


def tie_cap(tie: float) -> float:
    """The widest a tie gets under noise when speeds within ``tie`` are one already."""
    return max(POLICY.max_tie_share, tie)


@dataclass(kw_only=True, slots=True)
class Samples:
    """Seconds of one thing timed in rounds."""

    seconds: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        """The fastest round: the estimate (other work only slows a step down)."""
        return min(self.seconds) if self.seconds else math.inf

    @property
    def spread(self) -> float:
        """How well the fastest round repeats: second fastest / fastest - 1 (inf with fewer than 2 rounds)."""
        if len(self.seconds) < 2:
            return math.inf
        first, second = sorted(self.seconds)[:2]
        return second / max(first, 1e-12) - 1.0


def noise_of(samples: Sequence[Samples]) -> float:
    """The largest spread among things timed at least twice (0 when none was)."""
    spreads = [s.spread for s in samples if len(s.seconds) >= 2]
    return max(spreads, default=0.0)


def compare(fast: Samples, slow: Samples, *, factor: float = 1.0) -> str:
    """Is ``slow`` more than ``factor`` times slower than ``fast``, given the noise of both?

    Returns:
        "yes" when even the noise cannot explain the ratio, "no" when even without
        noise it is not, "unsure" in between (time both again).
    """
    ratio = slow.best / max(fast.best, 1e-12)
    band = max(fast.spread, slow.spread)
    if ratio <= factor:
        return "no"
    if ratio > factor * (1.0 + band):
        return "yes"
    return "unsure"


def interleaved_rounds(
    measure: dict[Hashable, Callable[[], float]],
    *,
    settled: Callable[[dict[Hashable, Samples]], bool],
    samples: dict[Hashable, Samples] | None = None,
    min_rounds: int | None = None,
    max_rounds: int | None = None,
    active: Callable[[dict[Hashable, Samples]], Sequence[Hashable]] | None = None,
    progress: Progress = QUIET,
) -> dict[Hashable, Samples]:
    """Time every key once per round, in a rotating order, until ``settled`` or ``max_rounds``.

    Args:
        measure: key -> a callable returning the seconds of one more measurement.
        settled: whether the samples so far decide what the caller needs.
        samples: samples to extend (e.g. from a first round at a smaller size).
        min_rounds, max_rounds: bounds on the rounds each key gets (default: the timing policy's).
        active: which keys still need timing after a round (default all);
            a key out of the race is timed no more.
        progress: hears which round runs, and which of its measurements.

    Returns:
        The samples by key.
    """
    min_rounds = timing_policy().min_rounds if min_rounds is None else min_rounds
    max_rounds = timing_policy().max_rounds if max_rounds is None else max_rounds
    samples = samples if samples is not None else {}
    for key in measure:
        samples.setdefault(key, Samples())
    keys = list(measure)
    for round_ in range(max_rounds):
        running = [k for k in (active(samples) if active else keys) if len(samples[k].seconds) < max_rounds]
        if not running:
            break
        if all(len(samples[k].seconds) >= min_rounds for k in running) and settled(samples):
            break
        shift = round_ % len(running)
        for number, key in enumerate(running[shift:] + running[:shift], start=1):  # rotate: no key is always first after a pause
            with progress.doing(f"round {round_ + 1} of at most {max_rounds}, measurement", step=number, of=len(running)):
                samples[key].seconds.append(measure[key]())
    return samples


@dataclass(kw_only=True, slots=True)
class Race:
    """Contenders timed in interleaved rounds until the fastest is clear or the rest are within noise.

    The winner is the simplest contender within the noise of the fastest
    (``chosen``). A contender stops being timed once it is clearly slower than
    the fastest, or once it is neither simpler nor faster than the one that
    would be chosen now (it could only win by turning out clearly faster later,
    which the rounds so far make unlikely).
    """

    contenders: list[Hashable]
    simplicity: Callable[[Hashable], tuple] = lambda key: ()
    """Sort key: smaller is simpler (the winner of a tie)."""
    tie: float = POLICY.tie_share

    def leader(self, samples: dict[Hashable, Samples]) -> Hashable:
        return min(self.contenders, key=lambda k: samples[k].best)

    def standing(self, samples: dict[Hashable, Samples]) -> dict[Hashable, str]:
        """Each contender against the leader: "leader", "tie", "slower" or "unsure"."""
        lead = self.leader(samples)
        result = {}
        for key in self.contenders:
            if key == lead:
                result[key] = "leader"
                continue
            verdict = compare(samples[lead], samples[key], factor=1.0 + self.tie)
            result[key] = {"no": "tie", "yes": "slower", "unsure": "unsure"}[verdict]
        return result

    def chosen(self, samples: dict[Hashable, Samples]) -> Hashable:
        return min(self.within_noise(samples), key=self.simplicity)

    def running(self, samples: dict[Hashable, Samples]) -> list[Hashable]:
        """Contenders still worth timing (all of them until each has the timing policy's ``min_rounds``)."""
        if any(len(samples[k].seconds) < timing_policy().min_rounds for k in self.contenders):
            return list(self.contenders)
        standing, chosen = self.standing(samples), self.chosen(samples)
        return [
            k for k in self.contenders
            if standing[k] != "slower"
            and (k == chosen or self.simplicity(k) < self.simplicity(chosen) or samples[k].best < samples[chosen].best)
        ]

    def settled(self, samples: dict[Hashable, Samples]) -> bool:
        standing = self.standing(samples)
        return all(standing[k] != "unsure" for k in self.running(samples))

    def done(self, samples: dict[Hashable, Samples], *, may_go_on: bool = True) -> bool:
        """``settled``, or the timing policy's ``max_rounds`` timed and not ``noisy`` (a noisy race goes on to its
        ``max_noisy_rounds`` where ``may_go_on``: the caller's time allows it)."""
        if self.settled(samples):
            return True
        running = self.running(samples)
        timing = timing_policy()
        rounds = min((len(samples[k].seconds) for k in running), default=timing.max_noisy_rounds)
        return rounds >= timing.max_rounds and not (may_go_on and self.noisy(samples))

    def noisy(self, samples: dict[Hashable, Samples]) -> bool:
        """Whether the contenders still timed repeat their fastest rounds worse than ``POLICY.max_tie_share`` (median spread)."""
        return self.median_spread(samples) > POLICY.max_tie_share

    def median_spread(self, samples: dict[Hashable, Samples]) -> float:
        """How well the contenders still timed repeat their fastest rounds: their median spread (0 before any has two rounds)."""
        spreads = sorted(samples[k].spread for k in self.running(samples) if len(samples[k].seconds) >= 2)
        return spreads[len(spreads) // 2] if spreads else 0.0

    def behind(self, samples: dict[Hashable, Samples]) -> dict[Hashable, float]:
        """Each contender's fastest round over the chosen one's, less 1 (0.08: 8% slower; negative: faster)."""
        chosen = samples[self.chosen(samples)].best
        return {k: samples[k].best / max(chosen, 1e-12) - 1.0 for k in self.contenders}

    def within_noise(self, samples: dict[Hashable, Samples]) -> list[Hashable]:
        """The leader and every contender it does not clearly beat: within the tie, or within the
        noise of the two (at most ``POLICY.max_tie_share``), what stayed unsure after the last round included."""
        lead = self.leader(samples)
        found = []
        for key in self.contenders:
            band = min(max(self.tie, samples[lead].spread, samples[key].spread), tie_cap(self.tie))
            if samples[key].best <= samples[lead].best * (1.0 + band):
                found.append(key)
        return found
