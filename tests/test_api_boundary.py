"""The Python API's arguments are checked where they come in (#53): a wrong type is one UserError naming the keyword
and the way out, not an AttributeError, TypeError or unpacking error from deep inside."""
import pytest
import torch

import autofit
from autofit.errors import UserError
from autofit.plan_file import save_plan
from tests.helpers.training import fresh_model, make_data, make_plan


def test_apply_plan_takes_a_plan_or_its_path_and_names_anything_else(tmp_path):
    model = fresh_model()
    plan = make_plan(model)
    path = save_plan(plan, tmp_path / "plan.json")
    assert autofit.apply_plan(model, str(path)).model is not None  # a path is read, as fit(plan=...) reads it
    for bad, said in [({"config": {}}, "got dict; make it a Plan first"), (None, "got NoneType; pass autofit.load_plan")]:
        with pytest.raises(UserError, match=f"apply_plan's plan must be a Plan or a plan.json path, {said}"):
            autofit.apply_plan(fresh_model(), bad)
    with pytest.raises(UserError, match="apply_plan's model must be a torch.nn.Module, got NoneType"):
        autofit.apply_plan(None, plan)


@pytest.mark.parametrize("keyword, value, said", [
    ("lr", "fast", "lr='fast' is not a number"),
    ("log_dir", 123, "log_dir=123 is not a path"),
    ("epochs", 2.5, "epochs=2.5 is not a whole number"),
    ("seed", True, "seed=True is not a whole number"),
])
def test_fit_names_an_argument_of_the_wrong_type(tmp_path, keyword, value, said):
    model, data = fresh_model(), make_data()
    options = {"log_dir": tmp_path / "run", keyword: value}
    with pytest.raises(UserError, match=said):
        autofit.fit(model, train_data=data.train, plan=make_plan(model), verbose=False, **options)
    assert not (tmp_path / "run").exists()


def test_plan_names_an_example_batch_that_returns_no_pair():
    with pytest.raises(UserError, match=r"example_batch\(2\) returned str; return a pair \(inputs, targets\)"):
        autofit.plan(torch.nn.Linear(4, 2), lambda n: "batch", budget="1GB", batch_size=4)


def test_fit_with_lora_keeps_torchao_s_pytree_notices_out_of_the_caller_s_log(monkeypatch, caplog):
    """Importing torchao (PEFT does) logged a warning per enum through torch.utils._pytree above fit's lines."""
    import logging

    def noisy(model, settings):
        logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass ...")
        return model

    monkeypatch.setattr("autofit.adapters.lora_model", noisy)
    pytree = logging.getLogger("torch.utils._pytree")
    monkeypatch.setattr(pytree, "level", logging.NOTSET)  # as a script has it (the command line quiets it for good)
    with caplog.at_level(logging.WARNING), pytest.raises(UserError, match="needs batch_size"):  # after the adapters
        autofit.fit(fresh_model(), train_data=make_data().train, lora="r=4", verbose=False)
    assert not [record for record in caplog.records if record.name == "torch.utils._pytree"]
    assert pytree.level == logging.NOTSET  # put back


def test_fit_names_an_unknown_keyword_and_the_nearest_one_before_doing_anything(tmp_path):
    model, data = fresh_model(), make_data()
    with pytest.raises(UserError, match=r"fit\(\) takes no keyword 'bugdet'; did you mean budget\?"):
        autofit.fit(model, train_data=data.train, plan=make_plan(model), log_dir=tmp_path / "run", bugdet="1MB")
    with pytest.raises(UserError, match="fit\\(\\) needs train_data"):
        autofit.fit(model, plan=make_plan(model), log_dir=tmp_path / "run")
    with pytest.raises(UserError, match="second argument is an autofit.FitSettings, got TensorDataset"):
        autofit.fit(model, data.train, log_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_fit_settings_check_their_fields_in_the_keywords_words():
    data = make_data()
    for options, said in [({"lr": "fast"}, "lr='fast' is not a number"), ({"resume": "yes"}, "resume='yes' must be True or False"),
                          ({"loss_fn": "mse"}, "loss_fn='mse' is not callable"), ({"device": "gpu"}, "device='gpu' is not one of"),
                          ({"batch_size": 0}, "batch_size=0 must be a whole number")]:
        with pytest.raises(UserError, match=said):
            autofit.FitSettings(train_data=data.train, **options)


def test_fit_keywords_are_fit_settings_fields_and_override_the_settings(tmp_path):
    """``FitKeywords`` (what an editor completes) and ``FitSettings`` (what is documented and checked) list the same
    fields with the same types; a keyword given beside settings is the one used."""
    import dataclasses

    from autofit.fit_settings import FitKeywords

    fields = {field.name: field.type for field in dataclasses.fields(autofit.FitSettings)}
    keywords = {name: getattr(kind, "__forward_arg__", kind) for name, kind in FitKeywords.__annotations__.items()}
    assert keywords == fields
    model, data = fresh_model(), make_data()
    settings = autofit.FitSettings(train_data=data.train, plan=make_plan(model), max_steps=1, verbose=False, log_dir=tmp_path / "a")
    result = autofit.fit(model, settings, log_dir=tmp_path / "b")
    assert result.log_dir == tmp_path / "b" and not (tmp_path / "a").exists()
