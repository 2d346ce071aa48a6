"""`autofit val`: score trained weights on a validation image folder."""
from __future__ import annotations

import typer

from autofit.cli import app
from autofit.commands.common import DEVICES, one_of, print_json
from autofit.config import DeviceChoice
from autofit.errors import UserError


@app.command()
def val(
    weights: str = typer.Option(..., "--weights", help="A checkpoint from `autofit train`, e.g. runs/NAME/best.pt."),
    data: str = typer.Option(
        None, "--data", help="An image folder of class folders, e.g. data/digits/val; default the model file's val_dataset()."
    ),
    batch_size: int = typer.Option(256, "--batch-size", help="Samples per forward."),
    device: str = typer.Option("cpu", help=f"{one_of(DeviceChoice)}."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Accuracy, macro and per-class precision/recall/F1, and the confusion matrix (without --data: loss, accuracy or perplexity)."""
    from autofit.tools.evaluate import format_evaluation, format_scores, validate_model_data, validate_weights
    from autofit.device import device_info

    if device not in DEVICES:
        raise UserError(f"--device {device!r} is unknown; use {one_of(DeviceChoice)}")
    if device == "cuda":
        device_info("cuda")  # one line when no GPU is visible
    if data is None:  # the model file's own validation data: any input form, any output
        scores = validate_model_data(weights, batch_size=batch_size, device=device)
        if as_json:
            print_json({"weights": weights, "data": "val_dataset()", **scores})
            return
        print(f"{weights} on the model's val_dataset()")
        print(format_scores(scores))
        return
    evaluation = validate_weights(weights, data, batch_size=batch_size, device=device)
    if as_json:
        print_json({"weights": weights, "data": data, **evaluation.to_dict()})
        return
    print(f"{weights} on {data}")
    print(format_evaluation(evaluation))
