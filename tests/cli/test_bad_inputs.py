"""Every bad input a user can give, in every command it reaches: one line on stderr, exit code 2, no traceback, nothing lost.

One table, run through the real command line: in this process (``run_cli``)
for most rows, in real subprocesses for a few. Plan rows run without
``--quiet``, so a single line also shows that nothing was searched first.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.training.rundir import run_files
from autofit.training.weights import load_checkpoint, save_checkpoint
from tests.helpers import ROOT
from tests.helpers.images import train_args, write_images

HEADER = "import numpy\nimport torch\nfrom torch import nn\n\n\n"
EXAMPLE = "def example_batch(n):\n    return torch.rand(n, 1, 8, 8), torch.randint(0, 2, (n,))\n"
SAME_LAYERS = "nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2)"
"""The layers of tests/training/test_faults.py's model: a file building these matches the plan's fingerprint."""

BAD_MODEL_FILES = {
    "build_raises": HEADER + "def build_model():\n    raise ValueError('no weights here')\n\n\n" + EXAMPLE,
    "build_not_a_module": HEADER + "def build_model():\n    return 'resnet'\n\n\n" + EXAMPLE,
    "build_exits": HEADER + "import sys\n\n\ndef build_model():\n    sys.exit(3)\n\n\n" + EXAMPLE,
    "no_parameters": HEADER + "def build_model():\n    return nn.Sequential(nn.Flatten(), nn.ReLU())\n\n\n" + EXAMPLE,
    "batch_not_a_pair": HEADER + f"def build_model():\n    return nn.Sequential({SAME_LAYERS})\n\n\n"
    "def example_batch(n):\n    return torch.rand(n, 1, 8, 8)\n",
    "batch_of_numpy": HEADER + f"def build_model():\n    return nn.Sequential({SAME_LAYERS})\n\n\n"
    "def example_batch(n):\n    return numpy.zeros((n, 1, 8, 8)), numpy.zeros(n)\n",
    "batch_wrong_shape": HEADER + f"def build_model():\n    return nn.Sequential({SAME_LAYERS})\n\n\n"
    "def example_batch(n):\n    return torch.rand(n, 3, 5, 5), torch.randint(0, 2, (n,))\n",
    "batch_ignores_size": HEADER + f"def build_model():\n    return nn.Sequential({SAME_LAYERS})\n\n\n"
    "def example_batch(n):\n    return torch.rand(4, 1, 8, 8), torch.randint(0, 2, (4,))\n",
    "forward_tuple": HEADER + "class Net(nn.Sequential):\n    def forward(self, x):\n        super().forward(x)\n        return None, None\n\n\n"
    f"def build_model():\n    return Net({SAME_LAYERS})\n\n\n" + EXAMPLE,
    "forward_dict": HEADER + "class Net(nn.Sequential):\n    def forward(self, x):\n        return {'features': super().forward(x)}\n\n\n"
    f"def build_model():\n    return Net({SAME_LAYERS})\n\n\n" + EXAMPLE,
}
"""Model files with one mistake each."""

EXPECTED = {
    "build_raises": "build_model() raised ValueError: no weights here (build_raises.py, line 7)",
    "build_not_a_module": "build_model() returned str, not a torch.nn.Module",
    "build_exits": "build_model() called sys.exit(3); return the model instead",
    "no_parameters": "the model has no parameters that train (0 parameter tensor(s), none with requires_grad)",
    "batch_not_a_pair": "returned Tensor; return a pair (inputs, targets)",
    "batch_of_numpy": "returned inputs of type ndarray, which hold no tensor",
    "batch_wrong_shape": "the forward or the loss failed on example_batch(2): RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    "batch_ignores_size": "returned inputs of 4 sample(s) (first dimension), not 2",
    # (a tuple or dict holding logits or a loss is a model's own output form: see tests/test_model_io.py)
    "forward_tuple": "the model returned tuple without a loss and the batch has no logits to score; define loss_fn(output, targets)",
    "forward_dict": "the model returned dict without a loss and the batch has no logits to score; define loss_fn(output, targets)",
}


@pytest.fixture(scope="module")
def files(project, tmp_path_factory):  # noqa: F811
    """The bad model files, a trained run, checkpoints naming each bad file, bad plans and a folder with a link loop."""
    root = tmp_path_factory.mktemp("bad")
    for name, text in BAD_MODEL_FILES.items():
        (root / f"{name}.py").write_text(text)
    from autofit.cli import main

    run = root / "run"
    argv = sys.argv
    sys.argv = ["autofit", *map(str, train_args(project, run, "--max-steps", "1"))]
    try:
        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code == 0
    finally:
        sys.argv = argv
    best = load_checkpoint(run / "best.pt") if (run / "best.pt").exists() else load_checkpoint(run / "last.pt")
    for name in BAD_MODEL_FILES:
        save_checkpoint(root / f"{name}.pt", {**best, "model_source": {**best["model_source"], "source": str(root / f"{name}.py")}})
    save_checkpoint(root / "good.pt", best)
    plan = json.loads((project / "plan.json").read_text())
    for name, change in {
        "negative_budget": {"budget_bytes": -5},
        "absurd_batch": {"global_batch_size": 10**15},
        "micro_above_global": {"micro_batch_size": 64},
    }.items():
        (root / f"{name}.json").write_text(json.dumps({**plan, **change}))
    loop = root / "loop_data"
    write_images(loop / "train", per_class=2, seed=0)
    write_images(loop / "val", per_class=2, seed=1)
    (loop / "train" / "a" / "again").symlink_to(loop / "train")
    (loop / "val" / "b" / "again").symlink_to(loop / "val" / "b")
    (root / "a_file").write_text("not a folder")
    return root


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    """A folder this process cannot write to (chmod; as root, an immutable folder), or None where neither works."""
    folder = tmp_path_factory.mktemp("read_only")
    folder.chmod(0o555)
    immutable = False
    if _writable(folder) and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        immutable = True
    yield None if _writable(folder) else folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").write_text("")
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


def model_rows():
    commands = {
        "probe": lambda f, p: ["probe", f, "-m", "2"],
        "plan": lambda f, p: ["plan", f, "--budget", "50MB", "--batch-size", "8", "--out", p / "unused" / "plan.json"],
        "compare": lambda f, p: ["compare", f, "--batch-size", "8", "--out-dir", p / "unused" / "compare"],
        "train": lambda f, p: [*train_args(p, p / "unused" / "run"), "--model", f],
        "val": lambda f, p: ["val", "--weights", f.with_suffix(".pt"), "--data", p / "data" / "val"],
        "export": lambda f, p: ["export", "--weights", f.with_suffix(".pt"), "--out", p / "unused" / "export.pt"],
    }
    reaches = {  # the commands each mistake reaches: train, val and export never call example_batch
        "build_raises": list(commands), "build_not_a_module": list(commands), "build_exits": list(commands),
        "no_parameters": ["probe", "plan", "compare"],
        "batch_not_a_pair": ["probe", "plan", "compare"], "batch_of_numpy": ["probe", "plan", "compare"],
        "batch_wrong_shape": ["probe", "plan", "compare"], "batch_ignores_size": ["probe", "plan", "compare"],
        "forward_tuple": ["probe", "plan", "compare", "train"], "forward_dict": ["probe", "plan", "compare", "train"],
    }
    for mistake, names in reaches.items():
        for command in names:
            yield pytest.param(mistake, commands[command], EXPECTED[mistake], id=f"{command}-{mistake}")


@pytest.mark.parametrize("mistake, command, expected", list(model_rows()))
def test_a_bad_model_file_is_one_line_in_every_command(files, project, run_cli, mistake, command, expected):  # noqa: F811
    code, _, err = run_cli(*command(files / f"{mistake}.py", project))
    assert_one_line(code, err, expected)
    # Nothing written; training stops at its first step, before it logged one: the folder holds no run.
    assert not (project / "unused").exists() or run_files(project / "unused" / "run") == []


def other_rows():
    """(id, args from (files, project, read_only, tmp_path), what the line says, needs a read-only folder)."""
    yield "probe-num-classes-0", lambda f, p, r, t: ["probe", "torchvision:resnet18", "-m", "1", "--num-classes", "0"], "--num-classes 0 must be at least 2", False
    yield "plan-num-classes-1", lambda f, p, r, t: ["plan", "timm:resnet18", "--budget", "50MB", "--batch-size", "8", "--num-classes", "1"], "--num-classes 1 must be at least 2", False
    yield "plan-precisions-empty", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--precisions", " , "], "--precisions ' , ' names no precision", False
    yield "plan-budget-above-the-machine", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "100TB", "--batch-size", "8"], "is more than this machine's memory", False
    # Every micro-batch of a billion-sample batch costs two terms (full ones and the last), not a billion; on the CPU
    # the batch itself waits in the budget, so the refusal comes at the floor, before anything is timed.
    yield "plan-batch-a-billion", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", str(10**9), "--out", t / "plan.json", "--no-cache", "--quiet"], "is below the floor", False
    yield "probe-m-too-large", lambda f, p, r, t: ["probe", p / "tiny.py", "-m", str(10**12)], "does not fit this machine", False
    yield "plan-out-is-a-folder", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--out", t], "is a folder", False
    yield "plan-out-below-a-file", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--out", f / "a_file" / "plan.json"], "is a file, not a folder", False
    yield "plan-out-read-only", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--out", r / "plan.json"], "cannot be written", True
    yield "plan-study-fails", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--out", t / "plan.json", "--study", "sqlite:////nonexistent/folder/plans.db"], "--study 'sqlite:////nonexistent/folder/plans.db' cannot be opened", False
    yield "plan-study-not-a-database", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--out", t / "plan.json", "--study", f"sqlite:///{p / 'tiny.py'}"], "file is not a database", False
    yield "train-log-dir-is-a-file", lambda f, p, r, t: train_args(p, f / "a_file"), "is a file, not a folder", False
    # An empty --log-dir was taken for the current folder.
    yield "train-log-dir-empty", lambda f, p, r, t: train_args(p, ""), "--log-dir '' names no folder", False
    yield "train-resume-log-dir-empty", lambda f, p, r, t: ["train", "--log-dir", "", "--resume"], "--log-dir '' names no folder", False
    yield "train-log-dir-read-only", lambda f, p, r, t: train_args(p, r), "cannot be written", True
    yield "train-log-dir-below-read-only", lambda f, p, r, t: train_args(p, r / "run"), "cannot be created", True
    yield "train-lr-inf", lambda f, p, r, t: [*train_args(p, t / "run"), "--lr", "inf"], "--lr inf must be a positive finite number", False
    yield "train-lr-nan", lambda f, p, r, t: [*train_args(p, t / "run"), "--lr", "nan"], "--lr nan must be a positive finite number", False
    # nan and inf in any number a command reads (float() takes both): refused before anything runs.
    yield "train-lora-alpha-nan", lambda f, p, r, t: [*train_args(p, t / "run"), "--lora", "r=8,alpha=nan"], "alpha a positive finite number", False
    yield "plan-lora-alpha-inf", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--lora", "r=8,alpha=inf,targets=1", "--out", t / "plan.json"], "alpha a positive finite number", False
    yield "train-max-grad-norm-nan", lambda f, p, r, t: [*train_args(p, t / "run"), "--max-grad-norm", "nan"], "--max-grad-norm nan must be a positive finite number", False
    yield "plan-max-grad-norm-inf", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--max-grad-norm", "inf", "--out", t / "plan.json"], "--max-grad-norm inf must be a positive finite number", False
    yield "plan-host-speed-nan", lambda f, p, r, t: ["plan", p / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--host-speed", "nan", "--out", t / "plan.json"], "--host-speed nan must be a positive number", False
    yield "train-max-steps-0", lambda f, p, r, t: [*train_args(p, t / "run"), "--max-steps", "0"], "--max-steps 0 must be at least 1", False
    yield "train-max-steps-negative", lambda f, p, r, t: [*train_args(p, t / "run"), "--max-steps", "-3"], "--max-steps -3 must be at least 1", False
    yield "train-plan-negative-budget", lambda f, p, r, t: ["train", "--plan", f / "negative_budget.json", "--data", p / "data", "--log-dir", t / "run"], "field budget_bytes", False
    yield "train-plan-absurd-batch", lambda f, p, r, t: ["train", "--plan", f / "absurd_batch.json", "--data", p / "data", "--log-dir", t / "run"], "field global_batch_size", False
    yield "train-plan-micro-above-global", lambda f, p, r, t: ["train", "--plan", f / "micro_above_global.json", "--data", p / "data", "--log-dir", t / "run"], "micro_batch_size", False
    # Text options with the model file's own datasets were ignored without a word.
    yield "train-val-fraction-without-data", lambda f, p, r, t: ["train", "--plan", p / "plan.json", "--model", p / "tiny.py", "--log-dir", t / "run", "--val-fraction", "0.2"], "--val-fraction shapes text given with --data", False
    yield "train-data-link-loop", lambda f, p, r, t: ["train", "--plan", p / "plan.json", "--data", f / "loop_data", "--log-dir", t / "run"], "is a symbolic link to", False
    yield "val-data-link-loop", lambda f, p, r, t: ["val", "--weights", f / "good.pt", "--data", f / "loop_data" / "val"], "is a symbolic link to", False
    yield "plot-out-read-only", lambda f, p, r, t: ["plot", "--log-dir", f / "run", "--out", r / "curves.png"], "cannot be written", True
    yield "plot-out-is-a-folder", lambda f, p, r, t: ["plot", "--log-dir", f / "run", "--out", t], "is a folder", False
    yield "export-out-read-only", lambda f, p, r, t: ["export", "--weights", f / "good.pt", "--out", r / "model.pt"], "cannot be written", True
    yield "export-out-is-a-folder", lambda f, p, r, t: ["export", "--weights", f / "good.pt", "--out", t], "is a folder", False
    yield "export-default-out-read-only", lambda f, p, r, t: ["export", "--weights", _copy_into(f / "good.pt", r)], "cannot be written", True


def _copy_into(path: Path, folder: Path | None) -> Path:
    """``path``'s copy in a read-only ``folder`` (made writable for a moment, when chmod made it read-only)."""
    target = folder / path.name
    if not target.exists():
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)
        target.write_bytes(path.read_bytes())
        folder.chmod(0o555)
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    return target


