"""Sequence length as a modelled dimension: records at a few lengths, every term fitted through them; the longest
sequence in `capacity --longest` and `plan --seq-len max`, and the lossy columns apart from the lossless ones."""
import json
import time
from dataclasses import dataclass

import pytest

from autofit.planning.lengths import SEQ_LEN_STEP, FittedPrecisions, LengthsDiffer, fit_at, longest_sequence, traced_lengths
from tests.helpers.planning import probed_fits_card

CARD = "1400MiB"
"""Just above the estimated GPU's fixed headroom (1.25 GiB): the tiny model's longest sequence at a batch of 1 lies
between its traced lengths (32, 1448 and 65536 tokens)."""


@dataclass
class Terms:
    peak: int
    seconds: float
    blocks: list[str]
    flags: list[bool]


def test_every_term_is_fitted_through_the_traced_lengths_and_other_shapes_are_refused():
    def at(t: int) -> Terms:  # a quadratic byte term, a linear time, and what does not change with the length
        return Terms(peak=1000 + 24 * t + 3 * t * t, seconds=0.5 + 0.01 * t, blocks=["a", "b"], flags=[True, False])

    lengths = [32, 1448, 65536]
    fitted = fit_at([at(t) for t in lengths], lengths, 29072)
    assert fitted == at(29072)
    assert fit_at([at(32), at(64)], [32, 64], 48).seconds == pytest.approx(at(48).seconds)  # linear through two
    with pytest.raises(LengthsDiffer):
        fit_at([at(32), Terms(peak=1, seconds=1.0, blocks=["a"], flags=[True])], [32, 64], 48)
    assert traced_lengths(32, context_length=65536) == [32, 1448, 65536]
    assert traced_lengths(128, context_length=128) == [32, 64, 128]
    assert longest_sequence(lambda t: t <= 100, context_length=65536) == 96
    assert longest_sequence(lambda t: True, context_length=4100) == 4096  # the context length bounds it
    assert longest_sequence(lambda t: False, context_length=128) == 0


def test_a_records_precisions_are_fitted_when_read_and_a_record_two_share_is_fitted_once():
    """``capacity --longest`` asks most lengths of one precision only; fp16 holds bf16's traces (the same objects)."""
    @dataclass
    class Costs:
        memory: Terms

    def at(t: int) -> dict:
        shared = Terms(peak=3 * t * t, seconds=0.01 * t, blocks=["a"], flags=[True])
        return {"fp32": Costs(memory=Terms(peak=24 * t, seconds=0.5, blocks=["a"], flags=[False])), "bf16": Costs(memory=shared),
                "fp16": Costs(memory=shared)}

    lengths = [32, 1448, 65536]
    fitted = FittedPrecisions([at(t) for t in lengths], lengths, 29072)
    assert list(fitted) == ["fp32", "bf16", "fp16"] and fitted["bf16"] == at(29072)["bf16"]
    assert fitted["fp16"].memory is fitted["bf16"].memory
    with pytest.raises(LengthsDiffer):
        FittedPrecisions([at(32), {"fp32": at(64)["fp32"]}], [32, 64], 48)


def test_the_longest_sequence_fits_when_probed_and_one_step_more_is_refused_from_its_own_traces(run_cli, tiny_lm_long, tmp_path):
    """`capacity --longest` with the lossy choices allowed: the lossless longest sequence, fitted between traced
    lengths, is probed in its configuration and fits the card; a record traced at one step more holds no configuration
    there; the lossy answers stand in columns of their own."""
    from autofit.commands.common import load_model_spec
    from autofit.planning.capacity import batch_fits, lossless, traced_record, usable_for
    from autofit.planning.lever_timings import Levers
    from autofit.planning.request import PlanRequest

    model = f"hf:{tiny_lm_long}"
    code, out, err = run_cli(
        "capacity", model, "--task", "causal-lm", "--seq-len", "32", "--batch-size", "1", "--on", CARD, "--precisions", "fp32",
        "--host-memory", "64KiB", "--longest", "--allow-lossy-optimizer", "--json", "-q", "--plot", tmp_path / "capacity.png",
    )
    assert code == 0, err
    answer = json.loads(out)
    assert (tmp_path / "capacity.png").read_bytes().startswith(b"\x89PNG")
    assert answer["traced_seq_lens"] == [32, 1448, 65536] and answer["lossy"] == ["8-bit optimizer state"]
    row, = answer["cards"]
    longest, config = row["longest_seq_len"], row["longest_seq_len_config"]
    assert 1448 < longest < 65536 and longest % SEQ_LEN_STEP == 0 and row["longest_seq_len_nearest_traced"] == 1448
    assert config["optimizer_state"] != "8bit"  # lossless: the lossy choices stay in their own columns
    lossy = row["lossy"]
    assert lossy["fits"] and lossy["longest_seq_len"] >= longest and lossy["largest_one_step"] >= row["largest_batch_one_step"]

    spec = load_model_spec(model, input_shape="3x224x224", num_classes=None, task="causal-lm", seq_len=longest)
    assert probed_fits_card(spec, config, micro_batch_size=config["micro_batch_size"], memory_bytes=row["memory_bytes"])
    request = PlanRequest(
        budget=CARD, batch_size=1, device="cuda", simulate=True, device_memory=CARD, precisions=("fp32",), host_memory="64KiB",
    )
    further = load_model_spec(model, input_shape="3x224x224", num_classes=None, task="causal-lm", seq_len=longest + SEQ_LEN_STEP)
    record, _ = traced_record(further, request, levers=Levers())
    usable = usable_for(record.headroom, record.resident_bytes, row["memory_bytes"])
    assert not batch_fits(record.model, usable_bytes=usable, allowed=lossless(record.allowed), smallest=record.smallest)


