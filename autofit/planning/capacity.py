"""Capacity: which cards a model trains on, and how, answered from one cost record ("will it fit on my card?").

``capacity_record`` builds the record the way ``plan --simulate --device cuda`` does (``modelling.stored_or_new``, the
same cost cache, ``trace_full`` with its recomputations, the chunked loss's and offload's runs), once, with every
lossless lever traced, since the least budget needs them all. Everything after that is pure (``search.space``):

- ``least_budget``: the least card memory whose headroom leaves room for some configuration (the floor with every
  lossless lever), by bisection over the budget;
- ``best_at``: the configuration the search chooses for a card's memory at a global batch, with its speed;
- ``largest_one_step``: the largest batch one micro-step holds on a card. With accumulation a step's memory grows
  with the global batch by the inputs' copy only, so batches far larger train once one micro-batch fits; the most
  samples one step holds is the figure that bounds the batch;
- ``longest_at``: the longest sequence a global batch trains on a card, from records at a few traced lengths with
  every term fitted through them (``lengths``); ``longest_seq_len`` (``plan --seq-len max``) traces again at its
  answer until the answer is a traced length.

The declared lossy choices (8-bit optimizer state, bf16-pure, an NF4 base) are traced where the user allows them and
answered apart: ``lossless`` takes them out of the lossless answers, ``lossy_answer`` gives a card's with them.

A card's speeds come from the FLOP counts with its row of ``GPU_PEAKS`` (``card_speeds``, kept in the cache beside
the costs); its memory's headroom is the estimated GPU's (``Headroom``), the one ``plan --simulate`` keeps.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.planning.bounds import host_step_bytes
from autofit.planning.costs import CostModel, SpeedCosts
from autofit.planning.memory.headroom import Headroom
from autofit.planning.context import PlanContext, intra_op_threads, plan_context
from autofit.planning.lever_timings import Levers, card_host_update, lever_search
from autofit.planning.memory.levers import LeverChoice
from autofit.planning.lengths import SEQ_LEN_STEP, LengthRecords, LengthsDiffer, longest_sequence, traced_lengths
from autofit.planning.modelling import (
    add_eight_bit_state, add_loss_chunks, add_nf4_state, add_recomputations, add_speeds, micro_batch_sizes, save,
    stored_or_new, timing_sizes, trace_full, trace_offload,
)
from autofit.planning.request import PlanRequest
from autofit.planning.search.space import Allowed, Evaluation, LeverSearch, cheapest_for, score_all, score_point
from autofit.planning.speed.estimated import GPU_PEAKS, flop_speed_costs, gpu_kind
from autofit.planning.verify.candidates import predicted_peak
from autofit.planning.verify.measurements import Measurements
from autofit.spec import ModelSpec
from autofit.units import format_bytes, parse_budget
from strategies import MASTER_WEIGHTS, PRECISIONS, PURE_BF16

DEFAULT_CARDS = ("T4", "RTX 4090", "A100 40GB", "L40S", "H100")
"""Common cards of 16, 24, 40, 48 and 80 GB, each a row of ``GPU_PEAKS``."""

BUDGET_RESOLUTION_BYTES = 8 * 2**20
"""How close ``least_budget``'s bisection comes to the least budget at least (it answers the budget above it)."""

LARGEST_BATCH_SEARCHED = 2**20
"""The largest-batch searches look no further: a batch this large is "at least" it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Card:
    """A GPU that is not here: its name, its memory, and its row of ``GPU_PEAKS`` for its speeds."""

    name: str
    memory_bytes: int
    kind: str | None
    """``GPU_PEAKS``' key; None for a card named by its memory alone (its speeds an A100's, as ``plan --simulate``'s)."""


def parse_cards(text: str) -> list[Card]:
    """Cards from ``--on``: table names ("RTX 4090", "h100"), each optionally with its memory ("A100 40GB": a card's
    GB are GiB, as vendors sell them), or a memory alone ("24GiB": a GPU of that memory).

    Raises:
        UserError: an empty list, or a name the table does not hold (the line lists those it does).
    """
    cards = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        cards.append(_card(part))
    if not cards:
        raise UserError(f"--on {text!r} names no card; give e.g. --on \"RTX 4090,A100 40GB\" (cards: {', '.join(GPU_PEAKS)})")
    return cards


def _card(text: str) -> Card:
    """One card of ``--on`` (``parse_cards``)."""
    if re.fullmatch(r"[\d.]+\s*[a-zA-Z]*", text):  # a memory alone: "24GiB"
        memory_bytes = parse_budget(text.replace(" ", ""))
        return Card(name=f"{format_bytes(memory_bytes)} GPU", memory_bytes=memory_bytes, kind=None)
    sized = re.fullmatch(r"(.*?)\s*(\d+(?:\.\d+)?)\s*(?:GB|GiB|G)", text, flags=re.IGNORECASE)
    name, memory = (sized.group(1).strip(), float(sized.group(2))) if sized else (text, None)
    try:
        kind = gpu_kind(name)
    except UserError:
        raise UserError(
            f"--on: {text!r} is not a card autofit knows; give any of {', '.join(GPU_PEAKS)} (optionally with its memory, "
            "e.g. \"A100 40GB\"), or a memory such as 24GiB"
        ) from None
    gib = memory if memory is not None else GPU_PEAKS[kind].memory_gib
    return Card(name=f"{kind} {gib:g}GB", memory_bytes=int(gib * 2**30), kind=kind)


