"""--lora: PEFT adapters over a pretrained hf: model, planned, trained and saved for PEFT; the base stays as loaded."""
import json

import pytest
import torch

from autofit.adapters import parse_lora
from autofit.errors import UserError
from autofit.training.weights import load_checkpoint
from tests.helpers.tiny_lm import corpus_lines

pytestmark = pytest.mark.slow  # the whole module plans or trains real models (tens of seconds each)

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = "r=4,alpha=8,targets=q_proj,v_proj"


def test_lora_text_is_read_once_and_written_back_the_same():
    settings = parse_lora("r=4, targets=q_proj,v_proj,alpha=8")
    assert settings.targets == ("q_proj", "v_proj") and settings.alpha == 8 and settings.text() == LORA
    assert parse_lora(settings.text()) == settings
    assert parse_lora("r=16").alpha == 16  # alpha defaults to r
    for bad, said in [("alpha=8", "needs r"), ("r=0", "at least 1"), ("r=4,rank=2", "'rank' is not a LoRA setting"),
                      ("r=4,r=8", "twice"), ("r=x", "whole number"), ("r=4,targets=", "targets not empty"),
                      ("r=4,alpha=nan", "alpha a positive finite number"), ("r=4,alpha=inf", "alpha a positive finite number")]:
        with pytest.raises(UserError, match=said):
            parse_lora(bad)


def test_plan_and_train_with_lora_change_only_the_adapters_and_save_them_for_peft(tiny_lm, tmp_path, run_cli):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in corpus_lines(80)))
    plan = tmp_path / "plan.json"
    code, out, err = run_cli("plan", f"hf:{tiny_lm}", "--task", "causal-lm", "--seq-len", "32", "--batch-size", "4",
                             "--budget", "1GB", "--out", plan, "--precisions", "fp32", "--lora", LORA)
    assert code == 0, err
    saved = json.loads(plan.read_text())["model"]
    assert saved["lora"] == LORA
    assert f"frozen; LoRA adapters ({LORA}) trained" in out
    code, out, err = run_cli("train", "--plan", plan, "--data", corpus, "--epochs", "1", "--workers", "0",
                             "--log-dir", tmp_path / "run", "--lr", "1e-2", "--merge")
    assert code == 0, err
    assert "saved merged" in out
    trained = load_checkpoint(tmp_path / "run" / "last.pt")["model_state"]
    base = {name: tensor for name, tensor in
            __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_lm).state_dict().items()}
    adapters = [name for name in trained if "lora_" in name]
    assert adapters
    for name, tensor in trained.items():
        if "lora_" in name:
            continue
        base_name = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(tensor, base[base_name]), name  # the pretrained base, loaded and frozen
    assert any(not torch.all(trained[name] == 0) for name in adapters if "lora_B" in name)  # B starts at 0: it trained
    # The adapter is saved for PEFT and loads over the base to the trained model's logits.
    model = peft.PeftModel.from_pretrained(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_lm), tmp_path / "run" / "hf",
    )
    assert all(torch.equal(model.state_dict()[name], trained[name]) for name in adapters)
    # --merge: the adapters merged into the base, loaded by transformers alone, give the adapted model's logits.
    merged = __import__("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf" / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    tokens = torch.randint(0, merged.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5)
    # Given again to train, it must be the plan's.
    code, out, err = run_cli("train", "--plan", plan, "--data", corpus, "--log-dir", tmp_path / "again", "--lora", "r=8")
    assert code == 2 and "the plan was made with --lora r=4,alpha=8,targets=q_proj,v_proj" in err


def test_fit_with_lora_trains_the_adapters_over_the_frozen_model(tmp_path):
    import autofit

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(8, 16))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("out", torch.nn.Linear(16, 3))
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    result = autofit.fit(model, train_data=data, batch_size=8, budget="64MB", epochs=1, lora="r=2,targets=fc,out",
                         log_dir=tmp_path / "run", verbose=False, num_workers=0, lr=1e-2)
    assert result.plan.model.lora == "r=2,alpha=2,targets=fc,out"
    state = model.state_dict()  # the adapters went into the model given, in place
    for name, tensor in base.items():
        layer, kind = name.rsplit(".", 1)
        assert torch.equal(state[f"{layer}.base_layer.{kind}"], tensor), name
    assert any("lora_B" in name and not torch.all(tensor == 0) for name, tensor in state.items())
    with pytest.raises(UserError, match="the plan was made with lora='r=2,alpha=2,targets=fc,out'"):
        autofit.fit(torch.nn.Linear(8, 3), train_data=data, plan=result.plan, lora="r=4,targets=fc", verbose=False)


