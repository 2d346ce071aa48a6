"""The planner's search: checkpoint modes by exact knapsack (``knapsack``), the rest by Optuna.

For one precision and micro-batch size, ``cheapest_for`` poses the covering
knapsack from the cost model: each block offers its modes with the bytes
they free (``MemoryCosts.at``, ``MemoryCosts.selective_drops``) and the
seconds they cost (``CostModel.recompute_seconds``,
``CostModel.selective_recompute_seconds``), under the memory model's segments.

With the memory levers (``LeverSearch``), each point also tries the step in
backward, host optimizer state, with ``--allow-lossy-optimizer`` 8-bit
optimizer state and with ``--allow-lossy-base`` frozen weights in NF4 (the
memory model's segments with them,
``memory.levers.lever_segments``), and offload is a fourth mode per block
(freeing what the block alone saved, at its copies' time); the knapsack's
choice is then checked against the model's whole prediction.

Precision x micro-batch size is the outer space, searched by Optuna: brute
force when it is small, TPE when it is not, in a study that can live in a
database and resume. ``score_point`` scores one point by the cost model, a pure function of it, the usable
bytes and the levers allowed; ``score_all`` scores every point of an ``Allowed`` space with no Optuna (what a
caller asking many budgets of one cost model wants); ``score_space`` lets Optuna pick the points and keeps them.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path


from autofit.config import TrainingConfig, step_in_backward_refusal
from autofit.errors import UserError
from autofit.measure.host_speed import HostLink
from autofit.planning.costs import CostModel
from autofit.planning.speed.levers import UpdateTime, offload_block_seconds, offload_floor_seconds
from strategies import MASTER_WEIGHTS, PURE_BF16
from autofit.planning.memory.levers import LeverChoice, lever_segments, offload_drops
from autofit.planning.search.knapsack import CheckpointChoice, cheapest_checkpoint
from autofit.planning.memory.segments import Segment
from autofit.planning.policy import POLICY


@dataclass(frozen=True, kw_only=True)
class LeverSearch:
    """The memory levers the search may add to checkpointing (one process), and what their time terms need.

    The step in backward is tried where a point has one micro-batch per step and is not fp16 (its GradScaler
    must see every gradient first); optimizer state on the host and offload (per block, a fourth mode beside
    none, selective and full) on a GPU only: on the CPU the host is the device; 8-bit optimizer state only
    when the user allowed it (it changes the optimizer's arithmetic), alone or with the step in backward; frozen weights
    in NF4 only when allowed (they round the weights), beside each of the others.
    Their time is ``speed.levers``': the step in backward's per-parameter overheads, measured; transfers over the host link (measured
    on a GPU here, else assumed) and the host's update for host state and offload; the 8-bit update's, measured.
    """

    step_in_backward: bool = False
    host_state: bool = False
    offload: bool = False
    eight_bit: UpdateTime | None = None
    """8-bit optimizer state may be chosen (``--allow-lossy-optimizer``): what it adds to a step (None: not searched)."""
    link: HostLink | None = None
    """The host link's rates (``speed.levers.host_link``), with host state or offload."""
    trainable_bytes: int = 0
    """Bytes of the parameters that train (their gradients are as many)."""
    host_update_seconds: float = 0.0
    """The optimizer's update of every trainable parameter on the host's CPU (``lever_timings.host_update``)."""
    host_update_source: str = ""
    """Where ``host_update_seconds`` came from (the given or assumed rate); "": timed on this machine's CPU."""
    step_in_backward_time: UpdateTime | None = None
    """What the step in backward adds to a step (``time_step_in_backward``; None: taken as nothing)."""
    loss_chunks: int = 1
    """The chunked output layer and loss's chunks, tried with each other choice where the memory model has its run
    (1: not searched: the model is no causal LM it applies to, ``strategies.chunkable``)."""
    head_share: float = 0.0
    """The output layer's share of the trainable parameters: what recomputing it costs (``speed.levers``)."""
    nf4: dict[str, UpdateTime] | None = None
    """Frozen weights may be held in NF4 (``--allow-lossy-base``, a model with weights it takes): per precision, one
    dequantization of every NF4 weight (None: not searched)."""

    def choices(self, precision: str, micro_batch_size: int, global_batch_size: int) -> list[LeverChoice]:
        """The levers to try at one point (offload is chosen per block inside each)."""
        found = self._state_choices(precision, micro_batch_size, global_batch_size)
        if self.nf4 is not None:  # it adds to each of the others
            found += [replace(choice, frozen_nf4=True) for choice in found]
        return found

    def _state_choices(self, precision: str, micro_batch_size: int, global_batch_size: int) -> list[LeverChoice]:
        """The gradient, state and loss levers to try at one point."""
        found = [LeverChoice()]
        if precision in (MASTER_WEIGHTS, PURE_BF16):  # their own state's place and optimizer: no state lever beside
            return found + ([LeverChoice(loss_chunks=self.loss_chunks)] if self.loss_chunks > 1 else [])
        stepping = self.step_in_backward and not step_in_backward_refusal(
            precision=precision, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, world_size=1,
        )
        if stepping:
            found.append(LeverChoice(optimizer_in_backward=True))
        if self.host_state:
            found.append(LeverChoice(optimizer_state="host"))  # with the step in backward too it frees nothing more
        if self.eight_bit is not None:  # on the device, so the step in backward frees the gradients beside it
            found.append(LeverChoice(optimizer_state="8bit"))
            if stepping:
                found.append(LeverChoice(optimizer_in_backward=True, optimizer_state="8bit"))
        if self.loss_chunks > 1:
            found += [replace(choice, loss_chunks=self.loss_chunks) for choice in found]
        return found

    def lever_seconds(
        self, model: CostModel, precision: str, micro_batch_size: int, choice: LeverChoice, *, checkpoint=frozenset(),
    ) -> float:
        """Seconds the levers add to one optimizer step (``speed.levers.lever_time``), with ``checkpoint`` (indices)
        the fully checkpointed blocks (NF4's weights are dequantized again where they recompute)."""
        if choice == LeverChoice() and precision != MASTER_WEIGHTS:
            return 0.0
        config = TrainingConfig(
            global_batch_size=model.global_batch_size, micro_batch_size=micro_batch_size, precision=precision,
            checkpoint=model.names(checkpoint), offload=model.names(choice.offload), optimizer_in_backward=choice.optimizer_in_backward,
            optimizer_state=choice.optimizer_state, loss_chunks=choice.loss_chunks, frozen_nf4=choice.frozen_nf4,
        )
        return self.lever_time(model, config).seconds

    def lever_time(self, model: CostModel, config: TrainingConfig):
        """What ``config``'s levers add to one optimizer step, with the notes that say how (``speed.levers.lever_time``)."""
        from autofit.planning.speed.levers import lever_time

        return lever_time(
            config, model=model, link=self.link, trainable_bytes=self.trainable_bytes, host_update_seconds=self.host_update_seconds,
            host_update_source=self.host_update_source, eight_bit=self.eight_bit, step_in_backward=self.step_in_backward_time,
            head_share=self.head_share, nf4=self.nf4.get(config.precision) if self.nf4 else None,
        )


def cheapest_for(
    model: CostModel, precision: str, micro_batch_size: int, *, limit_bytes: float, levers: LeverChoice | None = None,
    search: LeverSearch | None = None, relaxed: bool = False, selective: bool = True,
) -> CheckpointChoice | None:
    """``cheapest_checkpoint`` at one (precision, micro-batch) of the cost model, each block none, selective or full
    (selective where the model knows what it frees and costs), with ``levers``' step in backward and optimizer
    state, and offload as a fourth mode where ``search`` allows it.

    Without ``selective``, no block is checkpointed selectively (the point's cheapest block-only set).

    With ``relaxed``, where the traces hold plain training only, blocks are checkpointed all the same as if
    recomputing them held nothing (no recomputation's segment constrains the choice; selective frees at most
    what full does where its drops are not known): no choice the traces' recomputations would allow adds
    less time, so its speed bounds the point's (``needs_recomputations``). Where ``search`` offloads but the
    traces hold no offloading run yet, offload is a mode all the same, freeing what each block alone saved
    (known from plain training's traces) at the least its copies back cost (``offload_floor_seconds``), as if
    the copies brought back held nothing: no choice the offloading runs would allow adds less time
    (``needs_offload``). Its peak is then no prediction.

    With levers the knapsack's segments are the memory model's with them (``memory.levers.lever_segments``) and
    offload frees what each block alone saved (additive); the choice is then checked against the model's whole
    prediction (storages blocks share, copies backward brings back) and, while that does not fit, sought again
    under a limit lowered by the miss.
    """
    memory = model.precisions[precision].memory
    G = model.global_batch_size
    # Where the traces hold plain training only (``costs.complete_memory``), no block is checkpointed; at the
    # floor's size its own trace knows.
    known = memory.with_checkpointing(micro_batch_size)
    relaxed_offload = relaxed and _offload_untraced(memory, search)
    relaxed = relaxed and known is None
    checkpointing = known is not None or relaxed
    memory = known or memory
    levers = levers or LeverChoice()
    if levers.loss_chunks > 1 and not memory.has_chunks():
        return None
    segments, drops = memory.at(micro_batch_size, global_batch_size=G, chunked=levers.loss_chunks > 1)
    seconds = model.recompute_seconds(precision, micro_batch_size)
    selective_drops = memory.selective_drops(micro_batch_size) if selective else None
    modes = dict(
        checkpointing=checkpointing,
        selective_drops=drops if relaxed and selective and selective_drops is None else selective_drops,
        selective_seconds=model.selective_recompute_seconds(precision, micro_batch_size) if selective else None,
    )
    # Offload is a mode where its runs are traced, or (relaxed) before they are.
    traced = search is not None and search.offload and memory.has_levers() and memory.low.levers.offloaded is not None
    offloading, relaxed = traced or relaxed_offload, relaxed or relaxed_offload
    if levers.only_chunks() and not offloading:
        return cheapest_checkpoint(segments, drops, seconds, limit_bytes=limit_bytes, **modes)
    found = lever_segments(memory, micro_batch_size, global_batch_size=G, choice=levers)
    if found is None:
        return None
    with_levers, items = found
    segments = [
        Segment(peak_bytes=s.peak_bytes, dropped=s.dropped, phase=s.phase, recomputes=s.recomputes, selective=s.selective)
        for s in with_levers
    ]
    if offloading:
        priced = offload_floor_seconds if relaxed_offload else offload_block_seconds
        modes.update(
            offload_drops=offload_drops(items, len(drops)), offload_seconds=priced(model, precision, micro_batch_size, link=search.link),
        )
    target = limit_bytes
    for _attempt in range(POLICY.offload_refit_attempts):
        choice = cheapest_checkpoint(segments, drops, seconds, limit_bytes=target, **modes)
        if choice is None:
            return None
        if not choice.offload or relaxed:
            return choice
        exact = memory.peak_bytes(
            micro_batch_size, global_batch_size=G, checkpoint=choice.blocks, selective=choice.selective,
            levers=replace(levers, offload=choice.offload),
        )
        if exact <= limit_bytes:
            choice.peak_bytes = exact
            return choice
        target -= exact - limit_bytes + 1
    return None


@dataclass(kw_only=True, slots=True)
class Evaluation:
    """One point of the outer search, as the cost model sees it."""

    config: TrainingConfig
    """The point with its fastest checkpointed, selective and offloaded blocks and levers that fit (none when
    nothing fits)."""
    fits: bool = False
    peak_bytes: float = 0.0
    samples_per_s: float = 0.0
    plain_peak_bytes: float = 0.0
    """Peak without checkpointing."""
    plain_samples_per_s: float = 0.0
    bound_samples_per_s: float | None = None
    """Where the point does not fit as plain training and the memory model knows plain training's peaks only at
    this size (or models offload, which the search may choose, without its offloading runs): the most it could
    reach with checkpointing and offload (``cheapest_for``'s ``relaxed``; 0: nothing fits); None where those
    peaks are known."""

    @property
    def plain_config(self) -> TrainingConfig:
        """The point as plain training: no block checkpointed or offloaded, no lever."""
        config = self.config
        return TrainingConfig(global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size, precision=config.precision)

    def to_dict(self) -> dict:
        """A JSON object (a study keeps it): the configuration's fields, then the scores."""
        return {**asdict(self.config), **{k: v for k, v in asdict(self).items() if k != "config"}}

    @classmethod
    def from_dict(cls, data: dict) -> Evaluation:
        names = {f.name for f in fields(TrainingConfig)}
        config = TrainingConfig(**{k: v for k, v in data.items() if k in names})
        return cls(config=config, **{k: v for k, v in data.items() if k not in names})


@dataclass(frozen=True, kw_only=True, slots=True)
class Allowed:
    """What a search may choose: the outer space and the memory levers (``score_all``, ``score_point``)."""

    precisions: tuple[str, ...]
    micro_batch_sizes: tuple[int, ...]
    levers: LeverSearch | None = None
    """The memory levers the search may add, with their time terms (None: none)."""
    slack: float = POLICY.model_slack_share
    """How far over the usable bytes a prediction still counts as a candidate (the model's pessimism)."""


def score_all(model: CostModel, *, usable_bytes: float | dict[str, float], allowed: Allowed) -> list[Evaluation]:
    """Every (precision, micro-batch) point of ``allowed`` scored by the cost model (``score_point``), in that order.

    A pure function of its arguments: no context, clock, Optuna or I/O, and ``model`` is only read, so one cost
    model answers many budgets (or, with ``dataclasses.replace(model, global_batch_size=...)``, many batches)
    in milliseconds each. The planner drives the same scoring with Optuna (``score_space``) to keep a study.
    """
    return [
        score_point(
            model, precision, micro_batch_size, global_batch_size=model.global_batch_size, usable_bytes=usable_bytes,
            levers=allowed.levers, slack=allowed.slack,
        )
        for precision in allowed.precisions for micro_batch_size in allowed.micro_batch_sizes
    ]


def score_point(
    model: CostModel,
    precision: str,
    micro_batch_size: int,
    *,
    global_batch_size: int,
    usable_bytes: float | dict[str, float],
    levers: LeverSearch | None = None,
    slack: float = POLICY.model_slack_share,
) -> Evaluation:
    """One point scored by the cost model: plain training's peak and speed, and the fastest checkpoint modes and
    memory levers that fit (``cheapest_for``). Pure: ``model`` is only read.

    Args:
        usable_bytes: the largest peak the budget's headroom leaves (``Measurements.usable_bytes``), or that per precision.
        levers: the memory levers the point may add (None: none); it keeps the fastest of its choices.
        slack: how far over ``usable_bytes`` a prediction still counts as a candidate (the model's pessimism).
    """
    limit = (usable_bytes[precision] if isinstance(usable_bytes, dict) else usable_bytes) / model.memory_scale
    search = levers or LeverSearch()
    plain_peak = model.peak_bytes(precision, micro_batch_size, frozenset())
    # Priced as every other row is: bf16-master's plain training carries its host update and copies (``lever_seconds``).
    plain_speed = global_batch_size / (
        model.step_seconds(precision, micro_batch_size, frozenset()) + search.lever_seconds(model, precision, micro_batch_size, LeverChoice())
    )
    result = Evaluation(
        config=TrainingConfig(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, precision=precision),
        plain_peak_bytes=plain_peak, plain_samples_per_s=plain_speed,
    )
    memory = model.precisions[precision].memory
    choices = search.choices(precision, micro_batch_size, global_batch_size) if memory.has_levers() else [LeverChoice()]
    plain = cheapest_for(model, precision, micro_batch_size, limit_bytes=limit * (1 + slack))
    if plain is not None and not plain.blocks and not plain.selective:
        # It fits as plain training: every lever adds time (the step in backward none), so none is tried.
        choices = [LeverChoice()]
        search = replace(search, offload=False)  # its time terms stay (bf16-master's host update)
    for lever_choice in choices:
        choice = cheapest_for(
            model, precision, micro_batch_size, limit_bytes=limit * (1 + slack), levers=lever_choice, search=search,
        )
        if choice is None:
            continue
        speed, chosen = _samples_per_s(model, precision, micro_batch_size, choice, lever_choice, search, global_batch_size)
        if result.fits and speed <= result.samples_per_s:
            continue
        result.fits = True
        result.config = replace(
            result.config, checkpoint=model.names(choice.blocks), selective_checkpoint=model.names(choice.selective),
            offload=model.names(choice.offload), optimizer_in_backward=chosen.optimizer_in_backward,
            optimizer_state=chosen.optimizer_state, loss_chunks=chosen.loss_chunks, frozen_nf4=chosen.frozen_nf4,
        )
        result.peak_bytes = model.peak_bytes(precision, micro_batch_size, choice.blocks, choice.selective, levers=chosen)
        result.samples_per_s = speed
    fits_plain = plain is not None and not plain.blocks and not plain.selective
    if not fits_plain and (memory.with_checkpointing(micro_batch_size) is None or _offload_untraced(memory, search)):
        result.bound_samples_per_s = _bound_samples_per_s(
            model, precision, micro_batch_size, choices, search, limit_bytes=limit * (1 + slack),
        )
    return result


def score_space(
    model: CostModel,
    *,
    precisions: list[str],
    micro_batch_sizes: list[int],
    global_batch_size: int,
    usable_bytes: float | dict[str, float],
    study: Study | None,
    slack: float = POLICY.model_slack_share,
    levers: LeverSearch | None = None,
) -> tuple[list[Evaluation], str]:
    """Score the (precision, micro-batch) points Optuna picks (``score_point``), kept in ``study``.

    Args:
        model: the cost model (memory and speed).
        precisions, micro_batch_sizes: the space.
        global_batch_size: samples per optimizer step.
        usable_bytes: the largest peak the budget's headroom leaves (``Measurements.usable_bytes``), or that per precision.
        slack: how far over it a prediction still counts as a candidate (the model's pessimism).
        study: where the search is kept (None: in memory).
        levers: the memory levers the search may add (None: none); each point keeps the fastest of its choices.

    Returns:
        ``search``'s evaluations and the sampler's name.
    """
    def evaluate(precision: str, micro_batch_size: int) -> Evaluation:
        return score_point(
            model, precision, micro_batch_size, global_batch_size=global_batch_size, usable_bytes=usable_bytes, levers=levers,
            slack=slack,
        )

    if study is None:
        return search(evaluate, precisions=precisions, micro_batch_sizes=micro_batch_sizes, study_name="search", storage=None)
    searched = "" if tuple(precisions) == study.precisions else ":" + ",".join(precisions)
    return search(
        evaluate, precisions=precisions, micro_batch_sizes=micro_batch_sizes, study_name=study.name + searched,
        storage=study.search_storage,
    )


def _bound_samples_per_s(
    model: CostModel, precision: str, micro_batch_size: int, choices: list[LeverChoice], search: LeverSearch, *,
    limit_bytes: float,
) -> float:
    """The fastest a point could be with checkpointing (and offload), before its recomputations (or offloading runs)
    are traced (``Evaluation``). Offload's time is the knapsack's least (``offload_floor_seconds``), not
    ``lever_time``'s for the blocks it chose: that bounds every offloading choice's."""
    best = 0.0
    G = model.global_batch_size
    for lever_choice in choices:
        choice = cheapest_for(model, precision, micro_batch_size, limit_bytes=limit_bytes, levers=lever_choice, search=search, relaxed=True)
        if choice is None:
            continue
        if choice.offload and _offload_untraced(model.precisions[precision].memory, search):
            seconds = model.step_seconds(precision, micro_batch_size, choice.blocks, choice.selective)
            seconds += search.lever_seconds(model, precision, micro_batch_size, lever_choice, checkpoint=choice.blocks)
            seconds += choice.offload_seconds
            best = max(best, G / seconds)
            continue
        best = max(best, _samples_per_s(model, precision, micro_batch_size, choice, lever_choice, search, G)[0])
    return best


def _offload_untraced(memory, search: LeverSearch | None) -> bool:
    """Whether ``search`` offloads and ``memory`` (a ``MemoryCosts``) models the levers without the offloading runs
    (``modelling.trace_offload`` adds them where ``modelling.needs_offload`` finds they could matter)."""
    return search is not None and search.offload and memory.has_levers() and memory.low.levers.offloaded is None


def _samples_per_s(
    model: CostModel, precision: str, micro_batch_size: int, choice: CheckpointChoice, lever_choice: LeverChoice,
    search: LeverSearch, global_batch_size: int,
) -> tuple[float, LeverChoice]:
    """A point's samples/s with the knapsack's choice and the levers' time, and the levers with its offloaded blocks."""
    chosen = replace(lever_choice, offload=choice.offload)
    seconds = model.step_seconds(precision, micro_batch_size, choice.blocks, choice.selective)
    added = search.lever_seconds(model, precision, micro_batch_size, chosen, checkpoint=choice.blocks)
    return global_batch_size / (seconds + added), chosen


def search(
    evaluate: Callable[[str, int], Evaluation],
    *,
    precisions: list[str],
    micro_batch_sizes: list[int],
    study_name: str,
    storage: str | None = None,
    attributes: dict | None = None,
) -> tuple[list[Evaluation], str]:
    """Evaluate the (precision, micro-batch) space with Optuna.

    Args:
        evaluate: (precision, micro_batch_size) -> Evaluation from the cost model.
        precisions, micro_batch_sizes: the space.
        study_name: the study's name (in storage, one per model/device/batch/budget).
        storage: an Optuna storage URL such as "sqlite:///plans.db"; None keeps it in memory.
        attributes: study attributes to store (e.g. the cost model), set once.

    Returns:
        Every evaluation in the study (also those of an earlier, resumed run) and the sampler's name.
    """
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    size = len(precisions) * len(micro_batch_sizes)
    if size <= POLICY.brute_force_max_points:
        sampler, sampler_name = optuna.samplers.BruteForceSampler(seed=0), "brute force"
    else:
        sampler, sampler_name = optuna.samplers.TPESampler(seed=0), "TPE"
    study = open_study(study_name, storage=storage, sampler=sampler)
    for key, value in (attributes or {}).items():
        if key not in study.user_attrs:
            study.set_user_attr(key, value)

    def objective(trial) -> float:
        precision = trial.suggest_categorical("precision", precisions)
        micro_batch_size = trial.suggest_categorical("micro_batch_size", micro_batch_sizes)
        result = evaluate(precision, micro_batch_size)
        trial.set_user_attr("evaluation", result.to_dict())
        return result.samples_per_s if result.fits else 0.0

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and "evaluation" in t.user_attrs]
    wanted = size if size <= POLICY.brute_force_max_points else min(size, POLICY.tpe_trials)
    remaining = max(wanted - len(done), 0)
    if remaining:
        study.optimize(objective, n_trials=remaining)
    evaluations, seen = [], set()
    for trial in study.trials:
        data = trial.user_attrs.get("evaluation")
        if trial.state != optuna.trial.TrialState.COMPLETE or data is None:
            continue
        key = (data["precision"], data["micro_batch_size"])
        if key in seen or data["precision"] not in precisions or data["micro_batch_size"] not in micro_batch_sizes:
            continue
        seen.add(key)
        evaluations.append(Evaluation.from_dict(data))
    return evaluations, sampler_name


