import torch

from autofit.config import TrainingConfig
from autofit.plan_file import ModelInfo, Plan, load_plan, save_plan
from autofit.planning.report import batch_norm_notes


def test_batch_norm_with_micro_batches_is_noted():
    notes = batch_norm_notes(ModelInfo(batch_norm=True), micro_batch_size=16, global_batch_size=64)
    assert len(notes) == 1 and "micro-batch of 16" in notes[0] and "batch of 64" in notes[0]


def test_no_note_without_batch_norm_or_without_a_split():
    assert batch_norm_notes(ModelInfo(batch_norm=False), micro_batch_size=16, global_batch_size=64) == []
    assert batch_norm_notes(ModelInfo(batch_norm=True), micro_batch_size=64, global_batch_size=64) == []


def test_notes_round_trip_through_plan_json(tmp_path):
    plan = Plan(budget_bytes=1, config=TrainingConfig(global_batch_size=4, micro_batch_size=2), notes=["a note"])
    assert load_plan(save_plan(plan, tmp_path / "plan.json")).notes == ["a note"]


def test_model_info_of_a_library_model_names_its_classes_once():
    """torchvision and timm specs carry num_classes in their source options too: the plan's ModelInfo takes it once."""
    from types import SimpleNamespace

    from autofit.planning.report import model_info_of
    from autofit.spec import load_spec

    spec = load_spec("torchvision:resnet18", input_shape="3x32x32", num_classes=10)
    assert spec.source_options == {"num_classes": 10}
    with torch.device("meta"):
        model = spec.build_model()
    for asked in (10, None):
        info = model_info_of(SimpleNamespace(spec=spec, meta_model=model, num_classes=asked), output_shape=[4, 10])
        assert info.source == "torchvision:resnet18" and info.num_classes == 10 and info.input_shape == [3, 32, 32]
