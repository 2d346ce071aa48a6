"""`autofit train` on an hf: directory: pretrained weights loaded (or --from-config), --weights, and hf/ saved for
transformers; the knobs (--max-grad-norm, --schedule, --warmup-steps) through the command line."""
import json

import pytest
import torch

from autofit.config import TrainingConfig
from autofit.plan_file import DeviceInfo, ModelInfo, Plan, save_plan
from autofit.spec import load_spec, model_fingerprint

transformers = pytest.importorskip("transformers")

SEQ_LEN = 16
BATCH = 4


@pytest.fixture
def llama_dir(tmp_path):
    """A tiny Llama (hidden 32, 2 layers, vocab 100) saved with save_pretrained, and a tokenizer trained offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(123)
    folder = tmp_path / "tiny-llama"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog ran"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return folder


def _plan(tmp_path, source: str, **config) -> str:
    spec = load_spec(source, seq_len=SEQ_LEN)
    plan = Plan(
        model=ModelInfo(source=source, fingerprint=model_fingerprint(spec.build_model()), task="causal-lm", seq_len=SEQ_LEN),
        device=DeviceInfo(type="cpu"), budget_bytes=10**9,
        config=TrainingConfig(global_batch_size=BATCH, **{"micro_batch_size": BATCH, **config}),
    )
    return str(save_plan(plan, tmp_path / "plan.json"))


def _steps(log_dir) -> list[dict]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"]


def _first_batch_loss(model) -> float:
    """The loss of the run's first global batch (seed 0's order of the synthetic tokens) under ``model``."""
    from autofit.training.data import collate_pairs, epoch_order

    spec = load_spec(f"hf:{model.name_or_path}", seq_len=SEQ_LEN)
    dataset = spec.train_dataset()
    order = epoch_order(len(dataset), seed=0, epoch=0)[:BATCH]
    inputs, _ = collate_pairs([dataset[int(i)] for i in order])
    with torch.no_grad():
        return model(**inputs).loss.item()


def test_hf_dir_with_weights_trains_from_them_and_saves_hf_for_transformers(llama_dir, tmp_path, run_cli):
    plan = _plan(tmp_path, f"hf:{llama_dir}")
    code, out, err = run_cli("train", "--plan", plan, "--max-steps", "2", "--log-dir", tmp_path / "run", "--workers", "0")
    assert code == 0, err
    assert f"weights: pretrained from {llama_dir}, held in fp32\n" in out  # how the plan's precision holds them
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.float32)
    first = _steps(tmp_path / "run")[0]["loss"]
    assert first == pytest.approx(_first_batch_loss(pretrained), rel=1e-6)

    # hf/ reloads with transformers and gives the trained model's logits; the tokenizer is there too.
    from autofit.training.weights import load_checkpoint, model_from_checkpoint

    trained, _ = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "last.pt"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", local_files_only=True)
    tokens = torch.randint(0, 100, (2, SEQ_LEN))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, trained(input_ids=tokens).logits)
        assert not torch.allclose(reloaded(input_ids=tokens).logits, pretrained(input_ids=tokens).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "hf", local_files_only=True)
    assert tokenizer("the cat")["input_ids"] != []


def test_from_config_trains_from_random_weights(llama_dir, tmp_path, run_cli):
    plan = _plan(tmp_path, f"hf:{llama_dir}")
    code, out, err = run_cli("train", "--plan", plan, "--from-config", "--max-steps", "1", "--log-dir", tmp_path / "run", "--workers", "0")
    assert code == 0, err
    assert "weights: random init (--from-config)" in out
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.float32)
    assert _steps(tmp_path / "run")[0]["loss"] != pytest.approx(_first_batch_loss(pretrained), rel=1e-3)


def test_weights_flag_loads_a_state_dict_and_refuses_one_that_does_not_match(llama_dir, tmp_path, run_cli):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((llama_dir / "config.json").read_text())
    plan = _plan(tmp_path, f"hf:{config_only}")
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.float32)
    torch.save(pretrained.state_dict(), tmp_path / "state.pt")
    code, out, err = run_cli("train", "--plan", plan, "--weights", tmp_path / "state.pt", "--max-steps", "1",
                             "--log-dir", tmp_path / "run", "--workers", "0")
    assert code == 0, err
    assert f"weights: from {tmp_path / 'state.pt'}" in out
    assert _steps(tmp_path / "run")[0]["loss"] == pytest.approx(_first_batch_loss(pretrained), rel=1e-6)

    state = pretrained.state_dict()
    state["model.norm.weight"] = torch.ones(31)
    torch.save(state, tmp_path / "wrong.pt")
    code, out, err = run_cli("train", "--plan", plan, "--weights", tmp_path / "wrong.pt", "--log-dir", tmp_path / "run2")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "wrong.pt do not match the model: model.norm.weight is (31,) there but (32,) in the model" in err
    del state["model.norm.weight"]
    torch.save(state, tmp_path / "short.pt")
    code, out, err = run_cli("train", "--plan", plan, "--weights", tmp_path / "short.pt", "--log-dir", tmp_path / "run3")
    assert code == 2 and "1 missing (e.g. model.norm.weight)" in err and err.strip().count("\n") == 0, err
    code, out, err = run_cli("train", "--plan", plan, "--weights", tmp_path / "nothing.pt", "--log-dir", tmp_path / "run4")
    assert code == 2 and "nothing.pt' does not exist" in err, err


def test_hf_weights_that_do_not_fit_the_config_are_one_line(llama_dir, tmp_path, run_cli):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    plan = _plan(tmp_path, f"hf:{llama_dir}")
    code, out, err = run_cli("train", "--plan", plan, "--log-dir", tmp_path / "run")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "do not fit the config: model.layers.0.mlp.down_proj.weight is (32, 64) in the file but (32, 48) in the model" in err


def test_max_grad_norm_clips_in_training_and_is_refused_with_a_plan_that_steps_in_backward(llama_dir, tmp_path, run_cli):
    plan = _plan(tmp_path, f"hf:{llama_dir}")
    code, out, err = run_cli("train", "--plan", plan, "--max-grad-norm", "0.5", "--max-steps", "1", "--log-dir", tmp_path / "clipped")
    assert code == 0, err
    assert "gradients clipped to norm 0.5" in out
    assert json.loads((tmp_path / "clipped" / "run_plan.json").read_text())["max_grad_norm"] == 0.5
    code, out, err = run_cli("train", "--log-dir", tmp_path / "clipped", "--resume", "--max-grad-norm", "1", "--max-steps", "2")
    assert code == 2 and "max_grad_norm 1.0 differs from the run" in err, err
    plan = _plan(tmp_path, f"hf:{llama_dir}", optimizer_in_backward=True)
    code, out, err = run_cli("train", "--plan", plan, "--max-grad-norm", "1", "--log-dir", tmp_path / "run")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "cannot clip gradients (--max-grad-norm 1)" in err


def test_schedule_flags_set_the_rate_and_are_kept_on_resume(llama_dir, tmp_path, run_cli):
    plan = _plan(tmp_path, f"hf:{llama_dir}")
    common = ("--lr", "0.01", "--schedule", "linear", "--warmup-steps", "2", "--workers", "0")
    code, out, err = run_cli("train", "--plan", plan, *common, "--max-steps", "2", "--log-dir", tmp_path / "run")
    assert code == 0, err
    code, out, err = run_cli("train", "--log-dir", tmp_path / "run", "--resume", "--max-steps", "4")
    assert code == 0, err
    total = 64  # 256 synthetic samples / 4 per step, one epoch
    expected = [0.0, 0.005] + [0.01 * (1 - 0.9 * (step - 2) / (total - 2)) for step in (2, 3)]
    assert [r["lr"] for r in _steps(tmp_path / "run")] == pytest.approx(expected)
    code, out, err = run_cli("train", "--log-dir", tmp_path / "run", "--resume", "--schedule", "cosine")
    assert code == 2 and "schedule cosine differs from the run" in err, err


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_plan_summary_says_which_weights_training_starts_from_and_that_clipping_leaves_a_lever_out(llama_dir, tmp_path, run_cli):
    arguments = ("--seq-len", str(SEQ_LEN), "-n", "4", "-b", "200MB", "--simulate", "--no-cache", "-q", "--precisions", "fp32")
    code, out, err = run_cli("plan", f"hf:{llama_dir}", *arguments, "--max-grad-norm", "1", "-o", tmp_path / "plan.json")
    assert code == 0, err
    assert f"weights     pretrained from {llama_dir}" in out
    assert "the optimizer step in backward was left out: it cannot clip gradients (--max-grad-norm 1)" in out
    assert json.loads((tmp_path / "plan.json").read_text())["max_grad_norm"] == 1
    (llama_dir / "model.safetensors").unlink()
    code, out, err = run_cli("plan", f"hf:{llama_dir}", *arguments, "-o", tmp_path / "plan2.json")
    assert code == 0 and "weights     random init from config.json" in out, err


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_weights_dtype_config_keeps_a_bf16_config_s_weights_as_bf16_pure_and_is_one_line_where_it_cannot(llama_dir, tmp_path, run_cli):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    arguments = (f"hf:{llama_dir}", "--seq-len", str(SEQ_LEN), "-n", "4", "-b", "200MB", "--simulate", "--no-cache", "-q")
    code, out, err = run_cli("plan", *arguments, "--precisions", "fp32", "-o", tmp_path / "fp32.json")
    assert code == 0, err
    assert "held in fp32 (config.json's dtype bf16 is not used" in out and "--weights-dtype config keeps them in bf16" in out
    code, out, err = run_cli("plan", *arguments, "--weights-dtype", "config", "-o", tmp_path / "plan.json")
    assert code == 0, err
    assert json.loads((tmp_path / "plan.json").read_text())["precision"] == "bf16-pure"
    assert "held in bf16 (bf16-pure, config.json's dtype)" in out
    refused = {
        ("--weights-dtype", "bf16"): "--weights-dtype 'bf16' is unknown; choose fp32",
        ("--weights-dtype", "config", "--precisions", "bf16"): "drop --precisions bf16 or --weights-dtype",
        ("--weights-dtype", "config", "--gpus", "2"): "train on one process only; for 2 GPUs leave it out",
    }
    for flags, words in refused.items():
        code, out, err = run_cli("plan", *arguments, *flags, "-o", tmp_path / "refused.json")
        assert code == 2 and words in err and "Traceback" not in err, (flags, err)
    (llama_dir / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    code, out, err = run_cli("plan", *arguments, "--weights-dtype", "config", "-o", tmp_path / "refused.json")
    assert code == 2 and "config.json names fp16, and no precision here trains fp16 weights" in err, err
    model_file = tmp_path / "mlp.py"
    model_file.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(4, 2)\n"
        "def example_batch(n):\n    return torch.randn(n, 4), torch.randint(0, 2, (n,))\n"
    )
    code, out, err = run_cli(
        "plan", str(model_file), "-n", "4", "-b", "200MB", "--no-cache", "-q", "--weights-dtype", "config", "-o", tmp_path / "refused.json",
    )
    assert code == 2 and "names none; leave it out (fp32 weights)" in err, err
    assert not (tmp_path / "refused.json").exists()


def test_from_config_is_refused_for_a_model_file_and_with_weights(llama_dir, tmp_path, run_cli):
    model_file = tmp_path / "mlp.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build_model():\n    return nn.Linear(4, 2)\n\n"
        "def example_batch(n):\n    return torch.randn(n, 4), torch.randint(0, 2, (n,))\n"
    )
    plan = Plan(model=ModelInfo(source=str(model_file)), device=DeviceInfo(type="cpu"), budget_bytes=10**8,
                config=TrainingConfig(global_batch_size=2, micro_batch_size=2))
    save_plan(plan, tmp_path / "mlp-plan.json")
    code, out, err = run_cli("train", "--plan", tmp_path / "mlp-plan.json", "--from-config", "--log-dir", tmp_path / "run")
    assert code == 2 and "--from-config is for an hf:DIR model holding weights" in err and err.strip().count("\n") == 0, err
    code, out, err = run_cli("train", "--plan", _plan(tmp_path, f"hf:{llama_dir}"), "--from-config", "--weights", tmp_path / "x.pt",
                             "--log-dir", tmp_path / "run2")
    assert code == 2 and "--weights and --from-config both choose the starting weights" in err, err


def test_sharded_weights_load_from_the_hf_dir_and_through_weights(llama_dir, tmp_path, run_cli):
    """save_pretrained's shards and their index: hf:DIR loads them, and so does --weights DIR."""
    from autofit.training.weights import state_dict_from

    pretrained = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    pretrained.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    state = state_dict_from(sharded)
    assert all(torch.equal(state[name], tensor) for name, tensor in pretrained.state_dict().items() if name in state)
    code, out, err = run_cli("train", "--plan", _plan(tmp_path, f"hf:{sharded}"), "--max-steps", "1", "--log-dir", tmp_path / "run", "--workers", "0")
    assert code == 0 and f"weights: pretrained from {sharded}" in out, err
    assert _steps(tmp_path / "run")[0]["loss"] == pytest.approx(_first_batch_loss(pretrained), rel=1e-6)


def test_unreadable_hf_weights_are_one_line(llama_dir, tmp_path, run_cli):
    plan = _plan(tmp_path, f"hf:{llama_dir}")
    (llama_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    code, out, err = run_cli("train", "--plan", plan, "--log-dir", tmp_path / "run")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "cannot load the weights in" in err and "give --from-config to train from random weights" in err
