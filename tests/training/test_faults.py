"""Nothing lost: run directories, signals, kills, full disks, bad images, OOM anywhere in a step, garbage logs.

Each test first reproduces what used to go wrong (a second run mixing its
files into the first's, a fresh start erasing a run, steps missing from the
log after a kill, a SIGTERM with no save, ...) and checks it cannot happen.
The bad inputs of every command are in tests/cli/test_bad_inputs.py.
"""
from dataclasses import replace
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autofit.errors import UserError
from autofit.plan_file import DeviceInfo
from autofit.training.stops import TrainingInterrupted
from autofit.training.rundir import LOCK_FILE, hold_run_directory
from autofit.training.weights import load_checkpoint
from tests.helpers import ROOT
from tests.helpers.images import MODEL_FILE, train_args, write_images
from tests.helpers.training import assert_same_weights, fresh_model, make_plan, run

def cli_subprocess(*args, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "autofit", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout,
    )


def step_records(log_dir: Path) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def weights(log_dir: Path) -> dict:
    return load_checkpoint(log_dir / "last.pt")["model_state"]


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autofit: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


# --- the run directory ------------------------------------------------------------------------


def test_a_second_run_in_a_held_log_dir_is_refused_naming_the_holder(tmp_path, project, run_cli):
    """Two runs on one --log-dir used to both exit 0 and mix their files; now the second is refused."""
    log_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from autofit.training.rundir import hold_run_directory
            with hold_run_directory(Path({str(log_dir)!r})):
                print("holding", flush=True)
                sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        code, _, err = run_cli(*train_args(project, log_dir))
        line = one_line(err)
        assert code == 2 and f"pid {holder.pid} on {os.uname().nodename}" in line and "another --log-dir" in line
        assert sorted(p.name for p in log_dir.iterdir()) == [LOCK_FILE]  # the second run wrote nothing
    finally:
        holder.communicate("", timeout=30)
    code, _, err = run_cli(*train_args(project, log_dir, "--max-steps", "1"))  # the holder is gone: the lock with it
    assert code == 0, err


def test_the_lock_is_released_when_the_run_ends(tmp_path):
    with hold_run_directory(tmp_path / "run"):
        with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()} "):
            with hold_run_directory(tmp_path / "run"):
                pass
    with hold_run_directory(tmp_path / "run"):
        pass


