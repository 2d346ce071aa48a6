"""The training data is checked as the example batch is, before step 1: a batch the model cannot take is one line."""
import pytest
import torch
from torch import nn

from autofit.errors import UserError
from autofit.training.data import TrainData, collate_pairs
from tests.helpers.training import fresh_model, make_data, make_plan, run


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 3)

    def forward(self, x, y):  # (B, 1, 4, 4), (B, 1, 4, 4) -> (B, 3)
        return self.linear((x + y).flatten(1))


def test_data_a_model_cannot_take_is_one_line_before_step_1_and_nothing_is_saved(tmp_path):
    torch.manual_seed(0)
    model = TwoInputs()
    pairs = torch.utils.data.TensorDataset(torch.randn(8, 1, 4, 4), torch.randn(8, 1, 4, 4))  # taken as (input, target)
    with pytest.raises(UserError, match=r"each \(tensor\[1, 4, 4\], tensor\[1, 4, 4\]\).*missing 1 required positional.*collate") as raised:
        run(model, make_plan(model, checkpoint=()), tmp_path / "run", data=TrainData(train=pairs, val=None))
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "run" / "last.pt").exists()


def test_a_validation_set_of_another_form_is_found_before_step_1(tmp_path):
    model = fresh_model()
    data = make_data()
    data.val = torch.utils.data.TensorDataset(torch.randn(4, 1, 5, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(UserError, match="validation data's first 2 samples"):
        run(model, make_plan(model), tmp_path / "run", data=data)


def test_the_check_changes_nothing_the_run_would_do(tmp_path):
    """Buffers and the random state are put back: the checked run trains as before (BatchNorm, dropout)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 3))
    before = model[2].running_mean.clone()
    from autofit.apply import apply_config
    from autofit.training.first_batch import check_data_batches

    applied = apply_config(model, make_plan(model, checkpoint=()).config, device="cpu")
    state = torch.random.get_rng_state()
    check_data_batches(applied, make_data(), loss_fn=nn.functional.cross_entropy)
    assert torch.equal(model[2].running_mean, before) and torch.equal(torch.random.get_rng_state(), state)


def test_flags_in_dict_samples_pass_through_collation_as_they_are():
    samples = [{"input_ids": torch.arange(3), "return_loss": True, "mask": None} for _ in range(2)]
    inputs, targets = collate_pairs(samples)
    assert inputs["return_loss"] is True and inputs["mask"] is None and inputs["input_ids"].shape == (2, 3) and targets is None
    labelled = collate_pairs([{"x": torch.zeros(2), "flag": True}, {"x": torch.zeros(2), "flag": False}])[0]
    assert labelled["flag"].tolist() == [True, False]  # a per-sample value differs between samples: a tensor as before
