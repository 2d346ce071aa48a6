"""The plan's alternatives and the summary: fitting is what was measured where it was measured; rejections are shown."""
from types import SimpleNamespace

import pytest

from autofit.config import TrainingConfig
from autofit.planning.summary import summary_lines
from autofit.plan_file import Measured, ModelInfo, Plan, Predicted
from autofit.planning.search.space import Evaluation
from autofit.planning.report import PlanReport, alternatives_table
from autofit.planning.records import Candidate, Measurement, Verified, VerifiedPoint

CHOSEN = TrainingConfig(global_batch_size=8, precision="bf16", micro_batch_size=4, checkpoint=("b0",))


def point(precision: str, micro_batch_size: int, **choices) -> TrainingConfig:
    """A configuration of the global batch of 8 these alternatives are for."""
    return TrainingConfig(global_batch_size=8, precision=precision, micro_batch_size=micro_batch_size, **choices)


def alternatives() -> list[dict]:
    """Five points on the front: measured to fit, rejected, predicted not to fit, chosen, and not measured."""
    evaluations = [
        Evaluation(config=point("bf16", 2), plain_peak_bytes=90, plain_samples_per_s=5.0),
        Evaluation(config=point("fp32", 2), plain_peak_bytes=100, plain_samples_per_s=10.0),
        Evaluation(
            config=CHOSEN, fits=True, peak_bytes=150, samples_per_s=15.0, plain_peak_bytes=500, plain_samples_per_s=16.0,
        ),
        Evaluation(config=point("fp32", 4), plain_peak_bytes=200, plain_samples_per_s=20.0),
        Evaluation(config=point("fp32", 8), plain_peak_bytes=400, plain_samples_per_s=30.0),
    ]
    verified = {
        "fp32:2:": VerifiedPoint(measured_peak_bytes=110, measured_samples_per_s=9.0, fits=True),
        "fp32:4:": VerifiedPoint(measured_peak_bytes=260, fits=False, rejected="measured peak 260 B does not fit"),
    }
    chosen = Verified(
        candidate=Candidate(config=CHOSEN, predicted_peak_bytes=150, predicted_samples_per_s=15.0),
        measurement=Measurement(peak_bytes=140, samples_per_s=14.0, meter="cpu"),
    )
    return alternatives_table(
        SimpleNamespace(global_batch_size=8), SimpleNamespace(memory_scale=1.0), evaluations, chosen=chosen, usable_bytes=250, verified=verified,
    )


def by_key(entries: list[dict]) -> dict[str, dict]:
    return {point(a["precision"], a["micro_batch_size"], checkpoint=a["checkpoint"]).key(): a for a in entries}


def test_fits_is_measured_where_measured_and_predicted_elsewhere():
    entries = by_key(alternatives())
    measured, rejected, too_big = entries["fp32:2:"], entries["fp32:4:"], entries["fp32:8:"]
    assert measured["fits_budget"] and measured["measured_peak_bytes"] == 110
    # predicted to fit (200 <= 250), measured not to: it does not fit, and says why
    assert not rejected["fits_budget"] and rejected["rejected"] == "measured peak 260 B does not fit"
    assert not too_big["fits_budget"] and "measured_peak_bytes" not in too_big
    predicted = entries["bf16:2:"]
    assert predicted["fits_budget"] and "measured_peak_bytes" not in predicted and "rejected" not in predicted


def test_the_chosen_alternative_carries_its_measured_peak():
    chosen = by_key(alternatives())[CHOSEN.key()]
    assert chosen["chosen"] and chosen["fits_budget"]
    assert chosen["measured_peak_bytes"] == 140 and chosen["measured_samples_per_s"] == 14.0


def test_the_summary_marks_how_each_alternative_fits_and_lists_the_rejections():
    plan = Plan(
        model=ModelInfo(source="model.py"), budget_bytes=300,
        config=TrainingConfig(global_batch_size=8, micro_batch_size=4, precision="bf16", checkpoint=["b0"]),
        predicted=Predicted(peak_bytes=150, samples_per_s=15.0),
        measured=Measured(peak_bytes=140, samples_per_s=14.0, meter="cpu"), headroom={"safety_margin": 6}, alternatives=alternatives(),
    )
    report = PlanReport(plan=plan, rejected=[{"config": "fp32:4:", "why": "measured peak 260 B does not fit"}])
    lines = summary_lines(report)
    rows = {key: next(line for line in lines if text in line) for key, text in [
        ("measured", " 10  fp32"), ("rejected", " 20  fp32"), ("too big", " 30  fp32"), ("predicted", " 5  bf16"), ("chosen", " 15  bf16"),
    ]}
    assert rows["measured"].split()[0] != "!" and " measured " in rows["measured"] and "110 B" in rows["measured"]
    assert rows["rejected"].lstrip().startswith("!") and " rejected " in rows["rejected"] and "260 B" in rows["rejected"]
    assert rows["too big"].lstrip().startswith("!") and "no (predicted)" in rows["too big"]
    assert " predicted " in rows["predicted"] and not rows["predicted"].lstrip().startswith("!")
    assert rows["chosen"].lstrip().startswith("*") and "140 B" in rows["chosen"]
    assert any("fp32, micro-batch 4, checkpoint none: measured peak 260 B does not fit" in line for line in lines)