def test_a_child_that_outlives_the_run_does_not_keep_its_lock(tmp_path):
    """A DataLoader worker forked while the run held the lock inherited its file description: after a SIGKILL of the
    run the worker lived on for seconds, and an immediate --resume was refused naming the dead process."""
    log_dir = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, time
            from pathlib import Path
            from autofit.training.rundir import hold_run_directory
            with hold_run_directory(Path({str(log_dir)!r})):
                child = os.fork()
                if child == 0:  # the worker: running (so past fork's hooks), then living on after the run
                    print(os.getpid(), flush=True)
                    time.sleep(60)
                    os._exit(0)
                os._exit(0)  # the run dies without leaving the block, as under SIGKILL
        """)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    child = int(run.stdout.readline())
    try:
        assert run.wait(timeout=60) == 0
        os.kill(child, 0)  # the worker still runs
        with hold_run_directory(log_dir):
            pass
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("files", [("best.pt", "metrics.jsonl"), ("last.pt",), ("metrics.jsonl",)])
def test_a_fresh_start_in_a_folder_holding_a_run_is_refused(tmp_path, project, run_cli, files):
    """best.pt and metrics.jsonl without last.pt used to count as a fresh folder: the history was erased."""
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    for name in files:
        (log_dir / name).write_bytes(b'{"kind": "step", "step": 1}\n')
    code, _, err = run_cli(*train_args(project, log_dir))
    line = one_line(err)
    assert code == 2 and "already holds a run" in line and "--overwrite" in line and "another --log-dir" in line
    assert ("--resume" in line) == ("last.pt" in files)
    assert all((log_dir / name).read_bytes() == b'{"kind": "step", "step": 1}\n' for name in files)


def test_overwrite_deletes_the_earlier_run_and_starts_again(tmp_path, project, run_cli):
    log_dir = tmp_path / "run"
    assert run_cli(*train_args(project, log_dir, "--max-steps", "2"))[0] == 0
    code, _, err = run_cli(*train_args(project, log_dir, "--max-steps", "1", "--overwrite"))
    assert code == 0, err
    assert [r["step"] for r in step_records(log_dir)] == [1]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    code, _, err = run_cli(*train_args(project, log_dir, "--overwrite", "--resume"))
    assert code == 2 and "give one of them" in one_line(err)


def test_an_overwrite_that_fails_before_its_first_save_loses_nothing(tmp_path, project, run_cli):
    """--overwrite used to delete the earlier run before the new one's plan was even applied."""
    log_dir = tmp_path / "run"
    assert run_cli(*train_args(project, log_dir, "--max-steps", "2"))[0] == 0
    before = {p.name: p.read_bytes() for p in log_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    bad = {**json.loads((project / "plan.json").read_text()), "selective_checkpoint": ["no_such_block"]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    code, _, err = run_cli("train", "--plan", tmp_path / "bad.json", "--data", project / "data", "--log-dir", log_dir, "--overwrite")
    assert code == 2 and "no_such_block" in one_line(err), err
    after = {p.name: p.read_bytes() for p in log_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    assert after == before and {"last.pt", "metrics.jsonl", "run_plan.json"} <= set(after)
    assert run_cli(*train_args(project, log_dir, "--resume", "--max-steps", "3"))[0] == 0  # the earlier run goes on


@pytest.mark.parametrize("saved", [False, True])
def test_an_overwrite_killed_around_its_first_save_is_settled_by_the_next_run(tmp_path, saved):
    """Killed before its first save, the new run gives the folder back to the earlier one; killed just after it,
    the earlier run's files, set aside, go."""
    log_dir = tmp_path / "run"
    (log_dir / ".previous").mkdir(parents=True)
    (log_dir / ".previous" / "last.pt").write_bytes(b"earlier")
    (log_dir / ".previous" / "metrics.jsonl").write_text('{"kind": "step"}\n')
    (log_dir / "metrics.jsonl").write_text('{"kind": "step", "new": true}\n')
    if saved:
        (log_dir / "last.pt").write_bytes(b"new")
    with hold_run_directory(log_dir):
        pass
    names = sorted(p.name for p in log_dir.iterdir())
    assert names == sorted([LOCK_FILE, "last.pt", "metrics.jsonl"])
    assert (log_dir / "last.pt").read_bytes() == (b"new" if saved else b"earlier")
    assert ('"new"' in (log_dir / "metrics.jsonl").read_text()) == saved


def test_a_run_never_replaces_the_plan_json_in_its_folder(tmp_path, project, run_cli, monkeypatch):
    """`train --plan ../plan.json --log-dir .` in a folder holding another model's plan.json replaced it with the
    run's copy, and --overwrite then deleted it: the run's copy is run_plan.json, and --resume goes on with it."""
    here = tmp_path / "other_project"
    here.mkdir()
    theirs = json.dumps({**json.loads((project / "plan.json").read_text()), "budget_bytes": 12345678})
    (here / "plan.json").write_text(theirs)
    monkeypatch.chdir(here)
    for args in (
        train_args(project, Path("."), "--max-steps", "1"),
        ["train", "--log-dir", ".", "--resume", "--max-steps", "2"],
        train_args(project, Path("."), "--max-steps", "1", "--overwrite"),
    ):
        code, _, err = run_cli(*args)
        assert code == 0, err
        assert (here / "plan.json").read_text() == theirs
    assert json.loads((here / "run_plan.json").read_text())["budget_bytes"] == 10**8 and len(step_records(here)) == 1


def test_a_best_pt_lost_to_a_kill_is_saved_again_on_resume(tmp_path, project, run_cli):
    """SIGKILL while best.pt was written left only its temporary file, and the resumed run ended with
    "weights: .../best.pt", a file that did not exist. last.pt, saved just before, holds the best epoch's weights."""
    log_dir = tmp_path / "run"
    assert run_cli(*train_args(project, log_dir, "--epochs", "1"))[0] == 0
    (log_dir / "best.pt").rename(log_dir / ".best.pt.0123abcd.tmp")  # as a kill mid-save leaves it
    code, out, err = run_cli("train", "--log-dir", log_dir, "--resume")
    assert code == 0, err
    best, last = load_checkpoint(log_dir / "best.pt"), load_checkpoint(log_dir / "last.pt")
    assert best["training"]["epoch"] == 1
    assert_equal_states(best["model_state"], last["model_state"])
    assert f"weights: {log_dir / 'best.pt'}" in out and not list(log_dir.glob(".best.pt.*.tmp"))


def test_leftovers_of_a_killed_save_are_cleaned_up(tmp_path):
    log_dir = tmp_path / "run"
    (log_dir / "last_sharded.previous").mkdir(parents=True)
    (log_dir / "last_sharded.partial").mkdir()
    (log_dir / ".last.pt.0123abcd.tmp").write_bytes(b"half")
    (log_dir / "notes.tmp").write_text("mine")
    with hold_run_directory(log_dir):
        pass
    # The complete save moved aside is put back; the half-written ones are gone; the user's file stays.
    assert sorted(p.name for p in log_dir.iterdir()) == [LOCK_FILE, "last_sharded", "notes.tmp"]


# --- metrics.jsonl is on disk before a save counts ---------------------------------------------


def test_every_record_up_to_a_save_is_on_disk_before_the_save(tmp_path, monkeypatch):
    """metrics.jsonl used to be buffered past a save of last.pt: a kill then lost steps the weights had seen."""
    from autofit.training import checkpoints, runlog

    synced = []
    real_fsync = os.fsync

    def spy_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def checked_save(self, checkpoint, *, model, optimizer):
        step = checkpoint["training"]["position"]["global_step"]
        on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in on_disk if r["kind"] == "step"][-1] == step
        assert synced and synced[-1].endswith("metrics.jsonl")
        return real_save(self, checkpoint, model=model, optimizer=optimizer)

    real_save = checkpoints.LocalCheckpoints.save_last
    monkeypatch.setattr(runlog.os, "fsync", spy_fsync)
    monkeypatch.setattr(checkpoints.LocalCheckpoints, "save_last", checked_save)
    model = fresh_model()
    run(model, make_plan(model), tmp_path, save_every_steps=2, max_steps=7)


def test_garbage_lines_in_metrics_are_skipped_and_counted_on_resume(tmp_path, capsys):
    """Non-UTF-8 bytes, a bare number or a list in metrics.jsonl used to crash --resume."""
    model = fresh_model()
    run(model, make_plan(model), tmp_path, max_steps=3)
    with open(tmp_path / "metrics.jsonl", "ab") as log:
        log.write(b"\xff\xfe not utf-8\n42\n[1, 2]\n\"text\"\n{\"kind\": \"step\", \"step\": \"x\"}\n{\"kind\": \"step\", \"ste")
    resumed = fresh_model()
    train_settings = {"resume": True, "max_steps": 5, "verbose": True}
    run(resumed, make_plan(resumed), tmp_path, **train_settings)
    assert "skipped 5 unreadable line(s)" in capsys.readouterr().out
    assert [r["step"] for r in step_records(tmp_path)] == [1, 2, 3, 4, 5]


# --- signals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_and_stop_as_ctrl_c_does(tmp_path, signal_number):
    """SIGTERM and SIGHUP used to kill the run with no save."""
    whole = fresh_model(dropout=0.2)
    run(whole, make_plan(whole), tmp_path / "whole")
    calls = {"n": 0}

    def signalling_loss(output, target):
        calls["n"] += 1
        if calls["n"] == 3 * 3 + 2:  # inside step 4
            os.kill(os.getpid(), signal_number)
        return nn.functional.cross_entropy(output, target)

    first = fresh_model(dropout=0.2)
    with pytest.raises(TrainingInterrupted) as stopped:
        run(first, make_plan(first), tmp_path / "cut", loss_fn=signalling_loss)
    assert (stopped.value.step, stopped.value.exit_code) == (4, 128 + signal_number)
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["training"]["position"]["global_step"] == 4
    resumed = fresh_model(dropout=0.2)
    run(resumed, make_plan(resumed), tmp_path / "cut", resume=True)
    assert_same_weights(resumed, whole, exact=True)
    assert [r["step"] for r in step_records(tmp_path / "cut")] == list(range(1, 11))


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_sigterm_to_autofit_train_exits_143_with_the_resume_command_and_resume_alone_continues(tmp_path, project, run_cli):
    """A real process: SIGTERM mid-epoch saves, exits 128+15, and `--log-dir DIR --resume` alone finishes the run."""
    settings = ("--epochs", "2", "--lr", "0.01", "--seed", "3")
    assert run_cli(*train_args(project, tmp_path / "whole", *settings))[0] == 0
    cut = tmp_path / "cut"
    # Epoch 1 is losses 1-6 (3 steps of 2 micro-batches) and 7-8 (validation): the 11th is in step 5.
    stopped = cli_subprocess(*train_args(project, cut, *settings, "--save-every", "2"), env_extra={"AUTOFIT_TEST_SIGNAL": "SIGTERM:11"})
    assert stopped.returncode == 143, stopped.stderr
    line = stopped.stderr.strip().splitlines()[-1]
    assert line == f"autofit: stopped by SIGTERM at epoch 2, step 5; saved {cut / 'last.pt'}; continue with `autofit train --log-dir {cut} --resume`"
    code, out, err = run_cli("train", "--log-dir", cut, "--resume")
    assert code == 0, err
    assert_equal_states(weights(cut), weights(tmp_path / "whole"))
    assert [r["step"] for r in step_records(cut)] == list(range(1, 7))
    assert "epoch 2/2" in out


# --- resume: the run's own settings ---------------------------------------------------------


def test_resume_refuses_settings_and_plans_that_differ(tmp_path, project, run_cli):
    """--plan on resume used to be ignored silently, and settings given again were taken whatever they were."""
    log_dir = tmp_path / "run"
    assert run_cli(*train_args(project, log_dir, "--max-steps", "1", "--seed", "3", "--lr", "0.01"))[0] == 0
    other_data = tmp_path / "other"
    write_images(other_data / "train", per_class=2, seed=5)
    write_images(other_data / "val", per_class=1, seed=6)
    for flags, named in [
        (("--seed", "4"), "seed 4 differs"),
        (("--lr", "0.02"), "lr 0.02 differs"),
        (("--data", other_data), f"--data {other_data} differs"),
    ]:
        code, _, err = run_cli("train", "--log-dir", log_dir, "--resume", *flags)
        assert code == 2 and named in one_line(err), err
    other_plan = json.loads((project / "plan.json").read_text())
    other_plan.update(precision="bf16", global_batch_size=16)
    other_plan.pop("grad_accum_steps", None)
    (tmp_path / "other.json").write_text(json.dumps(other_plan))
    code, _, err = run_cli("train", "--log-dir", log_dir, "--resume", "--plan", tmp_path / "other.json")
    line = one_line(err)
    assert code == 2 and "global_batch_size 16 (saved: 8)" in line and "precision 'bf16' (saved: 'fp32')" in line
    # Every choice of the configuration counts, the levers too (they used to be let through).
    for change, named in [
        ({"selective_checkpoint": ["1"]}, "selective_checkpoint ['1'] (saved: [])"),
        ({"optimizer_state": "8bit"}, "optimizer_state '8bit' (saved: 'device')"),
    ]:
        (tmp_path / "other.json").write_text(json.dumps({**json.loads((project / "plan.json").read_text()), **change}))
        code, _, err = run_cli("train", "--log-dir", log_dir, "--resume", "--plan", tmp_path / "other.json")
        assert code == 2 and named in one_line(err), err
    # The same settings again, and the same plan, are fine.
    code, _, err = run_cli(*train_args(project, log_dir, "--resume", "--seed", "3", "--lr", "0.01", "--max-steps", "2"))
    assert code == 0, err
    assert [r["step"] for r in step_records(log_dir)] == [1, 2]


def test_fit_resumes_with_the_saved_plan_and_settings(tmp_path):
    """fit(resume=True) needs no plan and no settings again: the run's own come from last.pt."""
    import autofit
    from tests.helpers.training import optimizer

    data = make_data()
    whole = fresh_model()
    autofit.fit(whole, train_data=data.train, val_data=data.val, plan=make_plan(whole), epochs=2, seed=4, lr=0.02,
                optimizer=optimizer, log_dir=tmp_path / "whole", verbose=False)
    first = fresh_model()
    autofit.fit(first, train_data=data.train, val_data=data.val, plan=make_plan(first), epochs=2, seed=4, lr=0.02,
                optimizer=optimizer, log_dir=tmp_path / "cut", max_steps=3, verbose=False)
    resumed = fresh_model()
    result = autofit.fit(resumed, train_data=data.train, val_data=data.val, optimizer=optimizer, log_dir=tmp_path / "cut",
                         resume=True, verbose=False)
    assert len(result.history) == 2
    assert_same_weights(resumed, whole, exact=True)
    with pytest.raises(UserError, match="seed 5 differs"):
        autofit.fit(fresh_model(), train_data=data.train, optimizer=optimizer, log_dir=tmp_path / "cut", resume=True, seed=5,
                    epochs=3)  # the run finished its 2 epochs: without more, there is nothing to resume (and no line)


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_an_error_in_the_user_s_code_is_one_line_naming_it_and_the_run_resumes(tmp_path, project):
    """A user's loss (or forward, or optimizer) that raised used to print a whole traceback, and no word on the run."""
    log_dir = tmp_path / "run"
    args = [*train_args(project, log_dir, "--save-every", "2"), "--model", project / "tiny.py"]
    failed = cli_subprocess(*args, env_extra={"AUTOFIT_TEST_SIGNAL": "RAISE:5"})  # step 3's first micro-batch
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith("autofit: error: ") and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert "ValueError: the labels are not what this loss expects (tiny.py, line" in line
    assert "last.pt keeps step 2: fix it, then continue with --resume" in line
    debug = cli_subprocess("--debug", *args[:1], "--log-dir", log_dir, "--resume", env_extra={"AUTOFIT_TEST_SIGNAL": "RAISE:1"})
    assert debug.returncode == 2 and "Traceback" in debug.stderr and debug.stderr.strip().splitlines()[-1].startswith("autofit: error: ")
    done = cli_subprocess("train", "--log-dir", log_dir, "--resume")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in step_records(log_dir)] == [1, 2, 3]


def test_a_resumed_run_keeps_going_to_its_own_max_steps(tmp_path, project, run_cli, monkeypatch):
    log_dir = tmp_path / "run"
    # Stopped by a real SIGINT in step 2, in this process (the loop's handler turns it into exit 130): the model
    # file's copy is a module of its own, whose count of losses starts at 0.
    model_file = tmp_path / "tiny.py"
    model_file.write_text(MODEL_FILE)
    monkeypatch.setenv("AUTOFIT_TEST_SIGNAL", "SIGINT:3")
    code, _, err = run_cli(*train_args(project, log_dir, "--max-steps", "4", "--epochs", "3", "--model", model_file))
    assert code == 130, err
    monkeypatch.delenv("AUTOFIT_TEST_SIGNAL")
    assert run_cli("train", "--log-dir", log_dir, "--resume")[0] == 0
    assert [r["step"] for r in step_records(log_dir)] == [1, 2, 3, 4]  # not all 9 steps of 3 epochs
    # A --max-steps the run has passed used to train on past it (to twice the run's steps, in the audit).
    code, _, err = run_cli("train", "--log-dir", log_dir, "--resume", "--max-steps", "3")
    assert code == 2 and "--max-steps 3 is already reached: the run in" in one_line(err) and "at step 4" in err
    assert run_cli("train", "--log-dir", log_dir, "--resume")[0] == 0  # --max-steps reached: on to --epochs
    assert [r["step"] for r in step_records(log_dir)] == list(range(1, 10))


# --- out of memory anywhere in a step ----------------------------------------------------------

from tests.helpers.training import FEATURES, Block, make_data  # noqa: E402


class AllocationFails:
    """Raises an allocation failure the ``at``-th time it is called, once; ``error`` makes it (default torch.OutOfMemoryError)."""

    def __init__(self, at: int, error=lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) -> None:
        self.at, self.calls, self.error = at, 0, error

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise self.error()


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.hook is not None:
            ctx.hook()
        return grad, None


class NormNet(nn.Module):
    """Dropout (the RNG) and BatchNorm (buffers a forward changes) before the places a failure is injected."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(0.2) for _ in range(3)))
        self.norm = nn.BatchNorm1d(FEATURES)
        self.head = nn.Linear(FEATURES, 3)
        self.in_forward = self.in_backward = None

    def forward(self, x):  # (B, 1, 4, 4) -> (B, 3)
        h = self.norm(self.blocks(x.flatten(1)))
        if self.in_forward is not None:
            self.in_forward()
        return self.head(_FailInBackward.apply(h, self.in_backward))


class FailingAdamW(torch.optim.AdamW):
    """AdamW whose first step fails: ``before`` anything changes, after one weight changed, or after a step count changed."""

    where = None

    def step(self, closure=None):
        if self.where is not None:
            where, FailingAdamW.where = FailingAdamW.where, None
            first = self.param_groups[0]["params"][0]
            with torch.no_grad():
                if where == "after a weight":
                    first.add_(1.0)
                if where == "after its state":
                    self.state[first]["step"].add_(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected in optimizer.step)")
        return super().step(closure)


def train_net(model, log_dir, *, micro_batch_size: int, precision="fp32", build_optimizer=None, **settings):
    from autofit.training.loop import TrainSettings, train

    return train(
        model, plan=make_plan(model, micro_batch_size=micro_batch_size, precision=precision), data=make_data(),
        loss_fn=nn.functional.cross_entropy, build_optimizer=build_optimizer or (lambda p: FailingAdamW(p, lr=1e-2)),
        model_source={"source": "tests/training/test_faults.py", "input_shape": "1x4x4", "num_classes": 3},
        settings=TrainSettings(log_dir=log_dir, verbose=False, epochs=1, **settings),
    )


def net() -> NormNet:
    torch.manual_seed(0)
    return NormNet()


INJECTIONS = {
    # The data check before step 1 runs two forwards (a training and a validation batch): the 4th is the 2nd micro-batch's.
    "forward": lambda model: setattr(model, "in_forward", AllocationFails(at=4)),  # the 2nd micro-batch's forward
    "backward": lambda model: setattr(model, "in_backward", AllocationFails(at=2)),
    "optimizer step": lambda model: setattr(FailingAdamW, "where", "before"),
    "cuBLAS": lambda model: setattr(model, "in_forward", AllocationFails(
        at=4, error=lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))),
    "cuDNN": lambda model: setattr(model, "in_backward", AllocationFails(
        at=1, error=lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))),
}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("where", list(INJECTIONS) + ["GradScaler"])
def test_out_of_memory_anywhere_in_a_step_is_redone_exactly(tmp_path, monkeypatch, where, precision):
    """The run equals one that used the halved micro-batch from the start: weights, BatchNorm statistics, RNG, scaler.

    It used not to: under fp16 the GradScaler stayed unscaled and the redone
    step applied its gradients times the loss scale; BatchNorm statistics and
    the RNG moved twice.
    """
    if where == "GradScaler" and precision != "fp16":
        pytest.skip("the GradScaler unscales only in fp16")
    reference = net()
    train_net(reference, tmp_path / "reference", micro_batch_size=2, precision=precision, max_steps=3)
    model = net()
    if where == "GradScaler":
        unscale, fails = torch.amp.GradScaler._unscale_grads_, AllocationFails(at=1)

        def failing_unscale(self, *args):
            found = unscale(self, *args)  # the gradients are unscaled in place, then the allocation fails
            fails()
            return found

        monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", failing_unscale)
    else:
        INJECTIONS[where](model)
    result = train_net(model, tmp_path / "recovered", micro_batch_size=4, precision=precision, max_steps=3)
    assert [(h["previous_micro_batch_size"], h["micro_batch_size"]) for h in result.plan.history] == [(4, 2)]
    assert_equal_states(model.state_dict(), reference.state_dict())
    saved, expected = load_checkpoint(tmp_path / "recovered" / "last.pt"), load_checkpoint(tmp_path / "reference" / "last.pt")
    assert saved["training"]["scaler"] == expected["training"]["scaler"]


@pytest.mark.parametrize("where", ["after a weight", "after its state"])
def test_out_of_memory_after_the_optimizer_changed_the_weights_stops_with_one_line(tmp_path, where):
    model = net()
    train_net(model, tmp_path, micro_batch_size=4, max_steps=2)
    before = load_checkpoint(tmp_path / "last.pt")
    FailingAdamW.where = where
    with pytest.raises(UserError, match="out of memory inside the optimizer step .* cannot be put back") as error:
        train_net(net(), tmp_path, micro_batch_size=4, resume=True, max_steps=4)
    assert "\n" not in str(error.value) and "--resume" in str(error.value)
    assert_equal_states(load_checkpoint(tmp_path / "last.pt")["model_state"], before["model_state"])  # nothing saved since


# --- a full disk --------------------------------------------------------------------------------


@pytest.mark.parametrize("full_at", ["last.pt", "metrics.jsonl"])
def test_a_full_disk_is_one_line_keeps_last_pt_and_the_run_resumes(tmp_path, monkeypatch, full_at):
    """ENOSPC at the second save (step 4): one line, last.pt of step 2 intact, no temporary file; resumed, as if never full."""
    whole = fresh_model(dropout=0.2)
    run(whole, make_plan(whole), tmp_path / "whole", save_every_steps=2)
    real_fsync, calls = os.fsync, {"n": 0}

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(".last.pt.") if full_at == "last.pt" else name == "metrics.jsonl":
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log_dir = tmp_path / "cut"
    first = fresh_model(dropout=0.2)
    with pytest.raises(UserError) as error:
        run(first, make_plan(first), log_dir, save_every_steps=2)
    assert str(error.value) == (
        f"the disk holding {log_dir} is full (No space left on device); last.pt keeps step 2 intact: "
        "free space, then continue with --resume"
    )
    assert load_checkpoint(log_dir / "last.pt")["training"]["position"]["global_step"] == 2
    assert not [p.name for p in log_dir.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(os, "fsync", real_fsync)  # space freed
    resumed = fresh_model(dropout=0.2)
    run(resumed, make_plan(resumed), log_dir, resume=True, save_every_steps=2)
    assert_same_weights(resumed, whole, exact=True)
    assert [r["step"] for r in step_records(log_dir)] == list(range(1, 11))


def test_a_full_disk_under_torch_save_is_the_same_one_line(tmp_path, project, run_cli, monkeypatch):
    """torch.save's zip writer reports a full disk as its own RuntimeError: at the best.pt save it was a traceback."""
    import autofit.training.weights as weights_module

    real_save = torch.save

    def save(obj, file, *args, **kwargs):
        if os.path.basename(os.readlink(f"/proc/self/fd/{file.fileno()}")).startswith(".best.pt."):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4032 vs 3968")
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(weights_module.torch, "save", save)
    log_dir = tmp_path / "run"
    code, _, err = run_cli(*train_args(project, log_dir, "--epochs", "1"))
    assert code == 2 and "Traceback" not in err, err
    assert one_line(err) == (
        f"autofit: error: the disk holding {log_dir} is full (No space left on device writing best.pt); last.pt keeps step 3 intact: "
        "free space, then continue with --resume"
    )
    assert not list(log_dir.glob(".*.tmp")) and load_checkpoint(log_dir / "last.pt")["training"]["position"]["epoch"] == 1


# --- an image that passes the scan but does not decode ---------------------------------------------


def truncated_jpeg(path: Path) -> Path:
    from PIL import Image

    pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 6 // 10])  # the header is whole: PIL's verify() passes it
    return path


def test_an_image_that_fails_to_decode_is_skipped_named_and_the_run_goes_on(tmp_path, project, run_cli):
    """A truncated JPEG used to pass the scan, then crash the DataLoader mid-epoch without naming the file, on every resume."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(project / "data", data)
    broken = [truncated_jpeg(data / "train" / "a" / "broken.jpg"), truncated_jpeg(data / "val" / "b" / "broken.jpg")]
    log_dir = tmp_path / "run"
    code, out, err = run_cli("train", "--plan", project / "plan.json", "--data", data, "--log-dir", log_dir, "--workers", "1", "--epochs", "2")
    assert code == 0, err
    assert out.count(f"skipped an image that cannot be read: {broken[0]} (image file is truncated") == 2
    assert out.count(f"skipped an image that cannot be read: {broken[1]} (") == 2
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    named = [(r["epoch"], Path(r["file"]).parent.parent.name) for r in records if r["kind"] == "unreadable"]
    assert named == [(1, "train"), (1, "val"), (2, "train"), (2, "val")]
    assert [r["skipped_images"] for r in records if r["kind"] == "epoch"] == [1, 1]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 9))  # 25 samples: 4 steps an epoch


# --- the budget, watched ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget_bytes, warned", [(10**9, False), (2_000, True)])
def test_the_cpu_run_warns_once_when_a_tracked_step_passes_the_budget(tmp_path, capsys, budget_bytes, warned):
    model = fresh_model()
    plan = replace(make_plan(model), budget_bytes=budget_bytes)
    run(model, plan, tmp_path, max_steps=4, verbose=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory:")]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == int(warned) and [r["step"] for r in records if r["kind"] == "memory"] == ([2] if warned else [])
    if warned:
        assert "past the budget (budget 1.95 KiB)" in lines[0]


def test_on_cuda_the_allocator_is_capped_at_the_budget_and_put_back(monkeypatch):
    """The CUDA side of the watch, on any machine: the fraction set, the warning against the prediction, the cap undone."""
    from autofit.plan_file import Predicted
    from autofit.training.gauges import BudgetWatch

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": 100 * 2**30})())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.5, raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, index: calls.append((fraction, index)))
    plan = replace(
        make_plan(fresh_model()), budget_bytes=30 * 2**30, headroom={"context": 2**30},
        predicted=Predicted(peak_bytes=20 * 2**30, samples_per_s=1.0),
    )
    with BudgetWatch(plan, device=torch.device("cuda")) as watch:
        assert calls == [(0.29, 0)]
        assert watch.warning(19 * 2**30) is None
        assert "the allocator's peak 21.00 GiB passed the plan's predicted 20.00 GiB" in watch.warning(21 * 2**30)
        assert watch.warning(25 * 2**30) is None  # once
    assert calls[-1] == (0.5, 0)


@pytest.mark.gpu
def test_a_cuda_run_trains_under_the_cap(tmp_path):
    model = fresh_model()
    plan = replace(make_plan(model), device=DeviceInfo(type="cuda"), budget_bytes=2**30)
    seen = []

    def loss(output, target):
        seen.append(torch.cuda.get_per_process_memory_fraction(0))
        return nn.functional.cross_entropy(output, target)

    before = torch.cuda.get_per_process_memory_fraction(0)
    run(model, plan, tmp_path, max_steps=2, loss_fn=loss)
    assert seen and all(f == pytest.approx(2**30 / torch.cuda.get_device_properties(0).total_memory) for f in seen)
    assert torch.cuda.get_per_process_memory_fraction(0) == before


# --- kill -9, at random points, then --resume: as if never killed ------------------------------------


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_killed_with_sigkill_at_random_points_and_resumed_the_run_ends_as_if_never_killed(tmp_path, project, run_cli):
    """Three SIGKILLs at random losses (mid-step, or in validation), a resume after each: same weights, each step once.

    --save-every 2 leaves steps logged after the last save: a resume must drop
    them from metrics.jsonl and do them again, so every step is there exactly once.
    """
    import random

    settings = ("--epochs", "3", "--save-every", "2", "--seed", "1")
    assert run_cli(*train_args(project, tmp_path / "whole", *settings))[0] == 0
    cut = tmp_path / "cut"
    seed = int(os.environ.get("AUTOFIT_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    args, kills = train_args(project, cut, *settings), []
    for _ in range(3):
        # Kill in the n-th loss this process computes (an epoch is 3 steps of 2 micro-batches, then 2 for validation),
        # any one left to it; the first process, after its first save (the 4th loss, step 2).
        left = _losses_left(cut, epochs=3) if kills else 24
        kills.append(rng.randint(1 if kills else 5, left))
        done = cli_subprocess(*args, env_extra={"AUTOFIT_TEST_SIGNAL": f"SIGKILL:{kills[-1]}"})
        assert done.returncode == -signal.SIGKILL, (seed, kills, done.stderr)
        args = ["train", "--log-dir", cut, "--resume"]
    code, _, err = run_cli(*args)
    assert code == 0, (seed, kills, err)
    assert_equal_states(weights(cut), weights(tmp_path / "whole"))
    records = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 10)), seed
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2, 3], seed
    expected = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["kind"] == "step"] == [r["loss"] for r in expected if r["kind"] == "step"]


def _losses_left(log_dir: Path, *, epochs: int) -> int:
    """Loss computations a run resumed from ``log_dir/last.pt`` has left: 6 per epoch's 3 steps, 2 per validation."""
    position = load_checkpoint(log_dir / "last.pt")["training"]["position"]
    return (3 - position["step_in_epoch"]) * 2 + 2 + (epochs - position["epoch"] - 1) * 8


def test_a_full_disk_under_tensorboard_is_the_exit_line_not_a_thread_traceback(tmp_path, monkeypatch, capfd):
    import threading

    from torch.utils.tensorboard import SummaryWriter

    from autofit.training.runlog import open_run_log

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "close", full)
    monkeypatch.setattr(SummaryWriter, "flush", full)
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    with open_run_log(tmp_path, keep_until_step=0, keep_until_epoch=0, writes=True) as log:
        log.step({"kind": "step", "epoch": 1, "step": 1, "loss": 1.0, "lr": 0.1, "samples_per_s": 1.0, "memory_bytes": 0})
        log.flush()
    assert seen == []
    err = capfd.readouterr().err
    assert "TensorBoard events were not all written" in err and "Traceback" not in err and err.count("\n") == 1
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_the_last_line_never_names_a_best_pt_of_another_epoch_as_the_best(tmp_path):
    """A best.pt save cut short after last.pt moved on cannot be repaired: the line says whose weights it holds."""
    from autofit.training.console import final_line

    best = {"epoch": 3, "val_accuracy": 0.9, "val_loss": 0.1, "train_loss": 0.2}
    path = tmp_path / "best.pt"
    assert final_line(best, path, held_epoch=3).endswith(f"weights: {path}")
    stale = final_line(best, path, held_epoch=1)
    assert "epoch 3" in stale and f"{path} holds epoch 1's" in stale and f"weights: {path}" not in stale


def test_a_full_disk_is_known_whichever_layer_says_it():
    """torch.save's zip writer and torch.distributed.checkpoint (a sharded save) each say it their own way."""
    from torch.distributed.checkpoint.api import CheckpointException

    from autofit.training.weights import disk_full

    nospace = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(nospace, "x") is nospace
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 64"), "last.pt").errno == errno.ENOSPC
    assert disk_full(CheckpointException("save failed", {1: (nospace, None)}), "last.pt") is nospace
    assert disk_full(CheckpointException("save failed", {0: (ValueError("bad"), None)}), "last.pt") is None
    assert disk_full(OSError(errno.EACCES, "Permission denied"), "x") is None
