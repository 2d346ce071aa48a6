from autofit.plan_file import ModelInfo, Plan, load_plan, save_plan
from autofit.planning.writing import batch_norm_notes


def test_batch_norm_with_micro_batches_is_noted():
    notes = batch_norm_notes(ModelInfo(batch_norm=True), micro_batch_size=16, global_batch_size=64)
    assert len(notes) == 1 and "micro-batch of 16" in notes[0] and "batch of 64" in notes[0]


def test_no_note_without_batch_norm_or_without_a_split():
    assert batch_norm_notes(ModelInfo(batch_norm=False), micro_batch_size=16, global_batch_size=64) == []
    assert batch_norm_notes(ModelInfo(batch_norm=True), micro_batch_size=64, global_batch_size=64) == []


def test_notes_round_trip_through_plan_json(tmp_path):
    plan = Plan(budget_bytes=1, global_batch_size=4, micro_batch_size=2, notes=["a note"])
    assert load_plan(save_plan(plan, tmp_path / "plan.json")).notes == ["a note"]
