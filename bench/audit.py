"""A runnable audit of what a hostile but ordinary user does (#53): each case runs `autofit` in a fresh process in a
temporary folder and is classed by what came back, then a table of counts is printed.

    python bench/audit.py            # every case; a few minutes on a busy 2-core machine
    python bench/audit.py -k resume  # the cases whose name holds "resume"

Classes: one-line (exit 2, one `autofit: error:` line, no traceback), success (exit 0 and the case's check holds),
traceback, hang (past the case's deadline), data lost (a file that existed before is gone or changed), wrong
success (exit 0 where a refusal was due, or the case's check fails). The next audit adds its cases to CASES.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLASSES = ("one-line", "success", "traceback", "hang", "data lost", "wrong success")


@dataclass(kw_only=True)
class Case:
    name: str
    args: Callable[[Path], list[str]]
    """The autofit arguments, given the case's folder (which holds the project)."""
    expect: str = "one-line"
    """"one-line" or "success"."""
    prepare: Callable[[Path], None] = lambda folder: None
    keep: Callable[[Path], list[Path]] = lambda folder: []
    """Files that must exist, unchanged, after the command."""
    check: Callable[[Path, str, str], bool] = lambda folder, out, err: True
    """For a success: what must hold of the folder and the output."""
    signal_after_s: float | None = None
    """Send SIGINT this long after the start (Ctrl-C)."""
    timeout_s: float = 120
    env: dict = field(default_factory=dict)
    python: bool = False
    """``args`` is a Python script's text (the API): run with ``python -c``; a UserError it leaves uncaught is one line."""


def _train(folder: Path, *extra: str) -> list[str]:
    return ["train", "--plan", str(folder / "plan.json"), "--data", str(folder / "data"), "--log-dir", str(folder / "run"),
            "--workers", "0", *extra]


def _finished(folder: Path) -> None:
    done = _run(_train(folder, "--epochs", "1"), cwd=folder, timeout_s=120)
    assert done[0] == 0, done[2]


def _latin1(folder: Path) -> None:
    (folder / "corpus.txt").write_bytes("caf\u00e9".encode("latin-1"))


def _fifo(folder: Path) -> None:
    os.mkfifo(folder / "corpus.jsonl")


def _corrupt_parquet(folder: Path) -> None:
    (folder / "corpus.parquet").write_bytes(b"PAR1 truncated")


def _dir_txt(folder: Path) -> None:
    (folder / "corpus.txt").mkdir()


def _model_card(folder: Path) -> None:
    _finished(folder)
    (folder / "run" / "hf").mkdir(exist_ok=True)
    (folder / "run" / "hf" / "README.md").write_text("my card")


def _changed_data(folder: Path) -> None:
    _finished(folder)
    (folder / "data" / "train" / "a" / "0.png").unlink()


def _killed_overwrite(folder: Path) -> None:
    from autofit.training.rundir import start_fresh

    _finished(folder)
    start_fresh(folder / "run", overwrite=True)  # what an --overwrite run killed before its first save leaves


def _text_plan(folder: Path) -> list[str]:
    return ["train", "--plan", str(folder.parent / "text_plan.json"), "--log-dir", str(folder / "run"), "--workers", "0", "--data"]


def make_text_plan(root: Path) -> None:
    """A tiny hf: causal LM with its tokenizer (``tests/helpers/tiny_lm.py``) and a plan for it, shared by the cases."""
    from autofit.config import TrainingConfig
    from autofit.plan_file import DeviceInfo, ModelInfo, Plan, save_plan
    from autofit.spec import load_spec, model_fingerprint
    from tests.helpers.tiny_lm import tiny_lm_dir

    source = f"hf:{tiny_lm_dir(root / 'lm')}"
    spec = load_spec(source, seq_len=16)
    plan = Plan(
        model=ModelInfo(source=source, fingerprint=model_fingerprint(spec.build_model()), task="causal-lm", seq_len=16),
        device=DeviceInfo(type="cpu"), budget_bytes=10**9, config=TrainingConfig(global_batch_size=4, micro_batch_size=4),
    )
    save_plan(plan, root / "text_plan.json")


def _bad_optimizer(folder: Path) -> None:
    (folder / "bad_optimizer.py").write_text(
        "import torch\nfrom torch import nn\n\ndef build_model():\n    return nn.Linear(4, 2)\n\n"
        "def example_batch(n):\n    return torch.randn(n, 4), torch.randint(0, 2, (n,))\n\n"
        "def build_optimizer(params):\n    raise ValueError('no optimizer today')\n"
    )


