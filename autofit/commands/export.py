"""`autofit export`: prune, quantize and save trained weights for inference."""
from __future__ import annotations

import typer

from autofit.cli import app
from autofit.commands.common import print_json


@app.command()
def export(
    weights: str = typer.Option(..., "--weights", help="A checkpoint from `autofit train`, e.g. runs/NAME/best.pt."),
    prune: float = typer.Option(0.0, "--prune", help="Share of conv/linear weights set to zero (global L1), in [0, 1)."),
    quantize: str = typer.Option("none", "--quantize", help="int8: dynamic quantization of Linear layers."),
    file_format: str = typer.Option("torchscript", "--format", help="torchscript or onnx."),
    data: str = typer.Option(None, "--data", help="A validation image folder: accuracy before and after."),
    out: str = typer.Option(None, "--out", help="The file to write; default beside the weights (best-export.pt or best.onnx)."),
    batch_size: int = typer.Option(256, "--batch-size", help="Samples per forward when validating."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Global L1 pruning, dynamic int8 quantization, TorchScript/ONNX; file size and accuracy before and after."""
    from autofit.tools.export import ExportConfig, export_weights, format_report

    config = ExportConfig(prune_amount=prune, quantize=quantize, format=file_format)
    report = export_weights(weights, config=config, out=out, data=data, batch_size=batch_size)
    if as_json:
        print_json(report.to_dict())
        return
    print(format_report(report))
