"""hf/ in the run directory through autofit.fit: a PEFT model's adapter, init_from, and a full disk as one line."""
import errno

import pytest
import torch

import autofit
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.library_models import SyntheticTokens
from autofit.plan_file import DeviceInfo, Plan

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _llama():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _fit(model, log_dir, **options):
    data = SyntheticTokens(vocab_size=100, seq_len=16, samples=16, seed=0)
    plan = Plan(device=DeviceInfo(type="cpu"), budget_bytes=10**9, config=TrainingConfig(global_batch_size=4, micro_batch_size=2))
    return autofit.fit(model, plan=plan, train_data=data, count_items=autofit.count_labels(shift=True), max_steps=2,
                       log_dir=log_dir, verbose=False, **options)


def test_a_peft_model_saves_its_adapter_which_peft_loads_over_the_base(tmp_path):
    lora = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _fit(lora, tmp_path / "run", optimizer=lambda params: torch.optim.AdamW(params, lr=0.05))
    assert (tmp_path / "run" / "hf" / "adapter_config.json").is_file()
    reloaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "run" / "hf")
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, lora(input_ids=tokens).logits)
        assert not torch.allclose(_llama()(input_ids=tokens).logits, lora(input_ids=tokens).logits)


def test_init_from_loads_a_state_dict_and_hf_holds_the_trained_weights(tmp_path):
    source = _llama()
    with torch.no_grad():
        source.model.norm.weight.mul_(3.0)
    torch.save(source.state_dict(), tmp_path / "start.pt")
    model = _llama()
    _fit(model, tmp_path / "run", init_from=tmp_path / "start.pt", optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", local_files_only=True)
    torch.testing.assert_close(reloaded.model.norm.weight, source.model.norm.weight)  # lr 0: the start, saved
    with pytest.raises(UserError, match=r"the weights in init_from do not match the model's names: 1 unexpected \(e.g. extra\)"):
        autofit.fit(_llama(), train_data=[], init_from={**source.state_dict(), "extra": torch.zeros(1)})


def test_a_full_disk_while_writing_hf_is_one_line(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "hf.partial" / "model.safetensors"))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    with pytest.raises(UserError) as error:
        _fit(_llama(), tmp_path / "run")
    assert "is full (No space left on device writing model.safetensors); last.pt keeps step 2 intact" in str(error.value)
    assert not (tmp_path / "run" / "hf.partial").exists() and (tmp_path / "run" / "last.pt").is_file()


def test_a_run_killed_while_replacing_hf_gets_the_old_one_back_and_overwrite_moves_it_aside(tmp_path):
    from autofit.training.rundir import remove_leftovers, restore_previous_run, start_fresh

    (tmp_path / "hf.old").mkdir()
    (tmp_path / "hf.old" / "config.json").write_text("{}")
    (tmp_path / "hf.partial").mkdir()
    remove_leftovers(tmp_path)
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf.partial").exists()
    (tmp_path / "last.pt").write_bytes(b"")
    start_fresh(tmp_path, overwrite=True)
    assert not (tmp_path / "hf").exists()
    restore_previous_run(tmp_path)
    assert (tmp_path / "hf" / "config.json").is_file()
