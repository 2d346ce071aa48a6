"""transformers decoders through hf:: the simulated meter counts what the cpu meter does, to the byte.

Over fake tensors transformers cannot read the attention mask or the positions, so it used to build the
4-D causal mask and repeat the key/value heads that a real run of an unpadded batch skips (10.5% over on
these models); ``measure.hf_masks`` decides as the real run does.
"""
import pytest

from autofit.measure.probe import probe
from autofit.spec import load_spec

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
    "gpt2": "GPT2Config",
}


def config_dir(tmp_path, kind: str):
    config_class = getattr(transformers, CONFIGS[kind])
    if kind == "gpt2":
        config = config_class(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=256, architectures=["GPT2LMHeadModel"])
    else:
        config = config_class(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, architectures=[CONFIGS[kind].replace("Config", "ForCausalLM")],
        )
    config.save_pretrained(tmp_path / kind)
    return f"hf:{tmp_path / kind}"


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_simulated_meter_is_the_cpu_meter_for_hf_decoders(tmp_path, kind):
    spec = load_spec(config_dir(tmp_path, kind), task="causal-lm", seq_len=64)
    real = probe(spec, micro_batch_size=3, global_batch_size=6, steps=1).peak_bytes
    simulated = probe(spec, micro_batch_size=3, global_batch_size=6, steps=1, simulate=True).peak_bytes
    assert simulated == real, f"simulated {simulated} B, cpu {real} B ({(simulated - real) / real:+.2%})"


def test_the_masks_are_put_back_after_the_simulated_meter():
    from transformers import masking_utils

    from autofit.measure.hf_masks import masks_as_in_real_runs

    before = masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices
    with masks_as_in_real_runs():
        assert masking_utils._ignore_causal_mask_sdpa is not before[0]
    assert (masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices) == before


def test_a_model_too_large_to_measure_for_real_is_refused_not_run(monkeypatch):
    """When fake tensors cannot run a model, the cpu meter would train it for real: beyond this machine's memory that
    is one line naming the bytes, not a process killed for memory."""
    import torch

    from autofit.errors import UserError
    from autofit.measure import meters
    from autofit.spec import ModelSpec, default_optimizer

    spec = ModelSpec(
        source="big.py", build_model=lambda: torch.nn.Linear(1024, 1024), example_batch=lambda n: (torch.randn(n, 1024), None),
        loss_fn=None, build_optimizer=default_optimizer,
    )
    monkeypatch.setattr(meters, "host_memory_bytes", lambda available: 2**20)  # 1 MiB free: the 16 MiB it needs do not fit
    with pytest.raises(UserError, match=r"would need about 16\.02 MiB of this machine's memory \(1\.00 MiB available"):
        meters.fall_back_from_simulation(spec, RuntimeError("reads a value"))
