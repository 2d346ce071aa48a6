"""The chunked output layer and loss: the model's own loss and gradients, without its whole logits."""
from __future__ import annotations

import copy

import pytest
import torch

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.model_io import call_model
from strategies import chunkable

transformers = pytest.importorskip("transformers")


def tiny_llama(vocab_size: int = 96) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batch(vocab_size: int = 96, *, padded: bool = True):
    torch.manual_seed(1)
    tokens = torch.randint(0, vocab_size, (3, 20))
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, 14:] = 0  # padding is labelled -100, as autofit's text batches are
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}


def loss_and_grads(model, inputs, *, chunks: int, precision: str = "fp32"):
    config = TrainingConfig(global_batch_size=3, micro_batch_size=3, precision=precision, loss_chunks=chunks)
    applied = apply_config(model, config, device="cpu")
    with applied.forward_context():
        output = call_model(applied.model, inputs)
    output.loss.backward()
    return output.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunks", [2, 7])
def test_chunked_loss_equals_the_models_own_loss_and_gradients_in_fp32(chunks):
    model = tiny_llama()
    plain = copy.deepcopy(model)
    inputs = batch()
    loss, grads = loss_and_grads(model, inputs, chunks=chunks)
    expected_loss, expected_grads = loss_and_grads(plain, inputs, chunks=1)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_chunked_loss_under_bf16_autocast_is_within_bf16_rounding_of_the_models_own():
    model = tiny_llama()
    plain = copy.deepcopy(model)
    inputs = batch()
    loss, grads = loss_and_grads(model, inputs, chunks=4, precision="bf16")
    expected_loss, expected_grads = loss_and_grads(plain, inputs, chunks=1, precision="bf16")
    torch.testing.assert_close(loss, expected_loss, atol=1e-2, rtol=1e-2)  # bf16 logits: 8 bits of mantissa
    head = "lm_head.weight"
    torch.testing.assert_close(grads[head], expected_grads[head], atol=1e-2, rtol=5e-2)


def test_without_labels_the_model_gives_its_logits():
    model = tiny_llama()
    expected = copy.deepcopy(model)(input_ids=batch()["input_ids"]).logits
    applied = apply_config(model, TrainingConfig(global_batch_size=3, micro_batch_size=3, loss_chunks=4), device="cpu")
    torch.testing.assert_close(applied.model(input_ids=batch()["input_ids"]).logits, expected)


def test_a_micro_batch_with_no_label_that_counts_has_loss_zero_not_nan():
    model = tiny_llama()
    inputs = batch()
    inputs["labels"] = torch.full_like(inputs["labels"], -100)
    loss, grads = loss_and_grads(model, inputs, chunks=3)
    assert loss.item() == 0.0 and all(torch.isfinite(g).all() for g in grads.values())


def test_a_model_that_is_not_a_causal_lm_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert "causal language models" in chunkable(model)
    with pytest.raises(UserError, match="--loss-chunks 8: a chunked loss is for transformers causal language models"):
        apply_config(model, TrainingConfig(global_batch_size=2, micro_batch_size=2, loss_chunks=8), device="cpu")


def test_loss_chunks_must_be_a_whole_number_from_one():
    """Built in Python, the error names the keyword the caller passed (#48: it said --loss-chunks); the command line
    keeps the flag (``keywords.command_line``)."""
    from autofit.keywords import command_line

    for bad in (0, -2, 2.5, True):
        with pytest.raises(UserError, match=rf"^loss_chunks={bad!r} must be a whole number") as error:
            TrainingConfig(global_batch_size=2, micro_batch_size=2, loss_chunks=bad)
        assert "--" not in str(error.value)
    with command_line(), pytest.raises(UserError, match=r"^--loss-chunks 0 must be a whole number"):
        TrainingConfig(global_batch_size=2, micro_batch_size=2, loss_chunks=0)
    config = TrainingConfig(global_batch_size=2, micro_batch_size=2, loss_chunks=8)
    assert config.levers() == "loss-chunks=8" and "loss-chunks=8" in config.key()


def test_probe_measures_the_chunked_loss_and_says_so(run_cli, tmp_path):
    path = tmp_path / "lm"
    tiny_llama(vocab_size=512).config.save_pretrained(path)
    source = ["probe", f"hf:{path}", "--task", "causal-lm", "--seq-len", "16", "-m", "4", "--steps", "2", "--json"]
    import json

    code, out, err = run_cli(*source)
    plain = json.loads(out)
    code, out, err = run_cli(*source, "--loss-chunks", "4")
    assert code == 0, out + err
    chunked = json.loads(out)
    assert chunked["loss_chunks"] == 4 and chunked["peak_bytes"] < plain["peak_bytes"]
    code, out, err = run_cli(*source[:-1], "--loss-chunks", "0")
    assert code == 2 and "--loss-chunks 0 must be a whole number from 1" in err and "Traceback" not in err


def test_a_causal_lm_under_lora_adapters_chunks_its_loss_to_the_same_loss_and_adapter_gradients():
    peft = pytest.importorskip("peft")
    torch.manual_seed(2)
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapters a say in the loss
            torch.nn.init.normal_(parameter, std=0.1)
    assert chunkable(model) is None
    plain = copy.deepcopy(model)
    inputs = batch()
    loss, grads = loss_and_grads(model, inputs, chunks=3)
    expected_loss, expected_grads = loss_and_grads(plain, inputs, chunks=1)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    for name in trained:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-6, rtol=1e-5, msg=name)
