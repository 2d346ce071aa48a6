"""How long does a plan take, where does the time go, and what is it worth in probes?

For each case, `autofit plan` runs as its own process (imports included), its
wall time is split by step (the summary's "time by step" line; for a source
tree without it, the progress lines' stamps), and it is divided by the wall
time of one `autofit probe` process of the plan's unconstrained configuration
(same meter, one process, 3 steps; always from this tree), run right after it. A second plan of the
same model at another budget shows what the cache saves.

Given several source trees (--trees), each case runs in every tree in turn,
so that before/after figures come from side-by-side runs on the same load.

With --load-test, the digits plan (or --load-case's) runs again while the bench keeps two busy
processes running, and the chosen configurations and times are compared with
the runs without them; a run past --timeout is killed and counted as a hang. The
"lstm" case is #47's: a two-layer LSTM language model file (written to the scratch folder) at
60% of its unconstrained peak, batch 8, on the CPU.

With --llama, Llama-3-shaped 1B and 70B configs (config.json only, written
here) are planned cold with the same flags (``LLAMA_FLAGS``: one simulated
192 GiB card, both plan), in every tree: the wall times, the memory model's
share, its 'memory: tracing' lines, and 70B over 1B.

    python bench/plan_speed.py                                  # this tree
    python bench/plan_speed.py --trees /tmp/before,. --threads 1
    python bench/plan_speed.py --cases digits --load-test 5
    python bench/plan_speed.py --no-main --load-test 10 --load-case lstm --timeout 300
    AUTOFIT_TRACE_WORKERS=2 python bench/plan_speed.py --llama --no-main --trees /tmp/before,.

A plan starts its trace workers only where no other task is seen running
(``planning/memory/workers.py``), so on a small machine one plan may trace
in its own process and the next in two workers; AUTOFIT_TRACE_WORKERS fixes
that for every plan the bench runs.

Every figure is printed with the machine's load average (1 minute) at its start.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autofit.units import format_bytes, parse_budget  # noqa: E402

SIMULATED_GPU = ("--simulate", "--device", "cuda", "--device-memory", "24GiB")


@dataclass
class Case:
    key: str
    model: list[str]
    """MODEL and the options that describe it (input shape, classes)."""
    batch_size: int
    budgets: tuple[str, str]
    """The first plan's budget and the second's (served by the cache); "floor"/"2floor" are found first, "0.6peak"
    from one probe of the whole batch."""
    simulate: bool = False


CASES = {
    "digits": Case("digits", ["examples/digits_cnn.py"], 64, ("64MB", "16MB")),
    "transformer": Case("transformer", ["examples/tiny_transformer.py"], 64, ("200MB", "50MB")),
    "resnet18": Case(
        "resnet18", ["torchvision:resnet18", "--input-shape", "3x32x32", "--num-classes", "10"], 256, ("floor", "2floor"),
    ),
    "resnet50": Case(
        "resnet50", ["torchvision:resnet50", "--input-shape", "3x224x224", "--num-classes", "1000"], 64, ("6GiB", "4GiB"), simulate=True,
    ),
    "lstm": Case("lstm", ["{scratch}/lstm_lm.py"], 8, ("0.6peak", "0.4peak")),
    "vit": Case("vit", ["torchvision:vit_b_16", "--input-shape", "3x224x224", "--num-classes", "1000"], 32, ("5GiB", "4GiB"), simulate=True),
    # #47's loops and many small ops, each at about half its unconstrained peak (ResNet-18 at the issue's 200 MiB).
    "resnet18-64": Case("resnet18-64", [str(ROOT / "bench/models47/resnet18_10.py")], 32, ("200MiB", "100MiB")),
    "mamba": Case("mamba", [str(ROOT / "bench/models47/mamba_like.py")], 32, ("30MiB", "20MiB")),
    "swin": Case("swin", [str(ROOT / "bench/models47/swin_like.py")], 32, ("45MiB", "30MiB")),
}
DEFAULT_CASES = ("digits", "transformer", "resnet18", "resnet50", "lstm", "vit")
LSTM_MODEL = '''"""A two-layer LSTM language model (#47's hang: real mkldnn RNN kernels beside forked trace workers)."""
import torch
from torch import nn

VOCAB, T = 256, 512


class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, VOCAB)

    def forward(self, tokens):  # (B, T)
        hidden, _ = self.lstm(self.embed(tokens))
        return self.head(hidden).transpose(1, 2)  # (B, VOCAB, T)


