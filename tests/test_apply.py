"""apply_plan: one fixed order of strategies, helpers for your own loop, refusals with one line."""
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from torch import nn

from autofit import apply_plan
from autofit.errors import UserError
from autofit.plan_file import DeviceInfo
from autofit.spec import model_fingerprint
from tests.helpers.training import CLASSES, TinyNet, make_plan


def model_and_plan(**plan_fields):
    torch.manual_seed(0)
    model = TinyNet()
    return model, make_plan(model, **plan_fields)


def test_checkpointing_is_applied_by_name_and_keeps_the_state_dict():
    model, plan = model_and_plan(checkpoint=("blocks.0", "blocks.2"))
    keys = list(model.state_dict())
    applied = apply_plan(model, plan)
    assert applied.model is model and list(model.state_dict()) == keys
    flagged = [name for name, m in model.named_modules() if getattr(m, "_autofit_checkpointed", False)]
    assert flagged == ["blocks.0", "blocks.2"]
    assert model_fingerprint(model) == plan.model.fingerprint


def test_fp32_helpers_are_off_objects_and_bf16_autocasts():
    model, plan = model_and_plan()
    applied = apply_plan(model, plan)
    assert isinstance(applied.forward_context(), nullcontext) and not applied.scaler.is_enabled()
    model, plan = model_and_plan(precision="bf16")
    with apply_plan(model, plan).forward_context():
        assert model(torch.randn(2, 1, 4, 4)).dtype == torch.bfloat16
    model, plan = model_and_plan(precision="fp16")
    assert apply_plan(model, plan).scaler.is_enabled()


def test_own_loop_with_the_helpers_gives_the_whole_batch_gradient():
    """The module docstring's recipe: 3 + 3 + 2 weighted micro-batches, checkpointed, equal to one batch of 8."""
    model, plan = model_and_plan(micro_batch_size=3)
    reference = TinyNet()
    reference.load_state_dict(model.state_dict())
    applied = apply_plan(model, plan)
    inputs, targets = torch.randn(8, 1, 4, 4), torch.randint(0, CLASSES, (8,))

    sizes = []
    for micro_inputs, micro_targets, weight in applied.micro_batches(inputs, targets):
        sizes.append(len(micro_targets))
        with applied.forward_context():
            loss = nn.functional.cross_entropy(applied.model(micro_inputs.to(applied.device)), micro_targets) * weight
        applied.scaler.scale(loss).backward()
    nn.functional.cross_entropy(reference(inputs), targets).backward()

    assert sizes == [3, 3, 2]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_halving_the_micro_batch_keeps_the_global_batch():
    model, plan = model_and_plan(global_batch_size=8, micro_batch_size=8)
    applied = apply_plan(model, plan)
    steps = []
    while applied.micro_batch_size > 1:
        applied.halve_micro_batch()
        steps.append((applied.micro_batch_size, applied.grad_accum_steps, applied.split.config.global_batch_size))
    assert steps == [(4, 2, 8), (2, 4, 8), (1, 8, 8)]
    with pytest.raises(UserError, match="micro-batch of 1 sample"):
        applied.halve_micro_batch()


def test_a_plan_for_another_model_is_refused_with_one_line():
    _, plan = model_and_plan()
    with pytest.raises(UserError) as error:
        apply_plan(nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), plan)
    assert "another model" in str(error.value) and "\n" not in str(error.value)


def test_a_plan_without_fingerprint_is_accepted():
    model, plan = model_and_plan()
    plan.model.fingerprint = None
    assert apply_plan(model, plan).micro_batch_size == 3


def test_unknown_block_and_sharded_plans_are_refused():
    model, plan = model_and_plan(checkpoint=("blocks.9",))
    with pytest.raises(UserError, match="blocks.9 not found"):
        apply_plan(model, plan)
    model, plan = model_and_plan()
    plan = replace(plan, config=replace(plan.config, world_size=2, sharding="fsdp"))
    with pytest.raises(UserError, match="single device"):
        apply_plan(model, plan)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_a_cuda_plan_without_a_gpu_is_refused():
    model, plan = model_and_plan()
    plan = replace(plan, device=DeviceInfo(type="cuda"))
    with pytest.raises(UserError, match="no.*CUDA|CUDA device, but none"):
        apply_plan(model, plan)


@pytest.mark.gpu
def test_a_cuda_plan_sets_the_allocator_it_names():
    from autofit._torch_private import expandable_segments_in_use, set_cuda_allocator_settings

    model, plan = model_and_plan()
    plan = replace(plan, device=DeviceInfo(type="cuda", allocator_settings="expandable_segments:True"))
    try:
        applied = apply_plan(model, plan)
        assert expandable_segments_in_use(applied.device)
    finally:
        set_cuda_allocator_settings("expandable_segments:False")


def test_the_exported_name_is_this_function_speaking_python():
    """``autofit.apply_plan`` is this function, its errors naming keywords rather than flags (``autofit.keywords``)."""
    import autofit
    from autofit.apply import apply_plan as direct

    assert autofit.apply_plan.__wrapped__ is direct and autofit.apply_plan is autofit.apply_plan
