"""AutofitCallback: Lightning with a plan trains as plain Lightning does, inside the plan's budget."""
import pytest
import torch

pytest.importorskip("lightning")

import lightning  # noqa: E402

from autofit.apply import checkpointed_blocks  # noqa: E402
from autofit.config import TrainingConfig  # noqa: E402
from autofit.errors import UserError  # noqa: E402
from autofit.integrations.lightning import AutofitCallback, trainer_settings  # noqa: E402
from autofit.plan_file import Plan  # noqa: E402
from tests.helpers.integrations import LIGHTNING_QUIET, classifier, image_loader  # noqa: E402

LOSSLESS = TrainingConfig(global_batch_size=4, micro_batch_size=2, checkpoint=("all",), optimizer_state="host")
"""Two micro-batches of 2, both convolution blocks recomputed, the optimizer's state on the host: the plain step's
arithmetic."""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return tmp_path_factory.mktemp("images") / "train"


def test_a_lossless_plan_trains_plain_lightnings_losses(images):
    plain = classifier()
    lightning.Trainer(max_steps=2, accumulate_grad_batches=2, **LIGHTNING_QUIET).fit(plain, image_loader(images, batch_size=2))
    planned = classifier()
    callback = AutofitCallback(Plan(budget_bytes=2**30, config=LOSSLESS), module="model")
    trainer = lightning.Trainer(max_steps=2, callbacks=[callback], **LIGHTNING_QUIET)
    trainer.fit(planned, image_loader(images, batch_size=2))
    assert trainer.accumulate_grad_batches == 2 and checkpointed_blocks(planned.model) == ["0.0", "0.1"]
    assert type(trainer.optimizers[0]).__name__ == "HostOptimizer"
    assert len(planned.losses) == 4 and planned.losses == pytest.approx(plain.losses, abs=1e-5)
    for (name, a), b in zip(plain.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)


def test_a_lightning_step_peaks_within_the_plans_budget(images):
    import autofit
    from autofit.measure.meters import TrackedMeter
    from tests.helpers.integrations import small_cnn

    # The plan's budget: what autofit's own loop measured for this configuration, with a plan's 5% margin.
    spec = autofit.spec_from_model(small_cnn(), lambda n: (torch.rand(n, 3, 8, 8), torch.randint(0, 2, (n,))))
    probed = autofit.probe(spec, micro_batch_size=2, global_batch_size=4, checkpoint="all", optimizer_state="host", steps=2)
    plan = Plan(budget_bytes=int(probed.peak_bytes * 1.05), config=LOSSLESS)
    module, meter = classifier(), TrackedMeter()
    trainer = lightning.Trainer(max_steps=2, callbacks=[AutofitCallback(plan, module="model")], **LIGHTNING_QUIET)
    # The optimizer is made inside fit: its state is counted as it is allocated (the meter's own optimizer has none).
    with meter.environment(), meter.measure(module, torch.optim.SGD(module.parameters())) as measured:
        trainer.fit(module, image_loader(images, batch_size=2))
    assert 0 < measured.peak_bytes <= plan.budget_bytes, (measured.peak_bytes, probed.peak_bytes)


def test_settings_that_contradict_the_plan_are_one_line(images):
    plan = Plan(budget_bytes=2**30, config=LOSSLESS)
    assert trainer_settings(plan) == {"precision": "32-true", "accumulate_grad_batches": 2}
    for settings, words in [
        ({"accumulate_grad_batches": 4}, "^Trainer accumulate_grad_batches=4 contradicts the plan's 2"),
        ({"precision": "bf16-mixed"}, "^Trainer precision='bf16-mixed' contradicts the plan's precision fp32"),
    ]:
        trainer = lightning.Trainer(max_steps=1, callbacks=[AutofitCallback(plan)], **LIGHTNING_QUIET, **settings)
        with pytest.raises(UserError, match=words):
            trainer.fit(classifier(), image_loader(images, batch_size=2))
    trainer = lightning.Trainer(max_steps=1, callbacks=[AutofitCallback(plan)], **LIGHTNING_QUIET)
    with pytest.raises(UserError, match=r"^the training DataLoader's batch_size 4 is not the plan's micro-batch 2; make it"):
        trainer.fit(classifier(), image_loader(images, batch_size=4))


def test_a_plan_lightning_cannot_host_is_refused_when_made():
    config = TrainingConfig(global_batch_size=4, micro_batch_size=2, precision="bf16-master")
    with pytest.raises(UserError, match="^precision bf16-master keeps bf16 weights that Lightning's precision plugins do not know"):
        AutofitCallback(Plan(budget_bytes=2**30, config=config))


def test_the_step_in_backward_trains_plain_lightnings_steps(images):
    plain = classifier()
    lightning.Trainer(max_steps=2, **LIGHTNING_QUIET).fit(plain, image_loader(images, batch_size=2))
    planned = classifier()
    plan = Plan(budget_bytes=2**30, config=TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_in_backward=True))
    trainer = lightning.Trainer(max_steps=2, callbacks=[AutofitCallback(plan, module="model")], **LIGHTNING_QUIET)
    trainer.fit(planned, image_loader(images, batch_size=2))
    # Lightning's step runs the closure (forward and backward, which steps each parameter) inside optimizer.step.
    assert type(trainer.optimizers[0]).__name__ == "OptimizerInBackward"
    assert planned.losses == pytest.approx(plain.losses, abs=1e-6)
    for a, b in zip(plain.parameters(), planned.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