def _no_layers(folder: Path) -> None:
    shutil.copytree(folder.parent / "lm", folder / "lm")
    config = json.loads((folder / "lm" / "config.json").read_text())
    (folder / "lm" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -1}))


def _other_input_shape(folder: Path) -> None:
    plan = json.loads((folder / "plan.json").read_text())
    plan["model"]["input_shape"] = [1, 16, 16]
    (folder / "plan.json").write_text(json.dumps(plan))


def _cached_plan(folder: Path) -> None:
    done = _run(["plan", str(folder / "tiny.py"), "--budget", "1GB", "--batch-size", "4", "--out", str(folder / "first.json")], cwd=folder,
                timeout_s=300, env={"AUTOFIT_CACHE_DIR": "cache"})  # relative: the case folder, where the case runs too
    assert done[0] == 0, done[2]


_API = "import autofit, torch\nfrom tests.helpers.training import fresh_model, make_data, make_plan\nm = fresh_model()\n"
"""What the API cases start from: the training tests' tiny classifier, its data and plan."""


def _unchanged(folder: Path) -> list[Path]:
    return [path for path in (folder / "run").rglob("*") if path.is_file() and path.name != ".autofit.lock"]


CASES = [
    Case(name="resume a finished run", prepare=_finished, args=lambda f: ["train", "--log-dir", str(f / "run"), "--resume"],
         expect="success", keep=_unchanged, check=lambda f, out, err: "is finished" in out),
    Case(name="resume keeps a model card in hf/", prepare=_model_card,
         args=lambda f: ["train", "--log-dir", str(f / "run"), "--resume", "--epochs", "2"],
         expect="success", keep=lambda f: [f / "run" / "hf" / "README.md"]),
    Case(name="resume over changed data", prepare=_changed_data,
         args=lambda f: ["train", "--log-dir", str(f / "run"), "--resume", "--epochs", "2"], keep=_unchanged),
    Case(name="resume over changed data, --data-changed", prepare=_changed_data,
         args=lambda f: ["train", "--log-dir", str(f / "run"), "--resume", "--epochs", "2", "--data-changed"],
         expect="success", check=lambda f, out, err: "--data-changed asks" in out),
    Case(name="resume after a killed --overwrite", prepare=_killed_overwrite,
         args=lambda f: ["train", "--log-dir", str(f / "run"), "--resume", "--epochs", "2"], expect="success"),
    Case(name="empty --log-dir", args=lambda f: [*_train(f)[:-4], "--log-dir", ""]),
    Case(name="text: latin-1", prepare=_latin1, args=lambda f: [*_text_plan(f), str(f / "corpus.txt")]),
    Case(name="text: FIFO as --data", prepare=_fifo, args=lambda f: [*_text_plan(f), str(f / "corpus.jsonl")], timeout_s=60),
    Case(name="text: corrupt parquet", prepare=_corrupt_parquet, args=lambda f: [*_text_plan(f), str(f / "corpus.parquet")]),
    Case(name="text: a folder named corpus.txt", prepare=_dir_txt, args=lambda f: [*_text_plan(f), str(f / "corpus.txt")]),
    Case(name="--lr nan", args=lambda f: _train(f, "--lr", "nan")),
    Case(name="--epochs 0", args=lambda f: _train(f, "--epochs", "0")),
    Case(name="probe: build_optimizer raises", prepare=_bad_optimizer, args=lambda f: ["probe", str(f / "bad_optimizer.py"), "-m", "2"]),
    Case(name="text: hf config of -1 layers", prepare=_no_layers,
         args=lambda f: ["plan", f"hf:{f / 'lm'}", "--task", "causal-lm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GB",
                         "--simulate", "--out", str(f / "p.json")]),
    Case(name="api: apply_plan(model, None)", python=True, args=lambda f: [_API + "autofit.apply_plan(m, None)"]),
    Case(name="api: apply_plan(model, {...})", python=True, args=lambda f: [_API + "autofit.apply_plan(m, {'config': {}})"]),
    Case(name="api: apply_plan(None, plan)", python=True, args=lambda f: [_API + "autofit.apply_plan(None, make_plan(m))"]),
    Case(name="api: apply_plan(model, 'plan.json')", python=True, expect="success",
         args=lambda f: [_API + "import autofit.plan_file as p\np.save_plan(make_plan(m), 'x.json')\nautofit.apply_plan(m, 'x.json')"]),
    Case(name="api: fit(lr='fast')", python=True,
         args=lambda f: [_API + "autofit.fit(m, train_data=make_data().train, plan=make_plan(m), lr='fast', log_dir='r')"]),
    Case(name="api: fit(log_dir=123)", python=True,
         args=lambda f: [_API + "autofit.fit(m, train_data=make_data().train, plan=make_plan(m), log_dir=123)"]),
    Case(name="api: plan(model, lambda n: 'batch')", python=True,
         args=lambda f: [_API + "autofit.plan(m, lambda n: 'batch', budget='1GB', batch_size=4)"]),
    Case(name="api: fit with labels beyond the model's outputs", python=True,
         args=lambda f: [_API + "d = make_data().train\nd.tensors[1][:] = 7\nautofit.fit(m, train_data=d, plan=make_plan(m), log_dir='r')"]),
    Case(name="api: fit with a validation set of the wrong width", python=True,
         args=lambda f: [_API + "v = torch.utils.data.TensorDataset(torch.randn(8, 1, 5, 5), torch.zeros(8, dtype=torch.long))\n"
                                "autofit.fit(m, train_data=make_data().train, val_data=v, plan=make_plan(m), log_dir='r')"]),
    Case(name="plan.json whose input shape is not the model's", prepare=_other_input_shape, args=lambda f: _train(f, "--epochs", "1")),
    Case(name="AUTOFIT_TRACE_WORKERS=abc, plan from the cache", prepare=_cached_plan, env={"AUTOFIT_TRACE_WORKERS": "abc", "AUTOFIT_CACHE_DIR": "cache"},
         args=lambda f: ["plan", str(f / "tiny.py"), "--budget", "1GB", "--batch-size", "4", "--out", str(f / "again.json")]),
    Case(name="Ctrl-C while importing", args=lambda f: ["plan", "--help"], signal_after_s=0.8, expect="interrupted"),
]
"""The cases: the image project's (``tests/helpers/images.py``), and text ones ("text: ...") over a tiny hf: LM."""