@pytest.mark.parametrize("args, expected, needs_read_only", [pytest.param(a, e, r, id=i) for i, a, e, r in other_rows()])
def test_other_bad_inputs_are_one_line(files, project, read_only, tmp_path, run_cli, args, expected, needs_read_only):  # noqa: F811
    if needs_read_only and read_only is None:
        pytest.skip("no read-only folder can be made here")
    before = sorted(p.name for p in (files / "run").iterdir())
    code, _, err = run_cli(*args(files, project, read_only, tmp_path))
    assert_one_line(code, err, expected)
    assert sorted(p.name for p in (files / "run").iterdir()) == before


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("row", ["probe-build_raises", "train-lr-nan", "plan-out-below-a-file", "val-build_not_a_module"])
def test_a_few_rows_in_real_processes(files, project, tmp_path, row):  # noqa: F811
    args = {
        "probe-build_raises": ["probe", files / "build_raises.py", "-m", "2"],
        "train-lr-nan": [*train_args(project, tmp_path / "run"), "--lr", "nan"],
        "plan-out-below-a-file": ["plan", project / "tiny.py", "--budget", "50MB", "--batch-size", "8", "--out", files / "a_file" / "x.json"],
        "val-build_not_a_module": ["val", "--weights", files / "build_not_a_module.pt", "--data", project / "data" / "val"],
    }[row]
    done = subprocess.run(
        [sys.executable, "-m", "autofit", *map(str, args)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert_one_line(done.returncode, done.stderr, "")


def assert_one_line(code: int, stderr: str, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("autofit: error: "), stderr
    assert "Traceback" not in stderr and expected in lines[0], stderr


def test_the_entry_point_runs_with_the_imports_out_of_the_collectors_walk(monkeypatch):
    """#47: every full collection of a plan (its probes free memory between them) walked the imports' objects too:
    ``cli.run`` freezes them before the command runs."""
    import gc

    from autofit import cli

    seen = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        cli.run()
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 0


def test_the_entry_point_leaves_the_run_s_objects_out_of_the_collector_at_exit(files, monkeypatch, capsys):
    """``cli.run`` (the script and ``python -m autofit``) freezes what the run made, an error's exit included: Python's
    exit then skips walking it (1.1-1.5 s after importing torchvision). The error stays one line and exit code 2."""
    import gc

    from autofit.cli import run

    monkeypatch.setattr(sys, "argv", ["autofit", "probe", str(files / "build_raises.py"), "-m", "2"])
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as exit_:
            run()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert_one_line(exit_.value.code, capsys.readouterr().err, "no weights here")
