"""The CUDA allocator both ways: what a card needs beyond the simulated peak, with and without expandable segments.

For each case (ResNet-50, ViT-B/16 and a d768 transformer at the calibration
table's sizes, and bench/floor.py's 0.94B decoder at its floor configuration,
bf16-master, and in fp32 with AdamW on the card), the simulated meter's peak is
predicted on the CPU (``--predict``, on any machine: fake tensors), and then
the same 3 steps run for real on the card, each setting in a fresh process:
the allocator's default segments, ``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``, and (for a few cases) expandable segments set from
inside the process as training sets them. Each row gives the allocated peak,
the reserved peak (the allocator's cache on top), what the process held in all
(NVML), and what an estimated plan for that setting keeps beyond the simulated
peak (planning/memory/headroom.py).

    python bench/gpu_allocator.py --predict bench/gpu_inputs/allocator_predicted.json   # on any CPU (2.5 minutes on 2 cores)
    # on a card (about 4 minutes on an H200):
    timeout 300 python bench/gpu_allocator.py --measure bench/gpu_inputs/allocator_predicted.json --out results/allocator
    python bench/gpu_allocator.py --smoke --out /tmp/allocator                    # tiny cases, all on the CPU

``--measure`` writes ``allocator.json`` (every value) and ``allocator.md`` (the
table) under ``--out``; a case that fails is a row with its error.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autofit._torch_private import expandable_segments_in_use, set_cuda_allocator_settings  # noqa: E402
from autofit.config import TrainingConfig  # noqa: E402
from autofit.measure.probe import measure  # noqa: E402
from autofit.plan_file import EXPANDABLE_SEGMENTS  # noqa: E402
from autofit.planning.memory.headroom import Headroom, persistent_bytes  # noqa: E402
from autofit.spec import ModelSpec, load_spec  # noqa: E402
from bench.sized_examples import example_spec  # noqa: E402

GiB = 2**30
SETTINGS = {"default": "", "expandable": EXPANDABLE_SEGMENTS, "expandable at run time": ""}
"""The allocator settings measured, as PYTORCH_CUDA_ALLOC_CONF spells them. "expandable at run time" sets
expandable segments from inside the process (``set_cuda_allocator_settings``, what training does where CUDA may
already be in use), for the cases in RUNTIME_CASES only: its peaks should be the environment variable's."""
RUNTIME_CASES = ("transformer d768", "decoder 0.94B 1x8 bf16-master", "transformer d64")


def transformer(d_model: int, n_layers: int, seq_len: int, n_heads: int) -> ModelSpec:
    return example_spec(
        "tiny_transformer.py", build=lambda module: module.TinyTransformer("sdpa"),
        D_MODEL=d_model, N_LAYERS=n_layers, SEQ_LEN=seq_len, N_HEADS=n_heads,
    )


def floor_decoder() -> ModelSpec:
    from bench.floor import decoder_spec

    return decoder_spec()


def cases(smoke: bool) -> list[tuple[str, Callable[[], ModelSpec], dict]]:
    """(label, spec, TrainingConfig's fields)."""
    if smoke:
        tiny = lambda: transformer(64, 2, 16, 4)  # noqa: E731
        return [
            ("transformer d64 L2 fp32", tiny, dict(global_batch_size=4, micro_batch_size=4)),
            ("transformer d64 L2 bf16 all", tiny, dict(global_batch_size=4, micro_batch_size=2, precision="bf16", checkpoint="all")),
        ]
    resnet = lambda: load_spec("torchvision:resnet50")  # noqa: E731
    vit = lambda: load_spec("torchvision:vit_b_16")  # noqa: E731
    d768 = lambda: transformer(768, 12, 512, 12)  # noqa: E731
    rows = []
    for label, spec, batch in (("resnet50 224 m=64", resnet, 64), ("vit_b_16 224 m=32", vit, 32), ("transformer d768 L12 T512 m=16", d768, 16)):
        for precision, checkpoint in (("fp32", "none"), ("fp32", "all"), ("bf16", "none"), ("bf16", "all")):
            rows.append((f"{label} {precision} ckpt {checkpoint}", spec, dict(
                global_batch_size=batch, micro_batch_size=batch, precision=precision, checkpoint=checkpoint)))
    rows.append(("decoder 0.94B 1x8 bf16-master ckpt all (floor)", floor_decoder, dict(
        global_batch_size=8, micro_batch_size=1, precision="bf16-master", checkpoint="all")))
    rows.append(("decoder 0.94B 1x8 fp32 ckpt all", floor_decoder, dict(
        global_batch_size=8, micro_batch_size=1, precision="fp32", checkpoint="all")))
    rows.append(("decoder 0.94B 8x1 bf16 ckpt none", floor_decoder, dict(
        global_batch_size=8, micro_batch_size=8, precision="bf16")))
    return rows


