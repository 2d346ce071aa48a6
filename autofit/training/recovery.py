"""Out of memory in a step: put back what the failed step changed, halve the micro-batch and redo the step exactly.

Wherever the allocation fails (a forward, a backward, the GradScaler's
unscale, the optimizer step), the step is redone from the state it started
in, so the run goes on exactly as if it had used the smaller micro-batch from
that step on. What a failed step may have changed, and how it is put back:

- gradients: dropped (``zero_grad(set_to_none=True)``);
- buffers a forward updates in place: copied back from a copy taken before
  the step. Running statistics (of modules with ``track_running_stats``,
  BatchNorm's, which its kernel updates without bumping their version
  counters) are copied every step; other buffers only when their version
  counter says they changed;
- the RNG (dropout masks drawn): restored;
- the GradScaler's record of having unscaled this step's gradients: reset
  (otherwise the redone step would apply its gradients times the loss scale);
- optimizer state created lazily by a first ``optimizer.step``: removed.

What cannot be put back without a copy of every weight: weights or optimizer
state that ``optimizer.step`` had already updated (their version counters
say so). Then the run stops with one line; last.pt keeps the last save.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autofit._torch_private import copy_tensors, grad_scaler_tensors, reset_grad_scaler_step, versions
from autofit.apply import AppliedPlan
from autofit.config import TrainingConfig
from autofit.errors import UserError, is_out_of_memory
from autofit.measure.meters import release_device_memory
from autofit.step import StepResult, train_step


class StepUndo:
    """Takes, before each step, what it needs to put a failed step back; ``undo`` puts it back.

    Args:
        model: the model being trained (its buffers are watched).
        optimizer: its state and parameters are watched from just before its ``step``.
        scaler: the GradScaler of the step (a disabled one for fp32/bf16).
        device: where the model runs (its RNG is saved besides the CPU's).
    """

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 device: torch.device) -> None:
        self.optimizer, self.scaler, self.device = optimizer, scaler, device
        running = [b for m in model.modules() if getattr(m, "track_running_stats", False) for b in m.buffers(recurse=False)]
        others = [b for b in model.buffers() if not any(b is r for r in running)]
        self.buffers, self.running = running + others, len(running)
        """The buffers, running statistics first: ``self.buffers[:self.running]`` are copied every step."""
        self.saved_buffers = [buffer.detach().clone() for buffer in self.buffers]
        self.buffer_versions = versions(self.buffers)
        self.rng: tuple | None = None
        self.before_optimizer: dict | None = None
        """What the optimizer held just before its step began (None: the step never reached it)."""
        optimizer.register_step_pre_hook(self._record_optimizer)  # for the optimizer's life: the run's

    def save(self) -> None:
        """Before a step: keep the buffers that changed since the last step, and the RNG state."""
        changed = self._changed_buffers()
        copy_tensors([self.saved_buffers[i] for i in changed], [self.buffers[i] for i in changed])
        self.buffer_versions = versions(self.buffers)
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        self.before_optimizer = None

    def undo(self, *, micro_batch_size: int) -> None:
        """After a failed step: put back everything it changed.

        Raises:
            UserError: the optimizer step had already updated weights or their
                state, which cannot be put back.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.before_optimizer is not None:
            changed = self._optimizer_changes()
            if changed:
                raise UserError(
                    f"out of memory inside the optimizer step (micro-batch {micro_batch_size}) after it had updated "
                    f"{changed}, which cannot be put back to redo the step; last.pt keeps the last save: free memory on "
                    "the device or re-plan with a lower --budget, then continue with --resume"
                )
            for param in self.before_optimizer["without_state"]:
                self.optimizer.state.pop(param, None)  # created by this step's lazy initialisation
        reset_grad_scaler_step(self.scaler)
        changed = self._changed_buffers()
        copy_tensors([self.buffers[i] for i in changed], [self.saved_buffers[i] for i in changed])
        self.buffer_versions = versions(self.buffers)
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None:
            torch.cuda.set_rng_state(self.rng[1], self.device)

    def _changed_buffers(self) -> list[int]:
        """Indices of the buffers that may differ from their copy: running statistics always, others by version."""
        return [i for i, version in enumerate(versions(self.buffers)) if i < self.running or version != self.buffer_versions[i]]

    def _record_optimizer(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.before_optimizer = {
            "params": versions(params),
            "state": self._state_signature(params),
            "without_state": [p for p in params if not optimizer.state.get(p)],
            "scaler": versions(grad_scaler_tensors(self.scaler)),
        }

    def _state_signature(self, params: list[torch.Tensor]) -> list:
        """For each parameter with state: its keys, and each value's identity and version (tensors) or value."""
        signature = []
        for param in params:
            state = self.optimizer.state.get(param)
            if state:
                signature.append([
                    (key, id(value), *versions([value])) if isinstance(value, torch.Tensor) else (key, value)
                    for key, value in state.items()
                ])
        return signature

    def _optimizer_changes(self) -> str:
        """What the interrupted optimizer step had already changed ("" when nothing)."""
        before = self.before_optimizer
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        had_state = [p for p in params if p not in set(before["without_state"])]
        if versions(params) != before["params"]:
            return "some weights"
        if self._state_signature(had_state) != before["state"]:
            return "its state (e.g. step counts or moments)"
        if versions(grad_scaler_tensors(self.scaler)) != before["scaler"]:
            return "the GradScaler's scale"
        return ""


@dataclass(frozen=True, slots=True)
class MicroBatchChange:
    """A smaller micro-batch after an out-of-memory error: the configuration trained from then on, and why."""

    config: TrainingConfig
    record: dict
    """What metrics.jsonl and the plan's history say of it (the error, the micro-batch before and after)."""


def step_with_recovery(applied: AppliedPlan, inputs, targets, *, loss_fn, optimizer: torch.optim.Optimizer,
                       undo: StepUndo, smallest_micro_batch: int = 1) -> tuple[StepResult, list[MicroBatchChange]]:
    """One optimizer step over a global batch, redone exactly with half the micro-batch after an allocation fails.

    ``smallest_micro_batch``: the fewest samples a forward may hold (the plan's ``model.min_micro_batch_size``: a loss
    that couples a batch's samples); the micro-batch is never halved below it.

    Returns:
        The step's result, and each micro-batch change made.

    Raises:
        UserError: out of memory at a micro-batch of 1 (or of ``smallest_micro_batch``), on several processes,
            or after the optimizer step had updated the weights.
    """
    ooms = []
    while True:
        undo.save()
        try:
            result = train_step(applied, inputs, targets, loss_fn=loss_fn, optimizer=optimizer)
            return result, ooms
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            message = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        # Here, outside the except block, the failed step's frames and tensors are gone.
        undo.undo(micro_batch_size=applied.micro_batch_size)
        release_device_memory(applied.device.type)
        previous = applied.micro_batch_size
        if smallest_micro_batch > 1 and previous // 2 < smallest_micro_batch:  # at 1, halving says so itself
            raise UserError(
                f"out of memory at micro-batch {previous} ({message}), and the loss couples the samples of a forward: the "
                f"plan holds at least {smallest_micro_batch} in each (its notes say why); re-plan with a lower --budget, "
                "or free memory on the device"
            )
        applied.halve_micro_batch()
        ooms.append(MicroBatchChange(config=applied.config, record={
            "event": "out_of_memory", "error": message, "previous_micro_batch_size": previous,
            "micro_batch_size": applied.micro_batch_size, "grad_accum_steps": applied.grad_accum_steps,
            "global_batch_size": applied.config.global_batch_size,
        }))