def _run(args: list[str], *, cwd: Path, timeout_s: float, signal_after_s: float | None = None,
         env: dict | None = None, python: bool = False) -> tuple[int | None, str, str]:
    process = subprocess.Popen(
        [sys.executable, "-c", *args] if python else [sys.executable, "-m", "autofit", *args], cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, start_new_session=True,
    )
    if signal_after_s is not None:
        time.sleep(signal_after_s)
        process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return None, out, err
    return process.returncode, out, err


def classify(case: Case, folder: Path) -> tuple[str, str]:
    """The case's class and the last line it printed."""
    case.prepare(folder)
    kept = {path: path.read_bytes() for path in case.keep(folder)}
    code, out, err = _run(case.args(folder), cwd=folder, timeout_s=case.timeout_s, signal_after_s=case.signal_after_s,
                          env=case.env, python=case.python)
    last = (err.strip().splitlines() or out.strip().splitlines() or [""])[-1][:160]
    if code is None:
        return "hang", last
    if "Traceback" in err:
        return "traceback", last
    if any(not path.is_file() or path.read_bytes() != content for path, content in kept.items()):
        return "data lost", last
    if case.expect == "interrupted":
        return ("one-line" if code == 130 and err.strip() == "autofit: interrupted" else "traceback"), last
    if code == 0:
        return ("success" if case.expect == "success" and case.check(folder, out, err) else "wrong success"), last
    lines = err.strip().splitlines()
    if (code == 2 or case.python) and len(lines) == 1 and lines[0].startswith("autofit: error: "):
        return ("one-line" if case.expect == "one-line" else "wrong success"), last
    return "traceback", last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the cases whose name holds this")
    options = parser.parse_args()
    from tests.helpers.images import make_project

    counts: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="autofit-audit-") as root:
        (Path(root) / "template").mkdir()
        template = make_project(Path(root) / "template")
        if any(options.k in c.name and "text" in c.name for c in CASES):
            make_text_plan(Path(root))
        for number, case in enumerate(c for c in CASES if options.k in c.name):
            folder = Path(root) / f"case{number}"
            shutil.copytree(template, folder)
            # The plan names its model file by path: point it at this copy.
            plan = json.loads((folder / "plan.json").read_text())
            plan["model"]["source"] = str(folder / "tiny.py")
            (folder / "plan.json").write_text(json.dumps(plan))
            kind, last = classify(case, folder)
            counts[kind] += 1
            print(f"{kind:<14} {case.name}: {last}", flush=True)
    total = sum(counts.values())
    print()
    print("| cases | " + " | ".join(CLASSES) + " |")
    print("|---" * (len(CLASSES) + 1) + "|")
    print(f"| {total} | " + " | ".join(str(counts[name]) for name in CLASSES) + " |")


if __name__ == "__main__":
    main()
