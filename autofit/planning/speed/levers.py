"""What the memory levers cost in time: the terms a lever plan's predicted samples/s adds, in one place.

The speed model (``CostModel.step_seconds``) predicts a step of a
configuration without levers. Its levers (the search's, ``search.LeverSearch``,
or a candidate below the floor, ``levers.py``) add, per
optimizer step of micro-batches m_1 .. m_k, with the host link's rates
``down`` (device -> pinned host) and ``up`` (pinned host -> device):

- **activation offload**: per micro-step, the offloaded blocks' saved
  activations, B bytes (taken as the bytes checkpointing those blocks would
  drop, ``MemoryCosts.at``: their saved tensors less input and output, so a
  slight under-count of what is copied), go to the host in the forward and
  come back in the backward (``strategies/offload.py``). The copies down run
  on a side stream beside the forward, so only what exceeds the forward's
  compute F shows; the copies back run on the compute stream when backward
  needs them, so all of them show::

      offload = sum over micro-steps of  max(0, B / down - F) + B / up

- **optimizer state on the host** (``HostOptimizer``): after each of the k
  micro-batches' backward the gradients (G bytes) go down (accumulated on the
  host), then the update runs on the host's CPU (U seconds:
  ``time_host_update`` on this CPU, per parameter element, times the
  trainable elements), and the parameters (P bytes) go back up. Nothing is
  taken to overlap: the copies run on the compute stream (those after the
  first micro-batch wait for it), the host step waits for them, and the
  copies up run before the next forward. The device's own optimizer step
  (``SpeedCosts.optimizer_seconds``, S) is no longer spent::

      host_state = k * G / down + U + P / up - S

- **optimizer step in backward**: the same updates, one optimizer per
  parameter stepped inside backward: each parameter pays a step's own
  overheads (a call, its hooks, on a GPU the launches a foreach step shares),
  B seconds per trainable tensor (``time_step_in_backward`` on the device the
  plan is for; planning for a GPU that is not here it is not measured and
  taken as nothing, as the notes say; with host state the update is the
  host's, in the term above)::

      step_in_backward = B * tensors
- **8-bit state** (torchao, with ``--allow-lossy-optimizer``): the same
  step, its update dequantizing and quantizing the moments: E seconds more
  per step (``time_eight_bit_update`` on the device the plan is for, a cost
  per parameter tensor and per element, for the trainable tensors and
  elements; negative where it is faster). Planning for a GPU that is not here it is not measured, and taken
  as nothing (the plan's notes say so)::

      eight_bit = E

- **chunked output layer and loss** (``loss_chunks``): backward runs each
  chunk's output layer again, one more forward of the head per micro-step.
  Its time is the micro-step's forward F times the head's share h of the
  trainable parameters (a language model's forward costs about 2 FLOPs per
  parameter and token; attention's share makes this an over-count)::

      chunked_loss = sum over micro-steps of  h * F

- **frozen weights in NF4** (``frozen_nf4``, with ``--allow-lossy-base``):
  every product over an NF4 weight dequantizes it whole, in forward and again
  in backward, and once more where a checkpointed block recomputes its
  forward. With D seconds for one dequantization of every NF4 weight
  (``time_nf4_dequantize`` on the device the plan is for, per element; for a
  GPU that is not here, the bytes it writes and reads again over half the
  table's memory bandwidth, an estimate), c checkpointed blocks of n::

      nf4 = sum over micro-steps of  (2 + c / n) * D

The search prices offload per block (``offload_block_seconds``): the bytes
the block alone saved, down beyond its own forward and all back up, summed
over blocks at least the term above. Before the offloading runs are traced,
it bounds offload's speed with the least that term can be
(``offload_floor_seconds``: the dropped bytes back up, nothing else).

``down`` and ``up`` are measured on this machine's GPU where there is one
(``measure_host_link``); planning for a GPU that is not here, they are
``ASSUMED_LINK_BYTES_PER_S`` and the plan's notes say so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autofit.config import TrainingConfig
from autofit.measure.host_speed import HostLink, measure_host_link
from autofit.planning.costs import CostModel
from autofit.units import format_bytes
from strategies import MASTER_WEIGHTS

ASSUMED_LINK_BYTES_PER_S = 12e9
"""Pinned copies each way when no GPU is here to measure: PCIe 3.0 x16's practical rate. PCIe 4.0 x16
reaches about 24 GB/s and 5.0 about 50, so an estimate from this errs slow, never fast."""


def host_link(device_type: str) -> HostLink:
    """The host link's rates: measured on this machine's GPU when planning for CUDA with one visible, else assumed."""
    if device_type == "cuda" and torch.cuda.is_available():
        return measure_host_link(torch.device("cuda", torch.cuda.current_device()))
    return HostLink(
        to_host_bytes_per_s=ASSUMED_LINK_BYTES_PER_S, to_device_bytes_per_s=ASSUMED_LINK_BYTES_PER_S, measured=False,
        source=f"assumed (no GPU here to measure it: PCIe 3.0 x16's {ASSUMED_LINK_BYTES_PER_S / 1e9:.0f} GB/s each way)",
    )


def offload_seconds(*, offloaded_bytes: float, forward_seconds: float, link: HostLink) -> float:
    """One micro-step's offload time: copies down beyond the forward's compute, and every copy back up."""
    down = offloaded_bytes / link.to_host_bytes_per_s
    return max(0.0, down - forward_seconds) + offloaded_bytes / link.to_device_bytes_per_s


def host_state_seconds(
    *, gradient_bytes: float, parameter_bytes: float, update_seconds: float, device_optimizer_seconds: float, link: HostLink
) -> float:
    """One step's time added by optimizer state on the host (may be negative when the host is fast)."""
    return (
        gradient_bytes / link.to_host_bytes_per_s + update_seconds + parameter_bytes / link.to_device_bytes_per_s
        - device_optimizer_seconds
    )