def predict(smoke: bool) -> list[dict]:
    """The simulated meter's peak for a GPU, per case, and its persistent bytes."""
    rows = []
    for label, make_spec, fields in cases(smoke):
        start = time.perf_counter()
        result = measure(make_spec(), TrainingConfig(**fields), device="cuda", simulate=True, steps=2)
        rows.append(dict(case=label, config=fields, predicted_bytes=result.peak_bytes, predicted_breakdown=result.breakdown,
                         persistent_bytes=persistent_bytes(result.breakdown), torch=torch.__version__))
        print(f"{label}: simulated {result.peak_bytes / GiB:.2f} GiB ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def measure_cases(predicted: list[dict], *, device: str, out: Path, at_run_time: bool) -> None:
    """In this process (its allocator set by the parent, or here ``at_run_time``): each case for real, one JSON line
    each as it ends."""
    specs = {label: make_spec for label, make_spec, _ in cases(device == "cpu")}
    if at_run_time:
        predicted = [row for row in predicted if row["case"].startswith(RUNTIME_CASES)]
        if device == "cuda":
            set_cuda_allocator_settings(EXPANDABLE_SEGMENTS)
    with out.open("a") as lines:
        for row in predicted:
            start = time.perf_counter()
            try:
                result = measure(specs[row["case"]](), TrainingConfig(**row["config"]), device=device, steps=3)
                cache = result.breakdown.get("allocator_cache", 0)
                context = result.breakdown.get("context", 0)
                record = dict(case=row["case"], process_bytes=result.peak_bytes, allocated_bytes=result.peak_bytes - cache - context,
                              reserved_bytes=result.peak_bytes - context, context_bytes=context, host_peak_bytes=result.host_peak_bytes,
                              samples_per_s=result.samples_per_s, measured_breakdown=result.breakdown)
            except Exception as error:  # noqa: BLE001 - one failing case is a row
                record = dict(case=row["case"], error=f"{type(error).__name__}: {str(error).strip()[:300]}", traceback=traceback.format_exc(limit=-3))
            record["seconds"] = time.perf_counter() - start
            if device == "cuda":
                record["allocator_settings"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
                record["expandable_segments_seen"] = expandable_segments_in_use(torch.device("cuda", torch.cuda.current_device()))
                torch.cuda.empty_cache()
            lines.write(json.dumps(record) + "\n")
            lines.flush()
            got = record.get("error") or f"process {record['process_bytes'] / GiB:.2f} GiB"
            print(f"  {row['case']}: {got} ({record['seconds']:.0f} s)", flush=True)


def estimated_headroom(row: dict, *, setting: str) -> int:
    """What a plan estimated for this setting keeps beyond the simulated peak, less the safety margin (a share of the
    budget, not of the peak)."""
    headroom = Headroom.estimated_cuda(row["predicted_bytes"], expandable_segments=setting != "default")
    causes = headroom.for_peak(row["predicted_bytes"], persistent_bytes=row["persistent_bytes"])
    return sum(value for cause, value in causes.items() if cause != "safety_margin")


def table(predicted: list[dict], measured: dict[str, dict[str, dict]]) -> str:
    lines = [
        "| case | setting | predicted | persistent | allocated | reserved | process | pred/alloc | beyond predicted | estimated headroom | covered by | expandable seen |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in predicted:
        for setting in SETTINGS:
            got = measured.get(setting, {}).get(row["case"])
            if got is None and setting == "expandable at run time":
                continue
            if got is None or "error" in got:
                lines.append(f"| {row['case']} | {setting} | {row['predicted_bytes'] / GiB:.2f} | | | | | | | | {got['error'] if got else 'not measured'} |")
                continue
            beyond = got["process_bytes"] - row["predicted_bytes"]
            keep = estimated_headroom(row, setting=setting)
            lines.append(
                f"| {row['case']} | {setting} | {row['predicted_bytes'] / GiB:.2f} | {row['persistent_bytes'] / GiB:.2f} | "
                f"{got['allocated_bytes'] / GiB:.2f} | {got['reserved_bytes'] / GiB:.2f} | {got['process_bytes'] / GiB:.2f} | "
                f"{row['predicted_bytes'] / got['allocated_bytes']:.3f} | {beyond / GiB:.2f} | {keep / GiB:.2f} | {(keep - beyond) / GiB:+.2f} | {got.get('expandable_segments_seen', '')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predict", type=Path, help="write the simulated peaks here (on any machine)")
    parser.add_argument("--measure", type=Path, help="the predictions to measure on the card, both ways")
    parser.add_argument("--out", type=Path, help="folder for allocator.json and allocator.md")
    parser.add_argument("--smoke", action="store_true", help="tiny cases, predicted and measured on the CPU")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--at-run-time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        predicted = json.loads(args.measure.read_text())
        measure_cases(predicted, device="cpu" if args.smoke else "cuda", out=Path(args.child), at_run_time=args.at_run_time)
        return 0
    if args.predict:
        args.predict.parent.mkdir(parents=True, exist_ok=True)
        args.predict.write_text(json.dumps(predict(args.smoke), indent=2))
        return 0
    if not args.out:
        parser.error("--out is needed with --measure or --smoke")
    args.out.mkdir(parents=True, exist_ok=True)
    source = args.measure
    if args.smoke:
        source = args.out / "predicted.json"
        source.write_text(json.dumps(predict(True), indent=2))
    elif source is None or not torch.cuda.is_available():
        parser.error("--measure PREDICTED needs a CUDA card (or use --smoke)")
    predicted = json.loads(source.read_text())
    measured: dict[str, dict[str, dict]] = {}
    for setting, conf in SETTINGS.items():
        lines = args.out / f"measured-{setting.replace(' ', '-')}.jsonl"
        lines.unlink(missing_ok=True)
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        print(f"{setting} (PYTORCH_CUDA_ALLOC_CONF={conf!r}):", flush=True)
        command = [sys.executable, __file__, "--measure", str(source), "--child", str(lines)] + (["--smoke"] if args.smoke else [])
        command += ["--at-run-time"] if setting == "expandable at run time" else []
        code = subprocess.run(command, env=env).returncode
        records = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
        measured[setting] = {record["case"]: record for record in records}
        if code:
            print(f"  the {setting} process exited {code} after {len(records)} case(s)", flush=True)
    text = table(predicted, measured)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke)"
    (args.out / "allocator.json").write_text(json.dumps(dict(card=name, torch=torch.__version__, predicted=predicted, measured=measured), indent=2))
    (args.out / "allocator.md").write_text(f"Allocator both ways on {name}, torch {torch.__version__}\n\n{text}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