def test_merge_without_adapters_is_one_line_before_training(run_cli, tmp_path):
    from tests.helpers import ROOT

    code, _, err = run_cli("train", "--plan", ROOT / "tests" / "plan_files" / "cpu_measured.json", "--merge",
                           "--log-dir", tmp_path / "run")
    assert code == 2 and "--merge merges LoRA adapters into the base, and this plan trains none" in err
    assert not (tmp_path / "run").exists()


def test_weights_of_the_base_model_start_a_lora_run(tiny_lm, tmp_path, run_cli):
    """--weights with the base model's own names (not a LoRA run's): loaded into the base, the adapters added over it."""
    transformers = __import__("transformers")
    plan = tmp_path / "plan.json"
    code, _, err = run_cli("plan", f"hf:{tiny_lm}", "--task", "causal-lm", "--seq-len", "32", "--batch-size", "2",
                           "--budget", "1GB", "--out", plan, "--precisions", "fp32", "--lora", LORA)
    assert code == 0, err
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny_lm))
    torch.save(base.state_dict(), tmp_path / "base.pt")
    code, out, err = run_cli("train", "--plan", plan, "--weights", tmp_path / "base.pt", "--max-steps", "1", "--workers", "0",
                             "--log-dir", tmp_path / "run")
    assert code == 0, err
    assert f"from {tmp_path / 'base.pt'}, frozen; LoRA adapters ({LORA}) trained" in out
    trained = load_checkpoint(tmp_path / "run" / "last.pt")["model_state"]
    for name, tensor in base.state_dict().items():
        if name == "lm_head.weight" and base.config.tie_word_embeddings:
            continue
        adapted = "base_model.model." + name.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")
        assert torch.equal(trained[adapted], tensor), name


def test_qlora_plans_below_the_lora_floor_and_trains_text_as_the_dense_base_does(tmp_path, run_cli):
    """The tiny Llama at hidden 128 (its q, o and MLP weights are whole NF4 blocks; k and v, 8,192 values, stay dense).
    Below the LoRA plan's floor, --lora is refused and names NF4; with --allow-lossy-base the plan holds the base in NF4,
    measured under that floor. Trained on the same text, its first and last steps' losses are within 1% of the dense
    base's (0.2% and 0.05% when written), and its validation perplexity falls."""
    pytest.importorskip("torchao")
    import re

    from autofit.plan_file import load_plan
    from tests.helpers.tiny_lm import tiny_lm_dir

    model = tiny_lm_dir(tmp_path / "lm", hidden=128, layers=4)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in corpus_lines(160)))
    plan = ["plan", f"hf:{model}", "--task", "causal-lm", "--seq-len", "32", "--batch-size", "4", "--precisions", "fp32",
            "--lora", LORA]
    code, _, err = run_cli(*plan, "--budget", "1KB", "--out", tmp_path / "refused.json")
    assert code == 2, err
    floor = float(re.search(r"below the floor ([\d.]+) MiB", err).group(1)) * 2**20
    budget = str(int(0.9 * floor))
    code, _, err = run_cli(*plan, "--budget", budget, "--out", tmp_path / "refused.json")
    assert code == 2 and "--allow-lossy-base for frozen weights in NF4" in err
    code, _, err = run_cli(*plan, "--budget", budget, "--allow-lossy-base", "--out", tmp_path / "qlora.json")
    assert code == 0, err
    qlora = load_plan(tmp_path / "qlora.json")
    assert qlora.config.frozen_nf4 and qlora.measured.peak_bytes < floor
    code, _, err = run_cli(*plan, "--budget", "1GB", "--out", tmp_path / "lora.json")
    assert code == 0, err
    runs = {}
    for name in ("lora", "qlora"):
        code, _, err = run_cli("train", "--plan", tmp_path / f"{name}.json", "--data", corpus, "--epochs", "2", "--workers", "0",
                               "--log-dir", tmp_path / name, "--lr", "3e-3")
        assert code == 0, err
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    steps = {name: [r["loss"] for r in records if r["kind"] == "step"] for name, records in runs.items()}
    assert steps["qlora"][0] == pytest.approx(steps["lora"][0], rel=0.01)
    assert steps["qlora"][-1] == pytest.approx(steps["lora"][-1], rel=0.01)
    perplexities = [r["val_perplexity"] for r in runs["qlora"] if r["kind"] == "epoch"]
    assert len(perplexities) == 2 and perplexities[1] < perplexities[0]
