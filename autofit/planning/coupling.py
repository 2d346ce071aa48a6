"""Whether a batch may be split into micro-batches: checked on the example batch, not assumed.

Accumulating micro-batches gives the whole batch's gradient only when the loss of a batch is the weighted mean of
its samples' (or items') losses. An in-batch contrastive loss (CLIP, SigLIP, SimCLR: each sample's negatives are the
other samples of the same forward) is not: over micro-batches of 2 it sees one negative, over micro-batches of 1
none, and its gradient is then zero. Such a model trains with the whole global batch in each forward, or with the
fewest samples its model file declares (``MIN_MICRO_BATCH``).

The check runs the model for real on the CPU in eval mode (dropout off, BatchNorm on its running statistics:
BatchNorm's own coupling has a note of its own, ``report.batch_norm_notes``), once on ``example_batch(n)`` whole and
once split in two halves weighted as training weights them, and compares loss and gradient.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from autofit._torch_private import without_dispatch_modes
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.model_io import as_loss, call_model
from autofit.spec import ModelSpec

CHECK_SAMPLES = 4
"""Samples of the example batch the check runs whole, then as two micro-batches of 2 (more where the model needs
larger micro-batches): few, as the model runs for real, and enough for a batch statistic to differ."""
LOSS_TOLERANCE = 1e-4
"""Relative difference of the whole batch's loss and the split one's still counted as equal (fp32 sums in another
order differ by about 1e-7)."""
GRADIENT_TOLERANCE = 1e-3
"""The same for the gradient's norm of the difference, relative to the whole batch's gradient norm."""
CHECKED_PARAMETERS = 200_000_000
"""Models up to this many parameters are checked: a real step of a larger one (a 1B language model planned with
``--simulate``) takes minutes on a CPU. Larger ones declare ``MIN_MICRO_BATCH`` where their loss couples a batch."""


@dataclass(frozen=True, slots=True)
class Coupling:
    """A loss that couples the samples of a batch: the fewest samples one micro-batch may hold, and why."""

    smallest_micro_batch: int
    why: str
    """One line for the plan's notes."""
    reason: str
    """What couples the samples, as ``why`` says it after its colon (for other lines to say)."""


def batch_coupling(spec: ModelSpec, *, global_batch_size: int, smallest: int, fits_here: bool) -> Coupling | None:
    """None where micro-batches of any size train the global batch's gradient (or nothing can tell), else the
    constraint on the micro-batch.

    Args:
        smallest: the smallest micro-batch the model runs with (``modelling.smallest_runnable``).
        fits_here: whether this machine can hold the model for real; when not, the check is not run (a model file's
            ``MIN_MICRO_BATCH`` still holds).
    """
    G = global_batch_size
    declared = spec.min_micro_batch_size
    if declared is not None:
        if declared <= smallest or G <= smallest:
            return None
        size = min(declared, G)
        reason = f"the model file declares MIN_MICRO_BATCH = {declared} (its loss couples the samples of a forward)"
        return Coupling(smallest_micro_batch=size, why=f"micro-batches hold at least {size} samples: {reason}", reason=reason)
    size = min(G, max(CHECK_SAMPLES, 2 * smallest))
    half = math.ceil(size / 2)
    if G <= smallest or half < smallest or not fits_here:
        return None
    found = _checked(spec, size=size, half=half)
    if found is None:
        return None
    whole_loss, split_loss, grad_apart = found
    loss_apart = abs(whole_loss - split_loss) / max(abs(whole_loss), abs(split_loss), 1e-12)
    if loss_apart <= LOSS_TOLERANCE and grad_apart <= GRADIENT_TOLERANCE:
        return None
    reason = (
        f"its loss couples the samples of a forward (in-batch negatives, a batch statistic): on example_batch({size}) "
        f"the whole batch's loss is {whole_loss:.4g}, over micro-batches of {half} {split_loss:.4g}, the gradient "
        f"{grad_apart:.0%} apart"
    )
    return Coupling(
        smallest_micro_batch=G, reason=reason,
        why=f"micro-batches hold the whole batch of {G}: {reason}; a model file may allow smaller ones with MIN_MICRO_BATCH = N",
    )


_RECENT: list[tuple[ModelSpec, int, int, tuple[float, float, float] | None]] = []
"""The last few checks' results with the spec they ran on: a plan's one-process floor, its ranks and a second plan of
the same spec (a refusal, then ``--gpus``) ask the same question, and each answer is a real step of the model. The
spec itself is kept, so its ``id`` cannot be reused by another; the gradients are not (three numbers are)."""
_RECENT_KEPT = 4