def open_study(study_name: str, *, storage: str | None, sampler=None):
    """Create or load a study; a bad storage URL is a one-line error."""
    import optuna

    try:
        return optuna.create_study(
            study_name=study_name, storage=storage, direction="maximize", sampler=sampler, load_if_exists=True
        )
    except Exception as error:  # SQLAlchemy/Optuna raise many types for an unusable URL
        raise UserError(
            f"--study {storage!r} cannot be opened ({type(error).__name__}: {(str(error).splitlines() or [''])[0]}); use e.g. sqlite:///plans.db"
        ) from error


@dataclass(frozen=True, kw_only=True, slots=True)
class Study:
    """Where a planning run keeps its search, cost model and measurements; nowhere when ``storage`` is None.

    The cost model and the measurements live in one study per model, device,
    batch and precisions (``prefix`` + "costs"), shared by every budget; each
    budget's search is a study of its own (``name``).
    """

    storage: str | None
    """An Optuna storage URL such as "sqlite:///plans.db"."""
    prefix: str
    """Shared by the studies of every budget for the same model, device, batch and precisions."""
    name: str
    precisions: tuple[str, ...] = ()
    """The precisions of the run; a search of fewer (the others not worth tracing) is named after them."""
    keep_trials: bool = True
    """Keep the search's scored points too (the cache does not: they are scored again in milliseconds)."""
    strict: bool = True
    """A storage that fails is an error (``--study``); else the run goes on without it (the cache), noted in ``problems``."""
    problems: list[str] = field(default_factory=list)
    read: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The stored attributes as first read (``load``), until this run saves one: Optuna reads and copies all of
    them whichever one is asked (an 8B model's costs: a third of a second each time); ``load`` copies the one asked."""
    opened: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The storage as first opened ("storage"), for every later load and save of the run: given a URL, Optuna
    builds an engine and checks the schema at each call (30-70 ms each, a plan makes about ten)."""

    @property
    def search_storage(self) -> str | None:
        """Where the search's trials go."""
        return self.storage if self.keep_trials else None

    def load(self, key: str):
        """An attribute stored for this model, device, batch and precisions (None when there is none)."""
        if self.storage is None:
            return None
        try:
            if "attributes" not in self.read:
                study = self._costs(create=False)
                self.read["attributes"] = {} if study is None else study.user_attrs
            return copy.deepcopy(self.read["attributes"].get(key))  # the caller's own: it may change it
        except Exception as error:  # a cache that cannot be read is a cache miss
            return self._failed(error)

    def save(self, key: str, value) -> None:
        if self.storage is None:
            return
        self.read.clear()  # read again where asked: the stored attributes changed
        try:
            self._costs(create=True).set_user_attr(key, value)
        except Exception as error:  # a cache that cannot be written is no cache
            self._failed(error)

    def _costs(self, *, create: bool):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        name = f"{self.prefix}costs"
        if create:
            if self.storage.startswith("sqlite:///"):
                Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            # An unusable storage raises here: ``save`` makes it the one-line error (``--study``) or a problem noted (the cache).
            direction = "maximize" if self.strict else "minimize"  # as each was first created (``open_study``, the cache)
            return optuna.create_study(study_name=name, storage=self._opened(), direction=direction, load_if_exists=True)
        if self.storage.startswith("sqlite:///") and not Path(self.storage.removeprefix("sqlite:///")).exists():
            return None
        try:
            return optuna.load_study(study_name=name, storage=self._opened())
        except KeyError:  # no such study yet
            return None

    def _opened(self):
        """The run's one storage object for ``storage`` (``opened``); Optuna's errors for an unusable URL pass through."""
        import optuna

        if "storage" not in self.opened:
            self.opened["storage"] = optuna.storages.get_storage(self.storage)
        return self.opened["storage"]

    def _failed(self, error: Exception) -> None:
        # SQLAlchemy's messages run over several lines (the SQL, a link): the first says what went wrong.
        why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        if self.strict:
            raise UserError(f"--study {self.storage!r} cannot be opened ({why}); use e.g. sqlite:///plans.db") from error
        problem = f"the cache {self.storage} was not used ({why}); --no-cache skips it"
        if problem not in self.problems:  # each store and load meets the same unusable file
            self.problems.append(problem)