def build_model():
    return LSTMLM()


def example_batch(n):
    tokens = torch.randint(0, VOCAB, (n, T + 1))
    return tokens[:, :-1], tokens[:, 1:]
'''
PHASES = ("startup", "memory", "floor", "speed", "search", "verify", "write")

LLAMA_SHAPES = {
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=8192, tie_word_embeddings=True),
    "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672, tie_word_embeddings=False),
}
LLAMA_FLAGS = (
    "--task", "causal-lm", "--seq-len", "2048", "--batch-size", "8", "--simulate", "--device", "cuda",
    "--device-memory", "192GiB", "--budget", "180GiB", "--host-memory", "2TiB", "--no-cache",
)


def load() -> float:
    return os.getloadavg()[0]


def settle(*, below: float = 1.0, longest_s: float = 180.0) -> float:
    """Wait until the 1-minute load average falls below ``below`` (at most ``longest_s``): the quiet runs must not
    start under the load the last runs' busy processes leave in the average. Returns the load at the end."""
    waited = 0.0
    while load() >= below and waited < longest_s:
        time.sleep(5)
        waited += 5
    return load()


@dataclass
class Run:
    seconds: float
    load: float
    cpu_seconds: float = 0.0
    """User + system CPU seconds of the process and its children (trace workers)."""
    phases: dict[str, float] = field(default_factory=dict)
    chosen: str = ""
    plan: dict = field(default_factory=dict)
    noise: str = ""
    threads: str = ""
    error: str = ""


def autofit(tree: Path, args: list[str], *, env: dict, timeout_s: float | None = None) -> tuple[float, float, subprocess.CompletedProcess]:
    """Run `python -m autofit ARGS` with ``tree`` first on the path; (wall seconds, load at start, result). A run
    past ``timeout_s`` is killed and returned with exit code -9 and "hang" as its last line. The run's CPU seconds
    (user + system, its workers included) are ``cpu_seconds(result)``."""
    env = {**env, "PYTHONPATH": str(tree)}
    started_load, start, started_cpu = load(), time.perf_counter(), _children_cpu()
    # Run from the tree itself: `python -m` puts the working directory first on the path.
    command = [sys.executable, "-m", "autofit", *args]
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(command, -9, "", f"hang: still running after {timeout_s:.0f} s, killed")
    done.cpu_seconds = _children_cpu() - started_cpu
    return time.perf_counter() - start, started_load, done


def _children_cpu() -> float:
    """User + system seconds of every waited-for child so far (a run's own, as a difference: runs are one at a time)."""
    used = os.times()
    return used.children_user + used.children_system


def cpu_seconds(done: subprocess.CompletedProcess) -> float:
    return getattr(done, "cpu_seconds", 0.0)


def plan(tree: Path, case: Case, budget: str, *, env: dict, out: Path, timeout_s: float | None = None) -> Run:
    args = ["plan", *case.model, "--budget", budget, "--batch-size", str(case.batch_size), "--out", str(out)]
    if case.simulate:
        args += list(SIMULATED_GPU)
    seconds, started_load, done = autofit(tree, args, env=env, timeout_s=timeout_s)
    run = Run(seconds=seconds, load=started_load, cpu_seconds=cpu_seconds(done))
    if done.returncode != 0:
        run.error = (done.stderr.strip().splitlines() or ["?"])[-1]
        return run
    run.plan = json.loads(out.read_text())
    run.chosen = chosen_text(run.plan)
    run.phases = phases(done.stdout, done.stderr, wall=seconds)
    noise = re.search(r"repeated within ([\d.]+%)", done.stdout)
    within = re.search(r"as fast within that noise: (.*) \(the simpler", done.stdout)
    close = re.search(r"slower, but within that noise: (.*)", done.stdout)
    run.noise = (noise.group(1) if noise else "") + (f"; within it: {within.group(1)}" if within else "") + (
        f"; slower within it: {close.group(1)}" if close else ""
    )
    threads = re.search(r"threads     (.*)", done.stdout)
    run.threads = threads.group(1) if threads else ""
    return run


def chosen_text(plan: dict) -> str:
    steps = math.ceil(plan["global_batch_size"] / plan["micro_batch_size"])
    return f"{plan['precision']} {plan['micro_batch_size']}x{steps} ckpt={len(plan['checkpoint'])}"


def phases(stdout: str, stderr: str, *, wall: float) -> dict[str, float]:
    """Seconds per step: the summary's split where there is one, else from the progress lines' stamps."""
    planned = re.search(r"planned in ([\d.]+) s", stdout)
    total = float(planned.group(1)) if planned else wall
    split = re.search(r"time by step \(s\): (.*)", stdout)
    found = {"startup": wall - total}
    if split:
        for part in split.group(1).split(","):
            name, seconds = part.strip().rsplit(" ", 1)
            found[name] = float(seconds)
        return found
    # The tree at the branch point: memory (with the floor), speed, search (with the candidates' memory probes),
    # verification (timing and the unconstrained configuration), each from its line's stamp to the next.
    stamps = [(float(m.group(1)), m.group(2)) for m in re.finditer(r"\[\s*([\d.]+) s\] (\w+)", stderr)]
    names = {"memory": "memory", "speed": "speed", "search": "search", "verify": "verify", "planned": None}
    marks = [(t, names[w]) for t, w in stamps if w in names]
    for (start, name), (end, _) in zip(marks, marks[1:]):
        if name:
            found[name] = found.get(name, 0.0) + end - start
    return found


def probe(tree: Path, case: Case, plan_dict: dict, *, env: dict) -> Run:
    """One `autofit probe` of the plan's unconstrained configuration (the plan's meter, 3 steps): the plan's own
    where it has none apart (the chosen configuration is the fastest with no budget)."""
    u = plan_dict["measured"]["unconstrained"]
    if u.get("precision") is None:
        u = {"precision": plan_dict["precision"], "micro_batch_size": plan_dict["micro_batch_size"],
             "grad_accum_steps": math.ceil(plan_dict["global_batch_size"] / plan_dict["micro_batch_size"])}
    args = [
        "probe", *case.model, "-m", str(u["micro_batch_size"]), "-k", str(u["grad_accum_steps"]), "--precision", u["precision"],
        "--steps", "3",
    ]
    if case.simulate:
        args += ["--simulate", "--device", "cuda"]
    seconds, started_load, done = autofit(tree, args, env=env)
    return Run(
        seconds=seconds, load=started_load, cpu_seconds=cpu_seconds(done), error="" if done.returncode == 0 else done.stderr.strip()[-200:],
    )


def floor_budget(case: Case, *, env: dict) -> int:
    """The floor, from the planner's refusal of a tiny budget (this tree, no cache)."""
    args = ["plan", *case.model, "--budget", "1MB", "--batch-size", str(case.batch_size), "--no-cache", "-q", "--out", os.devnull]
    _, _, done = autofit(ROOT, args, env=env)
    found = re.search(r"below the floor ([\d.]+ \w+)", done.stderr)
    if not found:
        raise SystemExit(f"no floor found for {case.key}: {done.stderr[-300:]}")
    value, unit = found.group(1).split()
    return parse_budget(f"{float(value) + 0.01}{unit}")  # the message rounds to 0.01: stay above it


def peak_budget(case: Case, share: float, *, env: dict) -> int:
    """``share`` of the peak of one probe of the whole batch in one micro-batch (fp32, this tree)."""
    args = ["probe", *case.model, "-m", str(case.batch_size), "--steps", "2", "--json", "-q"]
    _, _, done = autofit(ROOT, args, env=env)
    if done.returncode != 0:
        raise SystemExit(f"no peak found for {case.key}: {done.stderr[-300:]}")
    return int(json.loads(done.stdout)["peak_bytes"] * share)


def resolved_budgets(case: Case, *, env: dict) -> list[str]:
    """The case's budgets in bytes where they are named by the model's floor or peak."""
    budgets = list(case.budgets)
    if "floor" in budgets:
        floor = floor_budget(case, env=env)
        budgets = [str(floor) if b == "floor" else str(2 * floor) for b in budgets]
    return [str(peak_budget(case, float(b[: -len("peak")]), env=env)) if b.endswith("peak") else b for b in budgets]


def row(tree: str, case: Case, label: str, budget: str, run: Run, yardstick: Run | None) -> str:
    cells = [f"{run.phases.get(p, 0.0):.1f}" if p in run.phases else "-" for p in PHASES]
    measured = yardstick and not yardstick.error and not run.error
    ratio = f"{run.seconds / yardstick.seconds:.2f}" if measured else "-"
    cpu_ratio = f"{run.cpu_seconds / yardstick.cpu_seconds:.2f}" if measured and yardstick.cpu_seconds else "-"
    probe_s = f"{yardstick.seconds:.1f} / {yardstick.cpu_seconds:.1f} ({yardstick.load:.1f})" if yardstick else "-"
    what = run.error or run.chosen
    return (
        f"| {case.key} | {label} | {budget} | {tree} | {run.seconds:.1f} | {run.cpu_seconds:.1f} | {run.load:.1f} | " + " | ".join(cells)
        + f" | {probe_s} | {ratio} | {cpu_ratio} | {what} | {run.noise or '-'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=str(ROOT), help="Source trees to compare, separated by commas (e.g. a checkout of the branch point).")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"Of {', '.join(CASES)}.")
    parser.add_argument("--first-only", action="store_true", help="Each case's first plan only (not the second, from the cache).")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every process (default: unset).")
    parser.add_argument("--load-test", type=int, default=0, help="Runs of the digits plan under two busy processes.")
    parser.add_argument("--load-case", default="digits", help="The case the load test plans (its first budget).")
    parser.add_argument("--timeout", type=float, default=None, help="Seconds after which a load-test plan counts as a hang.")
    parser.add_argument("--no-main", action="store_true", help="Only the load test and --llama.")
    parser.add_argument("--llama", action="store_true", help="Plan Llama-3-shaped 1B and 70B configs with the same flags.")
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    labels = {tree: ("before" if i == 0 and len(trees) > 1 else "after") if len(trees) <= 2 else tree.name for i, tree in enumerate(trees)}
    env = {k: v for k, v in os.environ.items() if k != "AUTOFIT_CACHE_DIR"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="plan-speed-"))
    (scratch / "lstm_lm.py").write_text(LSTM_MODEL)
    for key, case in CASES.items():
        CASES[key] = Case(case.key, [a.format(scratch=scratch) for a in case.model], case.batch_size, case.budgets, case.simulate)
    print(f"# bench/plan_speed.py, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}")
    header = (
        "| case | plan | budget | tree | wall s | cpu s | load | " + " | ".join(PHASES)
        + " | probe wall / cpu s (load) | plan / probe (wall) | plan / probe (cpu) | chosen | timing noise |"
    )
    if not args.no_main:
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for key in args.cases.split(","):
            case = CASES[key]
            budgets = resolved_budgets(case, env=env)
            for tree in trees:
                cache = scratch / f"cache-{key}-{labels[tree]}"
                tree_env = {**env, "AUTOFIT_CACHE_DIR": str(cache)}
                for label, budget in zip(("first", "second (cache)")[: 1 if args.first_only else 2], budgets):
                    out = scratch / f"{key}-{labels[tree]}-{label[:5]}.json"
                    run = plan(tree, case, budget, env=tree_env, out=out)
                    # The yardstick runs from this tree: at the branch point `probe --simulate` failed for ViT.
                    yardstick = probe(ROOT, case, run.plan, env=tree_env) if run.plan and label == "first" else None
                    shown = format_bytes(int(budget)) if budget.isdigit() else budget
                    print(row(labels[tree], case, label, shown, run, yardstick if label == "first" else _last_probe.get(key + labels[tree])), flush=True)
                    if yardstick:
                        _last_probe[key + labels[tree]] = yardstick
    if args.llama:
        llama(trees, labels, env=env, scratch=scratch)
    if args.load_test:
        for tree in trees:  # the last tree (this one) gets every run; others two, to show what they did
            load_test(
                tree, CASES[args.load_case], runs=args.load_test if tree == trees[-1] else min(2, args.load_test), env=env,
                scratch=scratch, timeout_s=args.timeout,
            )


_last_probe: dict[str, Run] = {}


def llama(trees: list[Path], labels: dict, *, env: dict, scratch: Path) -> None:
    """Plan the 1B and 70B Llama shapes cold with ``LLAMA_FLAGS`` in each tree; 70B's wall time over 1B's."""
    from transformers import LlamaConfig

    print(f"\n## Llama-3 shapes, one flag set: {' '.join(LLAMA_FLAGS)}\n")
    print("| tree | model | layers | wall s | load | memory s | 'memory: tracing' lines | verify s | outcome |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tree in trees:
        walls = {}
        for name, shape in LLAMA_SHAPES.items():
            folder = scratch / f"llama-{name}"
            if not folder.exists():
                LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=8192, **shape).save_pretrained(folder)
            settle()
            out = scratch / f"llama-{name}-{labels[tree]}.json"
            seconds, started_load, done = autofit(tree, ["plan", f"hf:{folder}", *LLAMA_FLAGS, "--out", str(out)], env=env)
            walls[name] = seconds
            found = phases(done.stdout, done.stderr, wall=seconds)
            traced = len(re.findall(r"\] memory: tracing", done.stderr))
            outcome = chosen_text(json.loads(out.read_text())) if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1][:120]
            print(
                f"| {labels[tree]} | {name} | {shape['num_hidden_layers']} | {seconds:.1f} | {started_load:.1f} | "
                f"{found.get('memory', 0.0):.1f} | {traced} | {found.get('verify', 0.0):.1f} | {outcome} |",
                flush=True,
            )
        print(f"\n{labels[tree]}: 70B / 1B wall time {walls['70B'] / walls['1B']:.2f}\n")


def load_test(tree: Path, case: Case, *, runs: int, env: dict, scratch: Path, timeout_s: float | None = None) -> None:
    """The case's plan without and with two more busy processes: the same choice, how much slower, and no hang."""
    budget = resolved_budgets(case, env=env)[0]
    print(f"\n## {case.key} plan under load ({tree}), budget {format_bytes(int(budget)) if budget.isdigit() else budget}\n")
    print("| run | extra busy processes | load | wall s | chosen | timing noise | threads note |")
    print("|---|---|---|---|---|---|---|")

    def once(label: str, extra: int, index: int) -> Run:
        out = scratch / f"load-{label}-{index}.json"
        run_env = {**env, "AUTOFIT_CACHE_DIR": str(scratch / f"load-cache-{label}-{index}")}  # a cold cache each time
        run = plan(tree, case, budget, env=run_env, out=out, timeout_s=timeout_s)
        print(
            f"| {index} | {extra} | {run.load:.1f} | {run.seconds:.1f} | {run.error or run.chosen} | {run.noise or '-'} | {run.threads or '-'} |",
            flush=True,
        )
        return run

    settle()
    quiet = [once(f"quiet-{tree.name}", 0, i) for i in range(2)]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(5)  # let the load average see them
        loaded = [once(f"busy-{tree.name}", 2, i) for i in range(runs)]
    finally:
        for process in busy:  # only the processes started here
            process.kill()
            process.wait()
    hangs = sum(r.error.startswith("hang") for r in loaded)
    print(f"\nunder load: {runs - sum(bool(r.error) for r in loaded)} of {runs} planned, {hangs} hung; longest {max(r.seconds for r in loaded):.1f} s")
    reference = quiet[0].chosen
    same = sum(r.chosen == reference for r in loaded)
    # The other way to pass: the quiet choice within the noise a loaded run reports of its own choice.
    words = f"{quiet[0].plan['precision']}, micro-batch {quiet[0].plan['micro_batch_size']}, checkpoint none" if quiet[0].plan else "?"
    within = sum(r.chosen != reference and words in r.noise for r in loaded)
    quiet_s = min(r.seconds for r in quiet)
    print(
        f"\nwithout the extra processes: {', '.join(r.chosen for r in quiet)}; with them: {same} of {runs} chose {reference}"
        f"{f', {within} more chose one within the noise they report of it' if within else ''}; "
        f"time with / without: {', '.join(f'{r.seconds / quiet_s:.2f}' for r in loaded)}"
    )


if __name__ == "__main__":
    main()