@dataclass(kw_only=True)
class LeverTime:
    """Seconds the levers add to one optimizer step, and the notes that say how they were counted."""

    offload_seconds: float = 0.0
    host_state_seconds: float = 0.0
    eight_bit_seconds: float = 0.0
    step_in_backward_seconds: float = 0.0
    chunked_loss_seconds: float = 0.0
    nf4_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return (
            self.offload_seconds + self.host_state_seconds + self.eight_bit_seconds + self.step_in_backward_seconds
            + self.chunked_loss_seconds + self.nf4_seconds
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateTime:
    """What a lever's update adds to one optimizer step, for the trainable tensors and elements (8-bit state:
    ``time_eight_bit_update``; the step in backward: ``time_step_in_backward``)."""

    seconds: float
    """May be negative (a faster update)."""
    source: str
    """How it was counted, as the plan's notes say it."""


def lever_time(
    config: TrainingConfig,
    *,
    model: CostModel,
    link: HostLink | None,
    trainable_bytes: int,
    host_update_seconds: float,
    eight_bit: UpdateTime | None = None,
    step_in_backward: UpdateTime | None = None,
    head_share: float = 0.0,
    host_update_source: str = "",
    nf4: UpdateTime | None = None,
) -> LeverTime:
    """The levers' seconds per step of ``config`` (see the module docstring for the formulas).

    Args:
        model: the cost model; ``config.precision`` must be in it (memory and speed).
        link: the host link (needed with offload or host state).
        trainable_bytes: bytes of the parameters that train (their gradients are as many).
        host_update_seconds: the optimizer's update of every trainable parameter on the host's CPU.
        eight_bit: what 8-bit state adds to a step (needed with it).
        step_in_backward: what the step in backward adds to a step (None: taken as nothing, and the notes say so).
        head_share: the output layer's share of the parameters (with the chunked loss): of the forward's time.
        host_update_source: where ``host_update_seconds`` came from, for the notes ("": timed on this machine's CPU).
        nf4: one dequantization of every NF4 weight (needed with ``frozen_nf4``).
    """
    time = LeverTime()
    if config.loss_chunks > 1:
        _add_chunked_loss(time, config, model=model, head_share=head_share)
    if config.frozen_nf4:
        _add_nf4(time, config, model=model, nf4=nf4)
    if config.optimizer_state == "8bit":
        if eight_bit is None:
            raise ValueError("8-bit optimizer state needs its update's time (time_eight_bit_update)")
        time.eight_bit_seconds = eight_bit.seconds
        time.notes.append(f"8-bit optimizer state: {eight_bit.seconds:+.3g} s per step predicted for its update ({eight_bit.source})")
    if config.optimizer_in_backward and not config.updates_on_host:
        _add_step_in_backward(time, step_in_backward)
    if not (config.offload or config.updates_on_host):
        return time
    if link is None:
        raise ValueError("offload and host optimizer state need the host link's rates")
    if config.offload:
        _add_offload(time, config, model=model, link=link)
    if config.updates_on_host:
        _add_host_state(
            time, config, model=model, link=link, trainable_bytes=trainable_bytes, host_update_seconds=host_update_seconds,
            host_update_source=host_update_source,
        )
    return time


def _link_rates(link: HostLink) -> str:
    return f"{link.to_host_bytes_per_s / 1e9:.1f} GB/s down and {link.to_device_bytes_per_s / 1e9:.1f} GB/s up, {link.source}"


def _add_chunked_loss(time: LeverTime, config: TrainingConfig, *, model: CostModel, head_share: float) -> None:
    """The head's forward again in backward, per micro-step."""
    speed = model.precisions[config.precision].speed
    time.chunked_loss_seconds = sum(
        count * head_share * speed.forward_seconds_at(size) for size, count in model.micro_sizes(config.micro_batch_size)
    )
    time.notes.append(
        f"the output layer and loss in {config.loss_chunks} chunks: {time.chunked_loss_seconds:+.3g} s per step "
        f"predicted, the head's forward again in backward ({head_share:.0%} of the parameters, of the forward's time)"
    )


def _add_nf4(time: LeverTime, config: TrainingConfig, *, model: CostModel, nf4: UpdateTime | None) -> None:
    """One dequantization of every NF4 weight per forward and backward, and per recomputation."""
    if nf4 is None:
        raise ValueError("frozen weights in NF4 need their dequantization's time (time_nf4_dequantize)")
    micro_steps = sum(count for _, count in model.micro_sizes(config.micro_batch_size))
    passes = micro_steps * (2 + len(config.checkpoint) / max(len(model.blocks), 1))
    time.nf4_seconds = passes * nf4.seconds
    time.notes.append(
        f"frozen weights in NF4: {time.nf4_seconds:+.3g} s per step predicted for their dequantization, {passes:.3g} "
        f"times a step (in each micro-batch's forward and backward{', and again where checkpointed blocks recompute' if config.checkpoint else ''}; "
        f"{nf4.source})"
    )


def _add_step_in_backward(time: LeverTime, step_in_backward: UpdateTime | None) -> None:
    if step_in_backward is None:
        time.notes.append("the optimizer step in backward is taken to cost no time (the same updates, run inside backward)")
        return
    time.step_in_backward_seconds = step_in_backward.seconds
    time.notes.append(
        f"the optimizer step in backward: {step_in_backward.seconds:+.3g} s per step predicted, the same updates "
        f"one parameter at a time ({step_in_backward.source})"
    )


def _add_offload(time: LeverTime, config: TrainingConfig, *, model: CostModel, link: HostLink) -> None:
    """Each micro-step's offloaded bytes down (overlapping its forward) and back up."""
    costs = model.precisions[config.precision]
    blocks = [model.blocks.index(name) for name in config.offload]
    total_bytes = 0.0
    for size, count in model.micro_sizes(config.micro_batch_size):
        _, drops = costs.memory.at(size, global_batch_size=model.global_batch_size)
        offloaded = sum(drops[b] for b in blocks)
        total_bytes += count * offloaded
        time.offload_seconds += count * offload_seconds(
            offloaded_bytes=offloaded, forward_seconds=costs.speed.forward_seconds_at(size), link=link,
        )
    time.notes.append(
        f"activation offload moves about {format_bytes(total_bytes)} per step each way at {_link_rates(link)}: "
        f"+{time.offload_seconds:.3g} s per step predicted (the copies down overlap the forward, the copies back do not)"
    )


def _add_host_state(
    time: LeverTime, config: TrainingConfig, *, model: CostModel, link: HostLink, trainable_bytes: int, host_update_seconds: float,
    host_update_source: str,
) -> None:
    """Gradients down, parameters up and the update on the host, in place of the device's update."""
    master = config.precision == MASTER_WEIGHTS
    costs = model.precisions[config.precision]
    micro_steps = sum(count for _, count in model.micro_sizes(config.micro_batch_size))
    moved = trainable_bytes // 2 if master else trainable_bytes  # bf16 gradients down and weights up
    time.host_state_seconds = host_state_seconds(
        gradient_bytes=micro_steps * moved, parameter_bytes=moved, update_seconds=host_update_seconds,
        device_optimizer_seconds=costs.speed.optimizer_seconds, link=link,
    )
    gradients = f"the gradients ({format_bytes(moved)}" + (f", after each of {micro_steps} micro-batches)" if micro_steps > 1 else ")")
    what = "bf16 weights with their fp32 masters and optimizer state on the host" if master else "optimizer state on the host"
    source = host_update_source or f"timed on this machine's CPU with {torch.get_num_threads()} thread(s)"
    time.notes.append(
        f"{what} moves {gradients} down and the parameters "
        f"up each step at {_link_rates(link)}, and updates on the host's CPU in {host_update_seconds:.3g} s ({source}) instead of the device's "
        f"{costs.speed.optimizer_seconds:.3g} s: {time.host_state_seconds:+.3g} s per step predicted (nothing overlaps)"
    )


def offload_floor_seconds(model: CostModel, precision: str, micro_batch_size: int, *, link: HostLink) -> list[float]:
    """Per block: the least that offloading it adds to an optimizer step, before the offloading runs are traced.

    ``lever_time``'s offload term moves, per micro-step, the offloaded blocks' dropped bytes back up after their
    copies down (which may overlap the forward): at least those bytes over the link's rate up. Per block, its
    dropped bytes (``MemoryCosts.at``, known from plain training's traces; a block whose checkpointing keeps more
    than it frees counts nothing) over that rate, summed over the micro-steps: a sum over blocks of this is at
    most ``lever_time``'s offload term, so a speed found with it bounds the speed with offload from above
    (``search.cheapest_for``'s ``relaxed``).
    """
    costs = model.precisions[precision]
    totals = [0.0] * len(model.blocks)
    for size, count in model.micro_sizes(micro_batch_size):
        _, drops = costs.memory.at(size, global_batch_size=model.global_batch_size)
        for b, nbytes in enumerate(drops):
            totals[b] += count * max(nbytes, 0.0) / link.to_device_bytes_per_s
    return totals


def offload_block_seconds(model: CostModel, precision: str, micro_batch_size: int, *, link: HostLink) -> list[float]:
    """Per block: what offloading it alone costs per optimizer step, the search's additive term.

    Per micro-step, the bytes it alone saved (``memory.levers.offload_drops``), down beyond its own forward's
    compute and all of them back up: a sum over blocks of this is at least ``lever_time``'s offload term (whose
    copies down overlap the whole forward), so the knapsack errs slow.
    """
    from autofit.planning.memory.levers import LeverChoice, lever_segments, offload_drops

    costs = model.precisions[precision]
    totals = [0.0] * len(model.blocks)
    for size, count in model.micro_sizes(micro_batch_size):
        found = lever_segments(costs.memory, size, global_batch_size=model.global_batch_size, choice=LeverChoice())
        if found is None:
            return [float("inf")] * len(model.blocks)
        block_bytes = offload_drops(found[1], len(model.blocks))
        forward = costs.speed._block_forward_seconds(size) or [0.0] * len(model.blocks)
        for b, (nbytes, seconds) in enumerate(zip(block_bytes, forward)):
            totals[b] += count * offload_seconds(offloaded_bytes=nbytes, forward_seconds=seconds, link=link)
    return totals