@dataclass(frozen=True, kw_only=True, slots=True)
class CardAnswer:
    """One card's row: whether the batch trains there (lossless), how, how fast, and the most one step holds."""

    card: Card
    global_batch_size: int
    usable_bytes: dict[str, float]
    """Per precision, the largest predicted peak the card's headroom leaves."""
    chosen: Evaluation | None
    """The configuration the search chooses there (None: nothing fits)."""
    largest_one_step: int
    """The most samples one micro-step holds there (0: not even the smallest micro-batch fits)."""
    largest_one_step_config: TrainingConfig | None = None
    longest: Longest | None = None
    """The longest sequence a global batch trains there (None: no text model, or its lengths not modelled)."""
    lossy: LossyAnswer | None = None
    """The same answers with the declared lossy choices the user allows (None: none allowed)."""

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    def to_dict(self, *, tokens_per_sample: int | None) -> dict:
        chosen = self.chosen
        return {
            "card": self.card.name, "memory_bytes": self.card.memory_bytes, "kind": self.card.kind,
            "global_batch_size": self.global_batch_size, "fits": self.fits,
            "config": asdict(chosen.config) if chosen else None, "levers": config_words(chosen.config) if chosen else None,
            "predicted_peak_bytes": chosen.peak_bytes if chosen else None,
            "samples_per_s": chosen.samples_per_s if chosen else None,
            "tokens_per_s": chosen.samples_per_s * tokens_per_sample if chosen and tokens_per_sample else None,
            "largest_batch_one_step": self.largest_one_step,
            "largest_batch_config": asdict(self.largest_one_step_config) if self.largest_one_step_config else None,
            "longest_seq_len": self.longest.seq_len if self.longest else None,
            "longest_seq_len_nearest_traced": self.longest.nearest_traced if self.longest else None,
            "longest_seq_len_config": asdict(self.longest.config) if self.longest and self.longest.config else None,
            "lossy": asdict(self.lossy) if self.lossy else None,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Longest:
    """The longest sequence (a multiple of ``lengths.SEQ_LEN_STEP`` tokens) a global batch trains on a card, and the
    traced length nearest it: how far the answer rests on the fit through the traced lengths."""

    seq_len: int
    """0: not even ``SEQ_LEN_STEP`` tokens fit."""
    nearest_traced: int
    config: TrainingConfig | None = None
    """The fastest configuration the search finds at that length (None: none, or not asked)."""

    def words(self) -> str:
        """"2048 (traced)", "2960 (+912 from 2048)", "-" for none."""
        if not self.seq_len:
            return "-"
        distance = self.seq_len - self.nearest_traced
        return f"{self.seq_len} (traced)" if not distance else f"{self.seq_len} ({distance:+d} from {self.nearest_traced})"


@dataclass(frozen=True, kw_only=True, slots=True)
class LossyAnswer:
    """A card's answers with the declared lossy choices allowed (8-bit optimizer state, bf16-pure, an NF4 base):
    always beside the lossless ones, never mixed with them."""

    fits: bool
    largest_one_step: int
    longest_seq_len: int | None = None
    longest_seq_len_nearest_traced: int | None = None


def usable_for(headroom: Headroom, resident_bytes: dict[str, int], budget_bytes: int) -> dict[str, float]:
    """Per precision, the largest predicted peak a budget's headroom leaves (``Measurements.usable_bytes`` at another
    budget: ``headroom`` is the run's, ``resident_bytes`` each precision's ``resident_for``)."""
    room = replace(headroom, budget_bytes=budget_bytes)
    return {p: room.usable_bytes(persistent_bytes=resident) for p, resident in resident_bytes.items()}


def best_at(
    model: CostModel, *, global_batch_size: int, usable_bytes: dict[str, float], allowed: Allowed, smallest: int = 1,
) -> Evaluation | None:
    """The fastest point the search finds for ``global_batch_size`` (its micro-batch sizes, as the planner's:
    ``modelling.micro_batch_sizes``) within ``usable_bytes``; None when none fits. Pure: ``model`` is only read."""
    at = replace(model, global_batch_size=global_batch_size)
    sizes = tuple(micro_batch_sizes(global_batch_size, smallest=min(smallest, global_batch_size)))
    found = score_all(at, usable_bytes=usable_bytes, allowed=replace(allowed, micro_batch_sizes=sizes))
    return max((e for e in found if e.fits), key=lambda e: e.samples_per_s, default=None)


def one_step(model: CostModel, *, batch_size: int, usable_bytes: dict[str, float], allowed: Allowed) -> Evaluation | None:
    """The fastest point that trains ``batch_size`` samples in one micro-step (no accumulation); None when none fits."""
    at = replace(model, global_batch_size=batch_size)
    found = [
        score_point(
            at, precision, batch_size, global_batch_size=batch_size, usable_bytes=usable_bytes, levers=allowed.levers,
            slack=allowed.slack,
        )
        for precision in allowed.precisions
    ]
    return max((e for e in found if e.fits), key=lambda e: e.samples_per_s, default=None)


def point_fits(model: CostModel, precision: str, micro_batch_size: int, *, usable_bytes: dict[str, float], allowed: Allowed) -> bool:
    """Whether ``score_point`` would find the point fitting, asked the short way: its lever choices one after another
    (``search.space.cheapest_for``), stopping at the first that fits, without pricing any of them. The bisections ask
    this hundreds of times; the fastest configuration is scored only at their answers."""
    limit = usable_bytes[precision] / model.memory_scale * (1 + allowed.slack)
    search = allowed.levers or LeverSearch()
    if cheapest_for(model, precision, micro_batch_size, limit_bytes=limit) is not None:
        return True
    memory = model.precisions[precision].memory
    choices = search.choices(precision, micro_batch_size, model.global_batch_size) if memory.has_levers() else [LeverChoice()]
    return any(
        cheapest_for(model, precision, micro_batch_size, limit_bytes=limit, levers=choice, search=search) is not None
        for choice in choices
    )


def lossless(allowed: Allowed) -> Allowed:
    """``allowed`` without the declared lossy choices (8-bit optimizer state, frozen weights in NF4, bf16-pure): what
    the lossless columns answer with."""
    levers = allowed.levers
    return replace(
        allowed, precisions=tuple(p for p in allowed.precisions if p != PURE_BF16),
        levers=None if levers is None else replace(levers, eight_bit=None, nf4=None),
    )


def is_lossy(allowed: Allowed) -> bool:
    """Whether ``allowed`` holds a declared lossy choice (``lossless`` takes them away)."""
    return lossless(allowed) != allowed


def batch_fits(model: CostModel, *, usable_bytes: dict[str, float], allowed: Allowed, smallest: int = 1) -> bool:
    """Whether the search finds any configuration for ``model``'s global batch within ``usable_bytes``.

    Only the smallest micro-batch and the whole batch in one are asked: with accumulation a smaller micro-batch
    never needs more (fewer activations, the rest the same), and the whole batch in one step is where the step in
    backward, which frees the gradients, is tried."""
    G = model.global_batch_size
    sizes, order = sorted({G, min(smallest, G)}), _least_memory_first(allowed)
    return any(point_fits(model, p, m, usable_bytes=usable_bytes, allowed=allowed) for m in sizes for p in order)


def _least_memory_first(allowed: Allowed) -> list[str]:
    """The precisions, those that keep bf16 weights first: the likeliest to fit, so a fitting point is found soonest."""
    return sorted(allowed.precisions, key=lambda p: p not in (MASTER_WEIGHTS, PURE_BF16))


def largest_one_step(
    model: CostModel, *, usable_bytes: dict[str, float], allowed: Allowed, smallest: int = 1,
) -> tuple[int, Evaluation | None]:
    """The largest batch one micro-step holds within ``usable_bytes``, and the fastest point that holds it; (0, None)
    where not even ``smallest`` fits (the peak grows with the micro-batch: doubling, then bisection)."""
    order = _least_memory_first(allowed)

    def fits(size: int) -> bool:
        at = replace(model, global_batch_size=size)
        return any(point_fits(at, p, size, usable_bytes=usable_bytes, allowed=allowed) for p in order)

    size = _largest(fits, smallest)
    return size, one_step(model, batch_size=size, usable_bytes=usable_bytes, allowed=allowed) if size else None


def largest_global(
    model: CostModel, *, usable_bytes: dict[str, float], allowed: Allowed, smallest: int = 1,
) -> tuple[int, Evaluation | None]:
    """The largest global batch the search fits within ``usable_bytes`` (any micro-batch and accumulation), and its
    fastest point; about ``LARGEST_BATCH_SEARCHED`` where the memory does not grow with the global batch (a GPU, whose
    host holds it; on the CPU the batch waits in the same memory, so it is bounded)."""
    order = _least_memory_first(allowed)

    def fits(size: int) -> bool:
        at = replace(model, global_batch_size=size)
        sizes = micro_batch_sizes(size, smallest=min(smallest, size))[::-1]  # the smallest first: the likeliest to fit
        return any(point_fits(at, p, m, usable_bytes=usable_bytes, allowed=allowed) for m in sizes for p in order)

    size = _largest(fits, smallest)
    best = best_at(model, global_batch_size=size, usable_bytes=usable_bytes, allowed=allowed, smallest=smallest) if size else None
    return size, best


def _largest(fits, start: int) -> int:
    """The largest size from ``start`` up at which ``fits(size)`` (doubling, then bisection: what fits at one size fits
    at a smaller one); 0 where ``start`` does not fit; the last doubling at most ``LARGEST_BATCH_SEARCHED``."""
    if not fits(start):
        return 0
    low, high = start, None  # low fits; high, once known, does not
    while high is None:
        trial = low * 2
        if trial > LARGEST_BATCH_SEARCHED:
            return low
        if fits(trial):
            low = trial
        else:
            high = trial
    return _bisect(fits, low, high)[0]


def _bisect(below: Callable[[int], bool], low: int, high: int, *, within: Callable[[int], int] = lambda high: 1) -> tuple[int, int]:
    """Narrow ``low`` < ``high`` to at most ``within(high)`` apart, ``below(middle)`` moving ``low`` up and its negation
    ``high`` down (``below`` holds at ``low``, not at ``high``; neither is asked again)."""
    while high - low > within(high):
        middle = (low + high) // 2
        if below(middle):
            low = middle
        else:
            high = middle
    return low, high


def least_budget(
    model: CostModel, *, global_batch_size: int, headroom: Headroom, resident_bytes: dict[str, int], allowed: Allowed,
    smallest: int = 1, start_bytes: int,
) -> int | None:
    """The least budget (card memory) at which the search finds a configuration for ``global_batch_size``: the floor
    with every lever ``allowed``, within ``BUDGET_RESOLUTION_BYTES`` (or 0.2% of it) above it; None where none fits
    even in 16 times ``start_bytes`` (the largest card asked about: the bisection starts there).

    Each budget is asked the short way (``batch_fits``): an 8B model's least budget took 75 s with every micro-batch
    size scored, loaded.
    """
    at = replace(model, global_batch_size=global_batch_size)

    def fits(budget: int) -> bool:
        return batch_fits(at, usable_bytes=usable_for(headroom, resident_bytes, budget), allowed=allowed, smallest=smallest)

    high = start_bytes
    while not fits(high):
        if high >= 16 * start_bytes:
            return None
        high *= 2
    # fits(0) is False: no budget of 0 holds a model.
    return _bisect(lambda budget: not fits(budget), 0, high, within=lambda high: max(BUDGET_RESOLUTION_BYTES, high // 500))[1]


def answer_card(
    model: CostModel, card: Card, *, global_batch_size: int, headroom: Headroom, resident_bytes: dict[str, int],
    allowed: Allowed, smallest: int = 1,
) -> CardAnswer:
    """One card's row from the cost record (its speeds already the card's: ``with_speeds``). Pure."""
    usable = usable_for(headroom, resident_bytes, card.memory_bytes)
    chosen = best_at(model, global_batch_size=global_batch_size, usable_bytes=usable, allowed=allowed, smallest=smallest)
    largest, holding = largest_one_step(model, usable_bytes=usable, allowed=allowed, smallest=smallest)
    return CardAnswer(
        card=card, global_batch_size=global_batch_size, usable_bytes=usable, chosen=chosen, largest_one_step=largest,
        largest_one_step_config=holding.config if holding else None,
    )


def with_speeds(model: CostModel, speeds: dict[str, SpeedCosts]) -> CostModel:
    """The cost record with another card's speeds (the same memory)."""
    return replace(model, precisions={p: replace(c, speed=speeds[p]) for p, c in model.precisions.items()})


def borrowed_speeds(speeds: dict[str, SpeedCosts], precisions: list[str]) -> dict[str, SpeedCosts]:
    """``speeds`` (bf16's among them) with bf16-master's and bf16-pure's, which compute as bf16 does
    (``modelling.add_speeds``: their update on the host and its copies are priced apart, by the levers)."""
    found = dict(speeds)
    for precision in precisions:
        if precision in (MASTER_WEIGHTS, PURE_BF16):
            found[precision] = replace(speeds["bf16"], note=f"bf16's compute on this card ({precision})")
    return found


def config_words(config: TrainingConfig) -> str:
    """A configuration in words: "bf16, micro-batch 2 x 4, 32 blocks checkpointed, optimizer step in backward"."""
    parts = [config.precision, f"micro-batch {config.micro_batch_size} x {config.grad_accum_steps}"]
    if config.checkpoint:
        parts.append(f"{len(config.checkpoint)} block(s) checkpointed")
    if config.selective_checkpoint:
        parts.append(f"{len(config.selective_checkpoint)} selectively")
    if config.offload:
        parts.append(f"{len(config.offload)} offloaded")
    if config.optimizer_in_backward:
        parts.append("step in backward")
    if config.optimizer_state == "host":
        parts.append("state on the host")
    elif config.optimizer_state == "8bit":
        parts.append("8-bit state (lossy)")
    if config.loss_chunks != 1:
        parts.append(f"loss in {config.loss_chunks} chunks")
    if config.frozen_nf4:
        parts.append("base in NF4 (lossy)")
    return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class CapacityRecord:
    """What every card's answer is read from: the cost record (traced once), what the search may choose, and the
    headroom's terms."""

    model: CostModel
    """Memory for every card; speeds those of a card named by memory alone (``with_speeds`` gives a card's)."""
    allowed: Allowed
    headroom: Headroom
    resident_bytes: dict[str, int]
    """Per precision, ``Measurements.resident_for``: the persistent bytes the estimated headroom leaves out."""
    smallest: int
    """The smallest micro-batch the model trains with."""
    left_out: dict[str, str]
    """A precision or lever ("host state") -> why it is left out of every answer."""


def capacity_record(context: PlanContext, *, levers: Levers) -> CapacityRecord:
    """Trace the model once for every card (``context``: a simulated GPU as large as the largest card), through the
    planner's own steps and cache: every precision whose weights the largest card can hold, in full with its
    recomputations, and, for the least budget, with the chunked loss's and offload's runs (``levers``: what the
    user allows; the lossless levers always).

    Args:
        context: ``context.plan_context`` of a simulated GPU (``--device cuda --simulate``).
        levers: ``lever_timings.Levers``.
    """
    with intra_op_threads(context.threads):
        with context.phase("memory"):
            costs = stored_or_new(context)
        with context.phase("speed"):
            add_speeds(context, costs)
        measurements = Measurements(context, host_sample_bytes=0, stored=context.study.load("measurements"))
        over = {p: measurements.weights_over_budget(p) for p in context.precisions}
        traced = [p for p in context.precisions if over[p] is None] or [min(context.precisions, key=measurements.weight_bytes)]
        left_out = {
            p: f"its weights alone ({format_bytes(over[p])}) are more than the largest card leaves for a peak"
            for p in context.precisions if p not in traced
        }
        with context.phase("memory"):
            for precision in traced:
                trace_full(context, costs, precision, recompute=True)
                add_recomputations(context, costs, precision)
            search = lever_search(context, costs, levers)
            if search.eight_bit is not None:  # the lossy columns' (``lossless`` leaves them out of the others)
                add_eight_bit_state(context, costs)
            if search.nf4 is not None:
                add_nf4_state(context, costs)
            # Every card's least budget may need any lever: traced whatever the budget (usable 0).
            if search.loss_chunks > 1:
                add_loss_chunks(context, costs, chunks=search.loss_chunks, usable_bytes=0.0)
            if search.offload:
                for precision in traced:
                    trace_offload(context, costs, precision, usable_bytes=0.0)
        save(context, costs)
        resident = {p: measurements.resident_for(p) for p in PRECISIONS}
        context.study.save("measurements", measurements.to_store())
        search, precisions = _within_host(context, measurements, search, traced, left_out)
    return CapacityRecord(
        model=costs.model, allowed=Allowed(precisions=tuple(precisions), micro_batch_sizes=tuple(costs.micro_batch_sizes), levers=search, slack=0.0),
        headroom=measurements.headroom, resident_bytes=resident, smallest=costs.smallest, left_out=left_out,
    )


def _within_host(
    context: PlanContext, measurements: Measurements, search: LeverSearch, precisions: list[str], left_out: dict[str, str],
) -> tuple[LeverSearch, list[str]]:
    """The levers and precisions whose host bytes the host can hold (``context.host_budget_bytes``), the others said in
    ``left_out``: the planner measures each candidate's host bytes and refuses those over it (``Measurements.fits_host``);
    the table, which probes nothing, leaves out what needs more than that at least, counted as the planner counts it
    (``bounds.host_step_bytes``: fp32 copies, gradients, optimizer state and the step's temporaries). Offloaded
    activations are not counted here (a plan is).
    """
    host = context.host_budget_bytes
    if host is None or not measurements.resident_bytes:  # the CPU: the host is the device
        return search, precisions
    where = f"the host's {format_bytes(host)} ({context.host_budget_note})"
    kept = list(precisions)
    masters = host_step_bytes(context, MASTER_WEIGHTS) if MASTER_WEIGHTS in kept else None
    if masters is not None and masters > host:
        kept.remove(MASTER_WEIGHTS)
        left_out[MASTER_WEIGHTS] = (
            f"its fp32 masters, gradients, optimizer state and step need {format_bytes(masters)} of host memory, more than "
            f"{where}; --host-memory gives the training machine's"
        )
    state = host_step_bytes(context, "host state") if search.host_state else None
    if state is not None and state > host:
        search = replace(search, host_state=False)
        left_out["host state"] = (
            f"the fp32 copies, gradients, optimizer state and step need {format_bytes(state)} of host memory, more than "
            f"{where}; --host-memory gives the training machine's"
        )
    return search, kept


def card_speeds(context: PlanContext, record: CapacityRecord, kind: str) -> dict[str, SpeedCosts]:
    """A card's speeds for the record's precisions, from the FLOP counts at its row of ``GPU_PEAKS`` (as
    ``plan --simulate --device-kind KIND`` estimates them), kept in the cost cache beside the record."""
    key = f"capacity_speeds:{kind}"
    stored = context.study.load(key)
    precisions = list(record.model.precisions)
    if stored is not None:
        try:
            speeds = {p: SpeedCosts(**s) for p, s in stored.items()}
            return borrowed_speeds(speeds, precisions)
        except (TypeError, KeyError):  # another version's record: counted again
            pass
    timed = list(dict.fromkeys("bf16" if p in (MASTER_WEIGHTS, PURE_BF16) else p for p in precisions))
    sizes = timing_sizes(list(record.allowed.micro_batch_sizes))
    settings = dict(precisions=timed, sizes=sizes, device_type="cuda", device_name=f"simulated {kind}", pool=context.trace_pool)
    context.log(f"speed: estimating from FLOPs for the {kind} at micro-batch {', '.join(map(str, sizes))}")
    with context.phase("speed"), context.progress.doing(f"counting FLOPs for the {kind}"):
        try:  # counted on the model with its run of identical blocks cut short, as add_speeds does
            speeds = flop_speed_costs(context.sim_spec, repeat=context.repeat, **settings)
        except Exception:
            if context.repeat is None:
                raise
            speeds = flop_speed_costs(context.sim_spec, **settings)
    context.study.save(key, {p: asdict(s) for p, s in speeds.items()})
    return borrowed_speeds(speeds, precisions)


REFERENCE_BATCH = 8
"""``largest_batch``'s first traces are at this global batch (or at the smallest the model trains with)."""


def largest_batch(spec: ModelSpec, request: PlanRequest, *, log=None) -> tuple[int, str]:
    """The largest global batch ``request``'s budget trains (``plan --batch-size max``; ``request.batch_size`` is not
    read), lossless, and the line the plan keeps about it.

    Traced once at ``REFERENCE_BATCH`` and answered purely (``largest_global``), then traced again at that answer and
    answered again, so that the answer never rests on a line drawn far from a traced batch. On a GPU, where
    accumulation trains batches far larger than one step holds (its memory grows by the inputs' copy alone), the
    answer is the largest batch one micro-step holds (``largest_one_step``).

    Raises:
        UserError: not even the smallest batch the model trains with fits the budget.
    """
    size, seen, note = REFERENCE_BATCH, set(), ""
    while size not in seen:
        seen.add(size)
        context = plan_context(spec, replace(request, batch_size=size, gpus=1, nodes=1), log=log)
        context.log(f"--batch-size max: the costs at a batch of {size}, searched for the largest batch within {format_bytes(context.budget_bytes)}")
        try:
            record = capacity_record(context, levers=Levers(max_grad_norm=request.max_grad_norm))
        finally:
            context.trace_pool.close()
        usable = usable_for(record.headroom, record.resident_bytes, context.budget_bytes)
        if context.device == "cuda":  # accumulation trains far larger batches: the most one step holds bounds it
            found, _ = largest_one_step(record.model, usable_bytes=usable, allowed=record.allowed, smallest=record.smallest)
            note = (
                f"--batch-size max: {{}} is the largest batch one micro-step holds within {format_bytes(context.budget_bytes)}, "
                f"lossless (predicted from traces at a batch of {size}); with accumulation larger global batches train too "
                "(a step's memory grows with them by the inputs' copy only)"
            )
        else:  # the CPU: the global batch waits in the same memory, so it is bounded
            found, _ = largest_global(record.model, usable_bytes=usable, allowed=record.allowed, smallest=record.smallest)
            note = (
                f"--batch-size max: {{}} is the largest global batch the search fits within {format_bytes(context.budget_bytes)}, "
                f"lossless (one sample more does not fit, predicted from traces at a batch of {size})"
            )
        if found == 0:
            raise UserError(
                f"--batch-size max: not even a batch of {record.smallest} fits {format_bytes(context.budget_bytes)} with every "
                "lossless lever; give a larger --budget, or a batch with --allow-lossy-optimizer"
            )
        size = found
    return size, note.format(size)


def traced_record(spec: ModelSpec, request: PlanRequest, *, levers: Levers, log=None) -> tuple[CapacityRecord, int]:
    """``capacity_record`` of ``spec`` for ``request`` in a context of its own, and the budget's bytes."""
    context = plan_context(spec, request, log=log)
    try:
        return capacity_record(context, levers=levers), context.budget_bytes
    finally:
        context.trace_pool.close()


def length_records(
    given_record: CapacityRecord, *, given: int, context_length: int | None, trace: Callable[[int], CapacityRecord],
) -> LengthRecords:
    """The records the longest-sequence answers fit through: ``given_record`` (traced at the user's length) and
    ``trace(length)`` at each other of ``lengths.traced_lengths``."""
    records = LengthRecords(records={given: given_record}, given=given, context_length=context_length)
    for length in traced_lengths(given, context_length=context_length):
        if length != given:
            records.add(length, trace(length))
    return records


def longest_at(
    lengths: LengthRecords, *, global_batch_size: int, budget_bytes: int, lossy: bool = False, with_config: bool = True,
) -> Longest:
    """The longest sequence a global batch trains within ``budget_bytes`` (with any micro-batch and accumulation; the
    declared lossy choices only with ``lossy``), from the records fitted through the traced lengths, and with
    ``with_config`` the fastest configuration there (a search of every point: seconds for an 8B model). Pure.

    Raises:
        lengths.LengthsDiffer: the traced lengths' steps differ in structure.
    """
    def fits(length: int) -> bool:
        record = lengths.at(length)
        at = replace(record.model, global_batch_size=global_batch_size)
        usable = usable_for(record.headroom, record.resident_bytes, budget_bytes)
        allowed = record.allowed if lossy else lossless(record.allowed)
        return batch_fits(at, usable_bytes=usable, allowed=allowed, smallest=record.smallest)

    found = longest_sequence(fits, context_length=lengths.context_length, known=tuple(lengths.lengths))
    if not found:
        return Longest(seq_len=0, nearest_traced=0)
    if not with_config:
        return Longest(seq_len=found, nearest_traced=lengths.nearest(found))
    record = lengths.at(found)
    best = best_at(
        record.model, global_batch_size=global_batch_size, usable_bytes=usable_for(record.headroom, record.resident_bytes, budget_bytes),
        allowed=record.allowed if lossy else lossless(record.allowed), smallest=record.smallest,
    )
    return Longest(seq_len=found, nearest_traced=lengths.nearest(found), config=best.config if best else None)


def lossy_answer(
    model: CostModel, card: Card, *, global_batch_size: int, record: CapacityRecord, longest: Longest | None,
) -> LossyAnswer:
    """A card's answers with every choice ``record.allowed`` holds, the declared lossy ones among them (``longest``:
    the longest sequence with them, ``longest_at``'s, where asked). Pure."""
    usable = usable_for(record.headroom, record.resident_bytes, card.memory_bytes)
    at = replace(model, global_batch_size=global_batch_size)
    largest, _ = largest_one_step(model, usable_bytes=usable, allowed=record.allowed, smallest=record.smallest)
    return LossyAnswer(
        fits=batch_fits(at, usable_bytes=usable, allowed=record.allowed, smallest=record.smallest), largest_one_step=largest,
        longest_seq_len=longest.seq_len if longest else None, longest_seq_len_nearest_traced=longest.nearest_traced if longest else None,
    )


LENGTH_REFINEMENTS = 4
"""``longest_seq_len`` traces at most this many answers again (each answer nearer the one before)."""


def longest_seq_len(spec_at: Callable[[int | None], ModelSpec], request: PlanRequest, *, log=None) -> tuple[ModelSpec, str]:
    """The spec at the longest sequence ``request``'s budget trains a global batch of ``request.batch_size`` with
    (``plan --seq-len max``), lossless, and the line the plan keeps about it.

    Traced at the model's default length and the others of ``lengths.traced_lengths``, answered purely
    (``longest_at``), then traced again at the answer and answered again until the answer is a traced length, so
    that it never rests on a fit far from a trace.

    Args:
        spec_at: the model's spec at a sequence length (None: its default).

    Raises:
        UserError: a model of no sequence length, or not even ``SEQ_LEN_STEP`` tokens fit the budget.
    """
    spec = spec_at(None)
    given = spec.source_options.get("seq_len")
    if given is None:
        raise UserError(f"--seq-len max: {spec.source} takes no sequence (a text model's --task does); give --batch-size max instead")
    request = replace(request, gpus=1, nodes=1)
    levers, budget_bytes = Levers(max_grad_norm=request.max_grad_norm), 0

    def trace(length: int) -> CapacityRecord:
        nonlocal budget_bytes
        if log is not None:
            log(f"--seq-len max: the costs at {length} tokens a sequence")
        record, budget_bytes = traced_record(spec_at(length), request, levers=levers, log=log)
        return record

    lengths = length_records(trace(given), given=given, context_length=spec.context_length, trace=trace)
    for _ in range(LENGTH_REFINEMENTS):
        found = longest_at(lengths, global_batch_size=request.batch_size, budget_bytes=budget_bytes).seq_len
        if found == 0:
            raise UserError(
                f"--seq-len max: not even {SEQ_LEN_STEP} tokens a sequence fit {format_bytes(budget_bytes)} at a batch of "
                f"{request.batch_size} with every lossless lever; give a larger --budget or a smaller --batch-size"
            )
        if found in lengths.records:
            break
        lengths.add(found, trace(found))
    traced = ", ".join(map(str, lengths.lengths))
    bound = (
        f"the model's context length, {found}" if found == spec.context_length
        else f"{found + SEQ_LEN_STEP} does not fit"
    )
    note = (
        f"--seq-len max: {found} tokens is the longest sequence (a multiple of {SEQ_LEN_STEP}) a batch of {request.batch_size} "
        f"trains within {format_bytes(budget_bytes)}, lossless ({bound}; fitted through traces at {traced} tokens)"
    )
    return spec_at(found), note


def peak_curves(model: CostModel, *, batch_sizes: list[int], precisions: tuple[str, ...]) -> dict[str, list[float]]:
    """Predicted peaks (bytes, before headroom) of the whole batch in one micro-step at each of ``batch_sizes``, per
    precision with no block checkpointed and with every block checkpointed (no other lever): the lines
    ``--plot`` draws against the cards' memory. Pure."""
    every = frozenset(range(len(model.blocks)))
    curves = {}
    for precision in precisions:
        for label, blocks in (("no checkpointing", frozenset()), ("every block checkpointed", every)):
            curves[f"{precision}, {label}"] = [
                replace(model, global_batch_size=size).peak_bytes(precision, size, blocks) for size in batch_sizes
            ]
    return curves


def chosen_configs(rows: list[CardAnswer]) -> dict[str, TrainingConfig]:
    """Each configuration the rows chose, labelled with the cards that chose it ("RTX 3090, RTX 4090: bf16-master,
    4 x 2"): the lines ``--plot`` draws (cards of one memory often choose the same)."""
    found: dict[TrainingConfig, list[str]] = {}
    for row in rows:
        if row.chosen is not None:
            found.setdefault(row.chosen.config, []).append(row.card.name)
    return {
        f"{', '.join(cards)}: {config.precision}, {config.micro_batch_size} x {config.grad_accum_steps}": config
        for config, cards in found.items()
    }


def batch_curves(model: CostModel, configs: dict[str, TrainingConfig], *, batch_sizes: list[int]) -> dict[str, list[float]]:
    """Per configuration (label -> it), its predicted peak with the whole batch in one micro-step at each of
    ``batch_sizes`` (its precision, blocks and levers kept). Pure."""
    return {
        label: [
            predicted_peak(replace(model, global_batch_size=size), replace(config, global_batch_size=size, micro_batch_size=size))
            for size in batch_sizes
        ]
        for label, config in configs.items()
    }


def length_curves(lengths: LengthRecords, configs: dict[str, TrainingConfig], *, seq_lens: list[int]) -> dict[str, list[float]]:
    """Per configuration (label -> it), its predicted peak at each of ``seq_lens`` from the records fitted through
    the traced lengths (``LengthRecords.at``). Pure.

    Raises:
        lengths.LengthsDiffer: the traced lengths' steps differ in structure.
    """
    curves: dict[str, list[float]] = {label: [] for label in configs}
    for length in seq_lens:
        model = lengths.at(length).model
        for label, config in configs.items():
            curves[label].append(predicted_peak(replace(model, global_batch_size=config.global_batch_size), config))
    return curves


def plotted_lengths(lengths: LengthRecords) -> list[int]:
    """Sequence lengths to draw: 16 spread on a log scale from 8 tokens to the longest traced, and the traced ones."""
    top = max(lengths.lengths)
    spread = {max(SEQ_LEN_STEP, round(top * 2 ** (-i * math.log2(top / SEQ_LEN_STEP) / 15) / SEQ_LEN_STEP) * SEQ_LEN_STEP) for i in range(16)}
    return sorted(spread | set(lengths.lengths))


@dataclass(frozen=True, kw_only=True, slots=True)
class CapacityAnswers:
    """The least budget and every card's row (lossless), and with the declared lossy choices allowed, the least
    budget with them (each row's ``lossy``)."""

    least_bytes: int | None
    rows: list[CardAnswer]
    least_lossy_bytes: int | None = None
    """None: no lossy choice allowed (or none fits)."""
    lengths_note: str = ""
    """Why the longest column is missing where it was asked for ("" where it is not)."""


def answer_cards(
    context: PlanContext, record: CapacityRecord, cards: list[Card], *, global_batch_size: int, lengths: LengthRecords | None = None,
    longest_configs: bool = True,
) -> CapacityAnswers:
    """The least budget the batch trains in, and each card's row (its speeds the card's where its kind is known),
    all from ``record`` (``capacity_record``; the bisection for the least budget starts at the largest card): lossless,
    and apart from that with the declared lossy choices ``record.allowed`` holds; with ``lengths``, each card's
    longest sequence too (``longest_configs``: with the configuration there; the table shows none).

    Cards of the same memory share their longest sequence: it depends on the memory alone, not the card's speeds.
    """
    kept, lossy, note = lossless(record.allowed), is_lossy(record.allowed), ""
    longest_by_memory: dict[tuple[int, bool], Longest] = {}

    def longest(budget_bytes: int, *, lossy: bool) -> Longest:
        if (budget_bytes, lossy) not in longest_by_memory:
            longest_by_memory[budget_bytes, lossy] = longest_at(
                lengths, global_batch_size=global_batch_size, budget_bytes=budget_bytes, lossy=lossy, with_config=longest_configs,
            )
        return longest_by_memory[budget_bytes, lossy]

    def least(allowed: Allowed) -> int | None:
        return least_budget(
            record.model, global_batch_size=global_batch_size, headroom=record.headroom, resident_bytes=record.resident_bytes,
            allowed=allowed, smallest=record.smallest, start_bytes=max(card.memory_bytes for card in cards),
        )

    rows = []
    for card in cards:
        card_model = record.model if card.kind is None else with_speeds(record.model, card_speeds(context, record, card.kind))

        def priced(allowed: Allowed, kind: str | None = card.kind) -> Allowed:
            # Each card's typical host updates the masters and host state (the record's: an A100's, for a card named by memory).
            return allowed if kind is None else replace(allowed, levers=card_host_update(context, allowed.levers, kind))

        row = answer_card(
            card_model, card, global_batch_size=global_batch_size, headroom=record.headroom, resident_bytes=record.resident_bytes,
            allowed=priced(kept), smallest=record.smallest,
        )
        if lengths is not None:
            try:
                row = replace(row, longest=longest(card.memory_bytes, lossy=False))
            except LengthsDiffer as error:  # said under the table; the other answers stand
                lengths, note = None, f"the step differs in structure between lengths ({error}): not modelled"
        if lossy:
            row = replace(row, lossy=lossy_answer(
                card_model, card, global_batch_size=global_batch_size, record=replace(record, allowed=priced(record.allowed)),
                longest=None if lengths is None else longest(card.memory_bytes, lossy=True),
            ))
        rows.append(row)
    return CapacityAnswers(
        least_bytes=least(kept), rows=rows, least_lossy_bytes=least(record.allowed) if lossy else None, lengths_note=note,
    )

