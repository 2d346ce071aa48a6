"""`autofit capacity`: one simulated trace set answers every card, and its answers hold when planned and probed."""
import json

import pytest

from autofit.errors import UserError
from autofit.planning.capacity import parse_cards
from tests.helpers.planning import probed_fits_card

CARD = "1400MiB"
"""A card just above the estimated GPU's fixed headroom (context and allocator reserve, 1.25 GiB): the tiny model's
largest batch in one step is then a few hundred samples, quick to trace."""

MODEL = ["--task", "causal-lm", "--seq-len", "32"]
HOST = "64KiB"
"""Less host memory than the tiny model's AdamW state: optimizer state on the host is left out, as the planner would."""


def test_card_names_come_from_the_table_with_their_memory():
    a100, rtx, bare = parse_cards("A100 40GB, rtx4090, 24GiB")
    assert (a100.kind, a100.memory_bytes) == ("A100", 40 * 2**30)
    assert (rtx.kind, rtx.memory_bytes) == ("RTX 4090", 24 * 2**30)
    assert (bare.kind, bare.memory_bytes) == (None, 24 * 2**30)
    with pytest.raises(UserError, match="RTX 4090"):  # the line lists the table's cards
        parse_cards("RTX 9999")


def test_an_unknown_card_is_one_line(run_cli, tiny_lm):
    code, out, err = run_cli("capacity", f"hf:{tiny_lm}", *MODEL, "--batch-size", "4", "--on", "GTX 480")
    assert code == 2 and "GTX 480" in err and "H100" in err and "Traceback" not in err


def test_the_largest_batch_in_one_step_fits_when_probed_and_one_more_is_refused_from_its_own_traces(run_cli, tiny_lm, tmp_path):
    """The table's largest batch in one step, from traces at batch 4: its configuration probed exactly fits the card,
    and a record traced at one sample more (no extrapolation) holds that one in no single step either."""
    from autofit.commands.common import load_model_spec
    from autofit.planning.capacity import capacity_record, largest_one_step, one_step, usable_for
    from autofit.planning.context import plan_context
    from autofit.planning.lever_timings import Levers
    from autofit.planning.request import PlanRequest

    code, out, err = run_cli(
        "capacity", f"hf:{tiny_lm}", *MODEL, "--batch-size", "4", "--on", CARD, "--precisions", "fp32", "--host-memory", HOST,
        "--json", "-q", "--plot", tmp_path / "capacity.png",
    )
    assert code == 0, err
    answer = json.loads(out)
    assert (tmp_path / "capacity.png").read_bytes().startswith(b"\x89PNG")
    assert "more than the host's 64.00 KiB" in answer["left_out"]["host state"]  # the planner would refuse it there
    row, = answer["cards"]
    assert row["fits"] and answer["least_budget_bytes"] <= row["memory_bytes"]
    largest, config = row["largest_batch_one_step"], row["largest_batch_config"]
    assert 8 < largest < 10_000 and config["micro_batch_size"] == largest
    spec = load_model_spec(f"hf:{tiny_lm}", input_shape="3x224x224", num_classes=None, task="causal-lm", seq_len=32)
    assert probed_fits_card(spec, config, micro_batch_size=largest, memory_bytes=row["memory_bytes"])
    request = PlanRequest(
        budget=CARD, batch_size=largest + 1, device="cuda", simulate=True, device_memory=CARD, precisions=("fp32",), host_memory=HOST,
        cache=False,
    )
    context = plan_context(spec, request)
    try:
        record = capacity_record(context, levers=Levers())
    finally:
        context.trace_pool.close()
    usable = usable_for(record.headroom, record.resident_bytes, row["memory_bytes"])
    assert one_step(record.model, batch_size=largest + 1, usable_bytes=usable, allowed=record.allowed) is None
    # From traces at 4 samples the line reaches the largest batch within a few samples of the one traced there.
    again, _ = largest_one_step(record.model, usable_bytes=usable, allowed=record.allowed)
    assert 0.99 * largest <= again <= largest


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_batch_of_one_still_has_a_largest_batch(run_cli, tiny_lm):
    """Traces at a batch of 1 alone draw no line in the batch: the table said 1048576 (the search's cap) there."""
    code, out, err = run_cli(
        "capacity", f"hf:{tiny_lm}", *MODEL, "--batch-size", "1", "--on", CARD, "--precisions", "fp32", "--host-memory", HOST, "--json", "-q",
    )
    assert code == 0, err
    row, = json.loads(out)["cards"]
    assert row["fits"] and row["global_batch_size"] == 1 and 8 < row["largest_batch_one_step"] < 10_000


def test_plan_batch_size_max_plans_the_largest_batch_and_one_more_is_refused(run_cli, tmp_path):
    """On the CPU the global batch waits in the budget's memory: the largest batch is bounded, planned and verified."""
    from tests.helpers.planning import CNN_MODEL_FILE

    model = tmp_path / "model.py"
    model.write_text(CNN_MODEL_FILE)
    common = ["--budget", "2MiB", "--simulate", "--precisions", "fp32", "--json", "-q", "-o", tmp_path / "plan.json"]
    code, out, err = run_cli("plan", model, "--batch-size", "max", *common)
    assert code == 0, err
    plan = json.loads(out)
    largest = plan["global_batch_size"]
    assert 8 < largest < 100_000 and any("--batch-size max" in note for note in plan["notes"])
    assert plan["measured"]["peak_bytes"] + sum(plan["headroom"].values()) <= plan["budget_bytes"]  # verified
    code, out, err = run_cli("plan", model, "--batch-size", str(largest + 1), *common)
    assert code == 2 and "below the floor" in err and f"batch of {largest + 1}" in err


def test_a_batch_size_that_is_no_number_is_one_line(run_cli, tmp_path):
    code, out, err = run_cli("plan", tmp_path / "model.py", "--budget", "2MiB", "--batch-size", "many")
    assert code == 2 and "'many'" in err and "max" in err
    code, out, err = run_cli("plan", tmp_path / "model.py", "--budget", "2MiB", "--batch-size", "max", "--gpus", "2")
    assert code == 2 and "one process" in err and "--gpus 2" in err