def test_plan_seq_len_max_on_the_cpu_plans_the_longest_sequence_within_the_budget(run_cli, tiny_lm, tmp_path):
    """Traced at 32, 64 and 128 tokens (the context), answered, traced again at the answer: the plan at it is verified
    within the budget, and the budget binds below the context length."""
    common = ["--task", "causal-lm", "--batch-size", "1", "--budget", "560KiB", "--simulate", "--precisions", "fp32", "--json", "-q"]
    code, out, err = run_cli("plan", f"hf:{tiny_lm}", "--seq-len", "max", *common, "-o", tmp_path / "plan.json")
    assert code == 0, err
    plan = json.loads(out)
    longest = plan["model"]["seq_len"]
    assert 32 < longest < 128 and longest % SEQ_LEN_STEP == 0
    assert any(f"--seq-len max: {longest} tokens" in note and f"{longest + SEQ_LEN_STEP} does not fit" in note for note in plan["notes"])
    assert plan["measured"]["peak_bytes"] + sum(plan["headroom"].values()) <= plan["budget_bytes"]  # verified


def test_seq_len_max_needs_a_batch_and_a_text_model_each_refusal_one_line(run_cli, tmp_path):
    from tests.helpers.planning import CNN_MODEL_FILE

    model = tmp_path / "model.py"
    model.write_text(CNN_MODEL_FILE)
    for asked, expected in (
        (["--batch-size", "max", "--seq-len", "max"], "--batch-size N (not max)"),
        (["--batch-size", "4", "--seq-len", "long"], "'long'"),
    ):
        code, out, err = run_cli("plan", model, "--budget", "2MiB", *asked)
        assert code == 2 and expected in err and "Traceback" not in err
    code, out, err = run_cli("capacity", model, "--batch-size", "4", "--on", CARD, "--longest")
    assert code == 2 and "takes no sequence" in err and "Traceback" not in err


def test_a_length_process_that_hangs_dies_or_fails_is_stopped_and_its_length_left_to_this_process(monkeypatch):
    """No wait without a deadline: each other length's process answers, or is stopped with one line and its length
    traced here (``record`` None)."""
    from autofit.planning.length_workers import LengthDeadline, LengthWorkers
    from autofit.progress import as_progress
    from tests.helpers import length_targets

    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", "2")  # the suite's 0: no processes
    lines = []
    workers = LengthWorkers(
        None, [8, 16, 24, 32], None, None, target=length_targets.by_length, deadline=LengthDeadline(floor_s=6.0, times=1.0),
        progress=as_progress(lines.append),
    )
    try:
        assert workers.lengths == [8, 16, 24, 32]
        assert workers.record(8, own_s=0.0) == "record at 8"
        started = time.monotonic()
        assert workers.record(16, own_s=0.0) is None and time.monotonic() - started < 10
        assert workers.record(24, own_s=0.0) is None and workers.record(32, own_s=0.0) is None
        assert workers.record(40, own_s=0.0) is None  # none was started for it
    finally:
        workers.close()
    said = [line for line in lines if "traced here instead" in line]
    assert len(said) == 3 and "passed its deadline of 6 s" in said[0] and "died (exit code 3)" in said[1], said
    assert "failed (ValueError: no such length)" in said[2]
