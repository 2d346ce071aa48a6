"""examples/trainer_finetune.py and examples/lightning_classifier.py train a few steps with a plan."""
import json
import runpy
import sys

import pytest

import autofit
from autofit.plan_file import ModelInfo
from tests.helpers import EXAMPLES


def _run(monkeypatch, capsys, script: str, *args) -> str:
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    return capsys.readouterr().out.splitlines()[-1]


def test_the_trainer_example_fine_tunes_with_a_plan(tiny_lm, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from tests.helpers.tiny_lm import corpus_lines

    text, args, plan = tmp_path / "corpus.txt", tmp_path / "args.json", tmp_path / "plan.json"
    text.write_text("\n".join(corpus_lines(8)))
    args.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "report_to": [], "save_strategy": "no", "use_cpu": True, "optim": "adamw_torch"}))
    config = autofit.TrainingConfig(global_batch_size=4, micro_batch_size=2, checkpoint="all", loss_chunks=2)
    autofit.save_plan(autofit.Plan(budget_bytes=2**30, model=ModelInfo(seq_len=16), config=config), plan)
    last = _run(monkeypatch, capsys, "trainer_finetune.py", plan, "--model", tiny_lm, "--text", text, "--trainer-args", args, "--steps", "1")
    assert last.startswith("trained 1 step(s) of 4 samples (2 x 2): loss ") and (tmp_path / "out" / "final" / "config.json").is_file()


def test_the_lightning_example_classifies_an_image_folder_with_a_plan(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lightning")
    from autofit.spec import model_fingerprint
    from tests.helpers.images import write_images

    write_images(tmp_path / "images", per_class=4, seed=0)
    example = runpy.run_path(str(EXAMPLES / "lightning_classifier.py"))
    plan = autofit.Plan(
        budget_bytes=2**30, model=ModelInfo(fingerprint=model_fingerprint(example["build_model"]())),
        config=autofit.TrainingConfig(global_batch_size=4, micro_batch_size=2, checkpoint="features.0"),
    )
    autofit.save_plan(plan, tmp_path / "plan.json")
    last = _run(monkeypatch, capsys, "lightning_classifier.py", tmp_path / "plan.json", "--data", tmp_path / "images", "--steps", "1")
    assert last.startswith("trained 1 step(s) of 4 images (2 x 2), checkpoint features.0: loss ")