def _checked(spec: ModelSpec, *, size: int, half: int) -> tuple[float, float, float] | None:
    """(the whole batch's loss, the split one's, their gradients' difference relative to the whole's norm) of
    ``_whole_and_split``, run once per spec and split in this process; None where that cannot tell."""
    for kept, kept_size, kept_half, found in _RECENT:
        if kept is spec and (kept_size, kept_half) == (size, half):
            return found
    stepped = _whole_and_split(spec, size=size, half=half)
    found = None
    if stepped is not None:
        (whole_loss, whole_grad), (split_loss, split_grad) = stepped
        apart_squared = sum(float(torch.sub(a, b).square().sum()) for a, b in zip(whole_grad, split_grad))
        grad_apart = math.sqrt(apart_squared) / max(math.sqrt(sum(float(g.square().sum()) for g in whole_grad)), 1e-12)
        found = (whole_loss, split_loss, grad_apart)
    _RECENT.append((spec, size, half, found))
    del _RECENT[:-_RECENT_KEPT]
    return found


def _whole_and_split(spec: ModelSpec, *, size: int, half: int):
    """((loss, gradients) of ``example_batch(size)`` whole, the same over micro-batches of ``half``), or None where
    that cannot tell: the model fails so, or it is random in eval mode (a VAE's sampling: two runs of the whole
    batch already differ)."""
    loss_fn = as_loss(spec.loss_fn)
    try:
        with without_dispatch_modes(), torch.random.fork_rng(devices=[]):
            model = spec.build_model()
            model.eval()
            parameters = [p for p in model.parameters() if p.requires_grad]
            inputs, targets = spec.example_batch(size)

            def step(micro_batch_size: int, *, seed: int) -> tuple[float, torch.Tensor]:
                torch.manual_seed(seed)
                model.zero_grad(set_to_none=True)
                # The split as training makes it, through the one owner (plain fp32: no other strategy is on).
                applied = apply_config(model, TrainingConfig(global_batch_size=size, micro_batch_size=micro_batch_size), device="cpu")
                total = 0.0
                for micro_inputs, micro_targets, weight in applied.micro_batches(inputs, targets, count=loss_fn.count):
                    loss = loss_fn.weighted(call_model(model, micro_inputs), micro_targets, weight=weight)
                    loss.backward()
                    total += loss.item()
                return total, [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]

            whole = step(size, seed=0)
            split = step(half, seed=0)
            with torch.no_grad():  # the whole batch again under another seed: a forward is enough to see randomness
                torch.manual_seed(1)
                again = loss_fn(call_model(model, inputs), targets).item()
    except Exception:  # the model cannot run so (a detection model returns no loss in eval mode): nothing to tell
        return None
    if abs(whole[0] - again) > LOSS_TOLERANCE * max(abs(whole[0]), 1e-12) or not math.isfinite(whole[0] + split[0]):
        return None
    return whole, split


def kept_together(context, costs) -> Coupling | None:
    """Check the loss of ``context``'s model (``batch_coupling``) and, where it couples the samples of a batch, cut
    ``costs.micro_batch_sizes`` to the sizes it allows: the floor, the levers and the search then work within them.

    Returns:
        The coupling, for the plan's note; None where micro-batches of every size train the same gradient.
    """
    from autofit.planning.modelling import micro_batch_sizes

    G = context.global_batch_size
    stored = context.study.load("coupling")  # kept with the costs: the same model, batch and loss need no new check
    if isinstance(stored, dict) and isinstance(stored.get("smallest_micro_batch"), int) and "reason" in stored:
        coupling = Coupling(**stored) if stored["smallest_micro_batch"] else None
    else:
        with context.progress.doing("checking that the loss splits over micro-batches (the example batch whole and halved)"):
            coupling = batch_coupling(context.spec, global_batch_size=G, smallest=costs.smallest, fits_here=checkable(context.spec))
        context.study.save("coupling", asdict(coupling) if coupling else {"smallest_micro_batch": 0, "why": "", "reason": ""})
    if coupling is None:
        return None
    costs.micro_batch_sizes = micro_batch_sizes(G, smallest=max(costs.smallest, coupling.smallest_micro_batch))
    context.log(coupling.why)
    return coupling


def check_rank_share(spec: ModelSpec, *, global_batch_size: int, share: int, world_size: int) -> None:
    """Refuse to spread a batch whose loss couples its samples over ``world_size`` processes (each forward would see
    ``share`` samples of it, and DDP and FSDP2 average the ranks' gradients as they average micro-batches').

    Raises:
        UserError: the loss couples more samples than a rank's share holds.
    """
    coupling = batch_coupling(spec, global_batch_size=global_batch_size, smallest=1, fits_here=checkable(spec))
    if coupling is not None and coupling.smallest_micro_batch > share:
        raise UserError(
            f"{world_size} GPUs would each take {share} of the {global_batch_size} samples in one forward, but "
            f"{coupling.reason}; plan for one GPU (--gpus 1), or declare "
            f"MIN_MICRO_BATCH = {share} or less in the model file if groups of {share} samples will do"
        )


def checkable(spec: ModelSpec) -> bool:
    """Whether ``batch_coupling`` may step ``spec``'s model for real here: this machine holds it training, and it has
    at most ``CHECKED_PARAMETERS`` parameters (a model object from Python, not buildable on meta, is checked)."""
    from autofit.measure.meters import meta_parameter_count, trains_here

    count = meta_parameter_count(spec)
    return trains_here(spec) and (count is None or count <= CHECKED_PARAMETERS)
