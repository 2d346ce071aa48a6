"""transformers, timm and PEFT models built from tiny configs: meters, exact accumulation, hf: and timm: sources, fit().

These need the optional extra (``pip install 'autofit[hf]'``, part of ``.[test]``);
without it each test is skipped and says what to install.
"""
import copy
import importlib.util
import json
import sys
from dataclasses import replace

import pytest
import torch

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.probe import probe
from autofit.model_io import Loss, count_labels
from autofit.spec import ModelSpec, default_optimizer, load_spec, weights_held
from tests.helpers import EXAMPLES


def _needs(*packages):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: pip install 'autofit[hf]' (or .[test])")


needs_transformers = _needs("transformers")
needs_timm = _needs("timm")
needs_peft = _needs("transformers", "peft")

VOCAB, SEQ = 128, 16


@pytest.fixture(autouse=True)
def quiet_transformers():
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        transformers.logging.set_verbosity_error()


def padded_lm_batch(n: int, *, labels: bool = True, seed: int = 0):
    """Token sequences of different lengths, right-padded (mask 0, label -100)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n, SEQ), generator=generator)
    lengths = torch.tensor([SEQ // 2 + (5 * i) % (SEQ // 2 + 1) for i in range(n)])
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    batch = {"input_ids": tokens * mask, "attention_mask": mask}
    if labels:
        batch["labels"] = tokens.masked_fill(mask == 0, -100)
    return batch


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, use_cache=False))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=SEQ, use_cache=False,
    ))


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=3,
    ))


def lora_gpt2():
    import peft

    return peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))


def timm_model(name: str, **options):
    import timm

    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **options)


def lm_spec(build) -> ModelSpec:
    return ModelSpec(
        source=build.__name__, build_model=build, example_batch=lambda n: (padded_lm_batch(n), None),
        loss_fn=Loss(None, count_items=count_labels(shift=True)), build_optimizer=default_optimizer,
    )


def classifier_spec(build, *, source: str) -> ModelSpec:
    return ModelSpec(
        source=source, build_model=build,
        example_batch=lambda n: (padded_lm_batch(n, labels=False), torch.randint(0, 3, (n,))),
        loss_fn=Loss(None), build_optimizer=default_optimizer,
    )


def image_spec(build, *, source: str) -> ModelSpec:
    return ModelSpec(
        source=source, build_model=build, example_batch=lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        loss_fn=Loss(torch.nn.functional.cross_entropy), build_optimizer=default_optimizer,
    )


MODELS = {
    "gpt2": pytest.param(lambda: lm_spec(gpt2), marks=needs_transformers),
    "bert": pytest.param(lambda: classifier_spec(bert, source="bert"), marks=needs_transformers),
    "llama": pytest.param(lambda: lm_spec(llama), marks=needs_transformers),
    "lora-gpt2": pytest.param(lambda: lm_spec(lora_gpt2), marks=needs_peft),
    "convnext": pytest.param(lambda: image_spec(timm_model("test_convnext"), source="convnext"), marks=needs_timm),
    "vit": pytest.param(lambda: image_spec(timm_model("test_vit", img_size=32), source="vit"), marks=needs_timm),
    "efficientnet": pytest.param(lambda: image_spec(timm_model("test_efficientnet"), source="efficientnet"), marks=needs_timm),
}


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("make_spec", list(MODELS.values()), ids=list(MODELS))
def test_the_simulated_meter_equals_the_cpu_meter(make_spec, one_thread):
    spec = make_spec()
    cpu = probe(spec, micro_batch_size=4, global_batch_size=8, steps=2)
    simulated = probe(spec, micro_batch_size=4, global_batch_size=8, simulate=True, steps=2)
    assert simulated.meter == "simulated"  # no fallback was needed
    assert simulated.peak_bytes == pytest.approx(cpu.peak_bytes, rel=0.01)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert simulated.breakdown[part] == pytest.approx(cpu.breakdown[part], rel=0.01)


@needs_peft
def test_lora_is_counted_as_frozen_parameters_and_its_fingerprint_is_stable(one_thread):
    from autofit.spec import model_fingerprint

    model = lora_gpt2()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert model_fingerprint(model) == model_fingerprint(lora_gpt2())
    result = probe(lm_spec(lora_gpt2), micro_batch_size=4, simulate=True, steps=2)
    assert result.breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert 0 < result.breakdown["optimizer_state"] <= 2 * trainable + 4 * len([p for p in model.parameters() if p.requires_grad])


class GradRecorder(torch.optim.SGD):
    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


@needs_transformers
@pytest.mark.parametrize("micro_batch_size", [8, 4, 3])  # 8 = 4 + 4 = 3 + 3 + 2
def test_a_padded_gpt2_batch_gives_the_full_batch_gradient(micro_batch_size, one_thread):
    from autofit.apply import apply_config
    from autofit.config import TrainingConfig
    from autofit.step import train_step

    spec = load_spec(str(EXAMPLES / "hf_causal_lm.py"))
    torch.manual_seed(0)
    model = spec.build_model().eval()  # no dropout: the two runs must see the same function
    inputs, targets = spec.example_batch(8)
    assert (inputs["attention_mask"] == 0).any() and targets is None
    reference = copy.deepcopy(model)
    reference(**inputs).loss.backward()
    expected = [p.grad for p in reference.parameters()]
    applied = apply_config(model, TrainingConfig(global_batch_size=8, micro_batch_size=micro_batch_size), device="cpu")
    optimizer = GradRecorder(applied.model.parameters(), lr=0.0)
    train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)
    for ours, theirs in zip(optimizer.grads, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.fixture
def hf_dir(tmp_path):
    """A local transformers config for a 2-layer GPT-2 (nothing is downloaded)."""
    from transformers import GPT2Config

    path = tmp_path / "tiny-gpt2"
    GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    return path


@needs_transformers
def test_hf_sources_build_from_a_local_config(hf_dir, tmp_path, one_thread):
    spec = load_spec(f"hf:{hf_dir}", seq_len=8)
    assert spec.source_options == {"task": "causal-lm", "seq_len": 8}
    inputs, targets = spec.example_batch(2)
    assert targets is None and inputs["input_ids"].shape == (2, 8)
    assert probe(spec, micro_batch_size=2, steps=2).peak_bytes > 0
    from transformers import BertConfig

    BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=SEQ).save_pretrained(tmp_path / "bert")
    classifier = load_spec(f"hf:{tmp_path / 'bert' / 'config.json'}", task="sequence-classification", num_classes=3)
    inputs, targets = classifier.example_batch(2)
    assert set(inputs) == {"input_ids", "attention_mask"} and targets.shape == (2,)
    assert classifier.build_model().config.num_labels == 3
    for source, options, message in [
        (f"hf:{tmp_path / 'nothing'}", {}, "no transformers config"),
        (f"hf:{tmp_path / 'bert'}", {}, "--task"),
        (f"hf:{hf_dir}", {"task": "translation"}, "--task 'translation' is unknown"),
        (f"hf:{hf_dir}", {"seq_len": 999}, "--seq-len 999"),
        (f"hf:{hf_dir}", {"seq_len": 0}, "--seq-len 0 must be between 2"),  # 0 used to mean "not given"
        (f"hf:{hf_dir}", {"num_classes": 0, "task": "sequence-classification"}, "--num-classes 0 must be at least 2"),
    ]:
        with pytest.raises(UserError, match=message):
            load_spec(source, **options)


@needs_transformers
def test_cli_probes_dict_inputs_of_hf_models(hf_dir, tmp_path, run_cli, one_thread):
    code, out, err = run_cli("probe", f"hf:{hf_dir}", "--seq-len", "16", "-m", "4", "-k", "2", "--simulate", "--json")
    assert code == 0, err
    assert json.loads(out)["meter"] == "simulated"
    from transformers import BertConfig

    BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=SEQ).save_pretrained(tmp_path / "bert")
    code, out, err = run_cli("probe", f"hf:{tmp_path / 'bert'}", "--task", "sequence-classification", "--num-classes", "3",
                             "--seq-len", "16", "-m", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["samples_per_s"] > 0
    code, out, err = run_cli("probe", "torchvision:resnet18", "--task", "causal-lm")
    assert code == 2 and "are for hf: models" in err


@needs_transformers
@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_plan_and_train_an_hf_dir_end_to_end(hf_dir, tmp_path, run_cli, one_thread):
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", f"hf:{hf_dir}", "--budget", "20MB", "--batch-size", "8", "--seq-len", "16",
                             "--precisions", "fp32", "--out", plan_path)
    assert code == 0, err
    model = json.loads(plan_path.read_text())["model"]
    assert model["task"] == "causal-lm" and model["seq_len"] == 16
    code, out, err = run_cli("train", "--plan", plan_path, "--epochs", "1", "--max-steps", "2", "--workers", "0",
                             "--log-dir", tmp_path / "run")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["kind"] for r in records] == ["step", "step", "stop"]  # --max-steps ends validated
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


@needs_transformers
@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_fit_an_hf_model_on_a_dataset_of_dicts(tmp_path, one_thread):
    import autofit

    class Dicts(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            self.batch = padded_lm_batch(n, seed=seed)

        def __len__(self):
            return len(self.batch["input_ids"])

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.batch.items()}

    torch.manual_seed(0)
    result = autofit.fit(
        gpt2(), train_data=Dicts(16, 0), val_data=Dicts(8, 1), batch_size=8, budget="20MB", epochs=1,
        count_items=count_labels(shift=True), log_dir=tmp_path / "run", verbose=False,
    )
    record = result.history[-1]
    assert record["val_accuracy"] is None and record["val_perplexity"] == pytest.approx(torch.tensor(record["val_loss"]).exp().item())
    assert result.best_path.exists()


@needs_timm
def test_timm_sources(one_thread):
    spec = load_spec("timm:test_vit", input_shape="3x32x32", num_classes=7)
    assert spec.input_shape == (3, 32, 32) and spec.source_options == {"num_classes": 7}
    assert spec.build_model()(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(UserError, match="timm model 'no_such_net' is unknown"):
        load_spec("timm:no_such_net")


def test_a_missing_extra_is_one_line(monkeypatch, run_cli):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, out, err = run_cli("probe", "timm:resnet18")
    assert code == 2 and err.count("\n") == 1 and "pip install 'autofit[hf]'" in err
    code, out, err = run_cli("plan", "hf:somewhere", "--budget", "1GB", "--batch-size", "8")
    assert code == 2 and "needs the transformers package" in err


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("example, budget, extra", [
    pytest.param("hf_causal_lm.py", "20MB", (), marks=needs_transformers),
    pytest.param("timm_classifier.py", "20MB", (), marks=[needs_timm, _needs("sklearn")]),
])
@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_examples_plan_and_train(example, budget, extra, tmp_path, run_cli, one_thread):
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", EXAMPLES / example, "--budget", budget, "--batch-size", "8", "--precisions", "fp32",
                             "--out", plan_path, *extra)
    assert code == 0, err
    code, out, err = run_cli("train", "--plan", plan_path, "--epochs", "1", "--max-steps", "3", "--workers", "0",
                             "--log-dir", tmp_path / "run")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    assert len(losses) == 3 and all(loss == loss for loss in losses)


@needs_transformers
@pytest.mark.parametrize("config, task, expected", [
    ({"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 1, "vocab_size": 50, "bos_token_id": 0, "eos_token_id": 0},
     "image-classification", "no image-classification model for model_type 'gpt2'.*--task causal-lm or sequence-classification"),
    ({"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 1, "vocab_size": 50, "bos_token_id": 0, "eos_token_id": 0},
     "sequence-classification", "no pad_token_id.*eos_token_id, 0"),
    ({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 16,
      "vocab_size": 0, "bos_token_id": None, "eos_token_id": None}, "causal-lm", "vocab_size 0 must be"),
])
def test_configs_transformers_refuses_are_one_line_before_anything_runs(tmp_path, config, task, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=expected):
        load_spec(f"hf:{tmp_path}", task=task, seq_len=8, num_classes=None if task == "causal-lm" else 3)


@needs_transformers
def test_editing_an_hf_config_in_place_changes_the_cost_cache_s_key(tmp_path):
    """A config.json edited where it lies (here rope_theta: no layer's shape changes) is another model: fresh costs."""
    from autofit.planning.context import model_identity

    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
              "intermediate_size": 16, "vocab_size": 50, "bos_token_id": 0, "eos_token_id": 0}

    def identity(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        spec = load_spec(f"hf:{tmp_path}", task="causal-lm", seq_len=8)
        return model_identity(spec, spec.build_model(), device_name="cpu")

    assert identity() == identity()
    assert identity(rope_theta=500000.0) != identity()


@needs_transformers
def test_a_config_s_half_precision_dtype_is_said_and_the_weights_stay_fp32(tmp_path):
    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
              "intermediate_size": 16, "vocab_size": 50, "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_spec(f"hf:{tmp_path}", task="causal-lm", seq_len=8)
    assert {p.dtype for p in spec.build_model().parameters()} == {torch.float32}
    assert spec.config_dtype == "bf16"
    config = TrainingConfig(global_batch_size=2, micro_batch_size=2)
    assert "config.json's dtype bf16 is not used" in weights_held(spec, replace(config, precision="bf16"))
    assert weights_held(spec, replace(config, precision="bf16-pure")) == "held in bf16 (bf16-pure, config.json's dtype)"
    qlora = replace(config, precision="bf16-master", frozen_nf4=True)
    assert weights_held(spec, qlora) == (
        "held in bf16 on the device, their fp32 masters on the host (bf16-master); the frozen linear weights in 4-bit NF4 (QLoRA's base)"
    )
