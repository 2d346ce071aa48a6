"""A loss that couples the samples of a batch (in-batch negatives) is found by a check, and its batch is not split."""
import dataclasses

import pytest
import torch

from autofit.apply import apply_config
from autofit.planning.coupling import batch_coupling
from autofit.planning.planner import make_plan
from autofit.planning.request import PlanRequest
from autofit.step import train_step
from tests.helpers.planning import in_batch_loss, two_towers_spec, uneven_spec


def test_an_in_batch_contrastive_loss_is_found_to_couple_the_batch():
    coupling = batch_coupling(two_towers_spec(), global_batch_size=8, smallest=1, fits_here=True)
    assert coupling is not None and coupling.smallest_micro_batch == 8
    assert "couples the samples" in coupling.why and "MIN_MICRO_BATCH" in coupling.why


def test_a_loss_that_is_a_mean_over_samples_is_not_held_together():
    # BatchNorm too: in eval mode it normalises by its running statistics (its own note says what training does).
    assert batch_coupling(uneven_spec(), global_batch_size=8, smallest=2, fits_here=True) is None


def test_a_declared_smallest_micro_batch_is_kept():
    spec = dataclasses.replace(two_towers_spec(), min_micro_batch_size=4)
    coupling = batch_coupling(spec, global_batch_size=8, smallest=1, fits_here=False)
    assert coupling.smallest_micro_batch == 4 and "MIN_MICRO_BATCH = 4" in coupling.why


def test_a_contrastive_model_plans_the_whole_batch_and_its_step_is_the_full_batch_step(one_thread):
    spec = two_towers_spec()
    lines = []
    plan = make_plan(spec, PlanRequest(budget="60KB", batch_size=8, device="cpu", simulate=True, precisions=["fp32"]), log=lines.append)
    assert plan.config.micro_batch_size == 8 and plan.config.grad_accum_steps == 1 and plan.model.min_micro_batch_size == 8
    assert sum("couples the samples" in note for note in plan.notes) == 1, plan.notes
    torch.manual_seed(0)
    (queries, keys), _ = spec.example_batch(8)
    model = spec.build_model()
    reference = spec.build_model()
    reference.load_state_dict(model.state_dict())
    in_batch_loss(reference(queries, keys), None).backward()
    applied = apply_config(model, plan.config, device="cpu", use_scaler=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.register_hook(lambda g, p=p: setattr(p, "seen", g.clone()))
    train_step(applied, (queries, keys), None, loss_fn=in_batch_loss, optimizer=optimizer)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.seen, theirs.grad)


def test_a_batch_that_couples_its_samples_is_not_spread_over_gpus():
    from autofit.errors import UserError

    with pytest.raises(UserError, match=r"2 GPUs would each take 4 of the 8 samples.*couples the samples.*--gpus 1"):
        make_plan(two_towers_spec(), PlanRequest(budget="1GB", batch_size=8, device="cuda", simulate=True, gpus=2))


def test_training_never_halves_a_coupled_micro_batch_after_running_out_of_memory(tmp_path):
    from autofit.errors import UserError
    from tests.helpers.training import TinyNet, make_plan as plan_for, run

    class OutOfMemoryAbove2(TinyNet):
        def forward(self, x):
            if x.shape[0] > 2:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a micro-batch of {x.shape[0]}")
            return super().forward(x)

    model = OutOfMemoryAbove2()
    plan = plan_for(model, micro_batch_size=4, checkpoint=())
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, min_micro_batch_size=4))
    with pytest.raises(UserError, match=r"out of memory at micro-batch 4 .*couples the samples.*at least 4"):
        run(model, plan, tmp_path / "run", max_steps=1)


def test_the_same_spec_and_split_is_stepped_once_in_a_process():
    """A refusal, its ranks and a --gpus plan of one spec ask the same question: the model is built and stepped once."""
    spec = two_towers_spec()
    built = []

    def build_model():
        built.append(1)
        return spec.build_model()

    counted = dataclasses.replace(spec, build_model=build_model)
    first = batch_coupling(counted, global_batch_size=8, smallest=1, fits_here=True)
    again = batch_coupling(counted, global_batch_size=8, smallest=1, fits_here=True)
    assert first == again and first is not None and len(built) == 1
