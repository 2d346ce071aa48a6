"""TrainingConfig: the one spelling of a configuration, what follows from it computed once, a plan that never changes."""
import dataclasses
import re

import pytest

from autofit.config import TrainingConfig, step_in_backward_refusal
from autofit.errors import UserError
from autofit.plan_file import Plan, plan_from_dict
from strategies import micro_batch_count
from tests.helpers import ROOT


@pytest.mark.parametrize("G,N,m", [(8, 1, 3), (8, 2, 3), (9, 2, 5), (64, 8, 1), (7, 7, 1)])
def test_the_accumulation_steps_follow_the_ranks_split(G, N, m):
    config = TrainingConfig(global_batch_size=G, micro_batch_size=m, world_size=N, sharding="ddp" if N > 1 else "none")
    assert config.grad_accum_steps == micro_batch_count(G, world_size=N, micro_batch_size=m)
    assert config.rank_batch_size == -(-G // N)
    share = config.rank_share()
    assert (share.world_size, share.sharding, share.global_batch_size) == (1, "none", config.rank_batch_size)
    assert share.grad_accum_steps == config.grad_accum_steps


def test_block_names_are_held_as_tuples_whatever_the_spelling():
    config = TrainingConfig(global_batch_size=4, micro_batch_size=4, checkpoint="a, b", selective_checkpoint=["c"], offload="none")
    assert (config.checkpoint, config.selective_checkpoint, config.offload) == (("a", "b"), ("c",), ())
    assert TrainingConfig(global_batch_size=4, micro_batch_size=4, checkpoint="all").checkpoint == ("all",)
    assert hash(config) == hash(dataclasses.replace(config))  # frozen and hashable: a key of its own


@pytest.mark.parametrize(("spec", "words"), [("", "offload='' names a block with no name"), ("a,,b", "with no name"), ("a,a", "twice")])
def test_empty_and_repeated_block_names_are_one_line(spec, words):
    with pytest.raises(UserError, match=words) as error:
        TrainingConfig(global_batch_size=4, micro_batch_size=4, offload=spec)
    assert "\n" not in str(error.value) and "'all' or 'none'" in str(error.value)


def test_a_configuration_is_frozen_and_a_smaller_micro_batch_is_a_new_one():
    config = TrainingConfig(global_batch_size=8, micro_batch_size=8, precision="bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.micro_batch_size = 4
    smaller = config.with_micro_batch(4)
    assert (config.micro_batch_size, smaller.micro_batch_size, smaller.grad_accum_steps, smaller.precision) == (8, 4, 2, "bf16")


@pytest.mark.parametrize(("choices", "words"), [
    (dict(micro_batch_size=4), "needs one micro-batch per optimizer step, but micro-batch 4 of batch 8 makes 2"),
    (dict(precision="fp16"), "cannot run with fp16"),
    (dict(world_size=2, sharding="ddp"), "runs on one process only"),
])
def test_the_step_in_backward_refuses_itself_by_the_one_rule(choices, words):
    fields = dict(global_batch_size=8, micro_batch_size=8) | choices
    with pytest.raises(UserError, match=words) as error:
        TrainingConfig(optimizer_in_backward=True, **fields)
    assert "\n" not in str(error.value)
    rule = dict(precision="fp32", world_size=1) | {k: v for k, v in fields.items() if k != "sharding"}
    assert words in step_in_backward_refusal(**rule)
    assert step_in_backward_refusal(precision="bf16", global_batch_size=8, micro_batch_size=8, world_size=1) is None


@pytest.mark.parametrize(("choices", "words"), [
    (dict(micro_batch_size=9), "larger than the batch size 8"),
    (dict(precision="fp8"), "precision 'fp8' is unknown"),
    (dict(optimizer_state="4bit"), "optimizer state '4bit' is unknown"),
    (dict(sharding="zero3"), "sharding 'zero3' is unknown"),
    (dict(optimizer_state="host", world_size=2, sharding="fsdp"), "host runs on one process only"),
])
def test_impossible_choices_are_one_line(choices, words):
    with pytest.raises(UserError, match=words) as error:
        TrainingConfig(**(dict(global_batch_size=8, micro_batch_size=8) | choices))
    assert "\n" not in str(error.value)


def test_a_plan_is_frozen_and_changes_by_becoming_a_new_plan():
    plan = Plan(budget_bytes=2**20, config=TrainingConfig(global_batch_size=8, micro_batch_size=8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget_bytes = 1
    later = plan.changed(plan.config.with_micro_batch(4), event={"event": "out_of_memory", "micro_batch_size": 4})
    assert plan.config.micro_batch_size == 8 and plan.history == []
    assert later.config.grad_accum_steps == 2 and later.history == [{"event": "out_of_memory", "micro_batch_size": 4}]
    assert plan_from_dict(later.to_dict()) == later


def test_the_accumulation_formula_and_the_step_in_backward_rule_are_written_once():
    """``micro_batch_count`` divides a batch into micro-batches and ``step_in_backward_refusal`` says when the step in
    backward runs: no module computes either again."""
    division = re.compile(r"ceil\([^)\n]*/\s*[\w.]*micro_batch_size|//\s*[\w.]*micro_batch_size\)")
    rule = re.compile(r"optimizer_in_backward\b[^\n]*(grad_accum_steps\s*>|precision\s*[!=]=\s*\"fp16\")")
    found = []
    for path in [*(ROOT / "autofit").rglob("*.py"), *(ROOT / "strategies").rglob("*.py")]:
        for line in path.read_text().splitlines():
            if division.search(line) or rule.search(line):
                found.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert found == ["strategies/batch_split.py: return max(1, -(-largest_share // micro_batch_size))"]


def test_closed_choices_are_literal_types_the_checks_and_the_cli_share():
    """precision, optimizer state and sharding are ``Literal`` types: their values are the ones each strategy
    accepts, and the flags' help lists them from the same type (a value added there shows up everywhere)."""
    from typing import get_args, get_type_hints

    from autofit.commands.common import one_of
    from autofit.config import OptimizerStateChoice, PrecisionChoice, ShardingChoice
    from autofit.planning.request import PlanRequest
    from strategies.optimizer_state import OPTIMIZER_STATES
    from strategies.precision import PRECISIONS
    from strategies.sharding import SHARDINGS

    hints = get_type_hints(TrainingConfig)
    assert (hints["precision"], hints["optimizer_state"], hints["sharding"]) == (PrecisionChoice, OptimizerStateChoice, ShardingChoice)
    assert (get_args(PrecisionChoice), get_args(OptimizerStateChoice), get_args(ShardingChoice)) == (PRECISIONS, OPTIMIZER_STATES, SHARDINGS)
    assert get_args(get_type_hints(PlanRequest)["device"]) == ("cpu", "cuda")
    assert one_of(PrecisionChoice) == "fp32, bf16, fp16, bf16-master or bf16-pure"
    with pytest.raises(UserError, match="choose one of fp32, bf16, fp16, bf16-master, bf16-pure"):
        TrainingConfig(global_batch_size=8, micro_batch_size=8, precision="fp8")
