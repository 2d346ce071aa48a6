"""The Python API speaks Python: fit, plan and apply_plan name the keywords their caller passed, not the CLI's flags.

Each test first reproduces what went wrong (a second ``fit`` into the same log_dir planned again and then told a
Python caller to use "--resume, another --log-dir, or --overwrite", in a traceback) and checks it cannot happen.
"""
import re
import sys

import pytest
import torch
from torch import nn

import autofit
from autofit.errors import UserError
from autofit.keywords import DEBUG_VARIABLE, in_python
from tests.helpers.training import fresh_model, make_data, make_plan, optimizer

FLAG = re.compile(r"(?<![\w-])--[a-z]")


@pytest.mark.parametrize(("line", "python"), [
    ("runs/x already holds a run (last.pt); continue it with --resume, give another --log-dir, or --overwrite to start again",
     "runs/x already holds a run (last.pt); continue it with resume=True, give another log_dir, or overwrite=True to start again"),
    ("--log-dir 'runs/x' is a file, not a folder", "log_dir='runs/x' is a file, not a folder"),
    ("--lr nan must be a positive finite number, e.g. 1e-3", "lr=nan must be a positive finite number, e.g. 1e-3"),
    ("(75% of the time); try more --workers", "(75% of the time); try more num_workers"),
    ("--loss-chunks 0 must be from 1; leave --loss-chunks out", "loss_chunks=0 must be from 1; leave loss_chunks out"),
    ("re-plan with a lower --budget or --precision bf16 (--budget 16GB)", "re-plan with a lower budget or precision='bf16' (budget='16GB')"),
    ("fix it, then continue with --resume (autofit --debug shows the traceback)",
     "fix it, then continue with resume=True (AUTOFIT_DEBUG=1 shows the traceback)"),
    ("use --nproc-per-node 4, or `autofit train --log-dir R --resume`", "use --nproc-per-node 4, or `autofit train --log-dir R --resume`"),
])
def test_flags_read_as_the_keywords_a_python_caller_passes(line, python):
    assert in_python(line) == python


def test_a_second_fit_into_the_same_log_dir_is_refused_before_planning(tmp_path, monkeypatch, capsys):
    """The README's snippet run twice planned again, then raised a traceback naming --resume, --log-dir, --overwrite.
    The first run's lines name num_workers, the keyword fit takes, not --workers."""
    data, model = make_data(), fresh_model()
    log_dir = tmp_path / "tiny"
    autofit.fit(model, train_data=data.train, plan=make_plan(model), optimizer=optimizer, max_steps=1, log_dir=log_dir)
    out = capsys.readouterr().out
    assert "(num_workers sets it)" in out and "--workers" not in out

    def planner_called(*args, **kwargs):
        raise AssertionError("fit planned before refusing the log_dir")

    monkeypatch.setattr("autofit.planning.planner.make_plan", planner_called)
    with pytest.raises(UserError) as refused:
        autofit.fit(fresh_model(), train_data=data.train, batch_size=8, budget="1MB", log_dir=log_dir, verbose=False)
    line = str(refused.value)
    assert "\n" not in line and not FLAG.search(line), line
    assert all(words in line for words in ("already holds a run", "resume=True", "another log_dir", "overwrite=True")), line


def test_an_empty_log_dir_is_refused_and_a_script_ends_with_its_line(monkeypatch, capsys):
    """log_dir="" was taken for the current folder; an uncaught UserError ended a script with a traceback."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, traceback: seen.append(kind))
    with pytest.raises(UserError, match=r"^log_dir='' names no folder; give one") as refused:
        autofit.fit(fresh_model(), train_data=make_data().train, batch_size=8, log_dir="")
    error = refused.value
    sys.excepthook(type(error), error, error.__traceback__)  # what Python calls with an error a script left uncaught
    assert capsys.readouterr().err == f"autofit: error: {error}\n" and seen == []
    monkeypatch.setenv(DEBUG_VARIABLE, "1")  # the traceback, from the hook it replaced
    sys.excepthook(type(error), error, error.__traceback__)
    sys.excepthook(ValueError, ValueError("a bug"), None)  # not a user's mistake: its traceback, as before
    assert seen == [UserError, ValueError] and capsys.readouterr().err == ""


def test_plan_and_apply_plan_name_keywords_too():
    with pytest.raises(UserError, match=r"^max_grad_norm=-1.0 must be a positive finite number"):
        autofit.plan(nn.Linear(4, 2), lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,))), budget="1MB", batch_size=8,
                     max_grad_norm=-1.0)
    plan = autofit.Plan(budget_bytes=2**30, config=autofit.TrainingConfig(global_batch_size=2, micro_batch_size=2, loss_chunks=8))
    with pytest.raises(UserError, match=r"^loss_chunks=8: .*; leave loss_chunks out$"):
        autofit.apply_plan(nn.Sequential(nn.Linear(4, 4)), plan)


def test_probe_load_plan_and_an_applied_plan_speak_python(tmp_path):
    """autofit.probe, autofit.load_plan and the AppliedPlan autofit.apply_plan returns answered in flags (--steps,
    --loss-chunks, "re-plan with a lower --budget ... or --precision bf16"); a TrainingConfig they build too."""
    import json

    from autofit.plan_file import save_plan
    from autofit.spec import spec_from_model

    model = fresh_model()
    spec = spec_from_model(model, lambda n: (torch.rand(n, 1, 4, 4), torch.randint(0, 3, (n,))))
    for settings, said in (({"steps": 0}, "steps=0 must be at least 1"), ({"loss_chunks": 0}, "loss_chunks=0 must be")):
        with pytest.raises(UserError) as refused:
            autofit.probe(spec, micro_batch_size=2, **settings)
        assert said in str(refused.value) and not FLAG.search(str(refused.value)), str(refused.value)
    path = save_plan(make_plan(model), tmp_path / "plan.json")
    data = json.loads(path.read_text())
    data.update(precision="bf16-master", optimizer_state="host")  # a pair TrainingConfig refuses
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as refused:
        autofit.load_plan(path)
    assert "leave optimizer_state at device" in str(refused.value) and not FLAG.search(str(refused.value)), str(refused.value)
    applied = autofit.apply_plan(model, make_plan(model, micro_batch_size=1, checkpoint=()))
    with pytest.raises(UserError) as refused:
        applied.halve_micro_batch()  # out of memory at one sample: re-plan
    line = str(refused.value)
    assert "a lower budget" in line and "precision='bf16'" in line and not FLAG.search(line), line
