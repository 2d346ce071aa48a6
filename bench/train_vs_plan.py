"""Does training run at the speed its plan measured? Training samples/s over the plan's measured samples/s.

For each case `autofit plan` and then `autofit train --plan` run as their own
processes (imports included), and the ratio is read from the run's summary
line ("speed: training X samples/s (...), the plan measured Y ...: Rx"), which
compares with the plan's clock: CPU time where the plan timed with one thread
on a busy CPU (the wall clock's figure is then shown beside it), else the wall
clock. Each case runs quiet, then again
(plan and training) while the bench keeps two busy processes running, the load
under which training used to run 12-20 times slower than its plan (issue 28).

    python bench/train_vs_plan.py                      # every case, quiet and loaded
    python bench/train_vs_plan.py --cases digits --max-steps 20

Every figure is printed with the machine's load average (1 minute) at its start.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SPEED = re.compile(r"speed: training ([\d.]+) (samples|tokens)/s .*the plan measured ([\d.]+) .*: ([\d.]+)x")
WALL = re.compile(r"; ([\d.]+) by the wall clock")
THREADS = re.compile(r"threads: training with (\d+) intra-op thread")


def cases(data: Path) -> dict[str, dict]:
    """Name -> the model and the arguments `plan` and `train` take for it (the bundled examples, and a torchvision model)."""
    digits = ["--data", str(data)]
    return {
        "digits": {"model": str(EXAMPLES / "digits_cnn.py"), "plan": ["--batch-size", "64"], "train": digits},
        "timm": {"model": str(EXAMPLES / "timm_classifier.py"), "plan": ["--batch-size", "32"], "train": []},
        "hf-lm": {"model": str(EXAMPLES / "hf_causal_lm.py"), "plan": ["--batch-size", "16"], "train": []},
        "mobilenet": {
            "model": "torchvision:mobilenet_v3_small",
            "plan": ["--batch-size", "32", "--input-shape", "3x32x32", "--num-classes", "10"],
            "train": digits,
        },
    }


def run(args: list[str], *, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "autofit", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"autofit {' '.join(args[:2])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout + done.stderr


def one(name: str, case: dict, *, work: Path, max_steps: int) -> str:
    load = os.getloadavg()[0]
    plan = work / f"{name}.json"
    try:
        run(["plan", case["model"], "--budget", "4GB", *case["plan"], "--out", str(plan), "-q"], cwd=work)
        out = run(
            ["train", "--plan", str(plan), *case["train"], "--epochs", "1", "--max-steps", str(max_steps),
             "--log-dir", str(work / "runs" / name), "--overwrite"],
            cwd=work,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return f"| {name} | {load:.1f} | - | - | - | - | {error} |"
    speed, threads, wall = SPEED.search(out), THREADS.search(out), WALL.search(out)
    if speed is None:
        return f"| {name} | {load:.1f} | - | - | - | - | no speed line |"
    trained, unit, planned, ratio = speed.groups()
    clock = f"CPU time (wall clock: {float(wall.group(1)):.1f}, {float(wall.group(1)) / float(planned):.2f})" if wall else "wall clock"
    return (
        f"| {name} | {load:.1f} | {threads.group(1) if threads else '-'} | {float(planned):.1f} {unit}/s | "
        f"{float(trained):.1f} {unit}/s | {float(ratio):.2f} | {clock} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="digits,timm,hf-lm,mobilenet")
    parser.add_argument("--max-steps", type=int, default=20, help="Training steps per case (the first is not counted).")
    parser.add_argument("--busy", type=int, default=2, help="Busy processes for the loaded runs (0: quiet only).")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        data = work / "digits"
        subprocess.run([sys.executable, str(EXAMPLES / "make_digits.py"), str(data)], check=True, capture_output=True)
        table = cases(data)
        header = "| case | load (1 min) | threads | plan measured | training | training / plan | clock |\n|---|---|---|---|---|---|---|"
        print("quiet\n" + header, flush=True)
        for name in options.cases.split(","):
            print(one(name, table[name], work=work, max_steps=options.max_steps), flush=True)
        if options.busy:
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(options.busy)]
            try:
                print(f"\nwith {options.busy} busy processes started by the bench\n" + header, flush=True)
                for name in options.cases.split(","):
                    print(one(name, table[name], work=work, max_steps=options.max_steps), flush=True)
            finally:
                for process in busy:
                    process.kill()
                    process.wait()


if __name__ == "__main__":
    main()
