"""AutofitTrainer: transformers' Trainer with a plan trains as the plain Trainer does, inside the plan's budget."""
import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from autofit.apply import checkpointed_blocks  # noqa: E402
from autofit.config import TrainingConfig  # noqa: E402
from autofit.errors import UserError  # noqa: E402
from autofit.integrations.transformers import AutofitTrainer, trainer_arguments  # noqa: E402
from autofit.plan_file import DeviceInfo, ModelInfo, Plan  # noqa: E402
from tests.helpers.integrations import TRAINER_QUIET, logged_losses, padded_text  # noqa: E402

LOSSLESS = TrainingConfig(global_batch_size=4, micro_batch_size=2, checkpoint=("all",), loss_chunks=2, optimizer_state="host")
"""Two micro-batches of 2, every decoder layer recomputed, the loss over two chunks, the optimizer's state on the host:
the same arithmetic as the plain step."""


@pytest.fixture(scope="module")
def text(tiny_lm):
    return padded_text(tiny_lm)


def _args(tmp_path, **values) -> TrainingArguments:
    values = {"max_steps": 2, "logging_steps": 1, "seed": 0, "learning_rate": 1e-2, "train_sampling_strategy": "sequential", **TRAINER_QUIET, **values}
    return TrainingArguments(tmp_path, **values)


def test_a_lossless_plan_trains_the_plain_trainers_losses(tiny_lm, text, tmp_path):
    plain = Trainer(
        model=LlamaForCausalLM.from_pretrained(tiny_lm), args=_args(tmp_path / "plain", per_device_train_batch_size=2, gradient_accumulation_steps=2),
        train_dataset=text,
    )
    plain.train()
    planned = AutofitTrainer(
        model=LlamaForCausalLM.from_pretrained(tiny_lm), args=_args(tmp_path / "planned"), train_dataset=text,
        plan=Plan(budget_bytes=2**30, config=LOSSLESS),
    )
    assert (planned.args.per_device_train_batch_size, planned.args.gradient_accumulation_steps) == (2, 2)
    assert checkpointed_blocks(planned.model) == ["model.layers.0", "model.layers.1"]
    planned.train()
    expected, got = logged_losses(plain), logged_losses(planned)
    assert len(got) == 2 and got == pytest.approx(expected, abs=1e-5)
    for (name, a), b in zip(plain.model.named_parameters(), planned.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)


def test_a_trainer_step_peaks_within_the_plans_budget(tiny_lm, text, tmp_path):
    import autofit
    from autofit.measure.meters import TrackedMeter

    # The plan's budget: what autofit's own loop measured for this configuration (as a plan's measured peak),
    # with the safety margin of 5% a plan keeps.
    spec = autofit.load_spec(f"hf:{tiny_lm}", task="causal-lm", seq_len=16)
    probed = autofit.probe(
        spec, micro_batch_size=2, global_batch_size=4, checkpoint="all", loss_chunks=2, optimizer_state="host", steps=2,
    )
    plan = Plan(budget_bytes=int(probed.peak_bytes * 1.05), config=LOSSLESS)
    trainer = AutofitTrainer(model=LlamaForCausalLM.from_pretrained(tiny_lm), args=_args(tmp_path), train_dataset=text, plan=plan)
    trainer.create_optimizer()
    meter = TrackedMeter()
    with meter.environment(), meter.measure(trainer.model, trainer.optimizer) as measured:
        trainer.train()
    assert 0 < measured.peak_bytes <= plan.budget_bytes, (measured.peak_bytes, probed.peak_bytes)


def test_arguments_that_contradict_the_plan_are_one_line(tiny_lm, tmp_path):
    plan = Plan(budget_bytes=2**30, config=LOSSLESS)
    line = r"^TrainingArguments per_device_train_batch_size=8 x gradient_accumulation_steps=4 is a global batch of 32, the plan's is 4; leave"
    with pytest.raises(UserError, match=line) as error:
        AutofitTrainer(model=torch.nn.Linear(2, 2), args=_args(tmp_path, gradient_accumulation_steps=4), plan=plan)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="^TrainingArguments bf16=True contradicts the plan's bf16=False; leave bf16 out"):
        AutofitTrainer(model=torch.nn.Linear(2, 2), args=_args(tmp_path, bf16=True), plan=plan)
    on_a_gpu = Plan(budget_bytes=2**30, device=DeviceInfo(type="cuda"), config=LOSSLESS)
    with pytest.raises(UserError, match="^the plan is for cuda and the Trainer trains on cpu; train where cuda is, or re-plan with --device cpu"):
        AutofitTrainer(model=torch.nn.Linear(2, 2), args=_args(tmp_path), plan=on_a_gpu)
    # The same global batch, split otherwise (the run `autofit plan --from-trainer-args` planned): the plan's split.
    plan = Plan(budget_bytes=2**30, config=TrainingConfig(global_batch_size=4, micro_batch_size=2))
    trainer = AutofitTrainer(model=torch.nn.Linear(2, 2), args=_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=4), plan=plan)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 2)
    # Values the plan sets are left at their defaults, or agree with it.
    assert trainer_arguments(plan) == {
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "bf16": False, "fp16": False,
        "gradient_checkpointing": False, "torch_compile": False,
    }


@pytest.mark.parametrize(("config", "words"), [
    (TrainingConfig(global_batch_size=8, micro_batch_size=2, world_size=2, sharding="fsdp"), r"is for 2 \(fsdp\)"),
    (TrainingConfig(global_batch_size=5, micro_batch_size=2), "micro-batch 2 does not divide its global batch 5"),
])
def test_a_plan_the_trainer_cannot_host_is_refused_before_training(config, words, tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match=words):
        AutofitTrainer(model=model, args=_args(tmp_path), plan=Plan(budget_bytes=2**30, config=config))


def test_a_lora_plan_trains_only_the_adapters(tiny_lm, text, tmp_path):
    pytest.importorskip("peft")
    from autofit.adapters import lora_model, parse_lora

    plan = Plan(budget_bytes=2**30, model=ModelInfo(lora="r=4,alpha=8,targets=q_proj,v_proj"), config=LOSSLESS)
    with pytest.raises(UserError, match="the plan trains LoRA adapters"):
        AutofitTrainer(model=LlamaForCausalLM.from_pretrained(tiny_lm), args=_args(tmp_path), plan=plan)
    model = lora_model(LlamaForCausalLM.from_pretrained(tiny_lm), parse_lora(plan.model.lora))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = AutofitTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=text, plan=plan)
    trainer.train()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)


def test_the_step_in_backward_trains_the_plain_trainers_steps(tiny_lm, text, tmp_path):
    plain = Trainer(
        model=LlamaForCausalLM.from_pretrained(tiny_lm), train_dataset=text,
        args=_args(tmp_path / "plain", per_device_train_batch_size=2, max_grad_norm=0.0),
    )
    plain.train()
    # max_grad_norm left at the Trainer's default: the plan sets 0, as the step in backward cannot clip.
    plan = Plan(budget_bytes=2**30, config=TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_in_backward=True))
    planned = AutofitTrainer(model=LlamaForCausalLM.from_pretrained(tiny_lm), args=_args(tmp_path / "planned"), train_dataset=text, plan=plan)
    planned.train()
    assert planned.args.max_grad_norm == 0.0 and type(planned.optimizer.optimizer).__name__ == "OptimizerInBackward"
    assert logged_losses(planned) == pytest.approx(logged_losses(plain), abs=1e-6)
    for a, b in zip(plain.model.parameters(), planned.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