def test_a_simulated_plan_lists_its_chosen_measured_peak():
    """Simulating, the chosen configuration's peak is the simulated meter's: in the alternatives too, as measured."""
    from autofit.planning.planner import make_plan
    from autofit.planning.request import PlanRequest
    from tests.helpers.planning import uneven_spec

    plan = make_plan(uneven_spec(), PlanRequest(budget="3MB", batch_size=16, simulate=True, precisions=["fp32"]))
    chosen = [a for a in plan.alternatives if a["chosen"]]
    assert len(chosen) == 1 and chosen[0]["measured_peak_bytes"] == plan.measured.peak_bytes and chosen[0]["fits_budget"]


def test_speeds_keep_three_significant_digits_and_a_language_model_says_tokens():
    from autofit.units import format_rate

    assert [format_rate(x) for x in (0.01234, 1.1, 8.4167, 102.5, 12345.6)] == ["0.0123", "1.1", "8.42", "102", "12346"]
    plan = Plan(
        model=ModelInfo(source="hf:llama", task="causal-lm", seq_len=2048), budget_bytes=300,
        config=TrainingConfig(global_batch_size=8, micro_batch_size=4), predicted=Predicted(peak_bytes=150, samples_per_s=0.0421),
        measured=Measured(peak_bytes=140, meter="simulated"), alternatives=alternatives(),
    )
    speed = next(line for line in summary_lines(PlanReport(plan=plan)) if line.startswith("  speed"))
    assert speed == "  speed       not measured (simulated), 0.0421 predicted (86.2 tokens/s at 2048 tokens a sample)"


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_the_summary_says_how_much_memory_planning_held(run_cli, tmp_path):
    from tests.helpers import EXAMPLES

    code, out, err = run_cli("plan", EXAMPLES / "digits_cnn.py", "--budget", "64MB", "--batch-size", "8", "--precisions", "fp32",
                             "--out", tmp_path / "plan.json")
    assert code == 0, err
    line = next(line for line in out.splitlines() if "planning held at most" in line)
    assert "of this machine's memory (the process's peak resident set)" in line


def test_the_summary_names_the_allocator_setting_the_reserve_is_for():
    from autofit.plan_file import DeviceInfo

    plan = Plan(
        device=DeviceInfo(type="cuda", name="simulated cuda", total_bytes=2**34, allocator_settings="expandable_segments:True"),
        budget_bytes=2**33, budget_kind="cuda-process", estimated=True, config=TrainingConfig(global_batch_size=8, micro_batch_size=4),
        predicted=Predicted(peak_bytes=2**30, samples_per_s=1.0), measured=Measured(peak_bytes=2**30, meter="simulated"),
        headroom={"context": 768 * 2**20, "allocator_reserve": 2**29, "fragmentation": 1, "safety_margin": 1},
    )
    reserve = next(line for line in summary_lines(PlanReport(plan=plan)) if "allocator reserve" in line)
    assert reserve.endswith("512.00 MiB  (expandable segments, set by training)"), reserve


def test_a_plan_states_what_it_assumes_of_the_training_machine_before_it_traces(run_cli, tmp_path):
    """#47: the device, the host's memory and update rate, and where each comes from, before the first trace."""
    from tests.helpers import EXAMPLES

    code, _, err = run_cli(
        "plan", EXAMPLES / "digits_cnn.py", "-b", "50%", "-n", "16", "--simulate", "--device", "cuda", "--device-kind", "RTX 3090",
        "--host-memory", "64GiB", "--host-speed", "2e9", "--no-cache", "-o", tmp_path / "plan.json",
    )
    assert code == 0, err
    lines = err.splitlines()
    said = next(i for i, line in enumerate(lines) if "assuming" in line)
    assert said < next(i for i, line in enumerate(lines) if "tracing" in line)
    assert "assuming simulated RTX 3090 with 24.00 GiB; host memory 64.00 GiB (--host-memory);" in lines[said]
    assert "host update rate at --host-speed 2e+09 elements/s, the training machine's host as given" in lines[said]


@pytest.mark.parametrize(("choices", "why"), [
    ({}, "gradients 0 B (none alive at the peak)"),
    ({"optimizer_in_backward": True}, "gradients 0 B (each freed as its parameter steps in backward)"),
    ({"precision": "bf16-master"}, "optimizer state 0 B (on the host)"),
])
def test_a_kind_at_0_b_at_the_peak_says_why(choices, why):
    """#48: "gradients 0 B" in a full fine-tune read as a mistake: the breakdown is taken at the peak, and says so."""
    plan = Plan(
        budget_bytes=300, config=TrainingConfig(global_batch_size=8, micro_batch_size=8, **choices),
        predicted=Predicted(peak_bytes=150, samples_per_s=1.0),
        measured=Measured(peak_bytes=140, meter="cpu", breakdown={"parameters": 100, "gradients": 0, "optimizer_state": 0}),
    )
    lines = [" ".join(line.split()) for line in summary_lines(PlanReport(plan=plan))]
    assert why in lines, lines
