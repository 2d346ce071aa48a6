"""What the memory levers cost in time, measured or estimated for this model on the device the plan is for: the
estimate side of the search's levers, apart from the verification that measures configurations.

``lever_search`` gathers, once per planning run, every time term the search may add to a point (the step in
backward's per-tensor overhead, the 8-bit update, NF4's dequantization, the host's update and link) into one
``search.LeverSearch``, the record the search reads; ``lever_time_for`` is the same terms for one configuration
(the ladder below the floor). The formulas that turn them into seconds per step are ``speed.levers``'. It sits
beside ``modelling`` (the estimate's other steps), not in speed/, because it reads the run's context and builds
the search's record, both of which import speed/.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.host_speed import time_host_update
from autofit.measure.nf4_speed import nf4_bytes_moved, time_nf4_dequantize
from autofit.measure.optimizer_speed import EIGHT_BIT_ELEMENTS, time_eight_bit_update, time_step_in_backward
from autofit.planning.context import PlanContext
from autofit.planning.memory.nf4 import nf4_weight_dtype
from autofit.planning.modelling import Costs
from autofit.planning.search.space import LeverSearch
from autofit.planning.speed.estimated import GPU_PEAKS, gpu_peaks
from autofit.planning.speed.levers import LeverTime, UpdateTime, host_link, lever_time
from strategies import DEFAULT_LOSS_CHUNKS, chunkable, nf4_weights
from strategies.chunked_loss import causal_lm
from strategies.optimizer_state import eight_bit_adam


@dataclass(frozen=True, kw_only=True)
class Levers:
    """What the user allows the memory levers (the search's, and below the floor the ladder's) to change."""

    allow_lossy_optimizer: bool = False
    """8-bit optimizer state may be chosen (it changes the optimizer's arithmetic)."""
    allow_lossy_base: bool = False
    """Frozen weights may be held in NF4 (it rounds them: QLoRA)."""
    max_grad_norm: float | None = None
    """Training clips gradients (``--max-grad-norm``): the step in backward cannot, so it is left out."""


def host_update(context: PlanContext, trainable: Trainable) -> UpdateTime:
    """The optimizer's update of every trainable parameter on the host: at ``context.host_speed`` elements per second
    where the plan has one (``--host-speed``, or for a GPU that is not here its kind's typical host, assumed), else
    timed on this CPU, the host of the GPU here (``time_host_update``)."""
    if context.host_speed is not None:
        return UpdateTime(
            seconds=trainable.elements / context.host_speed,
            source=context.host_speed_source,
        )
    return UpdateTime(seconds=time_host_update(context.spec.build_optimizer) * trainable.elements, source="")


def card_host_update(context: PlanContext, search: LeverSearch, kind: str) -> LeverSearch:
    """``search`` with its host update at a typical host of ``kind`` (a card of the device table, ``GPU_PEAKS``), for
    a table of cards that are not here (``autofit capacity``) where ``--host-speed`` names no training machine."""
    if context.host_speed_given:
        return search
    rate = GPU_PEAKS[kind].host_update_per_s
    return replace(
        search, host_update_seconds=trainable_parameters(context).elements / rate,
        host_update_source=f"at {rate:g} elements/s, assumed for a typical {kind} host (the device table, docs/planner.md)",
    )


def loss_chunking(context: PlanContext) -> tuple[int, float]:
    """The chunks the chunked output layer and loss is tried with, and the output layer's share of the parameters
    (of the forward's time: what recomputing it costs, frozen or not); (1, 0.0) for a model it does not apply to
    (``strategies.chunkable``)."""
    model = context.meta_model
    if chunkable(model) is not None:
        return 1, 0.0
    total = sum(p.numel() for p in model.parameters())
    head = causal_lm(model).get_output_embeddings().weight
    return DEFAULT_LOSS_CHUNKS, head.numel() / total if total else 0.0


@dataclass(frozen=True, slots=True)
class Trainable:
    """The parameters that train: how many tensors, their elements and bytes."""

    tensors: int
    elements: int
    bytes: int


def trainable_parameters(context: PlanContext) -> Trainable:
    """The parameters that train, from the run's model on the meta device (nothing allocated)."""
    params = [p for p in context.meta_model.parameters() if p.requires_grad]
    return Trainable(
        tensors=len(params), elements=sum(p.numel() for p in params), bytes=sum(p.numel() * p.element_size() for p in params),
    )


def _timing_device(context: PlanContext) -> tuple[torch.device, str] | None:
    """The device the plan is for, to time a lever's update on, and its name for the notes; None for a GPU that
    is not here (nothing to time on)."""
    if context.device == "cuda" and not torch.cuda.is_available():
        return None
    if context.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        return device, torch.cuda.get_device_name(device)
    return torch.device("cpu"), f"CPU with {torch.get_num_threads()} thread(s)"


NOT_TIMED = "not measured: no GPU here to time it on, so taken as nothing"


def lever_search(context: PlanContext, costs: Costs, levers: Levers = Levers()) -> LeverSearch:
    """The memory levers the search may add above the floor on one process (``search.LeverSearch``).

    The step in backward everywhere (the search tries it where a point allows it); on a GPU (simulated too)
    also offload per block and optimizer state on the host, with the host link's rates (measured on a GPU
    here, else assumed) and the host's update (``host_update``: timed on this CPU for a GPU here, else at the
    given or assumed rate). 8-bit state only with
    ``allow_lossy_optimizer`` (it changes the arithmetic), its update timed on the device the plan is for; frozen
    weights in NF4 only with ``allow_lossy_base`` (it rounds them), for a model that has weights it takes, priced
    by their dequantization (``nf4_time``). With ``max_grad_norm`` (training clips gradients) the step in backward
    is left out.
    """
    trainable = trainable_parameters(context)
    eight_bit = eight_bit_time(context, trainable) if levers.allow_lossy_optimizer else None
    stepping = step_in_backward_time(context, costs, trainable)
    chunks, head_share = loss_chunking(context)
    nf4 = None
    if levers.allow_lossy_base and nf4_weights(context.meta_model):
        try:
            nf4 = {precision: nf4_time(context, costs, precision) for precision in context.precisions}
        except UserError as error:  # torchao missing: the plan goes on without it
            context.log(f"  left out: {error}")
    common = dict(
        step_in_backward=levers.max_grad_norm is None, eight_bit=eight_bit, step_in_backward_time=stepping, loss_chunks=chunks,
        head_share=head_share, nf4=nf4,
    )
    if context.device != "cuda":
        return LeverSearch(**common)
    update = host_update(context, trainable)
    return LeverSearch(
        host_state=True, offload=True, link=host_link(context.device), trainable_bytes=trainable.bytes,
        host_update_seconds=update.seconds, host_update_source=update.source, **common,
    )


def step_in_backward_time(context: PlanContext, costs: Costs, trainable: Trainable) -> UpdateTime:
    """What the optimizer step in backward adds to a step of this model (``speed.levers``): one optimizer per
    parameter timed against the model file's on the device the plan is for (``time_step_in_backward``; once, then
    kept with the costs), for the model's trainable tensors; taken as nothing when that device is a GPU that is
    not here."""
    timing = _timing_device(context)
    if timing is None:
        return UpdateTime(seconds=0.0, source=NOT_TIMED)
    device, where = timing
    per_tensor = costs.update_seconds.get("step_in_backward")
    if per_tensor is None:
        per_tensor = time_step_in_backward(context.spec.build_optimizer, device=device).per_tensor_seconds
        costs.update_seconds["step_in_backward"] = per_tensor
        costs.changed = True
    return UpdateTime(
        seconds=per_tensor * trainable.tensors,
        source=f"one optimizer per parameter timed against one for all on this {where}: {per_tensor * 1e6:+.3g} us "
        f"per tensor, for {trainable.tensors} trainable tensors",
    )


def nf4_time(context: PlanContext, costs: Costs, precision: str) -> UpdateTime:
    """One dequantization of every weight NF4 holds in this model at ``precision`` (``speed.levers``' D): timed per
    element on the device the plan is for (``time_nf4_dequantize``; once per dtype, then kept with the costs); for a
    GPU that is not here, the bytes it writes, counted on this CPU (``nf4_bytes_moved``), written and read again at
    half the GPU's memory bandwidth (an estimate)."""
    elements = sum(linear.weight.numel() for linear in nf4_weights(context.meta_model))
    dtype = nf4_weight_dtype(precision)
    name = str(dtype).removeprefix("torch.")
    timing = _timing_device(context)
    if timing is None:
        gpu, _ = gpu_peaks(context.info.name)
        moved = 2 * nf4_bytes_moved(dtype)
        return UpdateTime(
            seconds=moved * elements / (0.5 * gpu.bandwidth),
            source=f"estimated: {moved:.3g} bytes written and read per {name} weight element at half the "
            f"{gpu.bandwidth / 1e12:.2g} TB/s of {context.info.name}, for {elements:,} elements",
        )
    device, where = timing
    key = f"nf4_dequantize_{name}"
    per_element = costs.update_seconds.get(key)
    if per_element is None:
        per_element = time_nf4_dequantize(device=device, dtype=dtype)
        costs.update_seconds[key] = per_element
        costs.changed = True
    return UpdateTime(
        seconds=per_element * elements,
        source=f"timed on this {where}: {per_element * 1e9:.3g} ns per {name} weight element, for {elements:,} elements",
    )


def eight_bit_time(context: PlanContext, trainable: Trainable) -> UpdateTime | None:
    """What 8-bit optimizer state adds to a step of this model (``speed.levers``): its update timed against the model
    file's on the device the plan is for (``time_eight_bit_update``: per tensor and per element), for the model's
    trainable tensors and elements; taken as nothing when that device is a GPU that is not here. None (logged)
    where 8-bit state cannot run: the optimizer is not AdamW or Adam, or torchao is missing."""
    try:
        eight_bit_adam(context.spec.build_optimizer([torch.nn.Parameter(torch.empty(EIGHT_BIT_ELEMENTS, device="meta"))]))
    except UserError as error:
        context.log(f"  left out: 8-bit AdamW state: {error}")
        return None
    except Exception:  # a builder that needs the model's named groups: the timing falls back on AdamW
        pass
    timing = _timing_device(context)
    if timing is None:
        return UpdateTime(seconds=0.0, source=NOT_TIMED)
    device, where = timing
    try:
        cost = time_eight_bit_update(context.spec.build_optimizer, device=device)
    except UserError as error:
        context.log(f"  left out: 8-bit AdamW state: {error}")
        return None
    except Exception as error:  # torchao's compiled step cannot run here (a compiler missing): training could not either
        first_line = (str(error).splitlines() or [""])[0]
        context.log(f"  left out: 8-bit AdamW state: its step failed here ({type(error).__name__}: {first_line})")
        return None
    rates = f"{cost.per_tensor_seconds * 1e6:+.3g} us per tensor and {cost.per_element_seconds * 1e9:+.3g} ns per element"
    context.log(f"speed: 8-bit AdamW state's update {rates} (timed on this {where})")
    return UpdateTime(
        seconds=cost.seconds(tensors=trainable.tensors, elements=trainable.elements),
        source=f"its update timed against the model's optimizer on this {where}, {rates}, for {trainable.tensors} trainable "
        f"tensors of {trainable.elements:,} elements",
    )


def lever_time_for(context: PlanContext, costs: Costs, model, config: TrainingConfig) -> LeverTime:
    """What the chosen levers add to a step (``speed.levers``): the host link measured on a GPU here, else assumed;
    the host update as ``host_update`` prices it, as the search's rows are."""
    link = host_link(context.device) if config.offload or config.updates_on_host else None
    trainable = trainable_parameters(context)
    update = host_update(context, trainable) if config.updates_on_host else UpdateTime(seconds=0.0, source="")
    eight_bit = None
    if config.optimizer_state == "8bit":
        eight_bit = eight_bit_time(context, trainable) or UpdateTime(seconds=0.0, source="not measured: its update could not be timed here")
    stepping = step_in_backward_time(context, costs, trainable) if config.optimizer_in_backward else None
    return lever_time(
        config, model=model, link=link, trainable_bytes=trainable.bytes, host_update_seconds=update.seconds,
        host_update_source=update.source, eight_bit=eight_bit, step_in_backward=stepping, head_share=loss_chunking(context)[1],
        nf4=nf4_time(context, costs, config.precision) if config.frozen_nf4 else None,
    )
